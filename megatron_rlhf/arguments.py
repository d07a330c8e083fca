"""The entry points' parsers, assembled from the config dataclasses (:mod:`megatron_rlhf.flags`).

Only entry points import this module; the library takes dataclasses, never ``args``. The
flags declared here are the ones no dataclass holds: checkpoints, files, the runtime and
the model overrides (which change a checkpoint's :class:`ModelConfig`).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from megatron_rlhf.config import (
    PRESETS,
    EvalConfig,
    FinetuneConfig,
    FinetuneOptimConfig,
    GenerationConfig,
    LoopConfig,
    MigrationConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PPOConfig,
    PreferenceConfig,
    PrecisionConfig,
    RewardConfig,
    SpecConfig,
    dataclass_from_namespace,
    preset,
)
from megatron_rlhf.flags import add_fields, cli_message, field_docs, field_kinds

_MODEL_OVERRIDES = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                    "num_query_groups", "vocab_size", "max_position_embeddings", "rotary_base",
                    "norm_epsilon", "kv_channels")
_PARALLEL_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """``--model`` and the overrides of a model's config (None: the preset's or checkpoint's)."""
    g = p.add_argument_group("model (a preset, or the checkpoint's config, then overrides)")
    g.add_argument("--model", choices=sorted(PRESETS), default=None,
                   help="architecture preset for a model built from scratch")
    docs = field_docs(ModelConfig)
    for name in _MODEL_OVERRIDES:
        typ = field_kinds(ModelConfig, name)[0][0]
        g.add_argument("--" + name.replace("_", "-"), type=typ, default=None, help=f"override: {docs[name]}")
    g.add_argument("--tie-embeddings", dest="tie_embeddings", action="store_true", default=None,
                   help="override: share input embedding and LM head")
    g.add_argument("--untie-embeddings", dest="tie_embeddings", action="store_false",
                   help="override: separate LM head")
    g.add_argument("--seq-length", type=int, help="override: max_position_embeddings at least this")


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    add_fields(p.add_argument_group("parallelism"), ParallelConfig, only=_PARALLEL_SIZES)


def add_layout_args(p: argparse.ArgumentParser) -> None:
    add_fields(p.add_argument_group("layouts per stage (parameter reallocation)"), ParallelConfig,
               exclude=_PARALLEL_SIZES)


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def add_runtime_args(p: argparse.ArgumentParser) -> None:
    """Checkpoints, seed, timeout, dtype; a command that has no dataclass holding
    ``--micro-batch-size`` or ``--seq-length`` accepts and ignores them."""
    g = p.add_argument_group("runtime")
    g.add_argument("--load", default=None, help="checkpoint to load (root or iter_* directory)")
    g.add_argument("--save", default=None, help="checkpoint root to save to")
    add_fields(g, LoopConfig, only=("seed",))
    g.add_argument("--distributed-timeout-minutes", type=_positive_float, default=30.0,
                   help="how long a collective waits for its peers before failing (a lost node "
                        "then ends the job with the lost ranks named)")
    taken = {a.dest for a in p._actions}
    if "micro_batch_size" not in taken:
        g.add_argument("--micro-batch-size", type=int, help="not used by this command")
    if "seq_length" not in taken:
        g.add_argument("--seq-length", type=int, help="not used by this command")
    add_fields(g, PrecisionConfig)


def add_generation_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("generation")
    add_fields(g, GenerationConfig)
    g.add_argument("--draft-load", default=None, help="draft model checkpoint for speculation")
    add_fields(g, SpecConfig)


def add_migration_args(p: argparse.ArgumentParser) -> None:
    add_fields(p.add_argument_group("sample migration between data-parallel ranks (generation)"),
               MigrationConfig)


def add_optimizer_args(p: argparse.ArgumentParser, cls=OptimConfig) -> None:
    """megatron's optimizer: AdamW, warmup + cosine LR, clipping, distributed optimizer."""
    add_fields(p.add_argument_group("optimizer (AdamW, warmup + cosine)"), cls)


def add_rlhf_args(p: argparse.ArgumentParser) -> None:
    """Flags of ``python -m megatron_rlhf.train``: models, PPO, optimizer, run."""
    g = p.add_argument_group("models")
    g.add_argument("--actor-load", required=True, help="initial policy checkpoint (LM)")
    g.add_argument("--ref-load", default=None, help="KL reference checkpoint (default: --actor-load)")
    g.add_argument("--critic-load", default=None,
                   help="critic checkpoint (default: the actor's trunk with a zero value head)")
    r = g.add_mutually_exclusive_group(required=True)
    r.add_argument("--reward-load", default=None, help="reward model checkpoint (scalar head)")
    r.add_argument("--reward-fn", default=None,
                   help="reward function by name: math (the response's final answer checked "
                        "against the record's --answer-key with math-verify), a rule (concise, "
                        "...: megatron_rlhf/rlhf/rewards/rules.py), or module:function of your own")
    add_fields(p.add_argument_group("rewards (--reward-fn)"), RewardConfig)
    g = p.add_argument_group("data and logs")
    g.add_argument("--prompts", default=None,
                   help="dataset of prompt records: .jsonl, .json or .parquet; every field "
                        "besides the prompt reaches the reward function (default: the shipped "
                        "instruction prompts' train split)")
    g.add_argument("--log-dir", default=None, help="metrics.jsonl and TensorBoard go here")
    add_fields(p.add_argument_group("PPO"), PPOConfig)
    g = p.add_argument_group("held-out evaluation")
    g.add_argument("--eval-prompts", default=None,
                   help="held-out records (a dataset file like --prompts), scored with the "
                        "run's reward before iteration 1, every --eval-interval and at the end")
    add_fields(g, EvalConfig)
    add_optimizer_args(p)
    add_fields(p.add_argument_group("run"), LoopConfig)


