"""Rule rewards: toy tasks scored from the response alone, each registered by name."""

from __future__ import annotations

import re

from megatron_rlhf.rlhf.rewards.base import RewardInput, register_reward


@register_reward("token_parity")
def token_parity(sample: RewardInput) -> float:
    """Fraction of response tokens with an even id, a final EOS not counted; range [0, 1]."""
    # meaningless for language, but learnable by tiny random models (the tests' reward)
    ids = sample.response_ids
    if (
        sample.finish_reason == "eos"
        and ids
        and (sample.eos_token_id is None or ids[-1] == sample.eos_token_id)
    ):
        ids = ids[:-1]
    if not ids:
        return 0.0
    return sum(1 for t in ids if t % 2 == 0) / len(ids)


@register_reward("concise")
def concise(sample: RewardInput) -> float:
    """Complete, short answers: 1.0 up to 10 words, linearly down to 0.0 at 100; 0.0 when
    cut off (``finish_reason == "length"``)."""
    if sample.finish_reason == "length":
        return 0.0
    n_words = len(sample.response.split())  # whitespace-separated
    return 1.0 - min(1.0, max(0, n_words - 10) / 90)


@register_reward("no_e")
def no_e(sample: RewardInput) -> float:
    """Lipogram: ``1 - (letters e/E) / max(1, letters)``, 1.0 for no e; 0.0 when empty."""
    text = sample.response
    if not text:
        return 0.0
    n_letters = sum(1 for c in text if c.isalpha())  # a response without letters scores 1.0
    n_e = sum(1 for c in text if c in "eE")
    return 1.0 - n_e / max(1, n_letters)


_BULLET = re.compile(r"^\s*([-*•]|\d+[.)])\s+")  # "-", "*", "•", "1." or "1)", then whitespace


@register_reward("format_bullets")
def format_bullets(sample: RewardInput) -> float:
    """Fraction of non-empty lines that are list items; 0.0 for a blank response."""
    lines = [line for line in sample.response.splitlines() if line.strip()]
    if not lines:
        return 0.0
    return sum(1 for line in lines if _BULLET.match(line)) / len(lines)
