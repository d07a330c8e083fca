#!/usr/bin/env python
"""A long-tail RLHF rollout at DP=2: makespan, balance and idle time of plain decoding,
fixed-n speculation, the ``auto`` drafting selector and auto + sample migration.

    python -m benchmarks.rollout [--load CKPT] [--draft-load DRAFT] [--nproc 2] [--variants off,2,auto,auto+mig] ...

Relaunches itself under torchrun (``--nproc`` ranks, ``--threads`` each); launched by torchrun it
runs as it is. Every round samples a new global batch of the shipped prompts, split over the DP
ranks as the trainer does, and runs every variant on it back to back, the order rotated per round.
Per variant and round one ``run`` line (makespan, busy work, balanced ideal, per-rank idle
fractions, tokens, answer lengths), then one ``variant`` line of medians and ratios to ``off``,
a ``goals`` line, and a table on stderr.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.harness import (
    Reporter, columns, draft_variant, load_note, machine, median_by, rank_env, relaunch)
from benchmarks.workloads import DTYPES, SMOLLM2_CKPT, load_lm, smollm2_checkpoint

DEFAULT_DRAFT = Path("out/bench/draft")
MAKE_DRAFT = ("OMP_NUM_THREADS=2 python tools/train_draft.py --target out/bench/smollm2 --save "
              "out/bench/draft --bf16 --feature-draft --num-layers 1 --limit 128 --samples-per-prompt 1 "
              "--epochs 10 --lr 3e-3 --max-new-tokens 40 --gen-batch-size 60 --valid-prompts 8 "
              "--eval-prompts 8")
GOALS = {"speedup": 1.3, "makespan_vs_ideal": 1.15, "idle_frac": 0.10}
"""auto+mig against off: makespan speedup >=; its makespan over its balanced ideal <=; the
largest per-rank idle fraction <=."""


def parse_variant(text: str) -> tuple[str, int | str, bool]:
    """``off`` / ``2`` / ``auto``, optionally ``+mig`` -> (name, num_draft_tokens, migrate)."""
    n, migrate = draft_variant(text)
    return ("off" if n == 0 else str(n)) + ("+mig" if migrate else ""), n, migrate


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", help=f"actor checkpoint (default {SMOLLM2_CKPT}, converted from the GGUF if absent)")
    p.add_argument("--draft-load", default=str(DEFAULT_DRAFT), help="draft checkpoint (default %(default)s)")
    p.add_argument("--nproc", type=int, default=2, help="data-parallel ranks (torchrun processes)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank when relaunching")
    p.add_argument("--variants", type=lambda s: [parse_variant(x) for x in s.split(",") if x.strip()],
                   default=[parse_variant(x) for x in ("off", "2", "auto", "auto+mig")])
    p.add_argument("--global-batch", type=int, default=24, help="samples per round over all ranks")
    p.add_argument("--rollout-n", type=int, default=2, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--split", choices=("train", "heldout"), default="train", help="shipped prompts")
    p.add_argument("--repeats", type=int, default=3, help="rounds (a new batch each)")
    p.add_argument("--max-draft-tokens", type=int, default=4, help="largest n auto considers")
    p.add_argument("--migration-interval", type=int, default=4)
    p.add_argument("--migration-threshold", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="also append the JSON lines to this file")
    args = p.parse_args(argv)
    names = [v[0] for v in args.variants]
    if not names or len(set(names)) != len(names):
        p.error(f"--variants must name distinct variants, got {names}")
    if args.nproc < 1 or args.threads < 1 or args.repeats < 1 or args.max_new_tokens < 1:
        p.error("--nproc, --threads, --repeats and --max-new-tokens must be >= 1")
    if args.rollout_n < 1 or args.global_batch % (args.rollout_n * args.nproc):
        p.error(f"--global-batch {args.global_batch} must be a multiple of --rollout-n {args.rollout_n} "
                f"x --nproc {args.nproc}")
    return args


def check_files(args) -> str | None:
    """A message saying what to do when a checkpoint is missing (before any collective)."""
    if args.load and not Path(args.load, "latest_checkpointed_iteration.txt").is_file():
        return f"--load {args.load} is not a checkpoint"
    if any(n != 0 for _, n, _ in args.variants) and \
            not Path(args.draft_load, "latest_checkpointed_iteration.txt").is_file():
        return (f"no draft checkpoint in {args.draft_load}: make one with\n  {MAKE_DRAFT}\n"
                "or pass --draft-load, or run only --variants off[,off+mig]")
    return None


class BusyClock:
    """Sums the wall time of the engine's compute (prefill, plain steps, speculative
    rounds) by wrapping those methods on one ``Generator`` instance."""

    METHODS = ("_prefill", "_plain_step", "_spec_round")

    def __init__(self, engine):
        self.seconds = 0.0
        for name in self.METHODS:
            setattr(engine, name, self._timed(getattr(engine, name)))

    def _timed(self, fn):
        def run(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t0
        return run


def timed_rollout(engine, clock: BusyClock, prompts, cfg, spec, seed: int, sample_ids, migrator) -> dict:
    """One rank's rollout from a barrier to the return of ``generate``: its measurements."""
    import torch.distributed as dist

    dist.barrier()
    clock.seconds = 0.0
    t0 = time.perf_counter()
    ro = engine.generate(prompts, cfg, spec, seed=seed, sample_ids=sample_ids, migrator=migrator)
    wall = time.perf_counter() - t0
    s = ro.stats
    return {"wall_s": wall, "busy_s": clock.seconds, "elapsed_s": s.elapsed_s, "prefill_s": s.prefill_s,
            "idle_s": s.idle_s, "sync_s": s.sync_s, "migration_s": s.migration_s,
            "migrated_out": s.migrated_out, "migrated_in": s.migrated_in, "migration_bytes": s.migration_bytes,
            "actor_steps": s.actor_steps, "rounds_by_draft_len": s.rounds_by_draft_len,
            "verifications": s.verifications, "accepted": s.accepted_tokens,
            "lengths": [int(x) for x in ro.lengths.tolist()], "finish": ro.finish_reasons}


