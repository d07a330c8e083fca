"""A reward function maps one :class:`RewardInput` to a finite number. Here: the input, the
registry of names, the decorators that mark how a function is called (``batched``,
``isolated``, ``needs_answer``) and the errors. Imports nothing from the package."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RewardInput:
    """One prompt/response pair as seen by a reward function."""

    prompt: str  # The user instruction text, without the chat template.
    response: str  # The decoded response, special tokens skipped.
    prompt_ids: list[int]  # Token ids of the (templated) prompt.
    # Token ids of the response; the EOS token is included when the response finished.
    response_ids: list[int]
    # ``"eos"`` if generation stopped at EOS, ``"length"`` if it hit the token limit.
    finish_reason: str
    eos_token_id: int | None  # The tokenizer's EOS token id, or None if it has none.
    # Every other field of the dataset record, untouched; empty for plain prompts.
    meta: dict = field(default_factory=dict)
    # The ground truth: the record's ``--answer-key`` field, set by the trainer (or None).
    answer: Any = None


# a per-sample function; a batched one is Callable[[list[RewardInput]], list[float]]
RewardFn = Callable[[RewardInput], float]

REWARD_FUNCTIONS: dict[str, Callable] = {}  # every registered reward function, by name


class RewardError(RuntimeError):
    """A reward failed a sample (under ``strict``), or cannot run as configured."""


class RewardConfigError(Exception):
    """The run is configured wrong for a reward function: the scorer stops it, strict or not."""


def register_reward(name: str) -> Callable[[Callable], Callable]:
    """Decorator registering ``fn`` under ``name``; ValueError if the name is taken."""

    def decorator(fn: Callable) -> Callable:
        if name in REWARD_FUNCTIONS:
            raise ValueError(f"reward function {name!r} is already registered")
        REWARD_FUNCTIONS[name] = fn
        return fn

    return decorator


def batch_reward(fn: Callable) -> Callable:
    """Mark ``fn(samples: list[RewardInput]) -> list[float]``: one call per batch."""
    fn.batched = True
    return fn


def isolated_reward(fn: Callable | None = None, *, warmup: Callable[[], Any] | None = None):
    """Mark a module-level ``fn`` to run in worker processes, a timeout per call; ``warmup``
    runs once per worker, untimed. ``@isolated_reward`` or ``@isolated_reward(warmup=f)``."""

    def mark(f: Callable) -> Callable:
        f.isolated = True
        if warmup is not None:
            f.warmup = warmup
        return f

    return mark if fn is None else mark(fn)


def answer_reward(fn: Callable) -> Callable:
    """Mark ``fn`` as reading ``sample.answer``: a run checks every record for the field."""
    fn.needs_answer = True
    return fn


def takes_answer_key(fn: Callable) -> bool:
    """Whether ``fn`` has an ``answer_key`` parameter (the scorer passes ``--answer-key``)."""
    try:
        return "answer_key" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def reads_answer(fn: Callable) -> bool:
    """Whether ``fn`` needs the ground-truth field in every record."""
    return bool(getattr(fn, "needs_answer", False)) or takes_answer_key(fn)


def get_reward_fn(name: str) -> Callable:
    """The reward function registered under ``name``, or a user's ``module:function``
    (imported; the module must be importable on every rank). ValueError listing valid names."""
    if ":" in name:
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
