"""The chunked LM head at TP=2 (with and without sequence parallelism) and PP=2 equals the
unchunked head (2 gloo ranks; tests/dist/scripts/chunked_head.py)."""

import pytest

from launch import torchrun

pytestmark = pytest.mark.dist


def test_chunked_head_equals_the_unchunked_at_tp2_and_pp2():
    r = torchrun(2, ["chunked_head.py"])
    assert "OK" in r.stdout
