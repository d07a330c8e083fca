"""TP=2 generation equals TP=1, with and without speculation (2 gloo ranks)."""

import pytest

pytestmark = pytest.mark.dist
# each script runs in the 2-rank launch shared with the other shared_launch tests (tests/launch.py)


@pytest.mark.shared_launch(2, "tp_generation.py")
def test_tp2_generation_equals_tp1(shared_launch):
    r = shared_launch()
    assert "OK" in r.stdout


@pytest.mark.shared_launch(2, "reallocation.py")
def test_reallocation_round_trip_and_generation(shared_launch):
    r = shared_launch()
    assert "OK" in r.stdout


@pytest.mark.shared_launch(2, "sequence_parallel.py")
def test_sequence_parallel_changes_no_result(shared_launch):
    r = shared_launch()
    assert "OK" in r.stdout
