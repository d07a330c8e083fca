"""The chunked LM head at TP=2 (with and without sequence parallelism) and PP=2 equals the
unchunked head (2 gloo ranks; tests/dist/scripts/chunked_head.py)."""

import pytest

pytestmark = pytest.mark.dist


@pytest.mark.shared_launch(2, "chunked_head.py")  # in the launch shared with other scripts
def test_chunked_head_equals_the_unchunked_at_tp2_and_pp2(shared_launch):
    r = shared_launch()
    assert "OK" in r.stdout
