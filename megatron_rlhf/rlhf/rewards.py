"""Reward functions, registered by name, and the scorer that runs them over a batch.

A reward function maps one :class:`RewardInput` (a prompt, its sampled response and the
record's other fields) to a finite real number. Functions are looked up by name
(``--reward-fn concise``, ``--reward-fn math``, or a user's ``module:function``) through
:func:`get_reward_fn`. :class:`RewardScorer` scores a batch: a crash, a non-finite value or
a timeout scores 0.0 and is counted (``reward_errors``, ``reward_timeouts``), or raises a
:class:`RewardError` naming the function and the sample under ``strict``;
:func:`score_samples` is its strict, in-process form.

Adding a rule::

    @register_reward("my_rule")
    def my_rule(sample: RewardInput) -> float:
        \"\"\"What it rewards; range [0, 1].\"\"\"
        return ...

Two marks change how the scorer calls a function (a user's ``module:function`` may carry
them too; set them with the decorators or as plain attributes):

- ``batched`` (:func:`batch_reward`): ``fn(samples: list[RewardInput]) -> list[float]``,
  one value per sample, instead of one call per sample (a wrong count is a RewardError
  whatever ``strict``: the function is broken, not a sample);
- ``isolated`` (:func:`isolated_reward`): the function runs in worker processes with a
  timeout per call, so a slow or stuck call costs one sample, not the iteration. The
  verifiers (``math``) are isolated. Such a function must be importable by name (a
  module-level function): the workers are fresh interpreters that import it.

A function with an ``answer_key`` parameter receives the scorer's ``answer_key``
(``--answer-key``) as a keyword; the others read ``sample.meta`` as they like.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import mmap
import numbers
import os
import pickle
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, NamedTuple

from megatron_rlhf.rlhf.verifiers import MissingAnswerError, math_reward

if TYPE_CHECKING:  # imported where a tensor is built: worker processes never load torch
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
    meta: dict = field(default_factory=dict)
    """Every other field of the dataset record (ground-truth answer, test cases, ids),
    untouched; empty for plain prompts."""


RewardFn = Callable[[RewardInput], float]
"""A per-sample function; a ``batched`` one is ``Callable[[list[RewardInput]], list[float]]``."""

REWARD_FUNCTIONS: dict[str, Callable] = {}
"""All registered reward functions, by name."""


class RewardError(RuntimeError):
    """A reward function crashed, returned something that is not a finite number, or timed
    out (under ``strict``); or it cannot run at all (a configuration error)."""


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


def isolated_reward(fn: Callable) -> Callable:
    """Mark ``fn`` to run in worker processes with a per-call timeout (sets
    ``fn.isolated = True``); returns ``fn`` itself. ``fn`` must be a module-level function.
    It may also carry ``fn.warmup``, a no-argument function each worker calls once before
    its first sample (imports, caches), outside any timeout."""
    fn.isolated = True
    return fn


def get_reward_fn(name: str) -> Callable:
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


# ------------------------------------------------------------------ one call's outcome


class _Outcome(NamedTuple):
    """What scoring one sample gave."""

    kind: str
    """ok | raised | bad | timeout | died | fatal (raised a configuration error) | length."""
    value: float = 0.0
    """The reward, when ``kind == "ok"``."""
    detail: str = ""
    """What went wrong, for the message."""
    cause: Any = None
    """The exception (in this process) or its traceback text (from a worker)."""
    span: tuple[int, int] | None = None
    """Positions in the batch of the batch call that gave it (batched functions)."""


_FATAL = ("fatal", "length")  # raised whatever ``strict``
_TIMEOUT = _Outcome("timeout")


def _checked(value: Any) -> _Outcome:
    """Booleans count as 0/1; anything but a finite real number is a bad value."""
    if isinstance(value, numbers.Real) and math.isfinite(value):
        return _Outcome("ok", float(value))
    return _Outcome("bad", detail=repr(value))


def _raised(exc: BaseException) -> _Outcome:
    kind = "fatal" if isinstance(exc, MissingAnswerError) else "raised"
    return _Outcome(kind, detail=f"{type(exc).__name__}: {exc}", cause=exc)


def _call_one(fn: Callable, sample: RewardInput) -> _Outcome:
    try:
        value = fn(sample)
    except Exception as exc:
        return _raised(exc)
    return _checked(value)


def _call_batch(fn: Callable, samples: list[RewardInput]) -> list[_Outcome]:
    n = len(samples)
    try:
        values = fn(list(samples))
        if hasattr(values, "tolist"):  # a tensor or an array
            values = values.tolist()
        values = list(values)
    except Exception as exc:
        return [_raised(exc)] * n
    if len(values) != n:
        return [_Outcome("length", detail=f"{len(values)} values")] * n
    return [_checked(v) for v in values]


class _Timeout(BaseException):
    """Raised by the in-process alarm; a BaseException so ``except Exception`` in the
    reward function does not swallow it."""


def _with_alarm(call: Callable[[], Any], seconds: float) -> Any:
    """``call()``, interrupted by :class:`_Timeout` after ``seconds`` (SIGALRM). Only on
    the main thread of a POSIX process; elsewhere ``call()`` runs without a limit. An
    alarm set by someone else (pytest-timeout) is restored, less the time spent here."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        return call()

    def on_alarm(signum, frame):
        raise _Timeout

    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    start = time.monotonic()
    old_delay, old_interval = 0.0, 0.0
    try:
        old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, seconds)  # one-shot
        try:
            return call()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        signal.signal(signal.SIGALRM, old_handler if old_handler is not None else signal.SIG_DFL)
        if old_delay > 0:
            left = max(old_delay - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, old_interval)


