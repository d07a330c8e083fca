"""The actor's training time per iteration with packing, the zero-advantage skip and the chunked
LM head, each alone and together, against none of them (JSON lines).

    python -m benchmarks.train_step [--preset smollm2-135m] [--rows 16] [--micro-batch-size 8]
        [--mini-batches 2] [--prompt 40,80] [--response 8,128] [--zero-groups 0.5] [--group 4]
        [--dtype bf16] [--recompute full] [--repeats 3] [--variants base,pack,skip,head,all]

One rank's share of the demo's GRPO update (``rlhf.update.train_actor``: forward, backward and
optimizer steps) on a random ``--preset`` model, one thread per variant, each variant in a fresh
process: ``--rows`` samples in groups of ``--group``, prompt and response lengths drawn uniformly
from the given ranges, ``--zero-groups`` of the groups with equal scores (zero advantages).
Variants: ``base`` padded micro-batches, no skip, whole logits; ``pack``, ``skip``, ``head``
each one of them on; ``all`` every one. ``s`` is the median of ``--repeats`` updates after one
warm-up; ``peak_gb`` the process's peak resident size. Ratio lines: base's time over each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from benchmarks.harness import ROOT, machine, one_rank_actor, rank_env

VARIANTS = {"base": (0, False, 0), "pack": (None, False, 0), "skip": (0, True, 0),
            "head": (0, False, 1024), "all": (None, True, 1024)}  # (token budget, skip, head chunk)


def _range(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"a range LO,HI with 1 <= LO <= HI, got {text}")
    return lo, hi


def _experience(args, cfg, device):
    import torch

    from megatron_rlhf.rlhf.advantages import grpo_advantages
    from megatron_rlhf.rlhf.batch import Experience, pack

    g = torch.Generator().manual_seed(0)
    lengths = [(int(torch.randint(args.prompt[0], args.prompt[1] + 1, (), generator=g)),
                int(torch.randint(args.response[0], args.response[1] + 1, (), generator=g)))
               for _ in range(args.rows)]
    ids = [torch.randint(3, cfg.vocab_size, (p + r,), generator=g).tolist() for p, r in lengths]
    ids, att, mask = pack([x[:p] for x, (p, _) in zip(ids, lengths)],
                          [x[p:] for x, (p, _) in zip(ids, lengths)], 0, device)
    groups = args.rows // args.group
    zero = set(torch.randperm(groups, generator=g)[:round(groups * args.zero_groups)].tolist())
    scores = torch.tensor([0.5 if i // args.group in zero else float(torch.randint(0, 2, (), generator=g))
                           for i in range(args.rows)])
    for k in range(groups):  # a group not meant to be zero gets one right and one wrong answer at least
        if k not in zero:
            scores[k * args.group:k * args.group + 2] = torch.tensor([0.0, 1.0])
    z = torch.zeros_like(mask)
    return Experience(input_ids=ids, attention_mask=att, response_mask=mask, old_logprobs=z,
                      ref_logprobs=z, scores=scores.to(device), kl=z,
                      advantages=grpo_advantages(scores.to(device), args.group, mask))


def _run(args) -> dict:
    from megatron_rlhf import runtime
    from megatron_rlhf.config import OptimConfig, PPOConfig, preset
    from megatron_rlhf.rlhf.optim import build_trainee
    from megatron_rlhf.rlhf.update import train_actor

    budget, skip, chunk = VARIANTS[args.one]
    model, pg = one_rank_actor(args.preset, args.dtype, args.recompute, chunk)
    cfg = preset(args.preset)
    t = build_trainee(model, pg, OptimConfig(lr=1e-6, clip_grad=1.0, use_distributed_optimizer=False), 1e-6)
    exp = _experience(args, cfg, runtime.device())
    ppo = PPOConfig(advantage_estimator="grpo", kl_coef=0.0, global_batch_size=args.rows // args.group,
                    rollout_n=args.group, micro_batch_size=args.micro_batch_size,
                    num_mini_batches=args.mini_batches, max_tokens_per_micro_batch=budget,
                    skip_zero_advantage=skip)
    if not runtime.reset_peak_host_memory():
        sys.exit("the peak resident size cannot be reset here (/proc/self/clear_refs)")
    times, metrics = [], {}
    for _ in range(args.repeats + 1):
        t0 = time.perf_counter()
        metrics = train_actor(t, exp, ppo, seed=0)
        times.append(time.perf_counter() - t0)
    real = int(exp.attention_mask.sum())
    return {"kind": "variant", "variant": args.one, "pack": budget != 0, "skip": skip, "head_chunk": chunk,
            "preset": args.preset, "dtype": args.dtype, "recompute": args.recompute, "rows": args.rows,
            "real_tokens": real, "padded_tokens": int(exp.attention_mask.numel()),
            "s": round(statistics.median(times[1:]), 3), "times": [round(x, 3) for x in times],
            "skipped_fraction": metrics.get("skipped_fraction"),
            "peak_gb": round(runtime.peak_host_memory_bytes() / 2**30, 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--rows", type=int, default=16, help="samples on this rank (the demo: 32 over 2 ranks)")
    p.add_argument("--group", type=int, default=4, help="samples per prompt")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--mini-batches", type=int, default=2)
    p.add_argument("--prompt", type=_range, default=(40, 80), help="prompt lengths LO,HI")
    p.add_argument("--response", type=_range, default=(8, 128), help="response lengths LO,HI")
    p.add_argument("--zero-groups", type=float, default=0.5, help="share of groups with equal scores")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--recompute", choices=("full", "selective"), default="full")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", default="base,pack,skip,head,all")
    p.add_argument("--one", choices=sorted(VARIANTS), default=None, help=argparse.SUPPRESS)  # (a child)
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or args.rows % args.group or not 0 <= args.zero_groups <= 1 or args.repeats < 1:
        p.error(f"--variants from {sorted(VARIANTS)} (got {unknown or 'ok'}), --rows a multiple of --group, "
                "--zero-groups in [0, 1], --repeats >= 1")
    if args.one is not None:
        print(json.dumps(_run(args)), flush=True)
        return 0
    env = rank_env(threads=1)
    print(json.dumps(machine(threads=env["OMP_NUM_THREADS"])), flush=True)
    rows = {}
    for v in variants:
        child = list(argv if argv is not None else sys.argv[1:])
        r = subprocess.run([sys.executable, "-m", "benchmarks.train_step", *child, "--one", v],
                           cwd=ROOT, env=env, capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"variant {v} failed:\n{r.stderr[-4000:]}")
        rows[v] = json.loads(r.stdout.strip().splitlines()[-1])
        print(json.dumps(rows[v]), flush=True)
    if "base" in rows:
        for v, row in rows.items():
            if v != "base":
                print(json.dumps({"kind": "ratio", "variant": v,
                                  "faster_than_base": round(rows["base"]["s"] / row["s"], 2),
                                  "peak_over_base": round(row["peak_gb"] / rows["base"]["peak_gb"], 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
