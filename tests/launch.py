"""Run a script or module under torchrun with gloo ranks, from a test."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
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


class SharedLaunch:
    """Scripts of tests/dist/scripts that each need ``nproc`` gloo ranks, run one after another
    in one torchrun launch (``several.py``): the start-up (python, torch, megatron-core, the
    process group), some 10 CPU-seconds a launch, is paid once for all of them.

    ``add(script, *args, timeout=...)`` registers a job; ``run(script, *args)`` runs every job
    not yet run (the first call launches them all) and returns that job's CompletedProcess:
    ``stdout`` its ranks' output (rank 0 first), ``stderr`` the launch's. A job that fails
    raises AssertionError with its ranks' tracebacks, as ``torchrun(nproc, [script, *args])``
    would; a job past its ``timeout`` (seconds from the end of the job before it, or from the
    launch) is killed with the launch. Either way the jobs after it run in a fresh launch, so
    each job gets its own verdict.
    """

    def __init__(self, nproc: int, out: Path):
        self.nproc, self.out = nproc, out
        self.jobs: dict[tuple, dict] = {}  # key -> {"id", "script", "args", "timeout", "result"}

    def add(self, script: str, *args: str, timeout: int = 600) -> None:
        key = (script, *args)
        if key not in self.jobs:
            self.jobs[key] = {"id": str(len(self.jobs)), "script": script, "args": list(args),
                              "timeout": timeout, "result": None}

    def run(self, script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
        self.add(script, *args, timeout=timeout)
        job = self.jobs[(script, *args)]
        if job["result"] is None:
            self._launch_pending()
        result = job["result"]
        if isinstance(result, str):
            raise AssertionError(result)
        return result

    def _launch_pending(self) -> None:
        pending = [j for j in self.jobs.values() if j["result"] is None]
        while pending:
            out = self.out / f"launch{len(list(self.out.glob('launch*')))}"
            out.mkdir(parents=True)
            (out / "jobs.json").write_text(json.dumps(
                {j["id"]: {"script": j["script"], "args": j["args"]} for j in self.jobs.values()}))
            ids = [j["id"] for j in pending]
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={self.nproc}",
                   f"--master_port={_port()}", str(SCRIPTS / "several.py"), str(out), *ids]
            what = f"{' '.join(cmd[:5])} several.py ... (jobs run one after another)"
            env = dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}", OMP_NUM_THREADS="1",
                       PYTHONWARNINGS="ignore")
            with open(out / "stdout", "w") as so, open(out / "stderr", "w") as se:
                p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=so, stderr=se, start_new_session=True)
                timed_out = self._watch(p, out, pending)
            stderr = (out / "stderr").read_text(errors="replace")
            ran = []
            for j in pending:
                i = j["id"]
                if (out / f"{i}.done").exists():
                    j["result"] = subprocess.CompletedProcess(
                        [j["script"], *j["args"]], 0, self._stdout(out, i), stderr)
                    ran.append(j)
                elif (out / f"{i}.start").exists() or not ran:
                    # the job that ended the launch (or the launch failed before any job started)
                    why = f"ran past {j['timeout']} s" if timed_out else f"failed ({p.returncode})"
                    errors = "\n".join((out / f"{i}.rank{r}.error").read_text(errors="replace")
                                       for r in range(self.nproc) if (out / f"{i}.rank{r}.error").exists())
                    j["result"] = (f"tests/dist/scripts/{j['script']} {' '.join(j['args'])} {why}, "
                                   f"run by {what}:\n{self._stdout(out, i)[-3000:]}\n{errors[-6000:]}\n"
                                   f"{stderr[-6000:]}")
                    ran.append(j)
                    break
            pending = [j for j in pending if j not in ran]

    def _watch(self, p: subprocess.Popen, out: Path, pending: list[dict]) -> bool:
        """Wait for the launch; kill its process group when the running job is past its
        timeout (returns True then)."""
        since = time.monotonic()
        current = 0
        try:
            while p.poll() is None:
                while current < len(pending) and (out / f"{pending[current]['id']}.done").exists():
                    current, since = current + 1, time.monotonic()
                if current < len(pending) and time.monotonic() - since > pending[current]["timeout"]:
                    return True
                time.sleep(0.2)
            return False
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # leftovers; everything on a timeout
            except ProcessLookupError:
                pass
            p.wait()

    def _stdout(self, out: Path, job_id: str) -> str:
        return "".join((out / f"{job_id}.rank{r}.out").read_text(errors="replace")
                       for r in range(self.nproc) if (out / f"{job_id}.rank{r}.out").exists())
