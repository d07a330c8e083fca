"""The device a rank computes on, its dtype (:func:`choose_dtype`: bf16 on a GPU and on a CPU
with bf16 instructions, else fp32, unless a flag says), and CPU thread tuning for gloo."""

from __future__ import annotations

import os

import torch

CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
"""The /proc/cpuinfo flags of x86 bf16 instructions (AMX tiles, AVX-512 dot products)."""


def has_cuda() -> bool:
    return torch.cuda.is_available()


def device() -> torch.device:
    """The device this rank computes on: its local GPU, or the CPU."""
    if has_cuda():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The feature flags of the first CPU in ``cpuinfo`` (default: /proc/cpuinfo); empty where
    there is none (not Linux, or not x86)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def choose_dtype(bf16: bool | None = None, cuda: bool | None = None,
                 flags: frozenset[str] | None = None) -> tuple[torch.dtype, str]:
    """The compute dtype and why: ``bf16`` True/False (``--bf16``/``--fp32``) decides; None
    (auto) is bf16 on a GPU (``cuda``, default: this machine has one) and on a CPU whose
    ``flags`` (default: :func:`cpu_flags`) include one of :data:`CPU_BF16_FLAGS`, else fp32."""
    if bf16 is not None:
        return (torch.bfloat16, "--bf16") if bf16 else (torch.float32, "--fp32")
    if has_cuda() if cuda is None else cuda:
        return torch.bfloat16, "the default on a GPU"
    have = [f for f in CPU_BF16_FLAGS if f in (cpu_flags() if flags is None else flags)]
    if have:
        return torch.bfloat16, f"the CPU reports {' and '.join(have)}"
    return torch.float32, f"the CPU has no bf16 instructions (no {' or '.join(CPU_BF16_FLAGS)} flag)"


def default_dtype(bf16: bool | None = None) -> torch.dtype:
    """:func:`choose_dtype`'s dtype."""
    return choose_dtype(bf16)[0]


def serial_helper_threads() -> bool:
    """Keep torch's intra-op parallelism on the main thread only; True if applied. Does
    nothing with one thread, without the OpenMP/MKL symbols, or with
    ``MRLHF_SERIAL_HELPER_THREADS=0``."""
    # gloo runs a collective's tensor copies in its worker threads. A copy large enough to be
    # split (a DCP metadata gather, a TP all-gather) makes such a thread open its own OpenMP
    # team. libgomp then holds more threads than cores and puts the main thread's workers to
    # sleep after every parallel region: each later elementwise op pays a futex wake-up
    # (see docs/benchmarks for the cost).
    # A thread takes torch's thread count when it first runs a parallel op. So: set torch's
    # count to 1 (what helper threads take), then give the main thread its count back directly
    # in OpenMP and MKL.
    import ctypes

    n = torch.get_num_threads()  # also completes the main thread's lazy thread setup
    if os.environ.get("MRLHF_SERIAL_HELPER_THREADS", "1") == "0":
        return False
    # torchrun sets OMP_NUM_THREADS=1 for several ranks per node: nothing to do then.
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

