"""Benchmark RLHF iterations with speculative generation on vs off (JSON lines).

    python tools/bench_rlhf.py --actor-load CKPT --draft-load DRAFT [--nproc 2] \\
        [--iters 6] [--num-draft-tokens 1 2 4] [-- EXTRA TRAIN FLAGS]

Runs ``python -m megatron_rlhf.train`` once per variant — plain decoding, then speculation
with each ``n`` — with the same seed, prompts, batch and flags (the demo's settings by
default), and prints one JSON line per variant (mean seconds per stage over the iterations
after the first, the generation share of an iteration, generation tokens/s, mean accepted
length, reward mean and std) and one line per speculative variant with its ratios to
plain decoding. Speculation is lossless, so reward statistics agree in expectation, not
sample by sample.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO_FLAGS = ["--reward-fn", "concise", "--global-batch-size", "8", "--rollout-n", "2",
              "--micro-batch-size", "8", "--max-new-tokens", "40", "--temperature", "1.0",
              "--lr", "1e-5", "--critic-lr", "2e-5", "--lr-warmup-iters", "2", "--kl-coef", "0.01",
              "--clip-grad", "1.0"]  # examples/cpu_demo.sh
STAGES = ("time_rollout_s", "time_experience_s", "time_train_s", "time_draft_s")


def run_variant(args, n: int, extra: list[str], out: Path) -> list[dict]:
    log = out / (f"spec{n}" if n else "plain")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
           "-m", "megatron_rlhf.train", "--actor-load", args.actor_load,
           "--train-iters", str(args.iters), "--log-dir", str(log), "--seed", str(args.seed),
           *DEMO_FLAGS, *extra]
    if n:
        cmd += ["--draft-load", args.draft_load, "--num-draft-tokens", str(n)]
        if args.draft_distill:
            cmd.append("--draft-distill")
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONWARNINGS="ignore")
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"variant n={n} failed:\n{r.stderr[-4000:]}")
    return [json.loads(x) for x in (log / "metrics.jsonl").read_text().splitlines()]


def summarise(rows: list[dict], n: int, args) -> dict:
    steady = rows[1:] or rows  # the first iteration pays one-off allocations
    mean = lambda k: statistics.fmean(r.get(k, 0.0) for r in steady)  # noqa: E731
    it = mean("time_iteration_s")
    return {
        "variant": f"spec n={n}" if n else "plain", "num_draft_tokens": n,
        "iterations": len(rows), "nproc": args.nproc, "machine": platform.processor() or platform.machine(),
        "iteration_s": it, **{k: mean(k) for k in STAGES},
        "generation_share": mean("time_rollout_s") / it if it else 0.0,
        "gen_tokens_per_s": mean("gen_tokens_per_s"), "accepted_length": mean("accepted_length"),
        "reward_mean": statistics.fmean(r["reward_mean"] for r in rows),
        "reward_std": statistics.fmean(r["reward_std"] for r in rows),
        "response_length": statistics.fmean(r["response_length"] for r in rows),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--actor-load", required=True)
    p.add_argument("--draft-load", required=True)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--num-draft-tokens", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--draft-distill", action="store_true", help="also distil the draft in the loop")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more train flags")
    args = p.parse_args(argv)
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    with tempfile.TemporaryDirectory() as tmp:
        plain = summarise(run_variant(args, 0, extra, Path(tmp)), 0, args)
        print(json.dumps(plain), flush=True)
        for n in args.num_draft_tokens:
            spec = summarise(run_variant(args, n, extra, Path(tmp)), n, args)
            print(json.dumps(spec), flush=True)
            print(json.dumps({
                "compare": f"spec n={n} / plain",
                "generation_speedup": plain["time_rollout_s"] / spec["time_rollout_s"],
                "iteration_speedup": plain["iteration_s"] / spec["iteration_s"],
                "reward_mean_diff": spec["reward_mean"] - plain["reward_mean"],
                "accepted_length": spec["accepted_length"],
            }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