def round_batch(prompts: list[list[int]], args, r: int) -> list[list[int]]:
    """Round ``r``'s global batch: ``global_batch / rollout_n`` prompts, each ``rollout_n`` times."""
    g = torch.Generator().manual_seed(args.seed * 1000 + r)
    k = args.global_batch // args.rollout_n
    if k > len(prompts):
        raise ValueError(f"--global-batch / --rollout-n = {k} prompts, only {len(prompts)} in the split")
    chosen = torch.randperm(len(prompts), generator=g)[:k].tolist()
    return [prompts[i] for i in chosen for _ in range(args.rollout_n)]


def percentiles(xs: list[int]) -> dict:
    s = sorted(xs)
    at = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return {"min": s[0], "p25": at(0.25), "p50": at(0.5), "p75": at(0.75), "p90": at(0.9), "max": s[-1],
            "mean": statistics.fmean(s)}


def run_record(variant: str, r: int, ranks: list[dict], max_new: int) -> dict:
    """One variant in one round, from every rank's measurements."""
    dp = len(ranks)
    makespan = max(x["wall_s"] for x in ranks)
    work = sum(x["busy_s"] for x in ranks)
    lengths = [n for x in ranks for n in x["lengths"]]
    reasons = [f for x in ranks for f in x["finish"]]
    new = sum(lengths)
    rounds = [sum(h) for h in zip(*[x["rounds_by_draft_len"] for x in ranks])]
    ver, acc = sum(x["verifications"] for x in ranks), sum(x["accepted"] for x in ranks)
    return {
        "kind": "run", "variant": variant, "round": r, "makespan_s": makespan, "work_s": work,
        "ideal_s": work / dp, "makespan_vs_ideal": makespan / (work / dp) if work else None,
        "idle_frac": [1 - x["busy_s"] / makespan for x in ranks],
        "new_tokens": new, "tokens_per_s": new / makespan,
        "answer_lengths": percentiles(lengths),
        "eos_fraction": reasons.count("eos") / len(reasons),
        "cut_fraction": sum(n >= max_new for n in lengths) / len(lengths),
        "rank_owned_tokens": [sum(x["lengths"]) for x in ranks],
        "migrated": sum(x["migrated_out"] for x in ranks),
        "migration_mb": sum(x["migration_bytes"] for x in ranks) / 2 / 2**20,  # counted by both ends
        "rounds_by_draft_len": rounds,
        "mean_accepted_length": 1 + acc / ver if ver else 1.0,
        "ranks": [{k: v for k, v in x.items() if k not in ("lengths", "finish")} for x in ranks],
    }


