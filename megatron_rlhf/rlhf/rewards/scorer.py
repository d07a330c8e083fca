"""The scorer: ``RewardScorer(fn_name, ...)(samples, first_index) -> (rewards [B], counts)``.

A failed sample scores 0.0 and is counted (``strict``: RewardError); a configuration error
always raises."""
# A failure is a crash, a non-finite value or a timeout; the first of each kind is printed.
# A configuration error is a RewardConfigError, a batch function's wrong count or a worker
# that cannot start.


from __future__ import annotations

import functools
import math
import numbers
import os
import pickle
import sys
import traceback
import weakref
from typing import TYPE_CHECKING

from megatron_rlhf.rlhf.rewards.base import RewardError, RewardInput, get_reward_fn, takes_answer_key
from megatron_rlhf.rlhf.rewards.outcome import (FATAL, TIMEOUT, Outcome, call_batch, call_one,
                                                remote_batch, remote_one)
from megatron_rlhf.rlhf.rewards.pool import Lost, WorkerPool, WorkerStartError
from megatron_rlhf.rlhf.rewards.timer import Timeout, with_alarm
from megatron_rlhf.rlhf.rewards.worker import RemoteTraceback

if TYPE_CHECKING:  # torch is imported where a tensor is built: workers never load it
    import torch

_PROMPT_SHOWN = 200  # characters of a failing sample's prompt in the printed report


