"""Under torchrun: several scripts of this folder, one after another, in one launch (one
start-up of python, torch and megatron-core for all of them; see ``launch.SharedLaunch``).

    python several.py OUT ID...   (the jobs: OUT/jobs.json, {"ID": {"script": ..., "args": [...]}})

Each job runs its script's ``main()`` with ``sys.argv = [script, *args]``, in a module of its
own (the script's file executed afresh), as ``python script args`` would: ``init_distributed``
finds the process group up and only seeds, as a fresh process's first call would (and
makes megatron's global memory buffer anew: ``as_in_a_fresh_process``). The script's
``runtime.shutdown()`` becomes a barrier (the group is torn down after the last job). Per
job, rank 0 writes ``ID.start`` before and ``ID.done`` after it (all ranks through it), each
rank its stdout to ``ID.rankR.out``; a job that raises writes its traceback to
``ID.rankR.error`` and ends the launch (torchrun stops the other ranks), like the script
failing alone.
"""

import contextlib
import importlib.util
import json
import sys
import time
import traceback
from pathlib import Path

from megatron_rlhf import runtime

HERE = Path(__file__).resolve().parent


def as_in_a_fresh_process() -> None:
    """Drop the process state a job leaves that a fresh process would not have: megatron's
    global memory buffer (its scratch tensors, made under inference mode by a generating job,
    cannot be written by a training forward after it); ``init_distributed`` makes a new one."""
    from megatron.core import parallel_state

    parallel_state._GLOBAL_MEMORY_BUFFER = None


def run_job(out: Path, job_id: str, job: dict, rank: int) -> None:
    as_in_a_fresh_process()
    path = HERE / job["script"]
    sys.argv = [str(path), *job["args"]]
    name = f"several_{job_id}_{path.stem}"  # registered: pickled objects name their module
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    with open(out / f"{job_id}.rank{rank}.out", "w", buffering=1) as f, contextlib.redirect_stdout(f):
        try:
            spec.loader.exec_module(module)
            module.main()
        except BaseException:
            f.flush()
            (out / f"{job_id}.rank{rank}.error").write_text(traceback.format_exc())
            raise
    del sys.modules[name]


def main():
    out, ids = Path(sys.argv[1]), sys.argv[2:]
    jobs = json.loads((out / "jobs.json").read_text())
    runtime.quiet_third_party_warnings()
    rank, _ = runtime.init_distributed()
    shutdown = runtime.shutdown
    runtime.shutdown = runtime.barrier  # the scripts' own shutdown: the next job needs the group
    try:
        for job_id in ids:
            if rank == 0:
                (out / f"{job_id}.start").write_text(str(time.time()))
            run_job(out, job_id, jobs[job_id], rank)
            runtime.barrier()
            if rank == 0:
                (out / f"{job_id}.done").write_text(str(time.time()))
    finally:
        runtime.shutdown = shutdown
    shutdown()


if __name__ == "__main__":
    main()