def variant_record(name: str, runs: list[dict], ref: list[dict] | None, ref_name: str) -> dict:
    med = statistics.median
    st = median_by(runs, lambda x: x["makespan_s"])
    rec = {"kind": "variant", "variant": name, "rounds": len(runs),
           "makespan_s": med([x["makespan_s"] for x in runs]), "ideal_s": med([x["ideal_s"] for x in runs]),
           "makespan_vs_ideal": med([x["makespan_vs_ideal"] for x in runs]),
           "idle_frac_max": med([max(x["idle_frac"]) for x in runs]),
           "new_tokens": med([x["new_tokens"] for x in runs]),
           "tokens_per_s": med([x["tokens_per_s"] for x in runs]),
           "migrated": med([x["migrated"] for x in runs]), "migration_mb": med([x["migration_mb"] for x in runs]),
           "mean_accepted_length": med([x["mean_accepted_length"] for x in runs]),
           "rounds_by_draft_len": st["rounds_by_draft_len"], "answer_lengths": st["answer_lengths"],
           "rounds_makespan_s": [x["makespan_s"] for x in runs],
           "rounds_new_tokens": [x["new_tokens"] for x in runs]}
    if ref is not None:
        rec["vs"] = ref_name
        rec["speedup"] = med([b["makespan_s"] / x["makespan_s"] for x, b in zip(runs, ref)])
        rec["tokens_per_s_ratio"] = med([x["tokens_per_s"] / b["tokens_per_s"] for x, b in zip(runs, ref)])
    return rec


def summary(rows: list[dict]) -> str:
    head = ("variant", "makespan s", "ideal s", "span/ideal", "idle max", "new tok", "tok/s",
            "speedup", "tok/s x", "migrated", "MB", "acc len", "len p50", "len p90", "len max", "rounds/n")
    cells = []
    for v in (r for r in rows if r["kind"] == "variant"):
        a = v["answer_lengths"]
        cells.append((v["variant"], v["makespan_s"], v["ideal_s"], v["makespan_vs_ideal"], v["idle_frac_max"],
                 v["new_tokens"], v["tokens_per_s"], v.get("speedup"), v.get("tokens_per_s_ratio"),
                 v["migrated"], v["migration_mb"], v["mean_accepted_length"], a["p50"], a["p90"], a["max"],
                 "/".join(map(str, v["rounds_by_draft_len"])) or "-"))
    lines = [columns(head, cells)]
    for g in (r for r in rows if r["kind"] == "goals"):
        lines.append(g["text"])
    return "\n".join(lines)


def goals_record(variants: dict) -> dict | None:
    v = variants.get("auto+mig")
    if v is None or "speedup" not in v:
        return None
    checks = {"speedup": v["speedup"] >= GOALS["speedup"],
              "makespan_vs_ideal": v["makespan_vs_ideal"] <= GOALS["makespan_vs_ideal"],
              "idle_frac": v["idle_frac_max"] <= GOALS["idle_frac"]}
    text = (f"goals for auto+mig vs {v['vs']}: speedup {v['speedup']:.2f}x >= {GOALS['speedup']} "
            f"{'met' if checks['speedup'] else 'NOT met'}; makespan/ideal {v['makespan_vs_ideal']:.2f} <= "
            f"{GOALS['makespan_vs_ideal']} {'met' if checks['makespan_vs_ideal'] else 'NOT met'}; "
            f"max per-rank idle {v['idle_frac_max']:.2f} <= {GOALS['idle_frac']} "
            f"{'met' if checks['idle_frac'] else 'NOT met'}")
    return {"kind": "goals", "goals": GOALS, "met": checks, "text": text}


