"""Colocation on GPU: park what the current stage does not use in pinned host memory.

Every stage runs on the same ranks. Entry points: :func:`move_model` (a model's weights),
:func:`park_trainee` (optimizer states, gradient buffers; whether at all: :func:`park_decision`),
:func:`release_weights` (the training copy's weights during the rollout), :class:`StageMemory`.
On CPU these are no-ops.
"""

from __future__ import annotations

import contextlib
import time

import torch

from megatron_rlhf import runtime


def _move(t: torch.Tensor, device) -> torch.Tensor:
    if device.type == "cpu":
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        out.copy_(t, non_blocking=True)
        return out
    return t.to(device, non_blocking=True)


def move_model(model: torch.nn.Module, device) -> None:
    """Move parameters and buffers in place (the module's tensors keep their identity)."""
    if not runtime.has_cuda():
        return
    device = torch.device(device)
    for p in model.parameters():
        p.data = _move(p.data, device)
    for mod in model.modules():
        for name, b in mod._buffers.items():
            if b is not None:
                mod._buffers[name] = _move(b, device)
    torch.cuda.synchronize()


def optimizer_tensors(t):
    """The optimizer's own device tensors of trainee ``t`` as ``(holder, key)`` pairs, where
    ``holder[key]`` is the tensor: every Adam state but the step count, and the fp32 masters."""
    from megatron_rlhf.rlhf.optim import inner_optimizers

    # An fp32 model's masters are its weights (megatron's optimizer steps them): they stay.
    weights = {p.untyped_storage().data_ptr() for p in t.model.parameters()}
    out = []
    for inner in inner_optimizers(t.optimizer):
        for group in inner.param_groups:
            out += [(_Data(p), None) for p in group["params"]
                    if p.untyped_storage().data_ptr() not in weights]
        for state in inner.state.values():
            out += [(state, k) for k, v in state.items()
                    if torch.is_tensor(v) and k != "step" and v.dim() > 0]
    return out


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen = {}
    for t in tensors:
        if t is not None and t.device.type != "meta":
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def trainee_bytes(t) -> dict[str, int]:
    """Bytes trainee ``t`` holds: ``weights`` (parameters, DDP's parameter buffers), ``grads``
    (DDP's gradient buffers), ``optimizer`` (:func:`optimizer_tensors`)."""
    grads = [b.grad_data for b in getattr(t.ddp, "buffers", []) + getattr(t.ddp, "expert_parallel_buffers", [])]
    return {"weights": storage_bytes(t.model.parameters()), "grads": storage_bytes(grads),
            "optimizer": storage_bytes(h.p.data if isinstance(h, _Data) else h[k] for h, k in optimizer_tensors(t))}


class _Data:
    """A parameter as the holder of its ``.data``: moved in place, its identity (the
    optimizer's state key) stays."""

    def __init__(self, p):
        self.p = p

    def __getitem__(self, _):
        return self.p.data

    def __setitem__(self, _, value):
        self.p.data = value


def park_trainee(t, host: bool, move=None) -> None:
    """``host=True``: :func:`optimizer_tensors` go to pinned host memory and DDP frees its
    gradient buffers. ``host=False``: both come back, the buffers zeroed. Idempotent.
    On CPU a no-op unless ``move(tensor, host)`` is given (tests)."""
    if move is None:
        if not runtime.has_cuda():
            return
        move = _move_tensor
    if t.parked == host:
        return
    for holder, key in optimizer_tensors(t):
        holder[key] = move(holder[key], host)
    t.parked = host
    if runtime.has_cuda():
        if host:
            t.ddp.offload_grad_buffers(synchronize=False, empty_cache=False)
        else:
            t.ddp.restore_grad_buffers(synchronize=False)
        torch.cuda.synchronize()
        if host:
            torch.cuda.empty_cache()


