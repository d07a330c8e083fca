"""Rule reward functions, registered by name.

A reward function maps one :class:`RewardInput` (a prompt and its sampled response) to a
finite real number. Functions are looked up by name (``--reward-fn concise``) through
:func:`get_reward_fn`; :func:`score_samples` scores a batch and turns a crash or a
non-finite value into a :class:`RewardError` that names the function and the sample.

Adding a rule::

    @register_reward("my_rule")
    def my_rule(sample: RewardInput) -> float:
        \"\"\"What it rewards; range [0, 1].\"\"\"
        return ...
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class RewardInput:
    """One prompt/response pair as seen by a reward function."""

    prompt: str
    """The user instruction text, without the chat template."""
    response: str
    """The decoded response, special tokens skipped."""
    prompt_ids: list[int]
    """Token ids of the (templated) prompt."""
    response_ids: list[int]
    """Token ids of the response; the EOS token is included when the response finished."""
    finish_reason: str
    """``"eos"`` if generation stopped at EOS, ``"length"`` if it hit the token limit."""
    eos_token_id: int | None
    """The tokenizer's EOS token id, or None if it has none."""


RewardFn = Callable[[RewardInput], float]

REWARD_FUNCTIONS: dict[str, RewardFn] = {}
"""All registered reward functions, by name."""


class RewardError(RuntimeError):
    """A reward function crashed or returned something that is not a finite number."""


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering ``fn`` under ``name``; ValueError if the name is taken."""

    def decorator(fn: RewardFn) -> RewardFn:
        if name in REWARD_FUNCTIONS:
            raise ValueError(f"reward function {name!r} is already registered")
        REWARD_FUNCTIONS[name] = fn
        return fn

    return decorator


def get_reward_fn(name: str) -> RewardFn:
    """The reward function registered under ``name``, or a user's ``module:function``
    (imported; the module must be importable on every rank). ValueError listing valid names."""
    if ":" in name:
        import importlib

        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"cannot load reward function {name!r}: {e}") from None
        if not callable(fn):
            raise ValueError(f"reward function {name!r} is not callable")
        return fn
    try:
        return REWARD_FUNCTIONS[name]
    except KeyError:
        valid = ", ".join(sorted(REWARD_FUNCTIONS))
        raise ValueError(f"unknown reward function {name!r}; valid names: {valid} "
                         "(or module:function for your own)") from None


def score_samples(fn_name: str, samples: list[RewardInput], first_index: int = 0) -> torch.Tensor:
    """Score ``samples`` with the function ``fn_name``; returns float32 ``[B]``.

    ``first_index`` is added to the position in ``samples`` in error messages, so a caller
    scoring a slice can report global sample indices. Booleans count as 0/1.
    """
    fn = get_reward_fn(fn_name)
    values = []
    for i, sample in enumerate(samples):
        index = first_index + i
        try:
            value = fn(sample)
        except Exception as exc:
            raise RewardError(
                f"reward function {fn_name!r} raised on sample {index}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RewardError(
                f"reward function {fn_name!r} returned {value!r} for sample {index}; "
                "rewards must be finite numbers"
            )
        values.append(float(value))
    return torch.tensor(values, dtype=torch.float32, device="cpu")  # moved with the batch's


# ---------------------------------------------------------------------------- rules


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
    ``1 - min(1, max(0, n_words - 10) / 90)`` with ``n_words`` the number of
    whitespace-separated words: up to 10 words score 1.0, falling linearly to 0.0 at
    100 words and beyond.
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