# --------------------------------------------------------------------- worker processes

_WORKER_START_S = 120.0
"""Longest wait for a worker to import the function and warm up."""

_PROGRESS = struct.Struct("<qd")
"""A worker's progress, in memory it shares with the scorer: the number of samples it has
started (ever) and the ``time.monotonic()`` at which it started the latest."""


class _RemoteTraceback(Exception):
    """A worker's traceback, chained as the cause of a RewardError."""

    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f'\n"""\n{self.tb}"""'


def _portable(outcome: _Outcome) -> _Outcome:
    """The outcome with its exception replaced by the traceback text (sent to the parent)."""
    if isinstance(outcome.cause, BaseException):
        exc = outcome.cause
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return outcome._replace(cause=tb)
    return outcome


def _worker_main(fd: int, progress_fd: int, parent_pid: int) -> None:
    """A worker process: load the function, warm up, then score the chunks it is sent until
    its connection closes; one message per chunk, the progress through it in shared memory."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and ends us
    with contextlib.suppress(Exception):  # Linux: die with the parent even while stuck in a call
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        return
    progress = mmap.mmap(progress_fd, _PROGRESS.size)
    os.close(progress_fd)
    conn = Connection(fd)
    try:
        fn, batched = pickle.loads(conn.recv_bytes())
        warmup = getattr(getattr(fn, "func", fn), "warmup", None)
        if warmup is not None:
            warmup()
    except BaseException as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        return
    conn.send(("ready",))
    started = 0
    while True:
        try:
            samples = conn.recv()
        except EOFError:
            return
        except Exception as exc:  # a sample that does not unpickle here
            conn.send(("lost", f"cannot receive the samples: {type(exc).__name__}: {exc}"))
            continue
        if batched:
            outcomes = _call_batch(fn, samples)
        else:
            outcomes = []
            for sample in samples:
                started += 1
                _PROGRESS.pack_into(progress, 0, started, time.monotonic())
                outcomes.append(_call_one(fn, sample))
        conn.send(("done", [_portable(o) for o in outcomes]))


class _Worker:
    """One worker: a fresh interpreter (with this process's ``sys.path``, so it imports the
    same modules; spawned, never forked: safe beside torch's and gloo's threads)."""

    def __init__(self, payload: bytes):
        ours, theirs = socket.socketpair()
        fd = theirs.fileno()
        if hasattr(os, "memfd_create"):
            progress_fd = os.memfd_create("reward-worker-progress")
        else:
            progress_fd, path = tempfile.mkstemp(prefix="reward-worker-")
            os.unlink(path)
        try:
            os.ftruncate(progress_fd, _PROGRESS.size)
            self.progress = mmap.mmap(progress_fd, _PROGRESS.size)
            code = (f"import sys; sys.path[:] = {sys.path!r}; "
                    "from megatron_rlhf.rlhf.rewards import _worker_main; "
                    f"_worker_main({fd}, {progress_fd}, {os.getpid()})")
            self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[fd, progress_fd],
                                         stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
            os.close(progress_fd)
        self.conn = Connection(ours.detach())
        self.conn.send_bytes(payload)
        self.ready = False
        self.chunk: list[int] | None = None
        """Batch positions of the chunk it is scoring."""
        self.sent_at = time.monotonic()
        """When the chunk was sent (before it is ready: when it was started)."""
        self.base = 0
        """Samples it had started before this chunk."""

    def dispatch(self, chunk: list[int], samples: list[RewardInput]) -> None:
        self.base = _PROGRESS.unpack_from(self.progress)[0]  # it is idle: no race
        self.conn.send([samples[i] for i in chunk])
        self.chunk, self.sent_at = chunk, time.monotonic()

    def in_flight(self) -> tuple[int, float]:
        """The position in the chunk of the sample being scored, and when it started."""
        started, at = _PROGRESS.unpack_from(self.progress)
        k = started - self.base - 1
        if k < 0:  # still receiving the chunk
            return 0, self.sent_at
        return min(k, len(self.chunk) - 1), at

    def stop(self, kill: bool) -> None:
        if kill:
            with contextlib.suppress(OSError):
                self.proc.kill()
        self.conn.close()  # an idle worker sees EOF and exits
        try:
            self.proc.wait(timeout=None if kill else 2.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _WorkerPool:
    """``size`` workers bound to one function, kept across calls.

    A call splits the batch into contiguous chunks (two per worker; one per worker for a
    batched function) and hands them to idle workers, one message each way per chunk. A
    per-sample call has ``timeout_s`` from the moment the worker starts it (which it
    records in memory shared with this process, so no message is needed per sample). A
    worker past it is killed and reaped: that sample times out, the rest of its chunk
    (those it had scored too: their results died with it) goes back to the queue for the
    other workers, and a fresh worker replaces it. A batch call has ``timeout_s`` per
    sample in its chunk, and on expiry all of the chunk's samples time out."""

    def __init__(self, name: str, fn: Callable, batched: bool, size: int):
        self.name, self.batched, self.size = name, batched, size
        self.payload = pickle.dumps((fn, batched))
        self.workers: list[_Worker] = []

    def close(self) -> None:
        workers, self.workers = self.workers, []
        for w in workers:
            w.stop(kill=w.chunk is not None or not w.ready)

    def _fill(self) -> None:
        while len(self.workers) < self.size:
            self.workers.append(_Worker(self.payload))

    def _drop(self, w: _Worker) -> None:
        self.workers.remove(w)
        w.stop(kill=True)

    def _deadline(self, w: _Worker, timeout_s: float) -> float:
        if not w.ready:
            return w.sent_at + _WORKER_START_S
        if self.batched:
            return w.sent_at + timeout_s * len(w.chunk)
        return w.in_flight()[1] + timeout_s

    def run(self, samples: list[RewardInput], timeout_s: float) -> list[_Outcome]:
        try:
            return self._run(samples, timeout_s)
        except BaseException:
            self.close()  # workers may hold chunks of this batch: start afresh next time
            raise

    def _run(self, samples: list[RewardInput], timeout_s: float) -> list[_Outcome]:
        n = len(samples)
        out: list[_Outcome | None] = [None] * n
        n_chunks = min(n, self.size if self.batched else 2 * self.size)
        bounds = [n * k // n_chunks for k in range(n_chunks + 1)]
        queue = deque(list(range(a, b)) for a, b in zip(bounds, bounds[1:]))
        while True:
            self._fill()
            for w in list(self.workers):
                if w.ready and w.chunk is None and queue:
                    chunk = queue.popleft()
                    try:
                        w.dispatch(chunk, samples)
                    except OSError:  # it died while idle: a fresh one takes the chunk
                        queue.appendleft(chunk)
                        self._drop(w)
            busy = [w for w in self.workers if w.chunk is not None or (queue and not w.ready)]
            if not busy:
                break
            left = min(self._deadline(w, timeout_s) for w in busy) - time.monotonic()
            for conn in wait([w.conn for w in busy], timeout=max(left, 0.0)):
                self._receive(next(w for w in busy if w.conn is conn), out, queue)
            now = time.monotonic()
            for w in busy:
                if w in self.workers and (w.chunk is not None or not w.ready) \
                        and self._deadline(w, timeout_s) <= now:
                    self._expire(w, out, queue)
        assert all(o is not None for o in out)
        return out  # type: ignore[return-value]

    def _lose(self, w: _Worker, out: list, outcome: _Outcome, queue: deque) -> None:
        """``w`` is gone in the middle of its chunk: the sample it was scoring (a batch call:
        the whole chunk) gets ``outcome``, the chunk's others go back to the queue."""
        k = 0 if self.batched else w.in_flight()[0]
        chunk, w.chunk = w.chunk, None
        if self.batched:
            for i in chunk:
                out[i] = outcome._replace(span=(chunk[0], chunk[-1]))
            return
        out[chunk[k]] = outcome
        rest = chunk[:k] + chunk[k + 1:]
        if rest:
            queue.appendleft(rest)

    def _receive(self, w: _Worker, out: list, queue: deque) -> None:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            self._drop(w)
            if w.chunk is None:
                if not w.ready:
                    raise RewardError(
                        f"the worker process for reward function {self.name!r} exited with "
                        f"code {w.proc.returncode} before it was ready (its error is above)") from None
                return  # died while idle; replaced
            self._lose(w, out, _Outcome("died", detail=f"exit code {w.proc.returncode}"), queue)
            return
        kind = msg[0]
        if kind == "ready":
            w.ready = True
            return
        if kind == "failed":
            self._drop(w)
            raise RewardError(f"cannot run reward function {self.name!r} in a worker process: "
                              f"{msg[1]}") from _RemoteTraceback(msg[2])
        chunk, w.chunk = w.chunk, None
        if kind == "done":
            span = (chunk[0], chunk[-1]) if self.batched else None
            for i, o in zip(chunk, msg[1]):
                out[i] = o._replace(span=span)
        else:  # "lost": the samples did not reach the function
            for i in chunk:
                out[i] = _Outcome("raised", detail=msg[1])

    def _expire(self, w: _Worker, out: list, queue: deque) -> None:
        self._drop(w)
        if not w.ready:
            raise RewardError(f"the worker process for reward function {self.name!r} did not "
                              f"start within {_WORKER_START_S:g} s")
        self._lose(w, out, _TIMEOUT, queue)


# ------------------------------------------------------------------------- the scorer


def takes_answer_key(fn: Callable) -> bool:
    """Whether ``fn`` checks a record field named by ``answer_key`` (the scorer passes it)."""
    try:
        return "answer_key" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


class RewardScorer:
    """Scores batches with one reward function; keeps its worker processes across calls.

    ``fn_name``: a registered name or ``module:function`` (ValueError listing the valid
    names if unknown). ``timeout_s``: the limit of one call of an isolated function (a
    batched one: per sample of the call). ``workers``: processes for an isolated function;
    None: ``min(2, cpu_count)``; 0: in this process, where the timeout is a SIGALRM that
    interrupts Python code on the main thread only (on another thread, or inside a long C
    call, there is no limit). Functions that are not isolated always run in this process,
    without a timeout. ``strict``: raise a :class:`RewardError` on the first failed sample
    instead of scoring it 0. ``answer_key``: passed to functions with an ``answer_key``
    parameter (the verifiers).

    Call it with the samples and the global index of the first (for messages); it returns
    float32 ``[B]`` rewards on the CPU and ``{"reward_timeouts": n, "reward_errors": n}``
    (samples scored 0 for a timeout; for a crash, a non-number or a dead worker). A
    configuration error (a record without the answer field, a batch function returning
    the wrong number of values, a function the workers cannot load) raises whatever
    ``strict``. ``last_failure`` holds the message of the latest failed sample.
    """

    def __init__(self, fn_name: str, *, timeout_s: float = 5.0, workers: int | None = None,
                 strict: bool = False, answer_key: str = "answer"):
        fn = get_reward_fn(fn_name)
        if not (isinstance(timeout_s, numbers.Real) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"the reward timeout must be a finite number of seconds > 0, got {timeout_s!r}")
        if workers is not None and (not isinstance(workers, int) or workers < 0):
            raise ValueError(f"reward workers must be None or an integer >= 0, got {workers!r}")
        self.fn_name, self.timeout_s, self.strict = fn_name, float(timeout_s), strict
        self.batched = bool(getattr(fn, "batched", False))
        self.isolated = bool(getattr(fn, "isolated", False))
        if takes_answer_key(fn):
            fn = functools.partial(fn, answer_key=answer_key)
        self.fn = fn
        if not self.isolated:
            workers = 0
        elif workers is None:
            workers = min(2, os.cpu_count() or 1)
        self.workers = workers
        self.last_failure: str | None = None
        self._pool: _WorkerPool | None = None
        if workers:
            try:
                pickle.dumps(fn)
            except Exception as e:
                raise ValueError(
                    f"isolated reward function {fn_name!r} cannot be sent to worker processes "
                    f"({type(e).__name__}: {e}); make it a module-level function, or use "
                    "workers=0") from None

    def __call__(self, samples: list[RewardInput], first_index: int = 0) -> tuple[torch.Tensor, dict]:
        import torch

        if not samples:
            outcomes = []
        elif self.workers:
            if self._pool is None:
                self._pool = _WorkerPool(self.fn_name, self.fn, self.batched, self.workers)
                weakref.finalize(self, self._pool.close)
            outcomes = self._pool.run(samples, self.timeout_s)
        else:
            outcomes = self._inline(samples)
        values = [o.value if o.kind == "ok" else 0.0 for o in outcomes]
        counts = {"reward_timeouts": sum(o.kind == "timeout" for o in outcomes),
                  "reward_errors": sum(o.kind not in ("ok", "timeout") for o in outcomes)}
        failed = [i for i, o in enumerate(outcomes) if o.kind != "ok"]
        if failed:
            fatal = [i for i in failed if outcomes[i].kind in _FATAL]
            i = (fatal or failed)[0]
            message = self._message(outcomes[i], first_index + i, first_index)
            self.last_failure = message
            if fatal or self.strict:
                cause = outcomes[i].cause
                if isinstance(cause, str):
                    cause = _RemoteTraceback(cause)
                raise RewardError(message) from cause
        return torch.tensor(values, dtype=torch.float32, device="cpu"), counts

    def _inline(self, samples: list[RewardInput]) -> list[_Outcome]:
        fn = self.fn
        if self.batched:
            span = (0, len(samples) - 1)
            try:
                call = functools.partial(_call_batch, fn, samples)
                outcomes = _with_alarm(call, self.timeout_s * len(samples)) if self.isolated else call()
            except _Timeout:
                outcomes = [_TIMEOUT] * len(samples)
            return [o._replace(span=span) for o in outcomes]
        if not self.isolated:
            return [_call_one(fn, s) for s in samples]
        outcomes = []
        for s in samples:
            try:
                outcomes.append(_with_alarm(functools.partial(_call_one, fn, s), self.timeout_s))
            except _Timeout:
                outcomes.append(_TIMEOUT)
        return outcomes

    def _message(self, o: _Outcome, index: int, first_index: int) -> str:
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
    """Score ``samples`` with the function ``fn_name``; returns float32 ``[B]``.

    Strict and in this process: ``RewardScorer(fn_name, strict=True, workers=0)``. The first
    crash, non-finite value or timeout raises a :class:`RewardError` naming the function
    and the sample (``first_index`` plus its position). Booleans count as 0/1.
    """
    return RewardScorer(fn_name, strict=True, workers=0)(samples, first_index)[0]


register_reward("math")(math_reward)


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
