"""Colocation on GPU: park what the current stage does not use in pinned host memory.

Every stage runs on the same ranks. Between its uses, a model's weights (reference,
reward) or an optimizer's states move to pinned CPU memory and come back before the next
use; the generator's KV cache is freed when generation returns; optimizer states and
gradient buffers leave the GPU while the rollout and experience stages run. On CPU these are no-ops.
"""

from __future__ import annotations

import contextlib
import time

import torch

from megatron_rlhf import platform


def _move(t: torch.Tensor, device) -> torch.Tensor:
    if device.type == "cpu":
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        out.copy_(t, non_blocking=True)
        return out
    return t.to(device, non_blocking=True)


def move_model(model: torch.nn.Module, device) -> None:
    """Move parameters and buffers in place (the module's tensors keep their identity)."""
    if not platform.has_cuda():
        return
    device = torch.device(device)
    for p in model.parameters():
        p.data = _move(p.data, device)
    for mod in model.modules():
        for name, b in mod._buffers.items():
            if b is not None:
                mod._buffers[name] = _move(b, device)
    torch.cuda.synchronize()


def park_trainee(t, host: bool) -> None:
    """Between training stages (``host=True``): megatron's optimizer moves its fp32 masters
    and Adam states to host memory, and DDP frees its fp32 gradient buffers; before
    training (``host=False``) both come back (the buffers zeroed)."""
    if not platform.has_cuda():
        return
    if host:
        t.optimizer.offload_to_cpu()
        t.ddp.offload_grad_buffers()
    else:
        t.optimizer.restore_from_cpu()
        t.ddp.restore_grad_buffers()
    torch.cuda.synchronize()


class StageMemory:
    """Times each stage and, on GPU, records its peak device memory."""

    def __init__(self):
        self.metrics: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str):
        if platform.has_cuda():
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if platform.has_cuda():
                torch.cuda.synchronize()
                self.metrics[f"peak_mem_{name}_gb"] = torch.cuda.max_memory_allocated() / 2**30
            self.metrics[f"time_{name}_s"] = time.perf_counter() - t0
