"""Run a script or module under torchrun with gloo ranks, from a test."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "dist" / "scripts"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, target: list[str], timeout: int = 600, check: bool = True):
    """``torchrun --nproc_per_node nproc TARGET...``; returns the CompletedProcess.

    ``target`` is a script path (relative to tests/dist/scripts) or ``-m module`` plus args.
    """
    if target[0] != "-m":
        target = [str(SCRIPTS / target[0]), *target[1:]]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={_port()}", *target]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
    return r
