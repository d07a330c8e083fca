"""The worker side of :mod:`~megatron_rlhf.rlhf.rewards.pool`: a fresh interpreter that loads
one callable, then answers each chunk of items it is sent with one message."""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import signal
import struct
import time
import traceback
from multiprocessing.connection import Connection

# A worker's progress, in memory shared with the parent: the number of items it has started
# (ever) and the time.monotonic() at which it started the latest.
PROGRESS = struct.Struct("<qd")


class RemoteTraceback(Exception):
    """A worker's traceback text, to chain as the cause of an error in the parent."""

    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f'\n"""\n{self.tb}"""'


def main(fd: int, progress_fd: int, parent_pid: int) -> None:
    """A worker process: load the callable, warm up, then answer each chunk it is sent with
    one message, until its connection closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and ends us
    with contextlib.suppress(Exception):  # Linux: die with the parent even while stuck in a call
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        return
    progress = mmap.mmap(progress_fd, PROGRESS.size)
    os.close(progress_fd)
    conn = Connection(fd)
    try:
        fn, batched, warmup = pickle.loads(conn.recv_bytes())
        if warmup is not None:
            warmup()
    except BaseException as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        return
    conn.send(("ready",))
    started = 0
    while True:
        try:
            items = conn.recv()
        except EOFError:
            return
        except Exception as exc:  # an item that does not unpickle here
            conn.send(("lost", f"cannot receive the items: {type(exc).__name__}: {exc}"))
            continue
        if batched:
            results = fn(items)
        else:
            results = []
            for item in items:
                started += 1
                PROGRESS.pack_into(progress, 0, started, time.monotonic())
                results.append(fn(item))
        conn.send(("done", results))
