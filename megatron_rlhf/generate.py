"""Generate from a checkpoint: ``python -m megatron_rlhf.generate`` (under torchrun for TP).

    torchrun --nproc_per_node 3 -m megatron_rlhf.generate --load CKPT \\
        --tensor-model-parallel-size 3 --prompt "What is RLHF?" --chat --max-new-tokens 64
    python -m megatron_rlhf.generate --load CKPT --draft-load DRAFT --num-draft-tokens 4 \\
        --prompts megatron_rlhf/data/prompts.jsonl --batch-size 16 --temperature 0.7 --json

Ranks beyond the TP size form data-parallel replicas that split the prompts; with
``--sample-migration on`` (the default at DP > 1) unfinished samples move, KV caches
included, from busy replicas to idle ones, and the tokens stay those of one replica alone
(keyed random numbers, exact verification of drafts). Everything
that can be wrong with the flags, the checkpoints or the prompts is reported before any
collective starts.
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_rlhf import arguments
from megatron_rlhf.config import GenerationConfig, MigrationConfig, SpecConfig, dataclass_from_namespace


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_rlhf.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    arguments.add_parallel_args(p)
    arguments.add_runtime_args(p)
    arguments.add_generation_args(p)
    arguments.add_migration_args(p)
    g = p.add_argument_group("input and output")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt text")
    src.add_argument("--prompts", help="a jsonl file of {\"prompt\": ...} lines")
    g.add_argument("--split", default=None, choices=["train", "heldout"],
                   help="with --prompts: only this split")
    g.add_argument("--limit", type=int, default=None, help="with --prompts: the first N only")
    g.add_argument("--batch-size", type=int, default=8, help="prompts per generation batch")
    g.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    g.add_argument("--json", action="store_true",
                   help="one JSON line per prompt: prompt_ids, output_ids, text, logprobs")
    args = p.parse_args(argv)
    if args.load is None:
        p.error("--load CHECKPOINT is required")
    return args


def validate(args: argparse.Namespace):
    """Check flags, checkpoint files, layout and prompts; no collectives. Returns the plan."""
    from megatron_rlhf.data.prompts import load_prompts
    from megatron_rlhf.data.tokenizer import encode_prompt, load_tokenizer
    from megatron_rlhf.generation.request import check_request
    from megatron_rlhf.models.checkpoint import read_checkpoint

    gen = dataclass_from_namespace(GenerationConfig, args)
    spec = dataclass_from_namespace(SpecConfig, args)
    par = arguments.parallel_config_from_args(args)
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    infos = [read_checkpoint(args.load)]
    if args.draft_load:
        infos.append(read_checkpoint(args.draft_load))
    if par.pipeline_model_parallel_size != 1:
        raise ValueError(f"generation runs unpipelined: use --pipeline-model-parallel-size 1 "
                         f"(got {par.pipeline_model_parallel_size}) and --tensor-model-parallel-size")
    tp = par.tensor_model_parallel_size
    for info in infos:
        info.config.check_tensor_parallel(tp)
    par.check_world(arguments.launch_world_size())
    tokenizer = load_tokenizer(infos[0].tokenizer_dir)
    texts = [args.prompt] if args.prompt is not None else [
        x.prompt for x in load_prompts(args.prompts, split=args.split)][: args.limit]
    prompts = [encode_prompt(tokenizer, t, chat=args.chat) for t in texts]
    spec.check_sources(bool(args.draft_load))
    check_request(prompts, gen, spec, infos[0].config, infos[1].config if args.draft_load else None,
                  history=spec.uses_history)
    return gen, spec, infos, tokenizer, prompts


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_rlhf import runtime

    runtime.quiet_third_party_warnings()
    gen, spec, infos, tokenizer, prompts = arguments.validated(validate, args)
    migration = arguments.validated(dataclass_from_namespace, MigrationConfig, args)

    # --- distributed from here on ---
    from megatron_rlhf.generation.engine import Generator, history_drafter
    from megatron_rlhf.generation.rollout import GenerationStats
    from megatron_rlhf.models.builder import build_model
    from megatron_rlhf.models.checkpoint import load_checkpoint
    from megatron_rlhf.parallel.groups import build_process_groups
    from megatron_rlhf.parallel.layout import Layout

    tp = args.tensor_model_parallel_size
    rank, world = runtime.init_distributed(seed=args.seed, timeout_minutes=args.distributed_timeout_minutes)
    layout = Layout.for_world(world, tp=tp)
    pg = build_process_groups(layout)
    dtype, why = arguments.precision_from_args(args)
    if not arguments.announce_precision(dtype, why):
        runtime.shutdown()
        return 2
    models = []
    for info in infos:
        m = build_model(info.config, info.role, pg, dtype=dtype, seed=args.seed)
        load_checkpoint(m, pg, info.path)
        models.append(m)
    engine = Generator(models[0], models[1] if len(models) > 1 else None,
                       pad_id=tokenizer.pad_token_id or 0, history=history_drafter(spec))
    dp_rank = layout.coords(rank).dp
    mine = list(range(dp_rank, len(prompts), layout.dp))
    migrator = None
    if migration.enabled(layout.dp):
        from megatron_rlhf.generation.migration import Migrator

        migrator = Migrator(pg.dp, migration, runtime.device(), tp_group=pg.tp)
    # with migration every replica takes part in every batch (the first replica has the most)
    batches = -(-len(range(0, len(prompts), layout.dp)) // args.batch_size) if migrator else None
    results, totals = [], GenerationStats()
    starts = range(0, len(mine), args.batch_size) if migrator is None else \
        [b * args.batch_size for b in range(batches)]
    for start in starts:
        idx = mine[start: start + args.batch_size]
        r = engine.generate([prompts[i] for i in idx], gen, spec, seed=args.seed, sample_ids=idx,
                            migrator=migrator)
        totals.add(r.stats)
        for j, i in enumerate(idx):
            n = int(r.lengths[j])
            results.append((i, prompts[i], r.response_ids[j, :n].tolist(),
                            r.response_logprobs[j, :n].tolist(), r.finish_reasons[j]))
    gathered = _gather(pg, results, totals)
    if rank == 0:
        _report(args, tokenizer, gathered)
    runtime.shutdown()
    return 0


def _gather(pg, results, totals):
    import torch.distributed as dist

    everything = [None] * pg.dp.size()
    dist.all_gather_object(everything, (results, totals), group=pg.dp)
    return everything


def _report(args, tokenizer, gathered) -> None:
    rows = sorted(r for results, _ in gathered for r in results)
    for i, prompt_ids, out, lps, reason in rows:
        text = tokenizer.decode(out, skip_special_tokens=True)
        if args.json:
            print(json.dumps({"index": i, "prompt_ids": prompt_ids, "output_ids": out,
                              "text": text, "logprobs": lps, "finish_reason": reason}))
        else:
            print(text if args.prompt is not None else f"[{i}] {text}")
    slowest = max(t.elapsed_s for _, t in gathered)  # ranks run concurrently
    total = gathered[0][1]
    for _, t in gathered[1:]:
        total.add(t)
    tokens = total.new_tokens
    line = (f"[{len(rows)} prompts, {tokens} tokens in {slowest:.2f}s: {tokens / max(slowest, 1e-9):.1f} tok/s"
            f"; decode: {total.decode}")
    if total.verifications:
        line += (f", mean accepted length {total.mean_accepted_length:.2f}, rounds by draft "
                 f"length {total.rounds_by_draft_len} ({total.mode})")
    print(line + "]", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
