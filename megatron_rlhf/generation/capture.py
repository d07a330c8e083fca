"""CUDA graph capture and replay of one step function, and the host read of its result.

Entry points: :class:`Captured` (warm-up on a side stream, capture, replay), :class:`Eager`
(the same step run without capture: the CPU, tests, a failed capture), :func:`record`
(names the op that broke a capture), :class:`Fetch` (a packed result on its way to the host).
Invariant: a step's in-place state is as it was before warm-up and capture.
"""

from __future__ import annotations

import torch

# Eager runs before a capture, on a side stream: lazy initialisation (cuBLAS workspaces)
# must not happen during capture.
WARMUP = 1


class Eager:
    """The static step run without capture (CPU, tests)."""

    def __init__(self, fn):
        self.fn = fn

    def run(self):
        return self.fn()


class CaptureError(RuntimeError):
    """A capture failed; the message names the first op that failed inside it."""


def describe(error: BaseException) -> str:
    """``error`` and where it was raised: its innermost frame, and the innermost in
    megatron_rlhf or megatron-core when that is another (the op our code called)."""
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    where = [f for f in frames if "megatron" in f.filename]
    shown = [frames[-1]] if frames else []
    if where and where[-1] is not shown[-1]:
        shown.insert(0, where[-1])
    at = " <- ".join(f"{f.filename}:{f.lineno} in {f.name} ({(f.line or '').strip()})"
                     for f in reversed(shown))
    return f"{type(error).__name__}: {error}" + (f" at {at}" if at else "")


def record(fn, capture):
    """``fn()`` inside the ``capture`` context; returns its result. A failure raises
    :class:`CaptureError` naming the first op that failed inside the capture: when an op
    breaks a capture, leaving the context (``capture_end()``) raises an error of its own
    that would otherwise hide it."""
    first = None
    try:
        with capture:
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 (kept: the context's exit may raise another)
                first = e
                raise
    except Exception as e:  # noqa: BLE001
        cause = first or e
        raise CaptureError(describe(cause)) from cause


class Captured:
    def __init__(self, fn, pool, state: tuple[torch.Tensor, ...]):
        """``state``: tensors the step advances in place, restored after warm-up and capture."""
        saved = [t.clone() for t in state]
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP):  # writes keys/values past each row's length: garbage there anyway
                    fn()
                    for t, v in zip(state, saved):
                        t.copy_(v)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            self.out = record(fn, torch.cuda.graph(self.graph, pool=pool))
        finally:  # a capture records without running: the state is as saved either way
            for t, v in zip(state, saved):
                t.copy_(v)

    def run(self):
        self.graph.replay()
        return self.out


class Fetch:
    """A step's packed result on its way to the host (a pinned buffer, and on a GPU the event
    after its copy)."""

    def __init__(self, host: torch.Tensor, event):
        self.host, self.event = host, event

    def result(self) -> list[list[float]]:
        """The rows, once the copy has landed (waits for it; the one host sync of a step)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()
