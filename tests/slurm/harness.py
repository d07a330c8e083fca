"""Submit a SLURM script with the shims of ``tests/slurm/bin`` and watch or kill its nodes.

    job = Job("examples/llama2/ppo.sbatch", [actor, reward, run], nodes=2,
              env={"GPUS_PER_NODE": "2", "TP": "2"}, workdir=tmp)
    job.start(); ...; job.kill_node(1); result = job.wait(timeout=120)

Each submission gets its own ``MASTER_PORT`` and a tag (``SLURM_SHIM_TAG``) that every
process of the job inherits; the harness finds a node's processes by their environment
(the torchrun agent and its workers, which torchrun starts in sessions of their own) and
kills what is left of a job when it ends. Output goes through files, not pipes: helpers that
outlive a killed process (megatron's checkpoint writer) would hold a pipe open.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
BIN = Path(__file__).resolve().parent / "bin"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Result:
    returncode: int
    output: str  # stdout and stderr of the job, interleaved
    elapsed_s: float

    def check(self) -> "Result":
        assert self.returncode == 0, f"job failed ({self.returncode}):\n{self.output[-8000:]}"
        return self


def _environ(pid: int) -> dict[str, str] | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def tagged_processes(tag: str, node: int | None = None) -> list[int]:
    """Our processes carrying ``SLURM_SHIM_TAG=tag`` (on ``node``: the tasks of an srun step
    there and their descendants, not the batch script)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        env = _environ(int(entry.name))
        if not env or env.get("SLURM_SHIM_TAG") != tag:
            continue
        if node is not None and (env.get("SLURM_NODEID") != str(node) or "SLURM_STEP_ID" not in env):
            continue
        pids.append(int(entry.name))
    return pids


def kill_tagged(tag: str, node: int | None = None) -> int:
    """SIGKILL the tagged processes (repeatedly, until none is left); returns how many."""
    killed = 0
    for _ in range(20):
        pids = tagged_processes(tag, node)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    return killed


class Job:
    """``sbatch [--nodes K] SCRIPT ARGS`` with the shims on PATH, run from the repository
    root (the submit directory the scripts expect), ``env`` added to the environment."""

    def __init__(self, script: str, args: list[str], workdir: Path, nodes: int | None = None,
                 env: dict[str, str] | None = None):
        self.cmd = ["sbatch", *([] if nodes is None else ["--nodes", str(nodes)]), script, *map(str, args)]
        self.tag = uuid.uuid4().hex
        workdir.mkdir(parents=True, exist_ok=True)
        self.log = workdir / f"job-{self.tag[:8]}.out"
        self.env = {**os.environ, "PATH": f"{BIN}:{Path(sys.executable).parent}:{os.environ['PATH']}",
                    "PYTHONPATH": f"{ROOT}:{TESTS}", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
                    "MASTER_PORT": str(free_port()), **(env or {}), "SLURM_SHIM_TAG": self.tag}
        self.proc: subprocess.Popen | None = None
        self.t0 = 0.0

    def start(self) -> "Job":
        self._out = open(self.log, "w")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=self.env, stdout=self._out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill_node(self, node: int) -> int:
        """SIGKILL every process of ``node`` (its torchrun agent and workers): the node dies."""
        return kill_tagged(self.tag, node)

    def abort(self) -> None:
        """Kill the whole job (a test that gives up on it)."""
        kill_tagged(self.tag)
        self.proc.wait()
        self._out.close()

    def wait(self, timeout: float = 600) -> Result:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            elapsed = self.elapsed()
            kill_tagged(self.tag)  # leftovers; all of the job on a timeout
            self.proc.wait()
            self._out.close()
        if code is None:
            raise AssertionError(f"{' '.join(self.cmd)} ran past {timeout} s:\n{self.output()[-8000:]}")
        return Result(code, self.output(), elapsed)


def sbatch(script: str, *args, workdir: Path, nodes: int | None = None, timeout: float = 600,
           **env: str) -> Result:
    """Submit, wait, return the Result (unchecked)."""
    return Job(script, list(args), workdir, nodes, {k: str(v) for k, v in env.items()}).start().wait(timeout)


def wait_for(condition, timeout: float, job: Job | None = None, what: str = "condition") -> None:
    """Poll ``condition()`` every 0.1 s; fail after ``timeout`` s or when ``job`` has ended."""
    end = time.monotonic() + timeout
    while not condition():
        failure = None
        if job is not None and job.proc.poll() is not None:
            failure = f"the job ended before {what}"
        elif time.monotonic() > end:
            failure = f"no {what} after {timeout} s"
        if failure:
            if job is not None:
                job.abort()
                failure += ":\n" + job.output()[-8000:]
            raise AssertionError(failure)
        time.sleep(0.1)
