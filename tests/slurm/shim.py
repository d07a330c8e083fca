"""``sbatch``, ``srun`` and ``scontrol show hostnames`` for one machine, so that tests run
the real SLURM scripts of ``examples/`` with N local "nodes".

The executables in ``tests/slurm/bin/`` call :func:`main`; a test puts that folder first on
``PATH`` (:mod:`slurm.harness`). What each command does:

``sbatch [--nodes K] [OPTIONS] SCRIPT [ARGS...]``
    reads the script's ``#SBATCH`` directives (those before its first command, as SLURM
    does; options on the command line win), sets the variables of a batch job
    (``SLURM_JOB_ID``, ``SLURM_NNODES``, ``SLURM_JOB_NODELIST`` = ``node[0-K-1]``,
    ``SLURM_SUBMIT_DIR`` = the current directory, ``SLURM_NTASKS_PER_NODE``, ...; stale
    ``SLURM_*`` variables are dropped) and runs ``bash SCRIPT ARGS`` in the submit
    directory on "node 0". Unlike a real ``sbatch`` it waits for the job (as
    ``sbatch --wait`` does), writes the job's output to its own stdout/stderr (``--output``
    and ``--error`` are accepted and ignored), and exits with the job's status.
``srun [--nodes K] [--ntasks N] [--ntasks-per-node T] COMMAND...``
    inside such a job, starts the step's tasks (one per node by default, the scripts'
    ``--ntasks-per-node=1``), each in a session of its own standing for its node, with
    ``SLURM_NODEID``, ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURMD_NODENAME`` and the
    ``SLURM_STEP_*`` variables, then waits for all of them (as srun does by default: the
    loss of one task does not stop the others) and exits with the highest status, saying
    which task failed. Node 0's tasks start first; when ``MASTER_ADDR``/``MASTER_PORT``
    are set and there are other nodes, those start once something listens there. On one
    machine every torchrun agent believes it is the c10d rendezvous host (torch matches
    "localhost"), and the first to bind the port hosts the store: going first, node 0
    hosts it, as on a cluster where ``MASTER_ADDR`` is node 0's name.
``scontrol show hostnames [LIST]``
    expands a host list (``node[0-1]``, ``a,b``; default ``SLURM_JOB_NODELIST``) and
    prints one host name per node: ``localhost`` (or ``$SLURM_SHIM_HOST``), since every
    simulated node is this machine.

``SLURM_SHIM_*`` variables are kept across ``sbatch``; the harness marks a job's processes
with ``SLURM_SHIM_TAG`` to find (and kill) them.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

# option -> (short form, takes a value)
OPTIONS = {
    "nodes": ("N", True), "ntasks": ("n", True), "ntasks-per-node": (None, True),
    "job-name": ("J", True), "gpus-per-node": (None, True), "cpus-per-task": ("c", True),
    "mem": (None, True), "time": ("t", True), "partition": ("p", True),
    "account": ("A", True), "output": ("o", True), "error": ("e", True),
    "chdir": ("D", True), "export": (None, True), "exclusive": (None, False),
    "wait": ("W", False), "label": ("l", False), "kill-on-bad-exit": ("K", False),
}
SHORT = {short: name for name, (short, _) in OPTIONS.items() if short}
NODE_PREFIX = "node"


class ShimError(Exception):
    pass


def parse_options(argv: list[str], prog: str) -> tuple[dict, list[str]]:
    """Leading SLURM options of ``argv`` -> ({name: value}, the rest)."""
    opts, i = {}, 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-":
        arg = argv[i]
        if arg == "--":
            i += 1
            break
        if arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
        else:
            name, value = SHORT.get(arg[1:2], arg[1:2]), arg[2:]
            eq = "=" if value else ""
        if name not in OPTIONS:
            raise ShimError(f"{prog}: unsupported option {arg} (tests/slurm/shim.py knows "
                            f"{', '.join('--' + o for o in OPTIONS)})")
        if OPTIONS[name][1] and not eq:
            i += 1
            if i == len(argv):
                raise ShimError(f"{prog}: option {arg} needs a value")
            value = argv[i]
        opts[name] = value if OPTIONS[name][1] else True
        i += 1
    return opts, argv[i:]


def directives(script: str) -> list[str]:
    """Arguments of the ``#SBATCH`` lines before the script's first command."""
    args = []
    with open(script) as f:
        for line in f:
            s = line.strip()
            if s.startswith("#SBATCH"):
                args += shlex.split(s[len("#SBATCH"):], comments=True)
            elif s and not s.startswith("#"):
                break
    return args


