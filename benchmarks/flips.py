"""How often a token flips between computations that should agree (JSON lines).

    python -m benchmarks.flips [--load CKPT] [--prompts 12] [--max-new-tokens 128] [--seeds 3] [--dtypes fp32,bf16]

Exact verification emits plain sampling's token *given equal logits*; other GEMM shapes (a
verification forward, another batch size) may round the logits differently, and a draw near a
CDF boundary then flips. On SmolLM2-135M-Instruct answering the shipped arithmetic problems:
``verify`` (plain against history-drafted decoding) and ``batch`` (one batch against two halves).
A dtype suffixed ``-before`` runs the older CPU decode numerics side by side. A flip ends the
comparison of its sample. One line per (dtype, comparison), then a table on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.harness import machine, markdown
from benchmarks.workloads import smollm2_checkpoint


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", type=Path, default=None, help="converted checkpoint (default: the GGUF, converted)")
    p.add_argument("--prompts", type=int, default=12, help="prompts per batch (even)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seeds", type=int, default=3, help="seeds (each a fresh set of samples)")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--draft-tokens", type=int, default=4, help="history drafts per verification")
    args = p.parse_args(argv)
    if args.prompts < 2 or args.prompts % 2:
        p.error("--prompts must be an even number >= 2 (the batch comparison halves it)")
    return args


def compare(a, b) -> tuple[int, int]:
    """``(flips, tokens compared)`` of two rollouts of the same samples: per sample, the
    tokens up to and including the first difference."""
    flips = tokens = 0
    for x, y in zip(a, b):
        n = min(len(x), len(y))
        first = next((i for i in range(n) if x[i] != y[i]), None)
        if first is None:
            tokens += n
            flips += len(x) != len(y)  # one stopped where the other did not
        else:
            tokens += first + 1
            flips += 1
    return flips, tokens


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from megatron_rlhf import runtime
    from megatron_rlhf.config import GenerationConfig, SpecConfig
    from megatron_rlhf.data.prompts import MATH_TRAIN, load_prompts
    from megatron_rlhf.generation.engine import Generator
    from megatron_rlhf.generation.history import HistoryDrafter
    from megatron_rlhf.models.builder import build_model
    from megatron_rlhf.models.checkpoint import load_checkpoint, read_checkpoint
    from megatron_rlhf.data.tokenizer import encode_prompt, load_tokenizer
    from megatron_rlhf.parallel.groups import build_process_groups
    from megatron_rlhf.parallel.layout import Layout

    runtime.quiet_third_party_warnings()
    runtime.init_distributed()
    torch.set_num_threads(1)
    pg = build_process_groups(Layout())
    ckpt = args.load or smollm2_checkpoint()
    info = read_checkpoint(ckpt)
    tok = load_tokenizer(info.tokenizer_dir)
    records = load_prompts(str(MATH_TRAIN))
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    header = machine(checkpoint=str(ckpt), prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                     temperature=args.temperature, seeds=args.seeds, draft_tokens=args.draft_tokens)
    print(json.dumps(header), flush=True)
    rows = []
    from megatron_rlhf.generation import cpu_numerics, kv_cache

    current = cpu_numerics.ATTEND_ALIGN, kv_cache.CPU_HALF_CACHE_MIN_BATCH
    for dtype_name in args.dtypes.split(","):
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name.removesuffix("-before")]
        before = dtype_name.endswith("-before")
        cpu_numerics.ATTEND_ALIGN, kv_cache.CPU_HALF_CACHE_MIN_BATCH = (1, 32) if before else current
        actor = build_model(info.config, "actor", pg, dtype=dtype)
        load_checkpoint(actor, pg, info.path)
        totals = {"verify": [0, 0, 0], "batch": [0, 0, 0]}  # flips, tokens, accepted drafts
        start = time.perf_counter()
        for seed in range(args.seeds):
            chunk = records[seed * args.prompts:(seed + 1) * args.prompts]
            prompts = [encode_prompt(tok, r.prompt, chat=True) for r in chunk]
            ids = list(range(len(prompts)))
            plain = Generator(actor, pad_id=tok.pad_token_id or 0).generate(prompts, cfg, SpecConfig(0), seed=seed)
            drafted = Generator(actor, pad_id=tok.pad_token_id or 0, history=HistoryDrafter())
            spec = SpecConfig(args.draft_tokens, draft_source="history")
            drafted.generate(prompts, cfg, spec, seed=seed + 1000)  # epoch 1: fills the history
            verified = drafted.generate(prompts, cfg, spec, seed=seed)
            f, t = compare(plain.responses(), verified.responses())
            totals["verify"][0] += f
            totals["verify"][1] += t
            totals["verify"][2] += verified.stats.history_accepted
            half = len(prompts) // 2
            halves = [Generator(actor, pad_id=tok.pad_token_id or 0).generate(
                prompts[i:i + half], cfg, SpecConfig(0), seed=seed, sample_ids=ids[i:i + half])
                for i in (0, half)]
            f, t = compare(plain.responses(), halves[0].responses() + halves[1].responses())
            totals["batch"][0] += f
            totals["batch"][1] += t
        for what, (flips, tokens, accepted) in totals.items():
            row = {"kind": "flips", "dtype": dtype_name, "comparison": what,
                   "against": "plain steps" if what == "verify" else f"batch {half} (x2)",
                   "of": f"verification ({args.draft_tokens} history drafts, exact)" if what == "verify"
                   else f"batch {args.prompts}", "flips": flips, "tokens": tokens,
                   "flips_per_million": 1e6 * flips / max(tokens, 1),
                   **({"accepted_drafts": accepted} if what == "verify" else {}),
                   "seconds": time.perf_counter() - start}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(markdown(("dtype", "comparison", "tokens compared", "flips", "per million"),
                   [(r["dtype"], f"{r['of']} vs {r['against']}", r["tokens"], r["flips"],
                     f"{r['flips_per_million']:.0f}") for r in rows]), file=sys.stderr)
    runtime.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
