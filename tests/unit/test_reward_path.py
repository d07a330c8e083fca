"""Rewards on the trainer's path (ExperienceMaker.score): the ground truth read once from
``--answer-key`` into ``RewardInput.answer``, so a user's function that composes the math
verifier works on a task whose answer field has another name; and a batch whose every
sample failed its reward stops the run unless tolerated."""

from __future__ import annotations

import pytest
import torch

from megatron_rlhf.config import PPOConfig, RewardConfig
from megatron_rlhf.data.prompts import load_prompts
from megatron_rlhf.generation.rollout import GenerationStats, Rollout
from megatron_rlhf.rlhf.experience import ExperienceMaker
from megatron_rlhf.rlhf.rewards import RewardError, get_reward_fn, reads_answer


class CharTokenizer:
    """Token id = character code."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def rollout(texts: list[str]) -> Rollout:
    ids = [[ord(c) for c in t] for t in texts]
    width = max(map(len, ids))
    resp = torch.tensor([x + [0] * (width - len(x)) for x in ids])
    lp = torch.zeros(resp.shape)
    return Rollout(prompt_ids=[[1]] * len(texts), response_ids=resp, response_logprobs=lp,
                   sampling_logprobs=lp, lengths=torch.tensor([len(x) for x in ids]),
                   finish_reasons=["eos"] * len(texts), stats=GenerationStats(new_tokens=1, elapsed_s=1.0))


def maker(fn: str, **reward) -> ExperienceMaker:
    return ExperienceMaker(PPOConfig(global_batch_size=4, rollout_n=1), None, reward_fn=fn,
                           tokenizer=CharTokenizer(), reward=RewardConfig(reward_workers=0, **reward))


def test_a_users_reward_composing_math_reads_the_answer_key_field(tmp_path):
    """A parquet task with ``question``/``solution`` fields, ``--prompt-key question
    --answer-key solution --reward-fn reward_fixtures:math_and_short``: the user's function
    calls ``get_reward_fn("math")(sample)`` and adds a check of its own."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": "6 * 7?", "solution": "42"}, {"question": "1 + 1?", "solution": "#### 2"},
            {"question": "1 + 2?", "solution": "3"}, {"question": "2 + 3?", "solution": "5"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "task.parquet")
    fn = "reward_fixtures:math_and_short"
    assert not reads_answer(get_reward_fn(fn))  # so the plan requires no field of the records
    records = load_prompts(tmp_path / "task.parquet", key="question")
    responses = ["#### 42", "The answer is 2.", "3, after a long detour", "#### 4"]
    m = maker(fn, answer_key="solution", strict_rewards=True)
    scores = m.score([[1]] * 4, [r.prompt for r in records], rollout(responses), 0, [r.meta for r in records])
    assert scores.tolist() == [1.0, 1.0, 0.0, 0.0]  # right; right; right but too long; wrong
    assert m.take_reward_stats() == {"reward_errors": 0, "reward_timeouts": 0}
    # the built-in verifier reads the same field
    scores = maker("math", answer_key="solution", strict_rewards=True).score(
        [[1]] * 4, [r.prompt for r in records], rollout(responses), 0, [r.meta for r in records])
    assert scores.tolist() == [1.0, 1.0, 1.0, 0.0]
    # without --answer-key the records have no ground truth: a configuration error, named
    with pytest.raises(RewardError, match="MissingAnswerError: the record has no ground-truth answer "
                                          r"for the verifier \(its fields: 'solution'\); --answer-key"):
        maker(fn).score([[1]] * 4, [r.prompt for r in records], rollout(responses), 0, [r.meta for r in records])


def test_a_batch_whose_every_sample_failed_stops_the_run(capsys):
    texts = ["a", "b", "c", "d"]
    with pytest.raises(RewardError, match="reward function 'reward_fixtures:always_keyerror' failed on "
                                          "every one of the 4 samples .*--tolerate-reward-errors"):
        maker("reward_fixtures:always_keyerror").score([[1]] * 4, texts, rollout(texts), 0, [{}] * 4)
    err = capsys.readouterr().err
    assert err.count("Traceback") == 1 and "KeyError: 'score'" in err and "prompt: 'a'" in err


def test_tolerated_or_partial_failures_score_zero_and_are_counted():
    texts = ["a", "b", "c", "d"]
    m = maker("reward_fixtures:always_keyerror", tolerate_reward_errors=True)
    assert m.score([[1]] * 4, texts, rollout(texts), 0, [{}] * 4).tolist() == [0.0] * 4
    assert m.take_reward_stats() == {"reward_errors": 4, "reward_timeouts": 0}
    m = maker("reward_fixtures:crashy")  # one sample of four crashes: the run goes on
    assert m.score([[1]] * 4, texts, rollout(["ok", "crash", "ok", "ok"]), 0, [{}] * 4).tolist() == [1, 0, 1, 1]
    assert m.take_reward_stats() == {"reward_errors": 1, "reward_timeouts": 0}
