"""Distributed init, devices, seeds, and the CPU shim for megatron-core.

megatron-core assumes CUDA in a handful of places. On a machine without CUDA (tests,
laptops, this project's CI) :func:`apply_cpu_shim` routes exactly those places to the
CPU. It is applied by :func:`init_distributed` when CUDA is absent and never at import;
on a GPU it does nothing.
"""

from __future__ import annotations

import functools
import os
import random
import sys
from contextlib import contextmanager
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


@contextmanager
def compile_on_first_call():
    """While megatron-core is imported, ``torch.compile(fn)`` returns a wrapper that calls
    the real ``torch.compile(fn)`` on its first call. megatron-core decorates about 40
    fusions with ``torch.compile`` at import; the first such decoration imports dynamo and
    inductor, 2 s of every process's start on a CPU (a third of a small run's), though no
    fusion runs there. ``torch.compile`` compiles on the first call anyway, so nothing
    changes when one runs. Restored on exit: later callers get the real one."""
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
    """Import megatron-core with its ``torch.compile`` decorations deferred
    (:func:`compile_on_first_call`) on a CPU; a plain import on a GPU or when it is loaded."""
    import importlib

    if "megatron.core" in sys.modules or has_cuda():
        importlib.import_module("megatron.core")
        return
    with compile_on_first_call():
        importlib.import_module("megatron.core")


def apply_cpu_shim() -> None:
    """Route megatron-core's CUDA assumptions to the CPU. Idempotent; a no-op with CUDA.

    Each line below answers one place where megatron-core 0.16 calls CUDA directly.
    """
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
    """Inside megatron-core's optimizer and DDP code (which allocate with
    ``device="cuda"``, call ``.cuda()`` and check ``param.type()`` against
    ``torch.cuda.*Tensor`` names): CUDA devices become the CPU, ``.cuda()`` keeps a CPU
    tensor where it is, and ``.type()`` names a CPU tensor as its CUDA twin."""

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
    CPU shim is active, nothing on a GPU. Scoped, not global: every torch call inside
    pays a Python dispatch, so the model's forward stays outside it."""
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


def _proc_status_kib(*keys: str) -> dict[str, int]:
    """The given ``/proc/self/status`` sizes (kB lines), read in one pass; {} where unreadable."""
    found = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in keys:
                    found[key] = int(line.split()[1])
    except OSError:
        return {}
    return found


# How far the peak may stay above the current size right after a reset and still count as
# reset: another thread may free memory between the reset and the read.
_RESET_SLACK_KIB = 64 * 1024


