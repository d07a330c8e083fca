"""Worker processes that apply one picklable callable to a list of items, with a timeout.

Entry point: :class:`WorkerPool`; ``run`` returns one result per item, or a :class:`Lost`
for an item whose call timed out, whose worker died, or that did not reach ``fn``.
"""
# A stuck worker costs its item, not the batch: it is killed, a fresh one replaces it, and
# the rest of its chunk goes to the others.

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any, NamedTuple

from megatron_rlhf.rlhf.rewards.worker import PROGRESS, RemoteTraceback
from megatron_rlhf.rlhf.rewards.worker import main as worker_main

START_S = 120.0  # the longest wait for a worker to import the callable and warm up

_PENDING = object()  # a result not in yet (None is a result)


class Lost(NamedTuple):
    """An item without a result: ``kind`` is ``timeout``, ``died`` or ``unreadable``."""

    kind: str
    detail: str = ""


class WorkerStartError(RuntimeError):
    """A worker could not load the callable, or exited or hung before it was ready."""


class _Worker:
    """One worker: a fresh interpreter with this process's ``sys.path`` (spawned, never
    forked: safe beside torch's and gloo's threads)."""

    def __init__(self, payload: bytes):
        ours, theirs = socket.socketpair()
        fd = theirs.fileno()
        if hasattr(os, "memfd_create"):
            progress_fd = os.memfd_create("worker-progress")
        else:
            progress_fd, path = tempfile.mkstemp(prefix="worker-progress-")
            os.unlink(path)
        try:
            os.ftruncate(progress_fd, PROGRESS.size)
            self.progress = mmap.mmap(progress_fd, PROGRESS.size)
            code = (f"import sys; sys.path[:] = {sys.path!r}; from {worker_main.__module__} import main; "
                    f"main({fd}, {progress_fd}, {os.getpid()})")
            self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[fd, progress_fd],
                                         stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
            os.close(progress_fd)
        self.conn = Connection(ours.detach())
        self.conn.send_bytes(payload)
        self.ready = False
        self.chunk: list[int] | None = None  # positions in the batch of the chunk it holds
        self.sent_at = time.monotonic()  # when the chunk was sent (before ready: the start)
        self.base = 0  # items it had started before this chunk

    def dispatch(self, chunk: list[int], items: list) -> None:
        self.base = PROGRESS.unpack_from(self.progress)[0]  # it is idle: no race
        self.conn.send([items[i] for i in chunk])
        self.chunk, self.sent_at = chunk, time.monotonic()

    def in_flight(self) -> tuple[int, float]:
        """The position in the chunk of the item being processed, and when it started."""
        started, at = PROGRESS.unpack_from(self.progress)
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


class WorkerPool:
    """``size`` workers calling ``fn(item)`` (``batched``: ``fn(chunk) -> list``, one result
    per item), after ``warmup()`` once each. ``fn`` and ``warmup`` must pickle by reference."""
    # run splits the items into contiguous chunks (two per worker; one when batched). An
    # item's call has timeout_s from its start, which the worker records in shared memory.
    # A batched call has timeout_s per item of its chunk; on expiry all of them are lost.

    def __init__(self, fn: Callable, size: int, batched: bool = False,
                 warmup: Callable[[], Any] | None = None):
        self.batched, self.size = batched, size
        self.payload = pickle.dumps((fn, batched, warmup))
        self.workers: list[_Worker] = []

    def close(self) -> None:
        workers, self.workers = self.workers, []
        for w in workers:
            w.stop(kill=w.chunk is not None or not w.ready)

    def run(self, items: list, timeout_s: float) -> tuple[list, list[tuple[int, int] | None]]:
        """``(results, spans)``: per item its result or a :class:`Lost`, and (batched) the
        first and last position of the chunk whose call gave it. Raises WorkerStartError."""
        try:
            return self._run(items, timeout_s)
        except BaseException:
            self.close()  # workers may hold chunks of this batch: start afresh next time
            raise

    def _fill(self) -> None:
        while len(self.workers) < self.size:
            self.workers.append(_Worker(self.payload))

    def _drop(self, w: _Worker) -> None:
        self.workers.remove(w)
        w.stop(kill=True)

    def _deadline(self, w: _Worker, timeout_s: float) -> float:
        if not w.ready:
            return w.sent_at + START_S
        if self.batched:
            return w.sent_at + timeout_s * len(w.chunk)
        return w.in_flight()[1] + timeout_s

    def _run(self, items: list, timeout_s: float) -> tuple[list, list]:
        n = len(items)
        out: list = [_PENDING] * n
        spans: list = [None] * n
        n_chunks = min(n, self.size if self.batched else 2 * self.size)
        bounds = [n * k // n_chunks for k in range(n_chunks + 1)]
        queue = deque(list(range(a, b)) for a, b in zip(bounds, bounds[1:]))
        while True:
            self._fill()
            for w in list(self.workers):
                if w.ready and w.chunk is None and queue:
                    chunk = queue.popleft()
                    try:
                        w.dispatch(chunk, items)
                    except OSError:  # it died while idle: a fresh one takes the chunk
                        queue.appendleft(chunk)
                        self._drop(w)
            busy = [w for w in self.workers if w.chunk is not None or (queue and not w.ready)]
            if not busy:
                break
            left = min(self._deadline(w, timeout_s) for w in busy) - time.monotonic()
            for conn in wait([w.conn for w in busy], timeout=max(left, 0.0)):
                self._receive(next(w for w in busy if w.conn is conn), out, spans, queue)
            now = time.monotonic()
            for w in busy:
                if w in self.workers and (w.chunk is not None or not w.ready) \
                        and self._deadline(w, timeout_s) <= now:
                    self._drop(w)
                    if not w.ready:
                        raise WorkerStartError(f"the worker process did not start within {START_S:g} s")
                    self._lose(w, out, spans, Lost("timeout"), queue)
        assert all(o is not _PENDING for o in out)
        return out, spans

    def _lose(self, w: _Worker, out: list, spans: list, lost: Lost, queue: deque) -> None:
        """``w`` is gone in the middle of its chunk: the item it was on (batched: the whole
        chunk) is ``lost``; the chunk's others go back to the queue."""
        k = 0 if self.batched else w.in_flight()[0]
        chunk, w.chunk = w.chunk, None
        if self.batched:
            for i in chunk:
                out[i], spans[i] = lost, (chunk[0], chunk[-1])
            return
        out[chunk[k]] = lost
        rest = chunk[:k] + chunk[k + 1:]
        if rest:
            queue.appendleft(rest)

    def _receive(self, w: _Worker, out: list, spans: list, queue: deque) -> None:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            self._drop(w)
            if w.chunk is None:
                if not w.ready:
                    raise WorkerStartError(f"it exited with code {w.proc.returncode} before it "
                                           "was ready (its error is above)") from None
                return  # died while idle; replaced
            self._lose(w, out, spans, Lost("died", f"exit code {w.proc.returncode}"), queue)
            return
        kind = msg[0]
        if kind == "ready":
            w.ready = True
            return
        if kind == "failed":
            self._drop(w)
            raise WorkerStartError(msg[1]) from RemoteTraceback(msg[2])
        chunk, w.chunk = w.chunk, None
        span = (chunk[0], chunk[-1]) if self.batched else None
        if kind == "done":
            for i, result in zip(chunk, msg[1]):
                out[i], spans[i] = result, span
        else:  # "lost": the items did not reach the callable
            for i in chunk:
                out[i], spans[i] = Lost("unreadable", msg[1]), span
