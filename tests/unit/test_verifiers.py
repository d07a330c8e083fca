"""The ``math`` verifier (math-verify): final-answer extraction and its precedence, number
forms, the ground truth (``sample.answer``), the gold cache, the scorer's pool, and the
benchmark's smoke run."""

from __future__ import annotations

import json

import pytest

from megatron_rlhf.rlhf.rewards import (
    REWARD_FUNCTIONS,
    MissingAnswerError,
    RewardConfigError,
    RewardError,
    RewardInput,
    RewardScorer,
    get_reward_fn,
    math_reward,
    reads_answer,
)
from megatron_rlhf.rlhf.rewards import math_answer



def sample(response: str, **meta) -> RewardInput:
    """A sample as the trainer builds it with the default ``--answer-key answer``."""
    return RewardInput(prompt="p", response=response, prompt_ids=[1], response_ids=[2],
                       finish_reason="eos", eos_token_id=2, meta=meta, answer=meta.get("answer"))


def score(response: str, answer, **kw) -> float:
    return math_reward(sample(response, answer=answer), **kw)


def test_registered_isolated_and_per_sample():
    assert get_reward_fn("math") is REWARD_FUNCTIONS["math"] is math_reward
    assert math_reward.isolated is True and not getattr(math_reward, "batched", False)
    assert callable(math_reward.warmup) and reads_answer(math_reward)  # set by its decorators


RIGHT = [
    "\\boxed{42}",
    "#### 42",
    "The answer is 42.",
    "3 + 39 = 42. The answer is 42.",
    "First 6 * 7 = 40 + 2, so we get $\\boxed{42}$ apples.",
    "We have 3 + 39 = 42 apples.\n#### 42",
    "Adding 17 and 25 gives 42",  # the last number
    "The answer is $42$.",
    "42.0",
]
WRONG = ["41", "The answer is 41.", "I think 41", "3 + 39 = 42. The answer is 41.", "", "no idea"]


@pytest.mark.parametrize("answer", ["42", 42])
@pytest.mark.parametrize("response", RIGHT)
def test_right_answers_score_one(response, answer):
    assert score(response, answer) == 1.0


@pytest.mark.parametrize("answer", ["42", 42])
@pytest.mark.parametrize("response", WRONG)
def test_wrong_answers_score_zero(response, answer):
    assert score(response, answer) == 0.0


@pytest.mark.parametrize("response, answer", [
    ("#### 42\nI checked it 3 times.", 42),  # #### beats a later number
    ("The answer is 42. It took me 3 steps.", 42),  # "answer is" beats a later number
    ("\\boxed{42} (not 41)", 42),  # a box beats a later number
    ("\\boxed{41}\n#### 42", 41),  # a box beats ####
    ("3 + 39 = 42. The answer is 42. (41 was a typo)", 42),
    ("#### Step 3\n3 + 39 = 42, so the answer is 42.\nWe used 2 steps.", 42),  # a heading
    ("#### Step 3\nAdd: 3 + 39 = 42", 42),
    ("####\n$42$ apples", 42),
    ("1 + 1 = 2, 2 + 2 = 4, so 7", 7),  # else the last number
])
def test_final_answer_precedence(response, answer):
    assert score(response, answer) == 1.0
    assert score(response, answer + 1) == 0.0


@pytest.mark.parametrize("response, answer", [
    ("0.5", "1/2"), ("1/2", "0.5"), ("\\boxed{\\frac{1}{2}}", 0.5), ("The answer is 0.5.", "\\frac{1}{2}"),
    ("$\\frac{3}{4}$", "0.75"), ("#### 1,000", 1000), ("So she has 1,000 apples.", "1000"),
    ("\\boxed{x^2+1}", "x^2+1"), ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"), ("The answer is 12.5", 12.5),
    ("#### 42", [41, 42]),  # a list of acceptable answers
    ("The answer is 1e-7... so \\boxed{0.0000001}", 1e-7),
])
def test_number_forms(response, answer):
    assert score(response, answer) == 1.0


