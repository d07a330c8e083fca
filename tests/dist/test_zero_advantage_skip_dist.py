"""The actor update's zero-advantage skip at DP=2 with overlapped gradient reduction, the
ranks running different numbers of micro-batches (tests/dist/scripts/zero_advantage_skip.py)."""

import pytest

pytestmark = pytest.mark.dist


# a rank left without a micro-batch hangs its peer in the gradient reduction: a timeout
# well above the run's time turns that into a failure (the script's own, in the launch it
# shares with other scripts)
@pytest.mark.shared_launch(2, "zero_advantage_skip.py", timeout=180)
def test_zero_advantage_skip_at_dp2_keeps_the_weights(shared_launch):
    r = shared_launch()
    assert "OK" in r.stdout
