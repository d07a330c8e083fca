"""Distributed init, devices, seeds, and the CPU shim for megatron-core.

megatron-core assumes CUDA in a handful of places. On a machine without CUDA (tests,
laptops, this project's CI) :func:`apply_cpu_shim` routes exactly those places to the
CPU. It is applied by :func:`init_distributed` when CUDA is absent and never at import;
on a GPU it does nothing.
"""

from __future__ import annotations

import os
import random
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

_SHIM_ACTIVE = False


def has_cuda() -> bool:
    return torch.cuda.is_available()


def device() -> torch.device:
    """The device this rank computes on: its local GPU, or the CPU."""
    if has_cuda():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def default_dtype(bf16: bool | None = None) -> torch.dtype:
    """bf16 on GPU and fp32 on CPU unless asked otherwise (``bf16=True/False``)."""
    if bf16 is None:
        bf16 = has_cuda()
    return torch.bfloat16 if bf16 else torch.float32


def apply_cpu_shim() -> None:
    """Route megatron-core's CUDA assumptions to the CPU. Idempotent; a no-op with CUDA.

    Each line below answers one place where megatron-core 0.16 calls CUDA directly.
    """
    global _SHIM_ACTIVE
    if has_cuda() or _SHIM_ACTIVE:
        return
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import utils as mutils

    # Layers allocate buffers with ``device=torch.cuda.current_device()``: allocate on the CPU.
    torch.cuda.current_device = lambda: torch.device("cpu")
    # dist_checkpointing.save synchronises the device before writing: nothing to wait for.
    torch.cuda.synchronize = lambda *args, **kwargs: None
    # The model-parallel RNG tracker saves/restores "the CUDA generator": use the CPU one.
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    # The default causal mask is built with device="cuda"; we pass explicit masks, and this
    # keeps any path that still asks for the default on the CPU.
    mutils.get_default_causal_mask = lambda sq: torch.triu(
        torch.ones(sq, sq, dtype=torch.bool), diagonal=1
    )
    _SHIM_ACTIVE = True


def quiet_third_party_warnings() -> None:
    """Silence known, harmless warnings of megatron-core and torch DCP (entry points call it)."""
    import warnings

    for pattern in (
        "Apex is not installed",
        "full scope is deprecated",
        "Please use DTensor instead",
        "TorchScript",
        "`torch.cuda.amp",
        "CUDA_DEVICE_MAX_CONNECTIONS",
        "Apex are not installed",
        "all_gather_into_tensor",
        "`load_state_dict` is deprecated",
    ):
        warnings.filterwarnings("ignore", message=f".*{pattern}.*")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def cpu_shim_active() -> bool:
    return _SHIM_ACTIVE


def init_distributed(seed: int = 1234, timeout_minutes: int = 30) -> tuple[int, int]:
    """Initialise torch.distributed from the torchrun environment; returns (rank, world size).

    NCCL with CUDA, gloo without. Works as a single process without torchrun too
    (world size 1). Applies the CPU shim when CUDA is absent and seeds every generator.
    """
    if not dist.is_initialized():
        backend = "nccl" if has_cuda() else "gloo"
        timeout = timedelta(minutes=timeout_minutes)
        if has_cuda():
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local % torch.cuda.device_count())
        if "RANK" in os.environ:  # launched by torchrun / srun: env:// rendezvous
            dist.init_process_group(backend=backend, timeout=timeout)
        else:  # a plain single process (tools, tests): no environment is modified
            dist.init_process_group(backend=backend, timeout=timeout, rank=0, world_size=1,
                                    init_method=f"tcp://127.0.0.1:{_free_port()}")
    apply_cpu_shim()
    from megatron.core import parallel_state

    # Local-spec attention takes scratch tensors from megatron's global memory buffer, which
    # parallel_state creates only inside initialize_model_parallel (we pass groups instead).
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()
    set_seed(seed)
    return dist.get_rank(), dist.get_world_size()


def set_seed(seed: int) -> None:
    """Seed python, numpy and torch (CPU and every GPU) identically on all ranks."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if has_cuda():
        torch.cuda.manual_seed_all(seed)


def seed_model_parallel_rng(seed: int, tp_rank: int) -> None:
    """Register megatron's ``model-parallel-rng`` state (different per TP rank).

    On GPU this is megatron's ``model_parallel_cuda_manual_seed``. On CPU the tracker's
    states are CPU generator states (see the shim). Re-seeding replaces the old state.
    """
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel.random import _MODEL_PARALLEL_RNG_TRACKER_NAME

    if has_cuda():
        tensor_parallel.model_parallel_cuda_manual_seed(
            seed, tp_rank=tp_rank, ep_rank=0, etp_rank=0, force_reset_rng=True
        )
        return
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.reset()
    tracker.states_[_MODEL_PARALLEL_RNG_TRACKER_NAME] = (
        torch.Generator().manual_seed(seed + 2718 + tp_rank).get_state()
    )
    tracker._is_initialized = True


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shutdown() -> None:
    """Tear the process group down cleanly (entry points call it before exiting)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """All-reduce a small tensor (statistics, flags) that may live on the host: NCCL only
    reduces CUDA tensors, so it travels on this rank's device and comes back to ``t``'s.
    ``t`` itself is left unchanged."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return t
    x = t.to(device(), copy=True)
    dist.all_reduce(x, op=op, group=group)
    return x.to(t.device)
