"""Packed micro-batches at TP=2 with sequence parallelism, PP=2 and DP=2 (tests/dist/scripts/packed.py)."""

import pytest

pytestmark = pytest.mark.dist


@pytest.mark.shared_launch(2, "packed.py", timeout=240)  # in the launch shared with other scripts
def test_packed_equals_padded_at_tp2_pp2_dp2(shared_launch):
    r = shared_launch()
    assert "OK" in r.stdout
