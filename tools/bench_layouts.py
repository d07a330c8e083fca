"""Benchmark RLHF iterations under per-stage layouts against one layout (JSON lines).

    python tools/bench_layouts.py [--nproc 4] [--iters 3] [--repeats 1] \\
        [--variants "2x1x2/2x2" "2x1x2/1x4"] [--model-dir out/bench/layout_model] [-- EXTRA TRAIN FLAGS]

Each variant is ``TRAIN/GEN`` (``--train-layout TPxPPxDP`` / ``--gen-layout TPxDP``); the
first is the reference (by default TP=2 x DP=2 everywhere: no reallocation), the others
move the actor's weights to the generation layout after every update. Every variant runs
``python -m megatron_rlhf.train`` under torchrun (``--nproc`` ranks, one thread each) with
the demo's settings (``bench_rlhf.DEMO_FLAGS``), the same seed and prompts; variants of a
round run back to back, the order rotated per round.

The model: SmolLM2-135M-Instruct's shape (30 layers, hidden 576, ffn 1536, 49152 tokens,
tied embeddings) with 8 query heads and 4 KV heads instead of 9 and 3, so that TP=2
divides them; random weights, SmolLM2's tokenizer. It is written to ``--model-dir`` once
(needs ``out/bench/smollm2``'s tokenizer, i.e. ``make demo`` or bench_generation first,
or ``--tokenizer DIR``).

Prints a header, one ``run`` line per variant and round (mean seconds per stage over the
iterations after the first, reallocation seconds and MB, reallocation share of the
iteration; goal <= 0.10) and one ``compare`` line per non-reference variant (median over
rounds of reference iteration seconds / the variant's). A table goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generation import cpu_model  # noqa: E402
from bench_rlhf import DEMO_FLAGS, ROOT  # noqa: E402

STAGES = ("time_rollout_s", "time_experience_s", "time_train_s", "time_reallocate_s")
DEFAULT_MODEL = ROOT / "out" / "bench" / "layout_model"
DEFAULT_TOKENIZER = ROOT / "out" / "bench" / "smollm2" / "iter_0000000" / "tokenizer"


def write_model(out: Path, tokenizer_dir: Path, role: str = "actor") -> None:
    """A random model of SmolLM2's shape with 8/4 heads (see the module docstring); a
    ``reward`` model gets a random value head (zero-initialised otherwise)."""
    code = f"""
import torch
from transformers import AutoTokenizer
from megatron_rlhf import runtime
from megatron_rlhf.config import preset
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.models.checkpoint import save_checkpoint
from megatron_rlhf.parallel.groups import build_process_groups
from megatron_rlhf.parallel.layout import Layout
if __name__ == "__main__":
    runtime.quiet_third_party_warnings()
    runtime.init_distributed()
    pg = build_process_groups(Layout())
    cfg = preset("smollm2-135m", num_attention_heads=8, num_query_groups=4, kv_channels=72)
    model = build_model(cfg, {role!r}, pg, dtype=torch.float32, seed=0)
    if {role!r} == "reward":
        torch.nn.init.normal_(model.output_layer.weight, std=0.02)
    save_checkpoint({str(out)!r}, 0, model, pg, tokenizer=AutoTokenizer.from_pretrained({str(tokenizer_dir)!r}))
"""
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True,
                   env=dict(os.environ, PYTHONWARNINGS="ignore"))


def run_variant(args, variant: str, extra: list[str], log: Path) -> list[dict]:
    train, gen = variant.split("/")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           "-m", "megatron_rlhf.train", "--actor-load", str(args.model_dir), "--train-iters", str(args.iters),
           "--log-dir", str(log), "--seed", str(args.seed), "--train-layout", train, "--gen-layout", gen,
           *DEMO_FLAGS, *extra]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONWARNINGS="ignore")
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"variant {variant} failed:\n{' '.join(cmd)}\n{r.stderr[-6000:]}")
    return [json.loads(x) for x in (log / "metrics.jsonl").read_text().splitlines()]


def summarise(rows: list[dict], variant: str, r: int) -> dict:
    steady = rows[1:] or rows  # the first iteration pays one-off allocations and the reshard plan
    mean = lambda k: statistics.fmean(x.get(k, 0.0) for x in steady)  # noqa: E731
    it = mean("time_iteration_s")
    return {"kind": "run", "variant": variant, "round": r, "iterations": len(rows), "iteration_s": it,
            **{k: mean(k) for k in STAGES}, "realloc_mb": mean("realloc_mb"),
            "realloc_share": mean("time_reallocate_s") / it if it else 0.0,
            "first_realloc_s": rows[0].get("time_reallocate_s", 0.0),
            "reward_mean": statistics.fmean(x["reward_mean"] for x in rows)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--variants", nargs="+", default=["2x1x2/2x2", "2x1x2/1x4"],
                   help="TRAIN/GEN layouts; the first is the reference")
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more train flags")
    args = p.parse_args(argv)
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    if not (args.model_dir / "latest_checkpointed_iteration.txt").is_file():
        if not args.tokenizer.is_dir():
            p.error(f"no tokenizer at {args.tokenizer}: run `make demo` (or bench_generation) "
                    "first, or pass --tokenizer DIR")
        write_model(args.model_dir, args.tokenizer)
    print(json.dumps({"kind": "header", "machine": cpu_model(), "cores": os.cpu_count(), "nproc": args.nproc,
                      "threads_per_rank": int(os.environ.get("OMP_NUM_THREADS", "1")),
                      "loadavg": os.getloadavg(), "model": str(args.model_dir), "iters": args.iters,
                      "repeats": args.repeats, "variants": args.variants,
                      "train_flags": DEMO_FLAGS + extra}), flush=True)
    runs = {v: [] for v in args.variants}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            k = r % len(args.variants)
            for v in args.variants[k:] + args.variants[:k]:
                row = summarise(run_variant(args, v, extra, Path(tmp) / f"r{r}-{v.replace('/', '_')}"), v, r)
                runs[v].append(row)
                print(json.dumps(row), flush=True)
    ref = args.variants[0]
    med = statistics.median
    for v in args.variants[1:]:
        print(json.dumps({"kind": "compare", "compare": f"{v} / {ref}", "rounds": len(runs[v]),
                          "iteration_speedup": med([a["iteration_s"] / b["iteration_s"]
                                                    for a, b in zip(runs[ref], runs[v])]),
                          "rollout_speedup": med([a["time_rollout_s"] / b["time_rollout_s"]
                                                  for a, b in zip(runs[ref], runs[v])])}), flush=True)
    head = ("variant", "iter s", "rollout s", "exper s", "train s", "realloc s", "realloc MB", "realloc share")
    print("  ".join(f"{h:>12}" for h in head), file=sys.stderr)
    for v, rs in runs.items():
        cells = [med([x[k] for x in rs]) for k in ("iteration_s", *STAGES, "realloc_mb", "realloc_share")]
        print("  ".join([f"{v:>12}"] + [f"{c:>12.2f}" for c in cells]), file=sys.stderr)
    print(f"load average at the end {os.getloadavg()} ({os.cpu_count()} cores)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