def add_finetune_args(p: argparse.ArgumentParser, stage: str) -> None:
    """Flags of ``train_sft`` (``stage`` sft) and ``train_rm`` (rm: reward models, or DPO)."""
    g = p.add_argument_group("model and data")
    g.add_argument("--load-model", required=True, dest="model_load",
                   help="initial checkpoint (an LM: the base, SFT or policy model)")
    if stage == "sft":
        add_fields(g, FinetuneConfig, exclude=("loss", "beta", "label_smoothing"))
    else:
        g.add_argument("--ref-load", default=None, help="DPO reference (default: --load-model)")
        add_fields(g, PreferenceConfig, exclude=("pack",))
    g.add_argument("--log-dir", default=None, help="metrics.jsonl and TensorBoard go here")
    add_optimizer_args(p, FinetuneOptimConfig)


def model_config_from_args(args: argparse.Namespace, base: ModelConfig | None = None) -> ModelConfig:
    """``base`` (e.g. a checkpoint's config) or ``--model``, with explicit flags applied."""
    if base is None:
        if args.model is None:
            raise ValueError("give --model PRESET or --load CHECKPOINT to define the model")
        base = preset(args.model)
    overrides = {name: getattr(args, name) for name in _MODEL_OVERRIDES}
    overrides["tie_embeddings"] = args.tie_embeddings
    if getattr(args, "seq_length", None) is not None:
        overrides["max_position_embeddings"] = max(args.seq_length, base.max_position_embeddings)
    return base.replace(**{k: v for k, v in overrides.items() if v is not None})


def parallel_config_from_args(args: argparse.Namespace) -> ParallelConfig:
    return dataclass_from_namespace(ParallelConfig, args)


def precision_from_args(args: argparse.Namespace, resumed: str | os.PathLike | None = None
                        ) -> tuple[torch.dtype, str]:
    """The run's dtype and why: ``--bf16``/``--fp32``; else, resuming, the precision the
    resumed run's weights (checkpoint ``resumed``) were saved in; else
    :func:`~megatron_rlhf.runtime.choose_dtype`'s automatic choice."""
    from megatron_rlhf.runtime import choose_dtype

    if args.bf16 is None and resumed is not None:
        from megatron_rlhf.models.checkpoint import stored_dtype

        stored = stored_dtype(resumed)
        if stored in (torch.bfloat16, torch.float32):
            return stored, f"the resumed run's, as its checkpoint {resumed} holds"
    return choose_dtype(args.bf16)


def dtype_from_args(args: argparse.Namespace) -> torch.dtype:
    return precision_from_args(args)[0]


def announce_precision(dtype: torch.dtype, why: str) -> bool:
    """After ``init_distributed``: the first rank prints the run's precision and why (the run
    header). False, an error printed, where ranks chose differently (the automatic choice on
    nodes whose CPUs differ): the run must not start."""
    import torch.distributed as dist

    name = {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype, str(dtype))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (name, why))
    first = dist.get_rank() == 0
    if len({n for n, _ in everyone}) > 1:
        if first:
            chose = {}
            for rank, (n, w) in enumerate(everyone):
                chose.setdefault(n, (rank, w, []))[2].append(rank)
            parts = [f"{n} on {len(ranks)} ranks (rank {r}: {w})" for n, (r, w, ranks) in chose.items()]
            print(f"error: the ranks chose different precisions, {'; '.join(parts)}: give --bf16 "
                  "or --fp32", file=sys.stderr, flush=True)
        return False
    if first:
        print(f"precision: {name} ({why})", file=sys.stderr, flush=True)
    return True


def launch_world_size() -> int:
    """The world size torchrun will give us, read before any process group exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def validated(check, *args):
    """Run an entry point's pre-flight ``check(*args)``; on bad input print ``error: ...``
    (once, from rank 0, settings named by their flags) and exit with status 2 before any
    collective has started."""
    try:
        return check(*args)
    except (ValueError, FileNotFoundError) as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {cli_message(e)}", file=sys.stderr, flush=True)
        else:
            # Every rank finds the same error; the others wait a little so that torchrun,
            # which stops all workers at the first exit, does not kill rank 0 mid-report.
            import time

            time.sleep(10)
        raise SystemExit(2) from None