def count(value, what: str) -> int:
    text = str(value).split("-")[0]  # --nodes=2-4: the minimum
    if not text.isdigit() or int(text) < 1:
        raise ShimError(f"bad {what}: {value!r}")
    return int(text)


def node_names(n: int) -> list[str]:
    return [f"{NODE_PREFIX}{i}" for i in range(n)]


def hostlist(n: int) -> str:
    return f"{NODE_PREFIX}0" if n == 1 else f"{NODE_PREFIX}[0-{n - 1}]"


def expand_hostlist(text: str) -> list[str]:
    """``node[0-2,5],login`` -> node0 node1 node2 node5 login."""
    names = []
    for prefix, ranges, plain in re.findall(r"([^,\[]*)\[([^\]]*)\]|([^,]+)", text):
        if plain:
            names.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            width = len(lo)
            for i in range(int(lo), int(hi or lo) + 1):
                names.append(f"{prefix}{i:0{width}d}")
    return names


# ---------------------------------------------------------------------------- sbatch
def sbatch(argv: list[str]) -> int:
    cli, rest = parse_options(argv, "sbatch")
    if not rest:
        raise ShimError("usage: sbatch [OPTIONS] SCRIPT [ARGS...]")
    script, args = rest[0], rest[1:]
    opts, extra = parse_options(directives(script), f"sbatch ({script} #SBATCH)")
    if extra:
        raise ShimError(f"sbatch: {script}: stray #SBATCH words {extra}")
    opts.update(cli)
    if opts.get("export", "ALL") != "ALL":
        raise ShimError("sbatch: only --export=ALL is simulated")
    nodes = count(opts.get("nodes", 1), "--nodes")
    submit = os.getcwd()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SLURMD_")) or k.startswith("SLURM_SHIM_")}
    job_id = str(os.getpid())
    env.update(SLURM_JOB_ID=job_id, SLURM_JOBID=job_id, SLURM_CLUSTER_NAME="shim",
               SLURM_JOB_NAME=opts.get("job-name", os.path.basename(script)),
               SLURM_NNODES=str(nodes), SLURM_JOB_NUM_NODES=str(nodes),
               SLURM_JOB_NODELIST=hostlist(nodes), SLURM_NODELIST=hostlist(nodes),
               SLURM_SUBMIT_DIR=submit, SLURM_SUBMIT_HOST=socket.gethostname(),
               SLURM_NODEID="0", SLURMD_NODENAME=node_names(nodes)[0])
    if "ntasks-per-node" in opts:
        per = count(opts["ntasks-per-node"], "--ntasks-per-node")
        env.update(SLURM_NTASKS_PER_NODE=str(per), SLURM_NTASKS=str(per * nodes))
    if "ntasks" in opts:
        env["SLURM_NTASKS"] = env["SLURM_NPROCS"] = str(count(opts["ntasks"], "--ntasks"))
    for name, var in (("cpus-per-task", "SLURM_CPUS_PER_TASK"), ("gpus-per-node", "SLURM_GPUS_PER_NODE")):
        if name in opts:
            env[var] = str(opts[name])
    cwd = opts.get("chdir", submit)
    print(f"Submitted batch job {job_id}", flush=True)
    return subprocess.call(["bash", script, *args], cwd=cwd, env=env)


# ---------------------------------------------------------------------------- srun
def _listening(addr: str, port: int) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=1):
            return True
    except OSError:
        return False


