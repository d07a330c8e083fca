"""What a reward function is: its input, the registry of names, the marks that change how it
is called, and the errors. Imports nothing from the package, so any module can register.

A reward function maps one :class:`RewardInput` to a finite real number. The marks are
function attributes set by the decorators (a user's ``module:function`` may carry them):
``batched`` (one call per batch), ``isolated`` (worker processes, a timeout per call),
``needs_answer`` (reads ``sample.answer``: every record must hold the ``--answer-key`` field).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


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
    meta: dict = field(default_factory=dict)
    """Every other field of the dataset record, untouched; empty for plain prompts."""
    answer: Any = None
    """The ground truth: the record's ``--answer-key`` field, set by the trainer (None: the
    record has no such field)."""


RewardFn = Callable[[RewardInput], float]
"""A per-sample function; a ``batched`` one is ``Callable[[list[RewardInput]], list[float]]``."""

REWARD_FUNCTIONS: dict[str, Callable] = {}
"""All registered reward functions, by name."""


class RewardError(RuntimeError):
    """A reward function crashed, returned something that is not a finite number, or timed
    out (under ``strict``); or it cannot run at all (a configuration error)."""


class RewardConfigError(Exception):
    """Raised by a reward function when the run is configured wrong for it (not a fault of
    one sample): the scorer stops the run whatever its ``strict``."""


def register_reward(name: str) -> Callable[[Callable], Callable]:
    """Decorator registering ``fn`` under ``name``; ValueError if the name is taken."""

    def decorator(fn: Callable) -> Callable:
        if name in REWARD_FUNCTIONS:
            raise ValueError(f"reward function {name!r} is already registered")
        REWARD_FUNCTIONS[name] = fn
        return fn

    return decorator


def batch_reward(fn: Callable) -> Callable:
    """Mark ``fn(samples: list[RewardInput]) -> list[float]`` as a batch reward function
    (sets ``fn.batched = True``); returns ``fn`` itself."""
    fn.batched = True
    return fn


def isolated_reward(fn: Callable | None = None, *, warmup: Callable[[], Any] | None = None):
    """Mark ``fn`` to run in worker processes with a per-call timeout (``fn.isolated``);
    ``fn`` must be a module-level function. ``warmup``: a no-argument function each worker
    calls once before its first sample, outside any timeout (``fn.warmup``). Use as
    ``@isolated_reward`` or ``@isolated_reward(warmup=f)``; returns ``fn`` itself."""

    def mark(f: Callable) -> Callable:
        f.isolated = True
        if warmup is not None:
            f.warmup = warmup
        return f

    return mark if fn is None else mark(fn)


def answer_reward(fn: Callable) -> Callable:
    """Mark ``fn`` as reading ``sample.answer`` (sets ``fn.needs_answer = True``): a run
    checks that every record holds the ``--answer-key`` field before it starts."""
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
