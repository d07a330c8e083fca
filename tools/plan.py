#!/usr/bin/env python
"""Execution plans for an RLHF iteration on a cluster you describe (ReaLHF's search).

  python tools/plan.py --actor llama2-70b --critic llama2-7b --reward llama2-7b --nodes 8 --gpus-per-node 8 \\
      --gpu-memory-gb 80 [--hardware h100|h200|a100|FILE.json] [--profile FILE.json ...] \\
      [--space full|trainer|models] [--json] [--out PLAN.json]

Every call of the iteration's dataflow graph gets a layout; the estimator prices plans from the
hardware (or ``tools/profile_costs.py`` profiles) and the search finds the fastest plan that fits.
Prints the plan, predicted seconds per call and reallocation, memory per GPU, and the comparison
with the heuristic default; ``--out`` writes the plan for ``train --plan``. Exit code 2 when nothing fits.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from memory_plan import add_models_and_cluster, models_from  # tools/, beside this file

from megatron_rlhf.plan import memory
from megatron_rlhf.plan.cost import HARDWARE, Estimator, Hardware, Options, Profile, Speculation
from megatron_rlhf.plan.graph import rlhf_graph
from megatron_rlhf.plan.search import search


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    c = add_models_and_cluster(p)
    c.add_argument("--hardware", default="h100",
                   help=f"a profile ({', '.join(HARDWARE)}) or a Hardware JSON file")
    c.add_argument("--profile", nargs="*", default=[],
                   help="Profile JSON files from tools/profile_costs.py (measured per-layer costs)")
    w = p.add_argument_group("workload")
    w.add_argument("--rollout-batch", type=int, default=512, help="samples per iteration")
    w.add_argument("--max-prompt-length", type=int, default=1024)
    w.add_argument("--max-new-tokens", type=int, default=1024)
    w.add_argument("--response-fractions", default="0.25,0.5,0.75,1.0",
                   help="response lengths as fractions of --max-new-tokens (quantiles; the tail)")
    w.add_argument("--micro-batch-size", type=int, default=1)
    w.add_argument("--ppo-epochs", type=int, default=1)
    w.add_argument("--num-mini-batches", type=int, default=1)
    w.add_argument("--acceptance", type=float, default=0.6, help="with --draft: per-token acceptance")
    w.add_argument("--max-draft-tokens", type=int, default=4)
    w.add_argument("--fp32", action="store_true", help="fp32 weights and activations (default bf16)")
    s = p.add_argument_group("search")
    s.add_argument("--space", choices=("full", "trainer", "models"), default="full")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--budget", type=int, default=20_000, help="annealing steps")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--out", help="write the plan here (train --plan FILE)")
    return p


def hardware_of(args) -> Hardware:
    if args.hardware in HARDWARE:
        hw = HARDWARE[args.hardware]
    elif Path(args.hardware).exists():
        hw = Hardware.load(args.hardware)
    else:
        raise ValueError(f"--hardware {args.hardware!r}: use one of {', '.join(HARDWARE)} or a JSON file")
    return Hardware(**{**hw.__dict__, "gpus_per_node": args.gpus_per_node,
                       "gpu_memory_gb": args.gpu_memory_gb})


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    start = time.perf_counter()
    try:
        models = models_from(args)
        fractions = tuple(float(x) for x in args.response_fractions.split(","))
        if not fractions or not all(0 < f <= 1 for f in fractions):
            raise ValueError("--response-fractions: fractions in (0, 1], e.g. 0.25,0.5,0.75,1")
        spec = None
        if "draft" in models:
            spec = Speculation(models["draft"], args.acceptance, args.max_draft_tokens)
        profiles = {}
        for f in args.profile:
            prof = Profile.load(f)
            profiles[prof.shape] = prof
        est = Estimator(models, hardware_of(args), profiles,
                        Options(param_bytes=4 if args.fp32 else 2, micro_batch_size=args.micro_batch_size,
                                response_fractions=fractions, speculation=spec))
        graph = rlhf_graph(args.rollout_batch, args.max_prompt_length, args.max_new_tokens,
                           critic="critic" in models, reference="reference" in models,
                           reward_model="reward" in models, draft=spec is not None,
                           ppo_epochs=args.ppo_epochs, mini_batches=args.num_mini_batches)
        cluster = memory.Cluster(nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                                 gpu_memory_gb=args.gpu_memory_gb)
        result = search(graph, est, cluster, seed=args.seed, space=args.space, budget=args.budget)
    except ValueError as e:
        print(f"plan.py: error: {e}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    assumptions = {
        "models": {r: f"{getattr(args, r) if getattr(args, r) != 'SAME' else args.actor} "
                      f"({memory.count_parameters(cfg, r) / 1e9:.2f}B)" for r, cfg in models.items()},
        "cluster": f"{args.nodes}x{args.gpus_per_node} GPUs of {args.gpu_memory_gb:g} GB",
        "hardware": est.hw.__dict__ if not profiles else f"{est.hw.name} + measured profiles",
        "workload": f"{args.rollout_batch} samples, prompts {args.max_prompt_length} + responses "
                    f"{args.max_new_tokens} tokens (length quantiles {args.response_fractions}), "
                    f"micro-batch {args.micro_batch_size}, {args.ppo_epochs} epoch(s) x "
                    f"{args.num_mini_batches} step(s)",
        "search": f"{result.method}, {result.evaluated} plans evaluated in {elapsed:.1f} s, seed {args.seed}, "
                  f"space {args.space}",
    }
    if args.out:
        result.best.plan.save(args.out, predicted_s=round(result.best.time_s, 3), assumptions=assumptions)
    if args.json:
        print(json.dumps({"assumptions": assumptions, "best": result.best.to_json(),
                          "default": result.default.to_json(), "speedup_vs_default": result.speedup}))
        return 0
    for k, v in assumptions.items():
        print(f"{k}: {v}")
    print(table(result.best, "searched plan"))
    print(table(result.default, "heuristic default"))
    print(f"searched / default: {result.speedup:.2f}x faster (predicted)")
    return 0


def table(ev, title: str) -> str:
    lines = [f"\n{title}: {ev.time_s:.1f} s per iteration (predicted)",
             "| call | layout | seconds | parts | GB per GPU |", "|---|---|---|---|---|"]
    for call, parts in ev.calls.items():
        detail = ", ".join(f"{k} {v:.2f}" for k, v in parts.items() if k != "total" and v)
        lines.append(f"| {call} | {ev.plan.text(call)} | {parts['total']:.2f} | {detail} | "
                     f"{ev.memory[call] / memory.GB:.1f} |")
    for edge, (sec, nbytes) in ev.reallocs.items():
        if nbytes:
            lines.append(f"| reallocate {edge} | | {sec:.2f} | {nbytes / 2**20:.0f} MB per GPU | |")
    if ev.overlap_s > 0:
        lines.append(f"| inference calls on disjoint GPUs at once | | -{ev.overlap_s:.2f} | | |")
    if ev.train_overlap_s > 0:
        lines.append(f"| training calls on disjoint GPUs at once | | -{ev.train_overlap_s:.2f} | | |")
    lines.append(f"usable memory per GPU: {ev.capacity / memory.GB:.1f} GB")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
