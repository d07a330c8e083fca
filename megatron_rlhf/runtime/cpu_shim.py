"""megatron-core on a machine without CUDA: the shim that routes its CUDA calls to the CPU.

Entry point: :func:`apply_cpu_shim`, called by ``init_distributed`` when CUDA is absent,
never at import. On a GPU every function here does nothing.
"""

from __future__ import annotations

import functools
import os
import sys
from contextlib import contextmanager

import torch

from megatron_rlhf.runtime.devices import has_cuda

_SHIM_ACTIVE = False


@contextmanager
def compile_on_first_call():
    """Within the block, ``torch.compile(fn)`` returns a wrapper that calls the real
    ``torch.compile(fn)`` on its first call. Restored on exit."""
    # megatron-core decorates about 40 fusions with torch.compile at import. The first
    # decoration imports dynamo and inductor, a large share of a CPU process's start-up, though
    # no fusion runs there. torch.compile compiles at the first call anyway: nothing changes.
    real = torch.compile

    def deferred(model=None, **kwargs):
        if model is None:  # @torch.compile(mode=...) form
            return lambda fn: deferred(fn, **kwargs)
        if not callable(model) or isinstance(model, torch.nn.Module):
            return real(model, **kwargs)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kw):
            nonlocal compiled
            if compiled is None:
                compiled = real(model, **kwargs)
            return compiled(*args, **kw)

        return call

    torch.compile = deferred
    try:
        yield
    finally:
        torch.compile = real


def import_megatron_core() -> None:
    """Import megatron-core, on a CPU with :func:`compile_on_first_call`."""
    import importlib

    if "megatron.core" in sys.modules or has_cuda():
        importlib.import_module("megatron.core")
        return
    with compile_on_first_call():
        importlib.import_module("megatron.core")


def apply_cpu_shim() -> None:
    """Route megatron-core's CUDA assumptions to the CPU. Idempotent; a no-op with CUDA."""
    # Each line below answers one place where megatron-core 0.16 calls CUDA directly.
    global _SHIM_ACTIVE
    if has_cuda() or _SHIM_ACTIVE:
        return
    import_megatron_core()
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import utils as mutils

    # Layers allocate buffers with ``device=torch.cuda.current_device()``: allocate on the CPU.
    torch.cuda.current_device = lambda: torch.device("cpu")
    # dist_checkpointing.save synchronises the device before writing: nothing to wait for.
    torch.cuda.synchronize = lambda *args, **kwargs: None
    # megatron's optimizer offload helpers free the CUDA cache: nothing to free.
    torch.cuda.empty_cache = lambda: None
    # The model-parallel RNG tracker saves/restores "the CUDA generator": use the CPU one.
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    # The default causal mask is built with device="cuda"; we pass explicit masks, and this
    # keeps any path that still asks for the default on the CPU.
    mutils.get_default_causal_mask = lambda sq: torch.triu(
        torch.ones(sq, sq, dtype=torch.bool), diagonal=1
    )
    _SHIM_ACTIVE = True


class _CudaAsCpu(torch.overrides.TorchFunctionMode):
    """CUDA devices become the CPU, ``.cuda()`` is the identity, and ``.type()`` names a CPU
    tensor as its CUDA twin."""

    # megatron-core's optimizer and DDP code allocate with device="cuda", call .cuda() and check
    # param.type() against torch.cuda.*Tensor names.

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        where = kwargs.get("device")
        if where is not None and str(where).startswith("cuda"):
            kwargs = dict(kwargs, device="cpu")
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def cuda_as_cpu():
    """A context for megatron-core's optimizer and DDP calls: :class:`_CudaAsCpu` where the
    CPU shim is active, nothing on a GPU."""
    # Scoped, not global: every torch call inside pays a Python dispatch, so the model's
    # forward stays outside it.
    import contextlib

    return _CudaAsCpu() if _SHIM_ACTIVE else contextlib.nullcontext()


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
        "reduce_scatter_tensor",
        "`load_state_dict` is deprecated",
    ):
        warnings.filterwarnings("ignore", message=f".*{pattern}.*")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def cpu_shim_active() -> bool:
    return _SHIM_ACTIVE