def reset_peak_host_memory() -> bool:
    """Restart the process's peak resident size (Linux ``VmHWM``) from its current size, by
    writing 5 to ``/proc/self/clear_refs``; False where that is not possible.

    The reset is checked, not assumed: a kernel or sandbox may accept the write and keep the
    old peak (seen once on a CI machine: two stages reported the same lifetime peak). After
    the write the peak must be within 64 MiB of the current size; otherwise this returns
    False and the peak since the reset is not known.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    sizes = _proc_status_kib("VmHWM", "VmRSS")
    return len(sizes) == 2 and sizes["VmHWM"] - sizes["VmRSS"] <= _RESET_SLACK_KIB


def peak_host_memory_bytes() -> int | None:
    """The process's peak resident size since it started or since :func:`reset_peak_host_memory`
    (Linux ``VmHWM``); None where ``/proc`` does not say."""
    kib = _proc_status_kib("VmHWM").get("VmHWM")
    return None if kib is None else kib * 1024


def serial_helper_threads() -> bool:
    """Keep torch's intra-op parallelism on the main thread only; True if applied.

    Collectives on gloo run their tensor copies in gloo's worker threads. A copy large
    enough to be split (a DCP load's metadata gather, a TP all-gather) makes such a thread
    open its own OpenMP team. libgomp then manages more threads than there are cores and
    from then on puts the main thread's workers to sleep after every parallel region, so
    each later elementwise op pays a futex wake-up: on 2 cores, 5-10x slower elementwise
    ops for the rest of the process, and 10-20% slower decode steps (measured). A thread
    takes torch's thread count when it first runs a parallel op, so: set torch's count to
    1 (what helper threads will take), then give the main thread its count back directly
    in OpenMP and MKL. Does nothing with one thread (torchrun sets OMP_NUM_THREADS=1 for
    several ranks per node), when the OpenMP/MKL symbols are not found, or with
    ``MRLHF_SERIAL_HELPER_THREADS=0``.
    """
    import ctypes

    n = torch.get_num_threads()  # also completes the main thread's lazy thread setup
    if os.environ.get("MRLHF_SERIAL_HELPER_THREADS", "1") == "0":
        return False
    if n <= 1 or "OpenMP" not in torch.__config__.parallel_info():
        return False
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    try:  # the OpenMP runtime and MKL torch ships, then the process's global symbols
        libs = [ctypes.CDLL(os.path.join(torch_lib, name)) for name in ("libgomp.so.1", "libtorch_cpu.so")
                if os.path.exists(os.path.join(torch_lib, name))] + [ctypes.CDLL(None)]
    except (OSError, TypeError):  # no dlopen of the process itself (Windows)
        return False

    def symbol(name):
        return next((getattr(lib, name) for lib in libs if hasattr(lib, name)), None)

    omp_set, mkl_local = symbol("omp_set_num_threads"), symbol("MKL_Set_Num_Threads_Local")
    if omp_set is None or (torch.backends.mkl.is_available() and mkl_local is None):
        return False
    torch.set_num_threads(1)
    omp_set(ctypes.c_int(n))
    if mkl_local is not None:
        mkl_local(ctypes.c_int(n))
    if torch.get_num_threads() != n:  # a different OpenMP runtime than the one we reached
        torch.set_num_threads(n)
        return False
    return True


_HOST_KEY, _BEAT_KEY = "mrlhf/host/", "mrlhf/beat/"
HEARTBEAT_S = 1.0
"""Every rank of a multi-rank job adds 1 to its counter in the rendezvous store this often
(a daemon thread): after a failed collective, ranks whose counter stopped are the lost ones,
whatever the living ones are doing (blocked in another collective, or failing too)."""


def _where() -> str:
    import socket

    node = os.environ.get("GROUP_RANK")
    return socket.gethostname() + (f", node {node}" if node is not None else "")


def _store():
    return dist.distributed_c10d._get_default_store()


_heartbeat: dict = {}
"""The running heartbeat: its thread and the event that stops it (:func:`stop_heartbeat`)."""


def _start_heartbeat() -> None:
    """Record where this rank runs and start its heartbeat (:data:`HEARTBEAT_S`), stopped by
    :func:`stop_heartbeat` (at :func:`shutdown` and at exit)."""
    import atexit
    import threading

    try:
        store, rank = _store(), dist.get_rank()
        store.set(f"{_HOST_KEY}{rank}", _where())
        store.add(f"{_BEAT_KEY}{rank}", 1)
    except Exception:  # noqa: BLE001 (no store: nothing to name lost ranks with)
        return
    stop = threading.Event()

    def beat():
        while not stop.wait(HEARTBEAT_S):
            try:
                store.add(f"{_BEAT_KEY}{rank}", 1)
            except Exception:  # noqa: BLE001 (the store is gone: so is the job)
                return

    thread = threading.Thread(target=beat, daemon=True, name="mrlhf-heartbeat")
    _heartbeat.update(thread=thread, stop=stop)
    thread.start()
    atexit.register(stop_heartbeat)


def stop_heartbeat(timeout_s: float = 10.0) -> None:
    """Stop the heartbeat thread and wait for it. A daemon thread still inside a store call
    (C++, GIL released) when the interpreter finalises is unwound through C++ frames, and the
    process aborts ("terminate called without an active exception") after a job that
    succeeded; so every clean exit stops it first."""
    if not _heartbeat:
        return
    _heartbeat["stop"].set()
    _heartbeat["thread"].join(timeout_s)
    _heartbeat.clear()


def lost_peers(wait_s: float = 4 * HEARTBEAT_S) -> tuple[list[int], dict[int, str]] | None:
    """After a collective failed: the ranks that are gone, those whose heartbeat counter does
    not move over ``wait_s``, with where each ran (host, node) as recorded at start-up. None
    when the rendezvous store itself is unreachable (its host is among the lost)."""
    import time

    world = dist.get_world_size()
    try:
        store = _store()
        before = [store.add(f"{_BEAT_KEY}{r}", 0) for r in range(world)]
        time.sleep(wait_s)
        after = [store.add(f"{_BEAT_KEY}{r}", 0) for r in range(world)]
        missing = [r for r in range(world) if after[r] == before[r]]
        where = {r: (store.get(f"{_HOST_KEY}{r}").decode() if store.check([f"{_HOST_KEY}{r}"]) else "?")
                 for r in missing}
    except Exception:  # noqa: BLE001
        return None
    return missing, where


def is_peer_failure(e: BaseException) -> bool:
    """Whether ``e`` is a collective that failed because a peer is gone (a closed or reset
    connection, a timed-out collective), not an error of this rank's own."""
    text = str(e)
    return (isinstance(e, getattr(dist, "DistBackendError", ())) or "Connection reset" in text
            or "Connection closed" in text or "Timed out" in text or "timed out" in text)


def lost_peers_message(e: BaseException, wait_s: float = 4 * HEARTBEAT_S) -> str | None:
    """A message naming the lost ranks (their heartbeats stopped) when ``e`` is a collective that a lost peer broke
    (:func:`is_peer_failure`, :func:`lost_peers`); None otherwise (the error is this rank's)."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or not is_peer_failure(e):
        return None
    found = lost_peers(wait_s)
    if found is None:
        return (f"a collective failed ({str(e).splitlines()[0][:200]}) and the job's rendezvous "
                "store is unreachable: the node hosting it (the first node) is lost. "
                "Resubmit the job to resume from its last checkpoint.")
    missing, where = found
    if not missing:
        return None
    names = ", ".join(f"{r} ({where[r]})" for r in missing)
    return (f"lost rank{'s' if len(missing) > 1 else ''} {names}: a collective with "
            f"{'them' if len(missing) > 1 else 'it'} failed ({str(e).splitlines()[0][:200]}). "
            "The iteration in progress is lost; resubmit the job to resume from the last checkpoint.")


def exit_on_lost_peers(e: BaseException, label: str = "") -> int:
    """For an entry point's ``except RuntimeError``: print the message naming the lost ranks
    (:func:`lost_peers_message`) and return the exit code 4; re-raise ``e`` when no peer was
    lost (the error is this rank's own)."""
    import sys

    message = lost_peers_message(e)
    if message is None:
        raise e
    print(f"error: {label}{message}", file=sys.stderr, flush=True)
    return 4


def init_distributed(seed: int = 1234, timeout_minutes: float = 30) -> tuple[int, int]:
    """Initialise torch.distributed from the torchrun environment; returns (rank, world size).

    NCCL with CUDA, gloo without. Works as a single process without torchrun too
    (world size 1). Applies the CPU shim when CUDA is absent and seeds every generator.
    """
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
        stop_heartbeat()
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


def padded(rows: list, fill, dtype: torch.dtype, to=None, width: int | None = None,
           left: bool = False) -> torch.Tensor:
    """``[len(rows), width]`` tensor of the lists (or 1-D tensors) ``rows`` padded with ``fill`` (on the right,
    or on the left), on device ``to`` (default: this rank's). Assembled on the host and
    moved in one copy: a tensor per row on a GPU would be one transfer per row."""
    width = max([0] + [len(r) for r in rows]) if width is None else width
    out = torch.full((len(rows), width), fill, dtype=dtype, device="cpu")
    for i, r in enumerate(rows):
        if len(r):
            (out[i, width - len(r):] if left else out[i, : len(r)]).copy_(
                torch.as_tensor(r, dtype=dtype, device="cpu"))
    to = torch.device(to) if to is not None else device()
    return out if to.type == "cpu" else out.pin_memory().to(to, non_blocking=True)
