#!/usr/bin/env python
"""History drafts on the RL workload: the same prompts rolled out epoch after epoch (JSON lines).

    python -m benchmarks.history [--load CKPT] [--draft-load DRAFT] [--nproc 2] [--prompts 16] [--rollout-n 4] \\
        [--epochs 3] [--variants off,history,history-auto,model-auto,both-auto] [--dtype fp32] [--seed 0]

Relaunches itself under torchrun (one thread per rank): shipped arithmetic problems, each sampled
``--rollout-n`` times, split over the DP ranks with sample migration on, the same problems every
epoch with a new seed. Each variant (``VARIANTS``; see ``spec_of``, ``drafter_of``) keeps one
``Generator`` across the epochs, so its history holds the earlier epochs' answers. ``oracle-*`` and
``argmax-*`` bound what any draft could do. Verification is exact (but in ``model-3-rejection``):
``same_tokens`` checks each variant against ``off``. One line per variant and epoch; a table on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.harness import machine, markdown, rank_env, relaunch
from benchmarks.workloads import SMOLLM2_CKPT, smollm2_checkpoint

VARIANTS = ("off", "history", "history-auto", "history-auto-flat", "history-auto-8", "history-global-auto", "history-padded",
            "history-auto-padded", "model-auto", "both-auto", "model-3", "model-3-rejection", "oracle-auto", "oracle-8",
            "argmax-3", "argmax-auto")
PADDED = "-padded"  # every row verifies the round's width (Generator(ragged=False)): the control


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", type=Path, default=None,
                   help=f"a checkpoint, or a trained actor's iteration directory (RUN/iter_N/actor); "
                   f"default: the shipped SmolLM2 GGUF converted into {SMOLLM2_CKPT}")
    p.add_argument("--draft-load", type=Path, default=None, help="a draft model (model-auto, both-auto)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--rollout-n", type=int, default=4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--variants", default="off,history,history-auto")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad or "off" not in args.variants:
        p.error(f"--variants: choose among {', '.join(VARIANTS)}, off included (got {args.variants})")
    if any(v.startswith(("model", "both")) for v in args.variants) and args.draft_load is None:
        p.error("model-auto and both-auto need --draft-load")
    if args.load is not None and not ((args.load / "latest_checkpointed_iteration.txt").is_file()
                                      or (args.load / "megatron_rlhf.json").is_file()):
        p.error(f"--load {args.load} is not a checkpoint: leave it out (the shipped GGUF is converted), "
                "or pass a trained actor (out/demo/run/iter_0000016/actor after make demo)")
    if (args.prompts * args.rollout_n) % args.nproc:
        p.error("--prompts x --rollout-n must split evenly over --nproc ranks")
    return args


def spec_of(variant: str):
    from megatron_rlhf.config import SpecConfig

    variant = variant.removesuffix(PADDED)
    return {"off": SpecConfig(0), "history": SpecConfig(3, draft_source="history"),
            "history-auto": SpecConfig("auto", draft_source="history"),
            "history-auto-flat": SpecConfig("auto", draft_source="history"),
            "history-global-auto": SpecConfig("auto", draft_source="history", history_global=256),
            "history-auto-8": SpecConfig("auto", draft_source="history", max_draft_tokens=8),
            "oracle-auto": SpecConfig("auto", draft_source="history", max_draft_tokens=8),
            "oracle-8": SpecConfig(8, draft_source="history", max_draft_tokens=8),
            "argmax-3": SpecConfig(3, draft_source="history"),
            "argmax-auto": SpecConfig("auto", draft_source="history", max_draft_tokens=8),
            "model-auto": SpecConfig("auto", draft_source="model"),
            "model-3": SpecConfig(3, draft_source="model"),
            "model-3-rejection": SpecConfig(3, draft_source="model", verify="rejection"),
            "both-auto": SpecConfig("auto", draft_source="both")}[variant]


def oracle_drafter():
    """A :class:`HistoryDrafter` whose proposals are ``answers[sample]`` (set before each
    epoch) from the sample's position on: the best any draft could propose."""
    from megatron_rlhf.generation.history import HistoryDrafter

    class OracleDrafter(HistoryDrafter):
        def __init__(self):
            super().__init__()
            self.answers: dict[int, list[int]] = {}

        def propose(self, sample: int, n: int) -> list[int]:
            live = self.live[sample]
            done = len(live.doc) - len(live.history.prompt)
            return self.answers.get(sample, [])[done:done + n]

    return OracleDrafter()


