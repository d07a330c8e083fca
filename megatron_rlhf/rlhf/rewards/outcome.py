"""One call of a reward function and what it gave (:class:`Outcome`), in this process or in
a worker; the calls never raise: a failure is an outcome."""

from __future__ import annotations

import math
import numbers
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

from megatron_rlhf.rlhf.rewards.base import RewardConfigError, RewardInput


class Outcome(NamedTuple):
    """What scoring one sample gave."""

    kind: str  # ok | raised | bad | timeout | died | fatal (a configuration error) | length
    value: float = 0.0  # the reward, when ok
    detail: str = ""  # what went wrong, for the message
    cause: Any = None  # the exception (in this process) or its traceback text (from a worker)
    span: tuple[int, int] | None = None  # batch positions of the batch call that gave it


FATAL = ("fatal", "length")  # raised whatever ``strict``
TIMEOUT = Outcome("timeout")


def checked(value: Any) -> Outcome:
    """Booleans count as 0/1; anything but a finite real number is a bad value."""
    if isinstance(value, numbers.Real) and math.isfinite(value):
        return Outcome("ok", float(value))
    return Outcome("bad", detail=repr(value))


def raised(exc: BaseException) -> Outcome:
    kind = "fatal" if isinstance(exc, RewardConfigError) else "raised"
    return Outcome(kind, detail=f"{type(exc).__name__}: {exc}", cause=exc)


def call_one(fn: Callable, sample: RewardInput) -> Outcome:
    try:
        value = fn(sample)
    except Exception as exc:
        return raised(exc)
    return checked(value)


def call_batch(fn: Callable, samples: list[RewardInput]) -> list[Outcome]:
    n = len(samples)
    try:
        values = fn(list(samples))
        if hasattr(values, "tolist"):  # a tensor or an array
            values = values.tolist()
        values = list(values)
    except Exception as exc:
        return [raised(exc)] * n
    if len(values) != n:
        return [Outcome("length", detail=f"{len(values)} values")] * n
    return [checked(v) for v in values]


def portable(outcome: Outcome) -> Outcome:
    """The outcome with its exception replaced by the traceback text (to cross processes)."""
    if isinstance(outcome.cause, BaseException):
        exc = outcome.cause
        return outcome._replace(cause="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    return outcome


def remote_one(fn: Callable, sample: RewardInput) -> Outcome:
    """:func:`call_one` as a worker runs it."""
    return portable(call_one(fn, sample))


def remote_batch(fn: Callable, samples: list[RewardInput]) -> list[Outcome]:
    """:func:`call_batch` as a worker runs it."""
    return [portable(o) for o in call_batch(fn, samples)]
