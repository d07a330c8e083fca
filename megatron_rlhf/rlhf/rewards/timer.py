"""A time limit on a call in this process: ``with_alarm(call, seconds)`` raises
:class:`Timeout` when ``call()`` runs past ``seconds`` (SIGALRM, main thread only)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any


class Timeout(BaseException):
    """Raised by the alarm; a BaseException so ``except Exception`` in the call does not
    swallow it."""


def with_alarm(call: Callable[[], Any], seconds: float) -> Any:
    """``call()``, interrupted by :class:`Timeout` after ``seconds``; without a limit off the
    main thread or without ``setitimer``."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        return call()

    def on_alarm(signum, frame):
        raise Timeout

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
        if old_delay > 0:  # someone else's alarm (pytest-timeout), less the time spent here
            left = max(old_delay - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, old_interval)