def worker(args) -> int:
    import torch.distributed as dist

    from megatron_rlhf import runtime
    from megatron_rlhf.config import GenerationConfig, MigrationConfig, SpecConfig
    from megatron_rlhf.data.prompts import load_prompts
    from megatron_rlhf.data.tokenizer import encode_prompt, load_tokenizer
    from megatron_rlhf.generation.engine import Generator
    from megatron_rlhf.generation.migration import Migrator
    from megatron_rlhf.models.checkpoint import read_checkpoint
    from megatron_rlhf.parallel.groups import build_process_groups
    from megatron_rlhf.parallel.layout import Layout

    runtime.quiet_third_party_warnings()
    rank, world = runtime.init_distributed(seed=args.seed)
    if world != args.nproc:
        print(f"note: launched with {world} ranks, --nproc {args.nproc} ignored", file=sys.stderr)
    if args.global_batch % (args.rollout_n * world):
        print(f"error: --global-batch must be a multiple of --rollout-n x {world} ranks", file=sys.stderr)
        return 2
    pg = build_process_groups(Layout(dp=world))
    dp_rank = pg.dp.rank()
    info = read_checkpoint(args.load or SMOLLM2_CKPT)
    tokenizer = load_tokenizer(info.tokenizer_dir)
    prompts = [encode_prompt(tokenizer, p.prompt, chat=True) for p in load_prompts(split=args.split)]
    actor, _ = load_lm(info.path, pg, args.dtype, args.seed)
    needs_draft = any(n != 0 for _, n, _ in args.variants)
    draft = load_lm(args.draft_load, pg, args.dtype, args.seed)[0] if needs_draft else None
    dev = actor.embedding.word_embeddings.weight.device
    pad_id = tokenizer.pad_token_id or 0
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, stop_on_eos=True)
    mig_cfg = MigrationConfig(sample_migration=True, migration_interval=args.migration_interval,
                              migration_threshold=args.migration_threshold)
    engines = {"off": Generator(actor, pad_id=pad_id)}
    if draft is not None:
        engines["fixed"] = Generator(actor, draft, pad_id=pad_id)
        engines["auto"] = Generator(actor, draft, pad_id=pad_id)  # auto and auto+mig share its selector
    clocks = {k: BusyClock(e) for k, e in engines.items()}

    def setup(n):
        kind = "off" if n == 0 else ("auto" if n == "auto" else "fixed")
        spec = SpecConfig(n, max_draft_tokens=args.max_draft_tokens) if n == "auto" else SpecConfig(n)
        return engines[kind], clocks[kind], spec

    per = args.global_batch // world
    mine = list(range(dp_rank * per, (dp_rank + 1) * per))
    report = Reporter(args.out if rank == 0 else None)
    emit = report.emit if rank == 0 else (lambda rec: rec)
    emit(machine(threads_per_rank=torch.get_num_threads(), dp=world, model=str(info.path),
                 draft=args.draft_load if needs_draft else None, dtype=args.dtype,
                 prompts=f"{len(prompts)} shipped {args.split} prompts, chat template",
                 samples_per_rank=per, settings={k: (v if k != "variants" else [x[0] for x in v])
                                                 for k, v in vars(args).items() if k != "out"}))

    # warm-up: every variant once on round 0's batch, 4 new tokens (auto starts learning its costs here)
    batch0 = round_batch(prompts, args, 0)
    short = GenerationConfig(max_new_tokens=min(4, args.max_new_tokens), temperature=args.temperature)
    t0 = time.perf_counter()
    for _, n, migrate in args.variants:
        engine, _, spec = setup(n)
        engine.generate([batch0[i] for i in mine], short, spec, seed=args.seed, sample_ids=mine,
                        migrator=Migrator(pg.dp, mig_cfg, dev) if migrate else None)
    if rank == 0:
        print(f"warm-up {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)

    names = [v[0] for v in args.variants]
    runs = {name: [] for name in names}
    for r in range(args.repeats):
        batch = round_batch(prompts, args, r)
        k = r % len(args.variants)
        for name, n, migrate in args.variants[k:] + args.variants[:k]:
            engine, clock, spec = setup(n)
            mig = Migrator(pg.dp, mig_cfg, dev) if migrate else None
            mine_rec = timed_rollout(engine, clock, [batch[i] for i in mine], cfg, spec, args.seed + r,
                                     mine, mig)
            every = [None] * world
            dist.all_gather_object(every, mine_rec)
            rec = emit(run_record(name, r, every, args.max_new_tokens))
            runs[name].append(rec)
            if rank == 0:
                print(f"round {r} {name}: makespan {rec['makespan_s']:.1f}s, {rec['new_tokens']} tokens, "
                      f"idle {max(rec['idle_frac']):.2f}", file=sys.stderr, flush=True)
    if rank == 0:
        ref_name = "off" if "off" in runs else names[0]
        done = {n: emit(variant_record(n, runs[n], runs[ref_name] if n != ref_name else None, ref_name))
                for n in names}
        g = goals_record(done)
        if g is not None:
            emit(g)
        print(summary(report.rows), file=sys.stderr)
        print(load_note(report.rows[0]["loadavg"]), file=sys.stderr)
    runtime.shutdown()
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    problem = check_files(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if "RANK" not in os.environ:
        if not args.load:
            smollm2_checkpoint()
        return relaunch("benchmarks.rollout", args.nproc, argv, rank_env(args.threads, TQDM_DISABLE="1"))
    return worker(args)


if __name__ == "__main__":
    sys.exit(main())
