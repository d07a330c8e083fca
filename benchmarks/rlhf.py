"""RLHF iterations with speculative generation on vs off (JSON lines).

    python -m benchmarks.rlhf --actor-load CKPT [--draft-load DRAFT] [--task grpo|ppo] [--nproc 2] \\
        [--iters 6] [--num-draft-tokens 1 2 auto auto+mig history+mig both+mig] [--repeats 1] [-- TRAIN FLAGS]

Runs ``megatron_rlhf.train`` under torchrun once per variant and round with the settings of
``make demo`` (``--task grpo``) or ``DEMO=ppo make demo``: plain decoding (the reference) and each
``--num-draft-tokens`` value (``N``, ``auto``, ``history``/``both`` drafts, each optionally ``+mig``).
Prints a header, one ``run`` line per run (stage seconds after the first iteration, generation
share and speed, acceptance, migration, rewards) and one ``compare`` line per variant (median of
the per-round ratios to plain); a table goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import columns, draft_variant, load_note, machine, run_train
from benchmarks.workloads import TASK_FLAGS
STAGES = ("time_rollout_s", "time_experience_s", "time_train_s", "time_draft_s")
SOURCES = ("history", "both")  # variants drafting (also) from the rollout's history, under auto


def parse_variant(text: str) -> tuple[str, int | str, bool, str | None]:
    """``N`` / ``auto`` / ``plain`` / ``history`` / ``both``, optionally ``+mig`` ->
    (name, num_draft_tokens, migrate, draft source: None for the draft model)."""
    base, plus, suffix = text.strip().partition("+")
    if base in SOURCES:
        _, migrate = draft_variant("auto" + plus + suffix)
        return base + ("+mig" if migrate else ""), "auto", migrate, base
    n, migrate = draft_variant(text)
    name = "plain" if n == 0 else (f"spec n={n}" if isinstance(n, int) else "auto")
    return name + ("+mig" if migrate else ""), n, migrate, None


def uses_model(variant) -> bool:
    """Whether a variant needs ``--draft-load``."""
    _, n, _, source = variant
    return bool(n) and source != "history"


def run_variant(args, variant, extra: list[str], log: Path) -> list[dict]:
    name, n, migrate, source = variant
    cmd = ["--actor-load", args.actor_load, "--train-iters", str(args.iters), "--seed", str(args.seed),
           "--sample-migration", "on" if migrate else "off", *TASK_FLAGS[args.task], *extra]
    if source is not None:
        cmd += ["--draft-source", source]
    if n and uses_model(variant):
        cmd += ["--draft-load", args.draft_load]
    if n:
        cmd += ["--num-draft-tokens", str(n)]
        if n == "auto" and args.max_draft_tokens:
            cmd += ["--max-draft-tokens", str(args.max_draft_tokens)]
        if args.draft_distill and uses_model(variant):
            cmd.append("--draft-distill")
    return run_train(args.nproc, cmd, log, f"variant {name}")


def summarise(rows: list[dict], variant, r: int, args) -> dict:
    name, n, migrate, _ = variant
    steady = rows[1:] or rows  # the first iteration pays one-off allocations
    mean = lambda k: statistics.fmean(x.get(k, 0.0) for x in steady)  # noqa: E731
    it = mean("time_iteration_s")
    hist = [sum(h) for h in zip(*[x["gen_rounds_by_draft_len"] for x in steady if "gen_rounds_by_draft_len" in x])]
    return {
        "kind": "run", "variant": name, "num_draft_tokens": n, "sample_migration": migrate, "round": r,
        "iterations": len(rows), "iteration_s": it, **{k: mean(k) for k in STAGES},
        "generation_share": mean("time_rollout_s") / it if it else 0.0,
        "gen_tokens_per_s": mean("gen_tokens_per_s"), "accepted_length": mean("accepted_length"),
        "gen_rounds_by_draft_len": hist, "gen_migrated": sum(x.get("gen_migrated", 0) for x in steady),
        "gen_migration_mb": sum(x.get("gen_migration_mb", 0.0) for x in steady),
        "gen_idle_frac_max": mean("gen_idle_frac_max"),
        "reward_mean": statistics.fmean(x["reward_mean"] for x in rows),
        "reward_std": statistics.fmean(x["reward_std"] for x in rows),
        "response_length": statistics.fmean(x["response_length"] for x in rows),
        "eos_fraction": statistics.fmean(x.get("eos_fraction", 0.0) for x in rows),
    }


def compare(name: str, runs: list[dict], plain: list[dict]) -> dict:
    """Medians over rounds of the per-round ratios of ``runs`` to ``plain``."""
    med = statistics.median
    return {
        "kind": "compare", "compare": f"{name} / plain", "rounds": len(runs),
        "generation_speedup": med([p["time_rollout_s"] / x["time_rollout_s"] for x, p in zip(runs, plain)]),
        "iteration_speedup": med([p["iteration_s"] / x["iteration_s"] for x, p in zip(runs, plain)]),
        "gen_tokens_per_s_ratio": med([x["gen_tokens_per_s"] / p["gen_tokens_per_s"]
                                       for x, p in zip(runs, plain) if p["gen_tokens_per_s"]] or [0.0]),
        "reward_mean": med([x["reward_mean"] for x in runs]),
        "reward_mean_plain": med([p["reward_mean"] for p in plain]),
        "reward_mean_diff": med([x["reward_mean"] - p["reward_mean"] for x, p in zip(runs, plain)]),
        "reward_std": med([x["reward_std"] for x in runs]),
        "reward_std_plain": med([p["reward_std"] for p in plain]),
        "accepted_length": med([x["accepted_length"] for x in runs]),
        "gen_idle_frac_max": med([x["gen_idle_frac_max"] for x in runs]),
        "gen_idle_frac_max_plain": med([p["gen_idle_frac_max"] for p in plain]),
    }


def table(runs: dict[str, list[dict]], compares: dict[str, dict]) -> str:
    med = statistics.median
    head = ("variant", "iter s", "rollout s", "exper s", "train s", "draft s", "gen share", "gen tok/s",
            "acc len", "reward", "gen x", "iter x", "idle max", "migrated", "rounds/n")
    rows = []
    for name, rs in runs.items():
        c = compares.get(name, {})
        means = (med([x[k] for x in rs]) for k in ("iteration_s", *STAGES, "generation_share",
                                                     "gen_tokens_per_s", "accepted_length", "reward_mean"))
        rows.append((name, *means, c.get("generation_speedup"), c.get("iteration_speedup"),
                     med([x["gen_idle_frac_max"] for x in rs]),
                     rs[0]["gen_migrated"], "/".join(map(str, rs[0]["gen_rounds_by_draft_len"])) or "-"))
    return columns(head, rows)




def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--actor-load", required=True)
    p.add_argument("--draft-load", default=None, help="a draft model (variants N, auto, both)")
    p.add_argument("--task", choices=sorted(TASK_FLAGS), default="grpo",
                   help="the demo whose settings to run: grpo (make demo) or ppo (DEMO=ppo make demo)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--repeats", type=int, default=1, help="rounds of every variant (ratios: median)")
    p.add_argument("--num-draft-tokens", type=parse_variant, nargs="+",
                   default=[parse_variant(x) for x in ("1", "2", "auto", "auto+mig")],
                   help="variants besides plain: N, auto, history, both, plain+mig, each optionally +mig")
    p.add_argument("--max-draft-tokens", type=int, default=None, help="largest n auto considers")
    p.add_argument("--draft-distill", action="store_true", help="also distil the draft in the loop")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more train flags")
    args = p.parse_args(argv)
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    variants = [parse_variant("plain")] + [v for v in args.num_draft_tokens if v[0] != "plain"]
    names = [v[0] for v in variants]
    if len(set(names)) != len(names):
        p.error(f"variants repeat: {names}")
    if args.repeats < 1 or args.iters < 1:
        p.error("--repeats and --iters must be >= 1")
    if args.draft_load is None and any(uses_model(v) for v in variants):
        p.error("variants N, auto and both need --draft-load (history drafts need none)")
    print(json.dumps(machine(nproc=args.nproc, threads_per_rank=int(os.environ.get("OMP_NUM_THREADS", "1")),
                             actor=args.actor_load, draft=args.draft_load, iters=args.iters,
                             seed=args.seed, repeats=args.repeats, variants=names,
                             task=args.task, train_flags=TASK_FLAGS[args.task] + extra,
                             draft_distill=args.draft_distill)), flush=True)
    runs = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            k = r % len(variants)
            for v in variants[k:] + variants[:k]:
                log = Path(tmp) / f"r{r}-{v[0].replace(' ', '').replace('=', '')}"
                row = summarise(run_variant(args, v, extra, log), v, r, args)
                runs[v[0]].append(row)
                print(json.dumps(row), flush=True)
    compares = {}
    for name in names[1:]:
        compares[name] = compare(name, runs[name], runs["plain"])
        print(json.dumps(compares[name]), flush=True)
    print(table(runs, compares), file=sys.stderr)
    print(load_note(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
