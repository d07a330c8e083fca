"""Mixture-of-experts models over several ranks (tests/dist/scripts/moe_ep.py)."""

import pytest

from launch import torchrun

pytestmark = pytest.mark.dist


def test_expert_parallel_step_and_checkpoints_equal_ep1():
    r = torchrun(2, ["moe_ep.py"], timeout=300)
    assert "OK" in r.stdout


def test_moe_speculation_with_migration_changes_no_sample():
    """DP=2, samples migrating mid-generation, plain / history / model drafts: the tokens of
    plain decoding on one rank (fp32)."""
    r = torchrun(2, ["migration.py", "moe"], timeout=600)
    assert "MIGRATION OK" in r.stdout
