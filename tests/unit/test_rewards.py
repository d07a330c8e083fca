"""Rule reward functions, the registry and score_samples error reporting."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rlhf.rlhf import rewards
from megatron_rlhf.rlhf.rewards import (
    REWARD_FUNCTIONS,
    RewardError,
    RewardInput,
    get_reward_fn,
    register_reward,
    score_samples,
)

EOS = 2


def sample(response: str = "", response_ids=(), finish_reason: str = "eos", eos=EOS) -> RewardInput:
    return RewardInput(
        prompt="p",
        response=response,
        prompt_ids=[1, 5],
        response_ids=list(response_ids),
        finish_reason=finish_reason,
        eos_token_id=eos,
    )


@pytest.fixture
def temp_rewards():
    """Register temporary functions through the returned helper; removed afterwards."""
    added: list[str] = []

    def add(name, fn):
        register_reward(name)(fn)
        added.append(name)
        return fn

    yield add
    for name in added:
        REWARD_FUNCTIONS.pop(name, None)


# ------------------------------------------------------------------- rules


def test_token_parity():
    fn = get_reward_fn("token_parity")
    # final EOS (id 2, even) excluded: tokens 4, 7, 8, 9 -> 2 even of 4
    assert fn(sample(response_ids=[4, 7, 8, 9, EOS])) == 0.5
    # cut off: nothing excluded, 4, 7, 8 -> 2/3
    assert fn(sample(response_ids=[4, 7, 8], finish_reason="length")) == pytest.approx(2 / 3)
    # eos finish but last token is not EOS: nothing excluded
    assert fn(sample(response_ids=[3, 5, 6])) == pytest.approx(1 / 3)
    assert fn(sample(response_ids=[])) == 0.0
    assert fn(sample(response_ids=[EOS])) == 0.0
    assert fn(sample(response_ids=[1, 3], finish_reason="length")) == 0.0


def test_concise():
    fn = get_reward_fn("concise")
    assert fn(sample("one two three")) == 1.0
    assert fn(sample(" ".join(["w"] * 10))) == 1.0
    assert fn(sample(" ".join(["w"] * 55))) == 0.5
    assert fn(sample(" ".join(["w"] * 100))) == 0.0
    assert fn(sample(" ".join(["w"] * 250))) == 0.0
    assert fn(sample("short", finish_reason="length")) == 0.0
    assert fn(sample("")) == 1.0


def test_no_e():
    fn = get_reward_fn("no_e")
    assert fn(sample("A cat sat on a mat.")) == 1.0
    assert fn(sample("Eel")) == pytest.approx(1 - 2 / 3)
    assert fn(sample("tree, 42")) == 0.5  # letters t r e e: 2 e of 4
    assert fn(sample("")) == 0.0
    assert fn(sample("123 !")) == 1.0  # no letters, no e


def test_format_bullets():
    fn = get_reward_fn("format_bullets")
    text = "Intro line\n- first\n* second\n\n  • third\n1. fourth\n2) fifth\n-bad\n"
    # non-empty lines: 7; list items: first, second, third, fourth, fifth
    assert fn(sample(text)) == pytest.approx(5 / 7)
    assert fn(sample("- a\n- b")) == 1.0
    assert fn(sample("plain text")) == 0.0
    assert fn(sample("")) == 0.0
    assert fn(sample("\n  \n")) == 0.0


# ------------------------------------------------------------------ registry


def test_builtin_rules_registered():
    for name in ("token_parity", "concise", "no_e", "format_bullets"):
        assert name in REWARD_FUNCTIONS


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError) as info:
        get_reward_fn("nope")
    valid = ", ".join(sorted(REWARD_FUNCTIONS))
    assert str(info.value) == (f"unknown reward function 'nope'; valid names: {valid} "
                               "(or module:function for your own)")
    assert "concise, format_bullets, no_e, token_parity" in str(info.value)


def test_module_function_reward():
    assert get_reward_fn("megatron_rlhf.rlhf.rewards:no_e") is REWARD_FUNCTIONS["no_e"]
    with pytest.raises(ValueError, match="cannot load reward function 'no_such_module:f'"):
        get_reward_fn("no_such_module:f")


def test_duplicate_registration(temp_rewards):
    temp_rewards("_test_dup", lambda s: 0.0)
    with pytest.raises(ValueError, match="_test_dup"):
        register_reward("_test_dup")(lambda s: 1.0)
    with pytest.raises(ValueError, match="concise"):
        register_reward("concise")(lambda s: 1.0)
    assert REWARD_FUNCTIONS["concise"] is rewards.concise


# ------------------------------------------------------------- score_samples


def test_score_samples_values(temp_rewards):
    temp_rewards("_test_bool", lambda s: s.response == "yes")
    out = score_samples("concise", [sample("a b"), sample("x", finish_reason="length")])
    assert out.dtype == torch.float32 and out.shape == (2,)
    assert out.tolist() == [1.0, 0.0]
    assert score_samples("_test_bool", [sample("yes"), sample("no")]).tolist() == [1.0, 0.0]
    assert score_samples("concise", []).shape == (0,)


def test_score_samples_raising_function(temp_rewards):
    def boom(s):
        if s.response == "third":
            raise KeyError("missing field")
        return 1.0

    temp_rewards("_test_boom", boom)
    batch = [sample("first"), sample("second"), sample("third")]
    with pytest.raises(RewardError) as info:
        score_samples("_test_boom", batch, first_index=10)
    msg = str(info.value)
    assert "'_test_boom'" in msg and "sample 12" in msg and "KeyError" in msg
    assert "missing field" in msg
    assert isinstance(info.value.__cause__, KeyError)
    with pytest.raises(RewardError, match="sample 2:"):
        score_samples("_test_boom", batch)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, None, "1.0"])
def test_score_samples_non_finite(temp_rewards, bad):
    temp_rewards("_test_bad", lambda s: bad if s.response == "bad" else 0.5)
    with pytest.raises(RewardError) as info:
        score_samples("_test_bad", [sample("ok"), sample("bad")], first_index=4)
    msg = str(info.value)
    assert "'_test_bad'" in msg and "sample 5" in msg and "finite" in msg
    assert repr(bad) in msg


def test_fixture_keeps_registry_clean():
    assert not [name for name in REWARD_FUNCTIONS if name.startswith("_test_")]
