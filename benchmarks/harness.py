"""What every benchmark shares: the torchrun launch, a run's ``metrics.jsonl``, the machine
header, the JSON lines and the tables that go to stderr.

Imports only the standard library at import: the TRL worker of ``benchmarks.peer`` runs it in
a venv without megatron_rlhf's dependencies (:func:`cpu_flags` imports the package's reader
when called).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT / "out" / "bench"
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile", "avx512f", "avx2")


# ---------------------------------------------------------------------------- launch
def torchrun(nproc: int, *args) -> list[str]:
    """``torchrun --standalone --nproc_per_node NPROC ARGS`` as a command line of this python."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", *map(str, args)]


def rank_env(threads: int | str | None = None, **extra) -> dict:
    """The environment of a launch: ``OMP_NUM_THREADS`` (``threads``, else the caller's, else 1)
    and warnings off."""
    threads = threads if threads is not None else os.environ.get("OMP_NUM_THREADS", "1")
    return dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore", **extra)


def relaunch(module: str, nproc: int, argv: list[str], env: dict) -> int:
    """Run ``python -m MODULE ARGV`` on ``nproc`` ranks under torchrun; its exit status."""
    return subprocess.run(torchrun(nproc, "-m", module, *argv), cwd=ROOT, env=env).returncode


def run_checked(cmd: list, what: str, env: dict | None = None, cwd: Path = ROOT,
                echo: bool = False) -> subprocess.CompletedProcess:
    """Run ``cmd`` (from the repository root), its output captured; ``echo``: print it first.
    Exits with the command and the ends of its output when it fails."""
    cmd = [str(c) for c in cmd]
    if echo:
        print(f"# {what}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    r = subprocess.run(cmd, cwd=cwd, env=env or rank_env(), capture_output=True, text=True)
    if r.returncode:
        err = r.stderr if len(r.stderr) < 6000 else f"{r.stderr[:2000]}\n...\n{r.stderr[-4000:]}"
        sys.exit(f"{what} failed (exit {r.returncode}):\n{' '.join(cmd)}\n{r.stdout[-2000:]}\n{err}")
    return r


def run_train(nproc: int, flags: list, log: Path, what: str, module: str = "megatron_rlhf.train") -> list[dict]:
    """``python -m MODULE FLAGS --log-dir LOG`` on ``nproc`` ranks: its metrics.jsonl rows."""
    run_checked(torchrun(nproc, "-m", module, *flags, "--log-dir", log), what)
    return read_metrics(log)


def read_metrics(path: Path | str) -> list[dict]:
    """The rows of a run's ``metrics.jsonl`` (``path`` is the file or its log directory)."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


# ---------------------------------------------------------------------------- the machine
def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (else what ``platform`` says, or "unknown")."""
    for line in _cpuinfo():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def cpu_flags() -> list[str]:
    """Which of the CPU features that decide bf16 and fp32 speed the CPU has (read as the
    runs' automatic precision reads them: :func:`megatron_rlhf.runtime.cpu_flags`)."""
    from megatron_rlhf.runtime.devices import cpu_flags as flags

    have = flags()
    return [f for f in BF16_FLAGS if f in have]


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine(**fields) -> dict:
    """The header line of a benchmark: the machine, its load and versions, then ``fields``."""
    return {"kind": "header", "machine": cpu_model(), "cpu_flags": cpu_flags(), "cores": os.cpu_count(),
            "loadavg": os.getloadavg(), "python": platform.python_version(), "torch": version("torch"),
            "megatron_core": version("megatron-core"), **fields}


def load_note(start=None) -> str:
    """The closing line on stderr: the load average (other processes skew every number)."""
    first = "" if start is None else f" at the start {start},"
    return f"load average{first} at the end {os.getloadavg()} ({os.cpu_count()} cores)"


# ---------------------------------------------------------------------------- output
class Reporter:
    """Prints JSON lines (and appends them to a file); keeps them for the summary."""

    def __init__(self, out: str | None):
        self.out, self.rows = out, []

    def emit(self, record: dict) -> dict:
        line = json.dumps(record)
        print(line, flush=True)
        if self.out:
            with open(self.out, "a") as f:
                f.write(line + "\n")
        self.rows.append(record)
        return record


def cell(v, digits: int = 2) -> str:
    """A table cell: ``-`` for None, floats to ``digits`` places."""
    return "-" if v is None else (f"{v:.{digits}f}" if isinstance(v, float) else str(v))


def columns(head, rows, width: int = 10) -> str:
    """A right-aligned text table (``rows``: sequences of cells)."""
    return "\n".join("  ".join(f"{cell(c):>{width}}" for c in row) for row in [head, *rows])


def markdown(head, rows) -> str:
    """A markdown table (``rows``: sequences of cells, already formatted or plain)."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def median_by(items: list, key):
    """The item at the median of ``key`` (the upper one of an even count)."""
    return sorted(items, key=key)[len(items) // 2]


# ---------------------------------------------------------------------------- variants
def draft_variant(text: str) -> tuple[int | str, bool]:
    """``N`` / ``auto`` / ``off`` (or ``plain``, ``0``), optionally ``+mig`` ->
    ``(num_draft_tokens, migrate)``: the variant syntax of the rollout and rlhf benchmarks."""
    base, _, suffix = text.strip().partition("+")
    if suffix not in ("", "mig"):
        raise argparse.ArgumentTypeError(f"variant {text!r}: the only suffix is +mig")
    if base in ("off", "plain", "0"):
        return 0, bool(suffix)
    if base == "auto":
        return "auto", bool(suffix)
    try:
        n = int(base)
    except ValueError:
        raise argparse.ArgumentTypeError(f"variant {text!r}: expected off, N or auto (+mig)") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"variant {text!r}: N must be >= 1")
    return n, bool(suffix)


# ---------------------------------------------------------------------------- models
def one_rank_actor(preset_name: str, dtype: str, recompute: str | None, head_chunk: int):
    """``(model, process groups)``: a random ``preset_name`` actor (``dtype`` fp32 or bf16) in a
    one-process world, its LM head chunked ``head_chunk`` tokens at a time (0: off)."""
    import torch

    from megatron_rlhf import runtime
    from megatron_rlhf.config import preset
    from megatron_rlhf.models.builder import build_model
    from megatron_rlhf.models.forward import set_head_chunk
    from megatron_rlhf.parallel.groups import build_process_groups
    from megatron_rlhf.parallel.layout import Layout

    runtime.quiet_third_party_warnings()
    runtime.init_distributed()
    pg = build_process_groups(Layout())
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = build_model(preset(preset_name), "actor", pg, dtype=torch_dtype, seed=0, recompute=recompute)
    set_head_chunk(model, head_chunk)
    return model, pg
