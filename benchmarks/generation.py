#!/usr/bin/env python
"""Generation throughput of SmolLM2-135M-Instruct on CPU: our engine against its floor and HF.

    python -m benchmarks.generation [--load CKPT] [--draft-load CKPT] [--batch-sizes 1,4,16,64] ...

Per dtype and batch size, one JSON line per measurement (after a header line): ``floor`` (one bare
forward, no cache: no decoder steps faster), ``plain`` (our ``Generator``), ``hf`` (transformers
``generate`` on the same GGUF and prompt ids), ``spec`` per fixed draft length and ``auto`` (the
selector) with --draft-load. The variants of a round run back to back, the order rotated per round,
and each ratio is the median of the per-round ratios, so the machine's drift cancels out.
One process; a summary table and the goals go to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics
import sys
import time

import torch

from benchmarks.harness import Reporter, columns, load_note, machine, median_by
from benchmarks.workloads import DTYPES, SMOLLM2_CKPT, load_lm, smollm2_checkpoint, torch_dtype
from megatron_rlhf.config import GenerationConfig, SpecConfig



def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def draft_list(text: str) -> list:
    """``1,2,4,auto`` -> ``[1, 2, 4, "auto"]``."""
    out = []
    for x in (x.strip() for x in text.split(",")):
        if x == "auto":
            out.append(x)
        elif x:
            try:
                out.append(int(x))
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected integers >= 1 or auto, got {x!r}") from None
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", help=f"actor checkpoint (default: the GGUF converted into {SMOLLM2_CKPT})")
    p.add_argument("--draft-load", help="draft checkpoint: adds the speculative runs")
    p.add_argument("--batch-sizes", type=int_list, default=[1, 4, 16, 64])
    p.add_argument("--dtypes", type=lambda s: s.split(","), default=["fp32", "bf16"])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-draft-tokens", type=draft_list, default=[1, 2, 4, "auto"],
                   help="fixed draft lengths and/or auto, comma-separated (with --draft-load)")
    p.add_argument("--max-draft-tokens", type=int, default=4, help="largest n auto considers")
    p.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of every variant (ratios: median of the per-round ratios)")
    p.add_argument("--skip-hf", action="store_true", help="no transformers baseline")
    p.add_argument("--skip-floor", action="store_true", help="no bare-forward floor")
    p.add_argument("--out", help="also append the JSON lines to this file")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    bad = [d for d in args.dtypes if d not in DTYPES]
    if bad:
        p.error(f"unknown dtype(s) {bad}: choose from {sorted(DTYPES)}")
    if min(args.batch_sizes, default=0) < 1 or args.max_new_tokens < 1 or args.repeats < 1:
        p.error("batch sizes, --max-new-tokens and --repeats must be >= 1")
    if min([n for n in args.num_draft_tokens if n != "auto"], default=1) < 1 or args.max_draft_tokens < 1:
        p.error("--num-draft-tokens values (other than auto) and --max-draft-tokens must be >= 1")
    return args


def floor_ms(model, batch: int, position: int) -> float:
    """Median ms of 5 bare forwards (one new token per sample, no cache) after 2 warm-ups."""
    ids = torch.full((batch, 1), 1, dtype=torch.long)
    pos = torch.full((batch, 1), position, dtype=torch.long)
    mask = torch.zeros(batch, 1, 1, 1, dtype=torch.bool)  # nothing blocked
    with torch.inference_mode():
        for _ in range(2):
            model(ids, pos, mask)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            model(ids, pos, mask)
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def warm_up(engine, prompts, cfg, spec, seed: int) -> None:
    """One call of the engine writing at most 4 tokens per sample."""
    engine.generate(prompts, dataclasses.replace(cfg, max_new_tokens=min(4, cfg.max_new_tokens)), spec, seed)


def decode_ms(stats) -> float:
    return (stats.elapsed_s - stats.prefill_s) / max(stats.actor_steps, 1) * 1e3


def load_hf(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    from megatron_rlhf.models.smollm2 import smollm2_gguf

    path = smollm2_gguf()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()


def hf_runner(model, tokenizer, prompts, max_new: int, temperature: float, seed: int):
    """A function ``run(n)`` -> HF record of one ``generate`` call writing ``n`` new tokens."""
    batch = tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} \
        if temperature > 0 else {"do_sample": False}

    def run(n=max_new):
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**batch, max_new_tokens=n, min_new_tokens=n,
                                 pad_token_id=tokenizer.pad_token_id, **sampling)
        elapsed = time.perf_counter() - t0
        new = (out.shape[1] - batch["input_ids"].shape[1]) * len(prompts)
        return {"tokens_per_s": new / elapsed, "elapsed_s": elapsed, "new_tokens": new}

    return run


def interleaved(variants: dict, actor, prompts, cfg, seed: int, repeats: int, floor_at: int | None,
                hf_run):
    """``variants``: name -> (engine, spec). ``repeats`` rounds of the floor, then every variant
    and HF back to back, the order rotated by one per round; per round ``{"floor_ms", "hf",
    name: GenerationStats}`` (None where skipped). Every variant and HF warm up first."""
    for engine, spec in variants.values():
        warm_up(engine, prompts, cfg, spec, seed)
    names = list(variants)
    if hf_run is not None:
        hf_run(min(4, cfg.max_new_tokens))
        names.insert(1, "hf")  # plain, HF, n..., auto
    rounds = []
    for r in range(repeats):
        row = {"floor_ms": None if floor_at is None else floor_ms(actor, len(prompts), floor_at), "hf": None}
        k = r % len(names)
        for name in names[k:] + names[:k]:
            if name == "hf":
                row["hf"] = hf_run()
            else:
                engine, spec = variants[name]
                row[name] = engine.generate(prompts, cfg, spec, seed).stats
        rounds.append(row)
    return rounds


def spec_record(kind: str, base: dict, runs: list, plain_runs: list) -> dict:
    """A speculative variant (fixed n or auto) over the rounds: median tokens/s, the median of
    the per-round ratios to plain, and the median run's acceptance statistics."""
    med = statistics.median
    st = median_by(runs, lambda x: x.elapsed_s)
    return {"kind": kind, **base, "num_draft_tokens": "auto" if kind == "auto" else st.num_draft_tokens,
            "tokens_per_s": med([x.tokens_per_s for x in runs]),
            "speedup_vs_plain": med([x.tokens_per_s / p.tokens_per_s for x, p in zip(runs, plain_runs)]),
            "mean_accepted_length": st.mean_accepted_length,
            "accepted_per_position": st.accepted_per_position,
            "acceptance_per_position": st.acceptance_per_position,
            "actor_steps": st.actor_steps, "draft_steps": st.draft_steps,
            "ms_per_round": med([decode_ms(x) for x in runs]), "prefill_s": st.prefill_s,
            "elapsed_s": st.elapsed_s, "new_tokens": st.new_tokens,
            "rounds_tokens_per_s": [x.tokens_per_s for x in runs]}


