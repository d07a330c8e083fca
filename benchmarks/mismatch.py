#!/usr/bin/env python
"""Train-inference mismatch side by side: how far the generator's log-probs of the sampled
tokens are from the trainer's (``mismatch_*``), and for a mixture of experts how often the
trainer's routers choose other experts than the rollout's (``routing_*``), with and without
routing replay.

    python -m benchmarks.mismatch [--iters 2] [--variants dense-fp32 dense-bf16 moe-fp32 moe-bf16 moe-bf16+replay] [--out FILE.jsonl]

Every variant runs the demo's GRPO job (``benchmarks.workloads.TASK_FLAGS["grpo"]``, fewer
prompts) for ``--iters`` iterations with log pi_old from a training forward
(``--recompute-logprobs``), on SmolLM2 (``dense``) or SmolLM2 upcycled into 8 experts, 4 per
token (``moe``: ``tools/upcycle.py``, the dense model at step 0). One ``measurement`` line per
variant (means over the iterations), then a table on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import BENCH_DIR, Reporter, load_note, machine, markdown, run_checked, run_train
from benchmarks.workloads import TASK_FLAGS, smollm2_checkpoint

MOE_CKPT = BENCH_DIR / "smollm2-moe"
METRICS = ("mismatch_logprob_abs_mean", "mismatch_logprob_abs_max", "mismatch_k3",
           "routing_disagreement", "routing_tokens_disagreeing", "routing_mismatch")
VARIANTS = ("dense-fp32", "dense-bf16", "moe-fp32", "moe-bf16", "moe-bf16+replay")


def parse_variant(text: str) -> tuple[str, str, bool]:
    """``MODEL-PRECISION[+replay]`` -> ``(dense|moe, fp32|bf16, replay)``."""
    base, _, suffix = text.partition("+")
    model, _, precision = base.partition("-")
    if model not in ("dense", "moe") or precision not in ("fp32", "bf16") or suffix not in ("", "replay"):
        raise argparse.ArgumentTypeError(f"a variant is dense|moe-fp32|bf16[+replay], got {text!r}")
    if suffix and model == "dense":
        raise argparse.ArgumentTypeError(f"{text}: a dense model has no routes to replay")
    return model, precision, bool(suffix)


def moe_checkpoint(dense: Path) -> Path:
    """SmolLM2 upcycled into 8 experts of a quarter of its MLP, 4 per token (once)."""
    if not (MOE_CKPT / "latest_checkpointed_iteration.txt").is_file():
        run_checked([sys.executable, "tools/upcycle.py", "--input", dense, "--output", MOE_CKPT,
                     "--num-experts", "8", "--granularity", "4", "--topk", "4"], "upcycling", echo=True)
    return MOE_CKPT


def flags(variant: tuple[str, str, bool], actor: Path, args) -> list[str]:
    """The demo's GRPO flags for ``variant``."""
    model, precision, replay = variant
    out = [f for f in TASK_FLAGS["grpo"] if f not in ("--bf16", "--fp32")]
    return [f"--{precision}", *out, "--actor-load", actor, "--draft-source", "history",
            "--global-batch-size", str(args.prompts), "--recompute-logprobs", "--train-iters", str(args.iters),
            "--seed", str(args.seed), *(["--routing-replay", "rollout"] if replay else [])]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", type=parse_variant, nargs="+", default=[parse_variant(v) for v in VARIANTS])
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8, help="prompts per iteration (4 answers each)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None, help="also append the JSON lines here")
    args = p.parse_args(argv)
    report = Reporter(args.out)
    start = os.getloadavg()
    report.emit(machine(nproc=args.nproc, iters=args.iters, prompts=args.prompts, seed=args.seed,
                        variants=["-".join(v[:2]) + ("+replay" if v[2] else "") for v in args.variants]))
    dense = smollm2_checkpoint()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants:
            name = "-".join(variant[:2]) + ("+replay" if variant[2] else "")
            actor = moe_checkpoint(dense) if variant[0] == "moe" else dense
            metrics = run_train(args.nproc, flags(variant, actor, args), Path(tmp) / name, name)
            means = {k: statistics.fmean(r[k] for r in metrics if k in r) if any(k in r for r in metrics) else None
                     for k in METRICS}
            rows.append(report.emit({"kind": "measurement", "variant": name, **means,
                                     "iterations": len(metrics)}))
    head = ["variant", "|dlogp| mean", "|dlogp| max", "k3", "routes disagreeing", "tokens with a route disagreeing",
            "routes taken otherwise"]
    table = [[r["variant"], *("-" if r[k] is None else f"{r[k]:.3g}" for k in METRICS)] for r in rows]
    print(markdown(head, table), file=sys.stderr)
    print(load_note(start), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