def flat_drafter():
    """A :class:`HistoryDrafter` that predicts the same tokens left for every sample (the
    selector then weighs every sample alike: the control of length-aware widths)."""
    from megatron_rlhf.generation.history import HistoryDrafter

    class FlatDrafter(HistoryDrafter):
        def remaining(self, sample: int, limit: int) -> float:
            return 1.0

    return FlatDrafter()


def drafter_of(variant: str):
    """The history drafter of ``variant``'s generator (None: no history drafts)."""
    from megatron_rlhf.generation.engine import history_drafter

    if variant.startswith(ORACLES):
        return oracle_drafter()
    if variant.endswith("-flat"):
        return flat_drafter()
    return history_drafter(spec_of(variant))


ORACLES = ("oracle", "argmax")  # variants whose drafter reads off's answers (they run after it)


def greedy_answers(actor, prompts: list[list[int]], answers: list[list[int]], pad: int) -> list[list[int]]:
    """The policy's most likely token at each position of each answer, given the prompt and
    the answer's own prefix (a few samples per whole-sequence forward)."""
    import torch

    from megatron_rlhf import runtime

    from megatron_rlhf.data.padding import padded
    from megatron_rlhf.models.forward import lm_logits

    out = []
    for i in range(0, len(prompts), 4):
        pairs = list(zip(prompts[i:i + 4], answers[i:i + 4]))
        ids = padded([p + a for p, a in pairs], pad, torch.long, runtime.device())
        with torch.no_grad():
            logits = lm_logits(actor, ids)
        out += [logits[j, len(p) - 1:len(p) + len(a) - 1].argmax(-1).tolist() for j, (p, a) in enumerate(pairs)]
    return out