def park_decision(mode: str, cuda: bool, unparked=None) -> tuple[bool, str]:
    """``(park, why)``: whether the trainees' optimizer states and gradient buffers wait in
    host memory during generation (:func:`park_trainee`). ``mode``: ``--park-optimizer``
    (auto, on, off). ``unparked``: the memory estimate (:class:`~megatron_rlhf.plan.memory.Estimate`)
    with them left on the device, or None where there is none. auto keeps them on the device
    when generation and inference fit beside them in the estimate's usable memory (the GPU's
    less its reserve), and parks them otherwise or without an estimate."""
    if not cuda:
        return False, "no GPU: nothing is moved"
    if mode != "auto":
        return mode == "on", f"--park-optimizer {mode}"
    if unparked is None:
        return True, "auto, without a memory estimate"
    # Training holds them either way; the stages before it decide.
    stages = [s for s in unparked.stages if s.stage in ("generation", "inference")]
    worst = max(stages, key=lambda s: s.total - s.capacity)
    need = f"{worst.stage} with them needs {worst.total / 1e9:.1f} GB of {worst.capacity / 1e9:.1f} GB usable"
    if all(s.fits for s in stages):
        return False, f"auto: the memory estimate fits them ({need})"
    return True, f"auto: the memory estimate does not fit them ({need})"


def keep_graphs_decision(cuda: bool, estimate=None) -> tuple[bool, str]:
    """``(keep, why)``: whether the generator's KV cache store and decode graphs stay allocated
    through training, so the next rollout captures nothing new. ``estimate``: the run's memory
    estimate (:class:`~megatron_rlhf.plan.memory.Estimate`), or None. Kept when training fits
    with the generation stage's KV caches beside it; released otherwise, or without an estimate."""
    if not cuda:
        return False, "no GPU: no graphs to keep"
    if estimate is None:
        return False, "released after each rollout (no memory estimate)"
    gen, train = estimate.stage("generation"), estimate.stage("training")
    store = sum(v for k, v in gen.parts.items() if k.endswith("kv_cache"))
    need = (f"training with them needs {(train.total + store) / 1e9:.1f} GB of "
            f"{train.capacity / 1e9:.1f} GB usable")
    if train.total + store <= train.capacity:
        return True, f"kept across rollouts: the memory estimate fits them ({need})"
    return False, f"released after each rollout: the memory estimate does not fit them ({need})"


def release_weights(t, host: bool, force: bool = False) -> None:
    """``host=True``: trainee ``t``'s weights wait in pinned host memory while generation runs
    on another copy. ``host=False``: they come back. Idempotent. On CPU a no-op unless
    ``force`` (tests)."""
    # Each distinct storage behind the parameters (DDP's parameter buffers under the
    # distributed optimizer) is copied out and resized to nothing, then refilled in place:
    # every parameter, view and optimizer reference stays valid.
    if not (runtime.has_cuda() or force) or (t.released is not False) == host:
        return
    if host:
        t.released = []
        seen = set()
        for p in t.model.parameters():
            storage = p.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            keep = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=runtime.has_cuda())
            keep.untyped_storage().copy_(storage, non_blocking=True)
            t.released.append((storage, keep))
        if runtime.has_cuda():
            torch.cuda.synchronize()
        for storage, _ in t.released:
            storage.resize_(0)
        if runtime.has_cuda():
            torch.cuda.empty_cache()
        return
    for storage, keep in t.released:
        storage.resize_(keep.numel())
        storage.copy_(keep.untyped_storage(), non_blocking=True)
    if runtime.has_cuda():
        torch.cuda.synchronize()
    t.released = False


def _move_tensor(t: torch.Tensor, host: bool) -> torch.Tensor:
    return _move(t, torch.device("cpu") if host else runtime.device())


class StageMemory:
    """Times each stage (``time_<stage>_s``) and records this process's peak memory during it
    (``peak_mem_<stage>_gb``: CUDA's peak allocated, or on CPU the peak resident size)."""

    def __init__(self):
        self.metrics: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str):
        cuda = runtime.has_cuda()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        # Where the host peak cannot be restarted, no peak metric rather than the lifetime peak.
        host = not cuda and runtime.reset_peak_host_memory()
        self.metrics.pop(f"peak_mem_{name}_gb", None)  # never a previous call's value
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if cuda:
                torch.cuda.synchronize()
                self.metrics[f"peak_mem_{name}_gb"] = torch.cuda.max_memory_allocated() / 2**30
            elif host and (peak := runtime.peak_host_memory_bytes()) is not None:
                self.metrics[f"peak_mem_{name}_gb"] = peak / 2**30
            self.metrics[f"time_{name}_s"] = time.perf_counter() - t0
