"""Verifiers: rewards that check a response against ``sample.answer``, the ground truth the
trainer reads from the record's ``--answer-key`` field. ``math`` runs isolated: sympy's work
can be slow on adversarial text, and the scorer's worker processes bound it."""

from __future__ import annotations

from megatron_rlhf.rlhf.rewards.base import (RewardConfigError, RewardInput, answer_reward,
                                             isolated_reward, register_reward)
from megatron_rlhf.rlhf.rewards.math_answer import math_answer_correct


class MissingAnswerError(RewardConfigError, KeyError):
    """A sample has no ground truth: its record lacks the ``--answer-key`` field."""

    def __init__(self, meta: dict):
        fields = ", ".join(repr(k) for k in sorted(meta, key=str)) or "none"
        super().__init__(
            f"the record has no ground-truth answer for the verifier (its fields: {fields}); "
            "--answer-key names the field that holds it (default 'answer')")

    def __str__(self) -> str:  # KeyError's str() would quote the whole message
        return str(self.args[0])


def _warmup() -> None:
    """Import math-verify and compile its patterns before a worker's first timed call."""
    math_answer_correct("\\boxed{1}", "1")
    math_answer_correct("#### 1", 1)


@register_reward("math")
@isolated_reward(warmup=_warmup)
@answer_reward
def math_reward(sample: RewardInput) -> float:
    """1.0 if the response's final answer equals ``sample.answer``, else 0.0.
    MissingAnswerError if the sample has none; ValueError if math-verify cannot read it."""
    if sample.answer is None:
        raise MissingAnswerError(sample.meta)
    return 1.0 if math_answer_correct(sample.response, sample.answer) else 0.0
