"""RLHF iterations under per-stage layouts against one layout (JSON lines).

    python -m benchmarks.layouts [--nproc 4] [--iters 3] [--repeats 1] \\
        [--variants "2x1x2/2x2" "2x1x2/1x4"] [--model-dir out/bench/layout_model] [-- EXTRA TRAIN FLAGS]

Each variant is ``TRAIN/GEN`` (``--train-layout TPxPPxDP`` / ``--gen-layout TPxDP``); the first is
the reference, the others move the actor's weights to the generation layout after every update.
Every variant runs ``megatron_rlhf.train`` under torchrun with the PPO demo's flags on
``workloads.write_model``'s model. Prints a header, one ``run`` line per variant and round and one
``compare`` line per other variant (median of the per-round ratios); a table goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import columns, load_note, machine, run_train
from benchmarks.workloads import DEMO_FLAGS, LAYOUT_MODEL, LAYOUT_TOKENIZER, write_model

STAGES = ("time_rollout_s", "time_experience_s", "time_train_s", "time_reallocate_s")


def run_variant(args, variant: str, extra: list[str], log: Path) -> list[dict]:
    train, gen = variant.split("/")
    flags = ["--actor-load", args.model_dir, "--train-iters", args.iters, "--seed", args.seed,
             "--train-layout", train, "--gen-layout", gen, *DEMO_FLAGS, *extra]
    return run_train(args.nproc, flags, log, f"variant {variant}")


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
    p.add_argument("--model-dir", type=Path, default=LAYOUT_MODEL)
    p.add_argument("--tokenizer", type=Path, default=LAYOUT_TOKENIZER)
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more train flags")
    args = p.parse_args(argv)
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    if not (args.model_dir / "latest_checkpointed_iteration.txt").is_file():
        if not args.tokenizer.is_dir():
            p.error(f"no tokenizer at {args.tokenizer}: run `make demo` (or benchmarks.generation) "
                    "first, or pass --tokenizer DIR")
        write_model(args.model_dir, args.tokenizer)
    print(json.dumps(machine(nproc=args.nproc, threads_per_rank=int(os.environ.get("OMP_NUM_THREADS", "1")),
                             model=str(args.model_dir), iters=args.iters, repeats=args.repeats,
                             variants=args.variants, train_flags=DEMO_FLAGS + extra)), flush=True)
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
    rows = [(v, *(med([x[k] for x in rs]) for k in ("iteration_s", *STAGES, "realloc_mb", "realloc_share")))
            for v, rs in runs.items()]
    print(columns(head, rows, width=12), file=sys.stderr)
    print(load_note(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