class RewardScorer:
    """Scores batches with one reward function (``fn_name``: a registered name or
    ``module:function``; ValueError if unknown); keeps its worker processes across calls.
    ``last_failure``: the message of the latest failed sample."""

    def __init__(self, fn_name: str, *, timeout_s: float = 5.0, workers: int | None = None,
                 strict: bool = False, answer_key: str = "answer"):
        fn = get_reward_fn(fn_name)
        if not (isinstance(timeout_s, numbers.Real) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"the reward timeout must be a finite number of seconds > 0, got {timeout_s!r}")
        if workers is not None and (not isinstance(workers, int) or workers < 0):
            raise ValueError(f"reward workers must be None or an integer >= 0, got {workers!r}")
        # timeout_s: per call of an isolated function (a batched one: per sample of the call).
        # strict: raise on the first failed sample instead of scoring it 0.
        self.fn_name, self.timeout_s, self.strict = fn_name, float(timeout_s), strict
        self.batched = bool(getattr(fn, "batched", False))
        self.isolated = bool(getattr(fn, "isolated", False))
        self.warmup = getattr(fn, "warmup", None)
        if takes_answer_key(fn):  # a function with an answer_key parameter gets --answer-key
            fn = functools.partial(fn, answer_key=answer_key)
        self.fn = fn
        # Processes for an isolated function: None: min(2, cpu_count); 0: in this process,
        # where the timeout is a SIGALRM that interrupts Python code on the main thread only.
        # Other functions run in this process without a timeout.
        if not self.isolated:
            workers = 0
        elif workers is None:
            workers = min(2, os.cpu_count() or 1)
        self.workers = workers
        self.last_failure: str | None = None
        self._reported: set[tuple[str, str]] = set()  # kinds of failure printed so far
        self._pool: WorkerPool | None = None
        if workers:
            try:
                pickle.dumps((fn, self.warmup))
            except Exception as e:
                raise ValueError(
                    f"isolated reward function {fn_name!r} cannot be sent to worker processes "
                    f"({type(e).__name__}: {e}); make it a module-level function, or use "
                    "workers=0") from None

    def __call__(self, samples: list[RewardInput], first_index: int = 0) -> tuple[torch.Tensor, dict]:
        """``(rewards, counts)``: float32 ``[B]`` on the CPU, and ``{"reward_timeouts": n,
        "reward_errors": n}``. ``first_index``: the global index of ``samples[0]``."""
        import torch

        if not samples:
            outcomes = []
        elif self.workers:
            outcomes = self._in_workers(samples)
        else:
            outcomes = self._inline(samples)
        values = [o.value if o.kind == "ok" else 0.0 for o in outcomes]
        counts = {"reward_timeouts": sum(o.kind == "timeout" for o in outcomes),
                  "reward_errors": sum(o.kind not in ("ok", "timeout") for o in outcomes)}
        failed = [i for i, o in enumerate(outcomes) if o.kind != "ok"]
        if failed:
            fatal = [i for i in failed if outcomes[i].kind in FATAL]
            i = (fatal or failed)[0]
            self.last_failure = self._message(outcomes[i], first_index + i, first_index)
            if fatal or self.strict:
                cause = outcomes[i].cause
                raise RewardError(self.last_failure) from (
                    RemoteTraceback(cause) if isinstance(cause, str) else cause)
            for i in failed:
                self._report(outcomes[i], samples[i], first_index + i, first_index)
        return torch.tensor(values, dtype=torch.float32, device="cpu"), counts

    def _in_workers(self, samples: list[RewardInput]) -> list[Outcome]:
        if self._pool is None:
            call = remote_batch if self.batched else remote_one
            self._pool = WorkerPool(functools.partial(call, self.fn), self.workers, self.batched, self.warmup)
            weakref.finalize(self, self._pool.close)
        try:
            results, spans = self._pool.run(samples, self.timeout_s)
        except WorkerStartError as e:
            raise RewardError(f"cannot run reward function {self.fn_name!r} in a worker process: {e}") \
                from e.__cause__
        outcomes = []
        for r, span in zip(results, spans):
            if isinstance(r, Lost):  # the call ran past its time, or never returned
                r = Outcome(r.kind if r.kind in ("timeout", "died") else "raised", detail=r.detail)
            outcomes.append(r._replace(span=span))
        return outcomes

    def _inline(self, samples: list[RewardInput]) -> list[Outcome]:
        fn = self.fn
        if self.batched:
            span = (0, len(samples) - 1)
            try:
                call = functools.partial(call_batch, fn, samples)
                outcomes = with_alarm(call, self.timeout_s * len(samples)) if self.isolated else call()
            except Timeout:
                outcomes = [TIMEOUT] * len(samples)
            return [o._replace(span=span) for o in outcomes]
        if not self.isolated:
            return [call_one(fn, s) for s in samples]
        outcomes = []
        for s in samples:
            try:
                outcomes.append(with_alarm(functools.partial(call_one, fn, s), self.timeout_s))
            except Timeout:
                outcomes.append(TIMEOUT)
        return outcomes

    def _message(self, o: Outcome, index: int, first_index: int) -> str:
        name = self.fn_name
        where = (f"sample {index}" if o.span is None else
                 f"samples {first_index + o.span[0]}-{first_index + o.span[1]} (one batch call)")
        if o.kind == "bad":
            return (f"reward function {name!r} returned {o.detail} for {where}; "
                    "rewards must be finite numbers")
        if o.kind == "timeout":
            per = " per sample" if self.batched else ""
            return (f"reward function {name!r} timed out on {where} (over {self.timeout_s:g} s"
                    f"{per}; --reward-timeout sets the limit)")
        if o.kind == "died":
            return f"reward function {name!r} crashed its worker process on {where} ({o.detail})"
        if o.kind == "length":
            return (f"batch reward function {name!r} returned {o.detail} for {where}; "
                    "it must return one value per sample")
        return f"reward function {name!r} raised on {where}: {o.detail}"

    def _report(self, o: Outcome, sample: RewardInput, index: int, first_index: int) -> None:
        """Print the first failure of each kind (of each exception type, for a crash) with
        its traceback and the sample's prompt; later ones are only counted."""
        key = (o.kind, o.detail.partition(":")[0] if o.kind == "raised" else "")
        if key in self._reported:
            return
        self._reported.add(key)
        counter = "reward_timeouts" if o.kind == "timeout" else "reward_errors"
        prompt = sample.prompt if len(sample.prompt) <= _PROMPT_SHOWN else sample.prompt[:_PROMPT_SHOWN] + "..."
        lines = [f"warning: {self._message(o, index, first_index)}",
                 f"  it scores 0, counted in {counter}; only the first failure of each kind is "
                 "shown (--strict-rewards stops the run at the first)",
                 f"  prompt: {prompt!r}"]
        if isinstance(o.cause, BaseException):
            lines.append("".join(traceback.format_exception(type(o.cause), o.cause, o.cause.__traceback__)))
        elif isinstance(o.cause, str):
            lines.append(o.cause)
        print("\n".join(line.rstrip("\n") for line in lines), file=sys.stderr, flush=True)

    def close(self) -> None:
        """Stop the worker processes (a later call starts new ones)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def score_samples(fn_name: str, samples: list[RewardInput], first_index: int = 0) -> torch.Tensor:
    """Float32 ``[B]`` rewards of ``samples``, strict and in this process: the first crash,
    non-finite value or timeout raises a :class:`RewardError` naming the function and the
    sample (``first_index`` plus its position)."""
    return RewardScorer(fn_name, strict=True, workers=0)(samples, first_index)[0]
