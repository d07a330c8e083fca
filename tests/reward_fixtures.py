"""Reward functions for the scorer's tests, importable by name: the scorer's worker
processes are fresh interpreters that import them (``reward_fixtures:sleepy``)."""

from __future__ import annotations

import os
import time

from megatron_rlhf.rlhf.rewards import batch_reward, isolated_reward


@isolated_reward
def sleepy(sample) -> float:
    """Sleeps a minute when the response is ``"sleep"``; else the response's length."""
    if sample.response == "sleep":
        time.sleep(60)
    return float(len(sample.response))


@isolated_reward
def crashy(sample) -> float:
    """``"crash"`` raises, ``"nan"`` returns NaN, ``"exit"`` kills its process; else 1.0."""
    if sample.response == "crash":
        raise KeyError("missing field")
    if sample.response == "nan":
        return float("nan")
    if sample.response == "exit":
        os._exit(3)
    return 1.0


@isolated_reward
@batch_reward
def isolated_lengths(samples) -> list[float]:
    """Batched and isolated: the responses' lengths; sleeps a minute if one is ``"sleep"``."""
    if any(s.response == "sleep" for s in samples):
        time.sleep(60)
    return [len(s.response) for s in samples]


@batch_reward
def lengths(samples) -> list[float]:
    """Batched, in process: the responses' lengths."""
    return [len(s.response) for s in samples]


@batch_reward
def one_short(samples) -> list[float]:
    """Batched, broken: one value too few."""
    return [1.0] * (len(samples) - 1)


def keyed(sample, *, answer_key: str = "answer") -> float:
    """The record's ``answer_key`` field as a number (the scorer passes ``answer_key``)."""
    return float(sample.meta[answer_key])


@isolated_reward
def pid(sample) -> float:
    """The worker's process id."""
    return float(os.getpid())


def math_and_short(sample) -> float:
    """A user's reward composing the built-in verifier: ``math`` on ``sample.answer``, and
    only for a response of at most 20 characters (a check of its own)."""
    from megatron_rlhf.rlhf.rewards import get_reward_fn

    return get_reward_fn("math")(sample) * float(len(sample.response) <= 20)


def always_keyerror(sample) -> float:
    """Raises KeyError on every sample (a user's function reading a field no record has)."""
    return float(sample.meta["score"])
