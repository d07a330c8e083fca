"""Test hooks of the GPU check, for its failure paths on the CPU in seconds: ``--fake-stages``
(every stage a stand-in that passes at once) and ``--fake-fault STAGE:KIND`` (stage STAGE meets
fault KIND in its stage process instead of running)."""

from __future__ import annotations

import os
import signal
import time


def _hang(check) -> None:
    time.sleep(3600)  # until its process is ended at the deadline


def _cuda(check) -> None:
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def _kill_check(check) -> None:
    os.kill(os.getppid(), signal.SIGKILL)  # the check's main process, after its partial table
    os._exit(1)


FAULTS = {"hang": _hang, "cuda": _cuda, "abort": lambda check: os.abort(),
          "segfault": lambda check: os.kill(os.getpid(), signal.SIGSEGV), "kill-check": _kill_check}


def parse_faults(specs: list[str]) -> dict[str, str]:
    """``STAGE:KIND`` strings -> {stage: kind}; raises ValueError on an unknown kind."""
    faults = {}
    for spec in specs:
        stage, _, kind = spec.partition(":")
        if kind not in FAULTS:
            raise ValueError(f"--fake-fault {spec}: KIND is one of {', '.join(FAULTS)}")
        faults[stage] = kind
    return faults


def fake_functions(check, functions: dict) -> dict:
    """``functions`` with the stand-ins (``--fake-stages``) and the faults (``--fake-fault``)."""
    out = dict(functions)
    if check.args.fake_stages:
        out = {name: (lambda rows: "fake") for name in functions}
    for name, kind in parse_faults(check.args.fake_fault).items():
        out[name] = lambda rows, f=FAULTS[kind]: f(check)
    return out