@pytest.mark.parametrize("response, answer", [("0.5", "1/3"), ("\\boxed{x^2}", "x^2+1"),
                                              ("#### 42", [40, 41]), ("12.4", 12.5)])
def test_number_forms_wrong(response, answer):
    assert score(response, answer) == 0.0


@pytest.mark.parametrize("meta", [{"solution": "42", "id": 3}, {"answer": None, "id": 3}])
def test_missing_ground_truth(meta):
    """The verifier reads ``sample.answer`` only: a record field of another name (or a null
    one) is no ground truth; the trainer puts the ``--answer-key`` field there."""
    s = sample("#### 42", **meta)
    assert math_reward(RewardInput(**dict(vars(s), answer="42"))) == 1.0
    with pytest.raises(MissingAnswerError) as info:
        math_reward(s)
    msg = str(info.value)
    fields = ", ".join(repr(k) for k in sorted(meta))
    assert "no ground-truth answer" in msg and "--answer-key" in msg and f"fields: {fields}" in msg
    assert isinstance(info.value, KeyError) and isinstance(info.value, RewardConfigError)
    # through the scorer: a configuration error, raised even when not strict
    for strict in (False, True):
        with pytest.raises(RewardError, match="'math' raised on sample 9: MissingAnswerError: "
                                              "the record has no ground-truth answer"):
            RewardScorer("math", workers=0, strict=strict)([sample("1", answer=1), s], first_index=8)


@pytest.mark.parametrize("gold", ["", True, []])
def test_unreadable_gold_is_a_counted_error(gold):
    scores, counts = RewardScorer("math", workers=0)([sample("#### 42", answer=gold),
                                                      sample("#### 42", answer="42")])
    assert scores.tolist() == [0.0, 1.0]
    assert counts == {"reward_timeouts": 0, "reward_errors": 1}
    with pytest.raises(RewardError, match="sample 0"):
        RewardScorer("math", workers=0, strict=True)([sample("#### 42", answer=gold)])


def test_gold_answer_is_parsed_once_per_text():
    gold = "12345/7"
    math_answer._parse_gold.cache_clear()
    for r in ("#### 12345/7", "\\boxed{\\frac{12345}{7}}", "The answer is 3.", "#### 12345/7"):
        score(r, gold)
    info = math_answer._parse_gold.cache_info()
    assert info.misses == 1 and info.hits == 3


def test_pool_scores_like_in_process():
    batch = [sample(r, answer=a) for r, a in [
        ("\\boxed{42}", 42), ("#### 41", "42"), ("The answer is 1/2.", "0.5"), ("x", "7"),
        ("so 3 + 4 = 7", 7), ("\\boxed{\\frac{3}{4}}", "0.75"), ("The answer is 9.", "10")]]
    expected = [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert RewardScorer("math", workers=0)(batch)[0].tolist() == expected
    with RewardScorer("math", workers=2, timeout_s=5.0) as scorer:
        scores, counts = scorer(batch)
        assert scores.tolist() == expected and counts == {"reward_timeouts": 0, "reward_errors": 0}
        with pytest.raises(RewardError, match="--answer-key"):
            scorer([sample("#### 1")])


def test_bench_verify_smoke(capsys, tmp_path):
    from benchmarks import verify as bench

    out = tmp_path / "bench.jsonl"
    records = bench.main(["--count", "12", "--batch", "4", "--group", "3", "--workers", "0,1",
                          "--out", str(out)])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines == records == [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["variant"] for r in records[:-1]] == ["direct", "workers=0", "workers=1"]
    accuracies = {r["accuracy"] for r in records[:-1]}
    assert len(accuracies) == 1 and 0 < accuracies.pop() < 1  # right and wrong answers, same scores
    assert all(r["answers_per_s"] > 0 and r["reward_errors"] == 0 for r in records[:-1])
    assert records[-1]["kind"] == "summary" and "goal_met" in records[-1]
    samples = bench.make_samples(40, 4, seed=1)
    assert all(80 <= len(s.response) <= 320 for s in samples)
    assert {s.response.rsplit(" ", 1)[0][-10:] for s in samples}  # varied texts
