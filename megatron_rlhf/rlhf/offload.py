"""Colocation on GPU: park what the current stage does not use in pinned host memory.

Every stage runs on the same ranks. Between its uses, a model's weights (reference,
reward) or an optimizer's states move to pinned CPU memory and come back before the next
use; the generator's KV cache is freed when generation returns. On CPU these are no-ops.
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


def move_optimizer(optimizer: torch.optim.Optimizer, device) -> None:
    """Move every optimizer state tensor (Adam moments, fp32 masters) to ``device``."""
    if not platform.has_cuda():
        return
    device = torch.device(device)
    for m in getattr(optimizer, "masters", []):  # fp32 master weights of a bf16 model
        m.data = _move(m.data, device)
    for state in optimizer.state.values():
        for k, v in state.items():
            if torch.is_tensor(v) and v.dim() > 0:
                state[k] = _move(v, device)
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