def _wait_for_rendezvous(node0: list[subprocess.Popen], timeout: float = 300.0) -> None:
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return
    end = time.monotonic() + timeout
    while time.monotonic() < end and not _listening(addr, int(port)):
        if any(p.poll() is not None for p in node0):
            return  # node 0 is gone: let the others find out for themselves
        time.sleep(0.2)


def srun(argv: list[str]) -> int:
    if "SLURM_JOB_ID" not in os.environ:
        raise ShimError("srun: error: not inside a job: submit the script with the sbatch shim")
    opts, command = parse_options(argv, "srun")
    if not command:
        raise ShimError("usage: srun [OPTIONS] COMMAND...")
    job_nodes = count(os.environ["SLURM_NNODES"], "SLURM_NNODES")
    nodes = count(opts.get("nodes", job_nodes), "--nodes")
    if nodes > job_nodes:
        raise ShimError(f"srun: error: --nodes {nodes} exceeds the job's {job_nodes} nodes")
    if "ntasks" in opts:
        tasks = count(opts["ntasks"], "--ntasks")
    elif "ntasks-per-node" in opts:
        tasks = nodes * count(opts["ntasks-per-node"], "--ntasks-per-node")
    elif "nodes" not in opts and "SLURM_NTASKS" in os.environ:
        tasks = count(os.environ["SLURM_NTASKS"], "SLURM_NTASKS")
    else:
        tasks = nodes * count(os.environ.get("SLURM_NTASKS_PER_NODE", 1), "SLURM_NTASKS_PER_NODE")
    nodes = min(nodes, tasks)
    per_node = [tasks // nodes + (k < tasks % nodes) for k in range(nodes)]  # block distribution
    names = node_names(job_nodes)[:nodes]
    step = "0"  # the scripts run one step each
    procs: list[tuple[int, int, subprocess.Popen]] = []

    def forward(sig, _frame):
        for _, _, p in procs:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    rank = 0
    for node in range(nodes):
        if node == 1:
            _wait_for_rendezvous([p for _, _, p in procs])
        for local in range(per_node[node]):
            env = dict(os.environ, SLURM_NODEID=str(node), SLURMD_NODENAME=names[node],
                       SLURM_PROCID=str(rank), SLURM_LOCALID=str(local), SLURM_STEP_ID=step,
                       SLURM_STEPID=step, SLURM_STEP_NUM_NODES=str(nodes),
                       SLURM_STEP_NUM_TASKS=str(tasks), SLURM_STEP_NODELIST=hostlist(nodes),
                       SLURM_NTASKS=str(tasks), SLURM_NPROCS=str(tasks),
                       SLURM_STEP_TASKS_PER_NODE=",".join(map(str, per_node)))
            procs.append((node, rank, subprocess.Popen(command, env=env, start_new_session=True)))
            rank += 1
    status, running = 0, list(procs)
    while running:  # report each task's end as it happens
        time.sleep(0.1)
        for node, rank, p in [t for t in running if t[2].poll() is not None]:
            running.remove((node, rank, p))
            code = p.returncode
            if code:
                what = f"Killed by signal {-code}" if code < 0 else f"Exited with exit code {code}"
                print(f"srun: error: {names[node]}: task {rank}: {what}", file=sys.stderr, flush=True)
                status = max(status, 128 - code if code < 0 else code)
    return status


# ---------------------------------------------------------------------------- scontrol
def scontrol(argv: list[str]) -> int:
    if argv[:2] != ["show", "hostnames"]:
        raise ShimError(f"scontrol: only `scontrol show hostnames [LIST]` is simulated, not {argv}")
    text = argv[2] if len(argv) > 2 else os.environ.get("SLURM_JOB_NODELIST", "")
    host = os.environ.get("SLURM_SHIM_HOST", "localhost")
    for _ in expand_hostlist(text):
        print(host)
    return 0


def main(command: str, argv: list[str]) -> int:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `scontrol show hostnames | head -n1`
    try:
        return {"sbatch": sbatch, "srun": srun, "scontrol": scontrol}[command](argv)
    except ShimError as e:
        print(e, file=sys.stderr)
        return 1
