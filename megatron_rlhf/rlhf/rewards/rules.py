"""Rule rewards: toy tasks scored from the response alone, each registered by name."""

from __future__ import annotations

import re

from megatron_rlhf.rlhf.rewards.base import RewardInput, register_reward


@register_reward("token_parity")
def token_parity(sample: RewardInput) -> float:
    """Fraction of response tokens with an even id; range [0, 1].

    A final EOS token is not counted when ``finish_reason == "eos"``. 0.0 for an empty
    response. Meaningless for language, but learnable by tiny random models (tests).
    """
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
    """Rewards complete, short answers; range [0, 1].

    0.0 if the answer was cut off (``finish_reason == "length"``). Otherwise
    ``1 - min(1, max(0, n_words - 10) / 90)`` with ``n_words`` the whitespace-separated
    words: up to 10 words score 1.0, falling linearly to 0.0 at 100 words and beyond.
    """
    if sample.finish_reason == "length":
        return 0.0
    n_words = len(sample.response.split())
    return 1.0 - min(1.0, max(0, n_words - 10) / 90)


@register_reward("no_e")
def no_e(sample: RewardInput) -> float:
    """Lipogram task: avoid the letter e; range [0, 1].

    ``1 - (letters 'e'/'E') / max(1, letters)``, counting letters with ``str.isalpha``:
    1.0 means no 'e' at all. 0.0 for an empty response.
    """
    text = sample.response
    if not text:
        return 0.0
    n_letters = sum(1 for c in text if c.isalpha())
    n_e = sum(1 for c in text if c in "eE")
    return 1.0 - n_e / max(1, n_letters)


_BULLET = re.compile(r"^\s*([-*•]|\d+[.)])\s+")


@register_reward("format_bullets")
def format_bullets(sample: RewardInput) -> float:
    """Fraction of non-empty lines formatted as list items; range [0, 1].

    A list item starts with ``-``, ``*``, ``•``, ``1.`` or ``1)`` followed by whitespace.
    0.0 for an empty (or all-blank) response.
    """
    lines = [line for line in sample.response.splitlines() if line.strip()]
    if not lines:
        return 0.0
    return sum(1 for line in lines if _BULLET.match(line)) / len(lines)
