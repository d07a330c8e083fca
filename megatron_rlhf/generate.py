"""Generate from a checkpoint: ``python -m megatron_rlhf.generate`` (under torchrun for TP).

    torchrun --nproc_per_node 3 -m megatron_rlhf.generate --load CKPT \\
        --tensor-model-parallel-size 3 --prompt "What is RLHF?" --chat --max-new-tokens 64

Everything that can be wrong with the flags, the checkpoint or the prompt is reported
before any collective starts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from megatron_rlhf import arguments
from megatron_rlhf.config import GenerateConfig, dataclass_from_namespace


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_rlhf.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    arguments.add_parallel_args(p)
    arguments.add_runtime_args(p)
    g = p.add_argument_group("generation")
    g.add_argument("--prompt", required=True, help="prompt text")
    g.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (only mode yet)")
    g.add_argument("--json", action="store_true",
                   help="print one JSON line: prompt_ids, output_ids, text")
    args = p.parse_args(argv)
    if args.load is None:
        p.error("--load CHECKPOINT is required")
    return args


def validate(args: argparse.Namespace):
    """Check flags, checkpoint files, layout and prompt; no collectives. Returns the plan."""
    from megatron_rlhf.data.tokenizer import encode_prompt, load_tokenizer
    from megatron_rlhf.models.checkpoint import read_checkpoint

    gen = dataclass_from_namespace(GenerateConfig, args)
    par = arguments.parallel_config_from_args(args)
    info = read_checkpoint(args.load)
    cfg = info.config
    tp = par.tensor_model_parallel_size
    cfg.check_tensor_parallel(tp)
    par.check_world(arguments.launch_world_size())
    tokenizer = load_tokenizer(info.tokenizer_dir)
    prompt_ids = encode_prompt(tokenizer, args.prompt, chat=gen.chat)
    if len(prompt_ids) + gen.max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt of {len(prompt_ids)} tokens + --max-new-tokens {gen.max_new_tokens} "
            f"exceeds the model's {cfg.max_position_embeddings} positions"
        )
    return gen, info, tokenizer, prompt_ids


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_rlhf import platform

    platform.quiet_third_party_warnings()
    try:
        gen, info, tokenizer, prompt_ids = validate(args)
    except (ValueError, FileNotFoundError) as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr)
        return 2
    cfg, tp = info.config, args.tensor_model_parallel_size

    # --- distributed from here on ---
    from megatron_rlhf.generation.greedy import greedy_generate
    from megatron_rlhf.models.builder import build_model
    from megatron_rlhf.models.checkpoint import load_checkpoint
    from megatron_rlhf.parallel.groups import build_process_groups
    from megatron_rlhf.parallel.layout import Layout

    rank, world = platform.init_distributed(seed=args.seed)
    pg = build_process_groups(Layout.for_world(world, tp=tp))
    model = build_model(cfg, info.role, pg, dtype=arguments.dtype_from_args(args), seed=args.seed)
    load_checkpoint(model, pg, info.path)
    t0 = time.perf_counter()
    out = greedy_generate(model, prompt_ids, gen.max_new_tokens, cfg.eos_token_id)
    elapsed = time.perf_counter() - t0
    text = tokenizer.decode(out, skip_special_tokens=True)
    if rank == 0:
        if args.json:
            print(json.dumps({"prompt_ids": prompt_ids, "output_ids": out, "text": text}))
        else:
            print(text)
            print(f"[{len(out)} tokens in {elapsed:.2f}s, TP={tp}, world={world}]",
                  file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