AUTO_GOAL = 0.95
"""auto's tokens/s over the best of plain and every fixed n, at every batch and dtype."""


def summary(rows: list[dict]) -> str:
    by = {}
    for r in rows:
        if "batch" in r:
            by.setdefault((r["dtype"], r["batch"]), {}).setdefault(r["kind"], []).append(r)
    head = ("dtype", "B", "floor ms", "floor t/s", "plain t/s", "step ms", "step/floor",
            "hf t/s", "ours/hf", "best n", "spec x", "auto x", "auto/best", "auto rounds")
    rows_out, autos = [], []
    for (dtype, b), kinds in by.items():
        floor = kinds.get("floor", [{}])[0]
        plain = kinds.get("plain", [{}])[0]
        hf = kinds.get("hf", [{}])[0]
        spec = max(kinds.get("spec", [{}]), key=lambda r: r.get("speedup_vs_plain", 0))
        auto = kinds.get("auto", [{}])[0]
        if auto:
            autos.append(auto)
        hist = auto.get("rounds_by_draft_len")
        cells = (dtype, b, floor.get("ms_per_step"), floor.get("tokens_per_s"), plain.get("tokens_per_s"),
                 plain.get("ms_per_step"), plain.get("step_vs_floor"), hf.get("tokens_per_s"),
                 plain.get("ours_vs_hf"), spec.get("num_draft_tokens"), spec.get("speedup_vs_plain"),
                 auto.get("speedup_vs_plain"), auto.get("auto_vs_best"),
                 None if hist is None else "/".join(map(str, hist)))
        rows_out.append(cells)
    lines = [columns(head, rows_out)]
    if autos:
        worst = min(autos, key=lambda r: r["auto_vs_best"])
        ok = worst["auto_vs_best"] >= AUTO_GOAL
        lines.append(f"goal auto >= {AUTO_GOAL}x the best of plain and every fixed n at every batch and "
                     f"dtype: {'met' if ok else 'NOT met'} (worst {worst['auto_vs_best']:.2f}x at "
                     f"{worst['dtype']} batch {worst['batch']}, best there: {worst['best']}); "
                     "auto rounds = plain/n=1/n=2/... rounds of auto's median run")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_rlhf import runtime

    runtime.quiet_third_party_warnings()
    os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF loader's per-tensor progress bar
    from megatron_rlhf.data.prompts import load_prompts
    from megatron_rlhf.data.tokenizer import encode_prompt, load_tokenizer
    from megatron_rlhf.generation.engine import Generator
    from megatron_rlhf.models.checkpoint import read_checkpoint
    from megatron_rlhf.parallel.groups import build_process_groups
    from megatron_rlhf.parallel.layout import Layout

    _, world = runtime.init_distributed(seed=args.seed)
    if world != 1:
        print(f"error: the benchmark runs on one process (world size {world}); use python", file=sys.stderr)
        return 2
    info = read_checkpoint(args.load or smollm2_checkpoint())
    tokenizer = load_tokenizer(info.tokenizer_dir)
    tokenizer.padding_side = "left"
    tokenizer.pad_token = tokenizer.eos_token
    texts = [p.prompt for p in load_prompts(split="heldout")]
    encoded = [encode_prompt(tokenizer, t, chat=True) for t in texts]
    pg = build_process_groups(Layout())
    report = Reporter(args.out)
    report.emit(machine(
        threads=torch.get_num_threads(), model=str(info.path), model_config=info.config.to_dict(),
        draft=args.draft_load, heldout_prompts=len(encoded),
        settings={k: v for k, v in vars(args).items() if k not in ("out",)}))
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           stop_on_eos=False)
    pad_id = tokenizer.pad_token_id or 0
    prompts_for = lambda b: list(itertools.islice(itertools.cycle(encoded), b))  # noqa: E731
    fixed = [n for n in args.num_draft_tokens if n != "auto"]
    auto_spec = SpecConfig("auto", max_draft_tokens=args.max_draft_tokens)

    for name in args.dtypes:
        actor, _ = load_lm(info.path, pg, name, args.seed)
        draft = load_lm(args.draft_load, pg, name, args.seed)[0] if args.draft_load else None
        hf = None if args.skip_hf else load_hf(torch_dtype(name))
        auto_engine = None
        if draft is not None and "auto" in args.num_draft_tokens:
            # one selector for every batch: it learns its costs from its first call (here,
            # on the largest batch so that its cost table spans them all) and keeps learning
            auto_engine = Generator(actor, draft, pad_id=pad_id)
            t0 = time.perf_counter()
            warm_up(auto_engine, prompts_for(max(args.batch_sizes)), cfg, auto_spec, args.seed)
            costs = auto_engine.selector.costs
            report.emit({"kind": "profile", "dtype": name, "max_draft_tokens": args.max_draft_tokens,
                         "first_call_s": time.perf_counter() - t0, "cost_table": costs.to_dict()})
        for b in args.batch_sizes:
            prompts = prompts_for(b)
            mean_len = sum(map(len, prompts)) / b
            base = {"dtype": name, "batch": b, "max_new_tokens": args.max_new_tokens,
                    "prompt_tokens_mean": round(mean_len, 1), "temperature": args.temperature}
            hf_run = None if hf is None else hf_runner(hf, tokenizer, prompts, args.max_new_tokens,
                                                       args.temperature, args.seed)
            variants = {0: (Generator(actor, pad_id=pad_id), SpecConfig(0))}
            if draft is not None:
                spec_engine = Generator(actor, draft, pad_id=pad_id)
                variants.update({n: (spec_engine, SpecConfig(n)) for n in fixed})
                if auto_engine is not None:
                    variants["auto"] = (auto_engine, auto_spec)
            rounds = interleaved(variants, actor, prompts, cfg, args.seed, args.repeats,
                                 None if args.skip_floor else round(mean_len), hf_run)
            med = statistics.median
            runs = [r[0] for r in rounds]
            st = median_by(runs, lambda x: x.elapsed_s)
            steps = [decode_ms(x) for x in runs]
            if not args.skip_floor:
                floors = [r["floor_ms"] for r in rounds]
                report.emit({"kind": "floor", **base, "ms_per_step": med(floors),
                             "tokens_per_s": b / med(floors) * 1e3, "rounds_ms": floors})
            plain = {"kind": "plain", **base, "tokens_per_s": med([x.tokens_per_s for x in runs]),
                     "ms_per_step": med(steps),
                     "prefill_s": st.prefill_s, "elapsed_s": st.elapsed_s, "actor_steps": st.actor_steps,
                     "new_tokens": st.new_tokens, "rounds_tokens_per_s": [x.tokens_per_s for x in runs],
                     "rounds_ms_per_step": steps}
            if not args.skip_floor:
                plain["step_vs_floor"] = med([s_ / r["floor_ms"] for s_, r in zip(steps, rounds)])
            if hf is not None:
                hfs = [r["hf"] for r in rounds]
                plain["ours_vs_hf"] = med([x.tokens_per_s / h["tokens_per_s"] for x, h in zip(runs, hfs)])
                h = median_by(hfs, lambda x: x["elapsed_s"])
                report.emit({"kind": "hf", **base, **h, "tokens_per_s": med([x["tokens_per_s"] for x in hfs]),
                             "rounds_tokens_per_s": [x["tokens_per_s"] for x in hfs],
                             "ours_vs_hf": plain["ours_vs_hf"]})
            report.emit(plain)
            for n in fixed if draft is not None else []:
                report.emit(spec_record("spec", base, [r[n] for r in rounds], runs))
            if "auto" in variants:
                auto_runs = [r["auto"] for r in rounds]
                rec = spec_record("auto", base, auto_runs, runs)
                # per round: auto against the best of plain and every fixed n in that round
                others = [0, *fixed]
                rec["auto_vs_best"] = med([r["auto"].tokens_per_s / max(r[k].tokens_per_s for k in others)
                                           for r in rounds])
                best = max(others, key=lambda k: med([r[k].tokens_per_s for r in rounds]))
                rec["best"] = "plain" if best == 0 else f"n={best}"
                rec["goal_auto_vs_best"] = AUTO_GOAL
                rec["rounds_by_draft_len"] = median_by(auto_runs, lambda x: x.elapsed_s).rounds_by_draft_len
                rec["rounds_by_draft_len_per_round"] = [x.rounds_by_draft_len for x in auto_runs]
                report.emit(rec)
        del actor, draft, hf, auto_engine
    print(summary(report.rows), file=sys.stderr)
    print(load_note(report.rows[0]["loadavg"]), file=sys.stderr)
    runtime.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
