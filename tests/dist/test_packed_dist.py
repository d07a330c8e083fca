"""Packed micro-batches at TP=2 with sequence parallelism, PP=2 and DP=2 (tests/dist/scripts/packed.py)."""

import pytest

from launch import torchrun

pytestmark = pytest.mark.dist


def test_packed_equals_padded_at_tp2_pp2_dp2():
    r = torchrun(2, ["packed.py"], timeout=240)
    assert "OK" in r.stdout