def worker(args) -> int:
    import torch
    import torch.distributed as dist

    from megatron_rlhf import runtime
    from megatron_rlhf.config import GenerationConfig, MigrationConfig
    from megatron_rlhf.data.prompts import MATH_TRAIN, load_prompts
    from megatron_rlhf.data.tokenizer import encode_prompt, load_tokenizer
    from megatron_rlhf.generation.engine import Generator
    from megatron_rlhf.generation.migration import Migrator
    from megatron_rlhf.models.builder import build_model
    from megatron_rlhf.models.checkpoint import load_checkpoint, read_checkpoint
    from megatron_rlhf.parallel.groups import build_process_groups
    from megatron_rlhf.parallel.layout import Layout

    runtime.quiet_third_party_warnings()
    rank, world = runtime.init_distributed(seed=args.seed)
    pg = build_process_groups(Layout.for_world(world, tp=1))
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    info = read_checkpoint(args.load)
    tok = load_tokenizer(info.tokenizer_dir)
    actor = build_model(info.config, "actor", pg, dtype=dtype)
    load_checkpoint(actor, pg, info.path)
    draft = None
    if args.draft_load is not None:
        d = read_checkpoint(args.draft_load)
        draft = build_model(d.config, "draft", pg, dtype=dtype)
        load_checkpoint(draft, pg, d.path)
    pad = tok.pad_token_id or 0
    records = load_prompts(str(MATH_TRAIN))[:args.prompts]
    prompts = [encode_prompt(tok, r.prompt, chat=True) for r in records for _ in range(args.rollout_n)]
    per = len(prompts) // world
    mine = list(range(rank * per, (rank + 1) * per))
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    engines = {v: Generator(actor, draft if v.startswith(("model", "both")) else None, pad_id=pad,
                            history=drafter_of(v),
                            ragged=not v.endswith(PADDED))
               for v in args.variants}
    migrator = Migrator(pg.dp, MigrationConfig(), runtime.device(), tp_group=pg.tp)
    header = machine(checkpoint=str(args.load), dtype=args.dtype, ranks=world, prompts=args.prompts,
                     rollout_n=args.rollout_n, epochs=args.epochs, max_new_tokens=args.max_new_tokens,
                     temperature=args.temperature, variants=args.variants, seed=args.seed)
    if rank == 0:
        print(json.dumps(header), flush=True)
    rows = []
    for epoch in range(args.epochs):
        others = [v for v in args.variants if not v.startswith(ORACLES)]
        order = others[epoch % len(others):] + others[:epoch % len(others)]
        order += [v for v in args.variants if v.startswith(ORACLES)]  # after off: they read its answers
        tokens_by_variant = {}
        for v in order:
            dist.barrier()
            start = time.perf_counter()
            r = engines[v].generate([prompts[i] for i in mine], cfg, spec_of(v), seed=args.seed * 1000 + epoch,
                                    sample_ids=mine, migrator=migrator)
            wall = time.perf_counter() - start
            s = r.stats
            local = [r.responses(), wall, s.new_tokens, s.verifications, s.accepted_tokens,
                     s.history_verifications, s.history_accepted, sum(s.rounds_by_draft_len[1:]),
                     s.actor_steps, s.history_s]
            everything = [None] * world
            dist.all_gather_object(everything, local)
            tokens_by_variant[v] = [x for part in everything for x in part[0]]
            if v == "off" and any(o.startswith(ORACLES) for o in args.variants):
                greedy = None
                if any(o.startswith("argmax") for o in args.variants):  # not timed
                    parts = [None] * world
                    mine_greedy = greedy_answers(actor, [prompts[i] for i in mine],
                                                 [tokens_by_variant[v][i] for i in mine], pad)
                    dist.all_gather_object(parts, mine_greedy)
                    greedy = [x for part in parts for x in part]
                for o in args.variants:
                    if o.startswith(ORACLES):
                        source = greedy if o.startswith("argmax") else tokens_by_variant[v]
                        engines[o].history.answers = dict(enumerate(source))
            if rank:
                continue
            sums = [sum(part[i] for part in everything) for i in range(2, 10)]
            new, ver, acc, h_ver, h_acc, drafting, steps, _ = sums
            row = {"kind": "run", "epoch": epoch + 1, "variant": v,
                   "makespan_s": max(part[1] for part in everything), "new_tokens": new,
                   "accepted_length": 1 + acc / ver if ver else 1.0,
                   "history_accepted_length": 1 + h_acc / h_ver if h_ver else None,
                   "draft_round_frac": drafting / max(steps, 1),
                   "history_s_max": max(part[9] for part in everything)}
            row["tokens_per_s"] = new / row["makespan_s"]
            rows.append(row)
        if rank == 0:
            off = next(r for r in rows if r["epoch"] == epoch + 1 and r["variant"] == "off")
            for row in rows:
                if row["epoch"] == epoch + 1:
                    row["speedup"] = off["makespan_s"] / row["makespan_s"]
                    row["same_tokens"] = tokens_by_variant[row["variant"]] == tokens_by_variant["off"]
                    print(json.dumps(row), flush=True)
    if rank == 0:
        head = ("epoch", "variant", "makespan s", "tokens/s", "speedup vs off", "accepted length (history)",
                "rounds drafting", "same tokens")
        cells = []
        for r in rows:
            h = r["history_accepted_length"]
            cells.append((r["epoch"], r["variant"], f"{r['makespan_s']:.1f}", f"{r['tokens_per_s']:.1f}",
                          f"{r['speedup']:.2f}x", f"{r['accepted_length']:.2f} ({'-' if h is None else f'{h:.2f}'})",
                          f"{r['draft_round_frac']:.2f}", r["same_tokens"]))
        print(markdown(head, cells), file=sys.stderr)
    runtime.shutdown()
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "RANK" in os.environ:
        args.load = args.load or SMOLLM2_CKPT
        return worker(args)
    if args.load is None:
        smollm2_checkpoint()
    return relaunch("benchmarks.history", args.nproc, argv, rank_env(1))


if __name__ == "__main__":
    sys.exit(main())
