"""Process-group start and teardown, seeds, and small collectives."""

from __future__ import annotations

import os
import random
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from megatron_rlhf.runtime.cpu_shim import apply_cpu_shim
from megatron_rlhf.runtime.devices import device, has_cuda, serial_helper_threads
from megatron_rlhf.runtime.peers import _start_heartbeat, stop_heartbeat


def init_distributed(seed: int = 1234, timeout_minutes: float = 30) -> tuple[int, int]:
    """Initialise torch.distributed (NCCL with CUDA, else gloo) from the torchrun environment,
    or as a single process; apply the CPU shim and seed. Returns (rank, world size)."""
    if not dist.is_initialized():
        if not has_cuda():  # CPU tuning: a GPU process's host threads are not its compute
            serial_helper_threads()
        backend = "nccl" if has_cuda() else "gloo"
        timeout = timedelta(minutes=timeout_minutes)
        if has_cuda():
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local % torch.cuda.device_count())
        if "RANK" in os.environ:  # launched by torchrun / srun: env:// rendezvous
            dist.init_process_group(backend=backend, timeout=timeout)
            if dist.get_world_size() > 1:
                _start_heartbeat()
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
    """Register megatron's ``model-parallel-rng`` state (different per TP rank), replacing
    any earlier one."""
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel.random import _MODEL_PARALLEL_RNG_TRACKER_NAME

    if has_cuda():
        tensor_parallel.model_parallel_cuda_manual_seed(
            seed, tp_rank=tp_rank, ep_rank=0, etp_rank=0, force_reset_rng=True
        )
        return
    # On CPU the tracker's states are CPU generator states (see the shim).
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
        stop_heartbeat()
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """The all-reduced copy of a small tensor (statistics, flags) on ``t``'s device; ``t`` is
    left unchanged."""
    # NCCL only reduces CUDA tensors: a host tensor travels on this rank's device.
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return t
    x = t.to(device(), copy=True)
    dist.all_reduce(x, op=op, group=group)
    return x.to(t.device)
