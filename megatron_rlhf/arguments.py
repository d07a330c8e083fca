"""Megatron-style command-line flags, mapped onto the config dataclasses by field name.

Only entry points import this module; the library takes dataclasses, never ``args``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from megatron_rlhf.config import (
    DRAFT_SOURCES,
    PRESETS,
    SPEC_VERIFY,
    ModelConfig,
    ParallelConfig,
    dataclass_from_namespace,
    flag_field,
    preset,
)

_MODEL_OVERRIDES = (
    ("--num-layers", int, "transformer layers"),
    ("--hidden-size", int, "model width"),
    ("--ffn-hidden-size", int, "SwiGLU inner width"),
    ("--num-attention-heads", int, "query heads"),
    ("--num-query-groups", int, "KV heads (GQA groups)"),
    ("--vocab-size", int, "tokenizer vocabulary size"),
    ("--max-position-embeddings", int, "longest sequence the model is built for"),
    ("--rotary-base", float, "RoPE theta"),
    ("--norm-epsilon", float, "RMSNorm epsilon"),
    ("--kv-channels", int, "head dimension"),
)


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (a preset, or the checkpoint's config, then overrides)")
    g.add_argument("--model", choices=sorted(PRESETS), default=None,
                   help="architecture preset for a model built from scratch")
    for flag, typ, help_ in _MODEL_OVERRIDES:
        g.add_argument(flag, type=typ, default=None, help=f"override: {help_}")
    g.add_argument("--tie-embeddings", dest="tie_embeddings", action="store_true", default=None,
                   help="override: share input embedding and LM head")
    g.add_argument("--untie-embeddings", dest="tie_embeddings", action="store_false",
                   help="override: separate LM head")


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="TP size; must divide heads, KV heads and the number of ranks")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="PP size of training and inference (generation runs unpipelined)")


def add_layout_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("layouts per stage (parameter reallocation)")
    g.add_argument("--train-layout", default=None, metavar="TPxPPxDP",
                   help="layout of training and inference, e.g. 2x1x2 (default: "
                        "--tensor-model-parallel-size x 1 x the rest)")
    g.add_argument("--gen-layout", default=None, metavar="TPxDP",
                   help="layout of generation, e.g. 1x4; the actor's weights move to it after "
                        "every update (default: the train layout's TP x the rest: no move)")
    for flag, what in (("--ref-layout", "the reference model's inference"),
                       ("--reward-layout", "the reward model's inference"),
                       ("--critic-layout", "the critic's training (and inference)"),
                       ("--critic-infer-layout", "the critic's inference apart from its training "
                        "(a second copy, reallocated after each update)")):
        part = "" if flag == "--critic-layout" else ", or over part of them (TPxPPxDP@FIRST_RANK)"
        g.add_argument(flag, default=None, metavar="TPxPPxDP",
                       help=f"layout of {what}, over all ranks{part} (default: the train layout); "
                            "the samples move to its data-parallel ranks and the results back")
    g.add_argument("--draft-train-layout", choices=("gen", "train"), default="gen",
                   help="--draft-distill on the generation layout (default; the teacher is the "
                        "actor's generation copy) or on the train layout (PP=1; the teacher is the "
                        "actor's training copy, the draft's weights reallocated to generation)")
    g.add_argument("--plan", default=None, metavar="FILE.json|auto",
                   help="layouts from an execution plan (tools/plan.py --out) or searched now "
                        "(auto: the plan search over what this trainer executes, priced with "
                        "--plan-hardware); replaces the --*-layout flags")
    g.add_argument("--plan-hardware", default=None, metavar="NAME|FILE.json",
                   help="--plan auto: a hardware profile (h100, h200, a100, cpu), a Hardware "
                        "JSON or a tools/profile_costs.py Profile JSON (default: h100 on GPU, "
                        "cpu otherwise)")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                   help="activation recompute while training: full (re-run each layer in "
                        "backward) or selective (the attention core only); default: none")
    g.add_argument("--sequence-parallel", action="store_true", default=None,
                   help="with TP > 1, split whole sequences over the TP ranks outside "
                        "attention and MLP in training and inference (activations / TP); "
                        "generation runs whole sequences")
    _on_off(g, "release-train-copy", "with a --gen-layout of its own, the actor's training copy "
            "waits in host memory during generation (default on GPU)",
            "keep the training copy on the device during generation")


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def add_runtime_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("runtime")
    g.add_argument("--load", default=None, help="checkpoint to load (root or iter_* directory)")
    g.add_argument("--save", default=None, help="checkpoint root to save to")
    g.add_argument("--seed", type=int, default=1234, help="random seed (same on all ranks)")
    g.add_argument("--distributed-timeout-minutes", type=_positive_float, default=30.0,
                   help="how long a collective waits for its peers before failing (a lost node "
                        "then ends the job with the lost ranks named)")
    g.add_argument("--micro-batch-size", type=int, default=1, help="samples per forward")
    g.add_argument("--seq-length", type=int, default=None, help="maximum sequence length")
    d = g.add_mutually_exclusive_group()
    d.add_argument("--bf16", dest="bf16", action="store_true", default=None,
                   help="bf16 parameters and compute (default on GPU)")
    d.add_argument("--fp32", dest="bf16", action="store_false",
                   help="fp32 parameters and compute (default on CPU)")


def add_generation_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("generation")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt")
    g.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely (0: all)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0: all)")
    g.add_argument("--ignore-eos", dest="stop_on_eos", action="store_false",
                   help="every response runs to --max-new-tokens (benchmarks, cost profiling)")
    g.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="on GPU, launch every decode step eagerly instead of replaying CUDA graphs")
    g.add_argument("--draft-load", default=None, help="draft model checkpoint for speculation")
    g.add_argument("--num-draft-tokens", type=_draft_tokens, default=None,
                   help="draft tokens per verification: N, or auto (the default with "
                        "--draft-load): before every round the selector picks plain decoding or "
                        "1..--max-draft-tokens from the live batch, measured latencies and the "
                        "observed acceptance")
    g.add_argument("--max-draft-tokens", type=int, default=None,
                   help="largest draft length auto considers (default 4)")
    g.add_argument("--cost-profile", default=None,
                   help="auto: JSON of measured step latencies, loaded if it exists, else "
                        "profiled at the first call and written there (default: no profile; "
                        "the costs are learned from the rounds as they run)")
    g.add_argument("--draft-source", choices=DRAFT_SOURCES, default=None,
                   help="drafts from the draft model (model; the default with --draft-load), the "
                        "rollout's own history (history: prompt, group siblings and earlier "
                        "responses to the same prompt; no draft model needed) or both")
    g.add_argument("--spec-verify", dest="verify", choices=SPEC_VERIFY, default="exact",
                   help="exact (default): accept a draft token iff it is the token plain sampling "
                        "draws there, so samples equal speculation off's, token for token; "
                        "rejection (model drafts): rejection sampling, lossless in distribution "
                        "only: samples then depend on the selector's choices and timing, and a run "
                        "is not reproducible from its seed")
    g.add_argument("--history-responses", type=int, default=16,
                   help="history drafts: earlier responses kept per prompt (default 16)")
    g.add_argument("--history-prompts", type=int, default=4096,
                   help="history drafts: prompts whose responses are kept (default 4096)")
    g.add_argument("--history-global", type=int, default=0,
                   help="history drafts: newest responses to any prompt kept in a global index, "
                        "drafted from where they match longer than the prompt's history (default 0: off)")


def _draft_tokens(value: str):
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 or 'auto', got {value!r}") from None


def add_migration_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sample migration between data-parallel ranks (generation)")
    g.add_argument("--sample-migration", choices=("on", "off"), default=None,
                   help="move unfinished samples, KV cache included, from busy to idle "
                        "data-parallel ranks (default: on when there are 2+ DP ranks)")
    g.add_argument("--migration-interval", type=int, default=None,
                   help="rounds between exchanges of live counts (default 4)")
    g.add_argument("--migration-threshold", type=float, default=None,
                   help="migrate when the busiest rank holds more than (1 + this) x the mean "
                        "live count (default 0.25)")


def migration_config_from_args(args: argparse.Namespace):
    from megatron_rlhf.config import MigrationConfig

    on = {None: None, "on": True, "off": False}[getattr(args, "sample_migration", None)]
    return dataclass_from_namespace(MigrationConfig, argparse.Namespace(
        sample_migration=on, migration_interval=getattr(args, "migration_interval", None),
        migration_threshold=getattr(args, "migration_threshold", None)))


def model_config_from_args(args: argparse.Namespace, base: ModelConfig | None = None) -> ModelConfig:
    """``base`` (e.g. a checkpoint's config) or ``--model``, with explicit flags applied."""
    if base is None:
        if args.model is None:
            raise ValueError("give --model PRESET or --load CHECKPOINT to define the model")
        base = preset(args.model)
    overrides = {
        flag_field(f): getattr(args, flag_field(f)) for f, _, _ in _MODEL_OVERRIDES
    }
    overrides["tie_embeddings"] = args.tie_embeddings
    if getattr(args, "seq_length", None) is not None:
        overrides["max_position_embeddings"] = max(args.seq_length, base.max_position_embeddings)
    return base.replace(**{k: v for k, v in overrides.items() if v is not None})


def parallel_config_from_args(args: argparse.Namespace) -> ParallelConfig:
    return dataclass_from_namespace(ParallelConfig, args)


def dtype_from_args(args: argparse.Namespace) -> torch.dtype:
    from megatron_rlhf.runtime import default_dtype

    return default_dtype(args.bf16)


def launch_world_size() -> int:
    """The world size torchrun will give us, read before any process group exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def validated(check, *args):
    """Run an entry point's pre-flight ``check(*args)``; on bad input print ``error: ...``
    (once, from rank 0) and exit with status 2 before any collective has started."""
    try:
        return check(*args)
    except (ValueError, FileNotFoundError) as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr, flush=True)
        else:
            # Every rank finds the same error; the others wait a little so that torchrun,
            # which stops all workers at the first exit, does not kill rank 0 mid-report.
            import time

            time.sleep(10)
        raise SystemExit(2) from None


def add_optimizer_args(p: argparse.ArgumentParser) -> None:
    """megatron's optimizer: AdamW, warmup + cosine LR, clipping, distributed optimizer."""
    g = p.add_argument_group("optimizer (AdamW, warmup + cosine)")
    g.add_argument("--lr", type=float, default=1e-6, help="actor peak learning rate")
    g.add_argument("--critic-lr", type=float, default=5e-6, help="critic peak learning rate")
    g.add_argument("--min-lr", type=float, default=0.0, help="actor learning rate after decay")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="iterations of linear warmup")
    g.add_argument("--lr-decay-iters", type=int, default=None,
                   help="iterations of cosine decay (default: --train-iters)")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="AdamW beta1")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="AdamW beta2")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW epsilon")
    g.add_argument("--clip-grad", type=float, default=1.0, help="gradient-norm clip (0: none)")
    o = g.add_mutually_exclusive_group()
    o.add_argument("--use-distributed-optimizer", dest="use_distributed_optimizer",
                   action="store_true", default=True,
                   help="shard fp32 masters and Adam states over data-parallel ranks (default)")
    o.add_argument("--no-distributed-optimizer", dest="use_distributed_optimizer",
                   action="store_false", help="every data-parallel rank keeps the whole optimizer")
    _on_off(g, "overlap-grad-reduce", "reduce gradients during the last micro-batch's backward "
            "(default on GPU)", "reduce gradients after the backward (default on CPU)")
    _on_off(g, "overlap-param-gather", "gather updated parameters during the next mini-batch's "
            "forward (default with --overlap-grad-reduce)",
            "gather updated parameters in the optimizer step")


def _on_off(g, flag: str, on_help: str, off_help: str) -> None:
    """``--FLAG`` / ``--no-FLAG`` setting one field to True / False (None when neither is given)."""
    x = g.add_mutually_exclusive_group()
    dest = flag.replace("-", "_")
    x.add_argument(f"--{flag}", dest=dest, action="store_true", default=None, help=on_help)
    x.add_argument(f"--no-{flag}", dest=dest, action="store_false", help=off_help)


def add_rlhf_args(p: argparse.ArgumentParser) -> None:
    """Flags of ``python -m megatron_rlhf.train``: models, PPO, optimizer, run."""
    from megatron_rlhf.config import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, LOSS_AGGREGATIONS

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
    g = p.add_argument_group("rewards (--reward-fn)")
    g.add_argument("--answer-key", default="answer",
                   help="record field a verifier checks the answer against (default: answer)")
    g.add_argument("--reward-timeout", type=float, default=10.0,
                   help="seconds one verifier call may take; past it the sample scores 0")
    g.add_argument("--reward-workers", type=int, default=None,
                   help="processes verifying a batch (default: a small pool; 0: in-process)")
    g.add_argument("--strict-rewards", action="store_true",
                   help="a reward that crashes, returns a non-number or times out stops the run "
                        "(default: it scores 0, counted in the metrics reward_errors/_timeouts)")
    g.add_argument("--tolerate-reward-errors", action="store_true",
                   help="train on when every sample of a batch failed its reward function "
                        "(default: stop with an error)")
    g = p.add_argument_group("data and rollout")
    g.add_argument("--prompts", default=None,
                   help="dataset of prompt records: .jsonl, .json or .parquet; every field "
                        "besides the prompt reaches the reward function (default: the shipped "
                        "instruction prompts' train split)")
    g.add_argument("--prompt-key", default="prompt",
                   help="record field holding the prompt: a string or a chat messages list")
    g.add_argument("--max-prompt-length", type=int, default=256, help="longest prompt, tokens")
    g.add_argument("--no-chat", dest="chat", action="store_false", default=True,
                   help="do not apply the tokenizer's chat template")
    g.add_argument("--global-batch-size", type=int, default=8, help="prompts per iteration")
    g.add_argument("--rollout-n", type=int, default=2, help="responses sampled per prompt")
    g = p.add_argument_group("PPO")
    g.add_argument("--advantage-estimator", choices=ADVANTAGE_ESTIMATORS, default="gae",
                   help="gae (critic), grpo (group-normalised, KL as a loss), rloo (leave-one-out "
                        "baseline in the group) or reinforce++ (whitened returns); the last three "
                        "train no critic")
    g.add_argument("--ppo-epochs", type=int, default=1, help="passes over each iteration's samples")
    g.add_argument("--num-mini-batches", type=int, default=1, help="optimizer steps per PPO epoch")
    g.add_argument("--gamma", type=float, default=1.0, help="GAE discount")
    g.add_argument("--lam", type=float, default=0.95, help="GAE lambda")
    g.add_argument("--no-whiten-advantages", dest="whiten_advantages", action="store_false",
                   default=True, help="do not normalise GAE advantages over the batch")
    g.add_argument("--clip-eps", type=float, default=0.2, help="PPO ratio clip")
    g.add_argument("--value-clip-eps", type=float, default=0.2, help="value clip (0: none)")
    g.add_argument("--kl-coef", type=float, default=0.05,
                   help="KL-to-reference weight (reward penalty with gae, loss with grpo; 0: no "
                        "reference model is loaded or run, and no kl metric)")
    g.add_argument("--kl-estimator", choices=KL_ESTIMATORS, default=None,
                   help="per-token KL estimate (default: k3 as grpo's loss term, k1 in the reward)")
    g.add_argument("--entropy-coef", type=float, default=0.0, help="entropy bonus weight")
    g.add_argument("--clip-eps-low", type=float, default=None, help="lower ratio clip (default: --clip-eps)")
    g.add_argument("--clip-eps-high", type=float, default=None,
                   help="upper ratio clip (default: --clip-eps; DAPO's clip-higher: 0.28)")
    g.add_argument("--dual-clip", type=float, default=None, metavar="C",
                   help="cap the ratio term of negative advantages at -A*C (C > 1, e.g. 3)")
    g.add_argument("--loss-agg", choices=LOSS_AGGREGATIONS, default="token-mean",
                   help="token-mean over the batch's tokens; seq-mean-token-mean; or "
                        "seq-mean-token-sum-norm (Dr. GRPO: token sums over the length limit)")
    g.add_argument("--filter-groups", action="store_true",
                   help="DAPO dynamic sampling: drop groups whose rewards are all equal and "
                        "generate for more prompts until the batch is full")
    g.add_argument("--filter-max-tries", type=int, default=4,
                   help="--filter-groups: generation rounds per iteration at most (default 4)")
    g.add_argument("--overlong-buffer", type=int, default=0, metavar="L",
                   help="soft overlong punishment over the last L tokens before the limit")
    g.add_argument("--overlong-penalty", type=float, default=1.0, metavar="P",
                   help="the largest overlong penalty, at the length limit (default 1.0)")
    rc = g.add_mutually_exclusive_group()
    rc.add_argument("--recompute-logprobs", dest="recompute_logprobs", action="store_true",
                    default=None, help="log pi_old from a training forward, not from generation "
                    "(default: on for bf16, or when sampling is tempered or truncated: "
                    "--temperature not 0 or 1, --top-k or --top-p set; off otherwise; and "
                    "never needed with one optimizer step per iteration (--ppo-epochs 1, "
                    "--num-mini-batches 1) and no KL in the reward: the update's own "
                    "log-probs, detached, are then log pi_old)")
    rc.add_argument("--no-recompute-logprobs", dest="recompute_logprobs", action="store_false",
                    help="always use generation's log-probs")
    g = p.add_argument_group("held-out evaluation")
    g.add_argument("--eval-prompts", default=None,
                   help="held-out records (a dataset file like --prompts), scored with the "
                        "run's reward before iteration 1, every --eval-interval and at the end")
    g.add_argument("--eval-interval", type=int, default=0,
                   help="iterations between evaluations (0: before the first and after the last)")
    g.add_argument("--eval-samples", type=int, default=1, help="responses per prompt (pass@K)")
    g.add_argument("--eval-temperature", type=float, default=0.0, help="0: greedy (default)")
    g.add_argument("--eval-threshold", type=float, default=1.0,
                   help="a response scoring at least this counts as correct (eval/accuracy)")
    g.add_argument("--eval-limit", type=int, default=0, help="the first N held-out records (0: all)")
    add_optimizer_args(p)
    g = p.add_argument_group("run")
    g.add_argument("--train-iters", type=int, default=20, help="RLHF iterations")
    g.add_argument("--save-interval", type=int, default=0,
                   help="save every N iterations (0: at the end only; needs --save)")
    g.add_argument("--keep-last-checkpoints", type=int, default=0,
                   help="keep only the newest N checkpoints under --save, deleting older ones "
                        "after each save (0: keep all)")
    g.add_argument("--log-dir", default=None, help="metrics.jsonl and TensorBoard go here")
    g.add_argument("--wandb-project", default=None,
                   help="also log every metric to this Weights & Biases project (offline "
                        "without a network; needs `pip install wandb`)")
    g.add_argument("--draft-distill", action="store_true",
                   help="distil the draft towards the actor on every iteration's rollouts")
    g.add_argument("--draft-lr", type=float, default=1e-4, help="draft learning rate")
    g.add_argument("--draft-distill-topk", type=int, default=64, help="teacher tokens per position")


def add_finetune_args(p: argparse.ArgumentParser, stage: str) -> None:
    """Flags of ``train_sft`` (``stage`` sft) and ``train_rm`` (rm: reward models, or DPO)."""
    g = p.add_argument_group("model and data")
    g.add_argument("--load-model", required=True, dest="model_load",
                   help="initial checkpoint (an LM: the base, SFT or policy model)")
    g.add_argument("--data", required=True,
                   help='jsonl of {"prompt", "response"} or chat {"messages"}' if stage == "sft"
                   else 'jsonl of {"prompt", "chosen", "rejected"}')
    g.add_argument("--held-out-fraction", type=float, default=0.1,
                   help="records held out for evaluation (seeded split)")
    g.add_argument("--no-chat", dest="chat", action="store_false", default=True,
                   help="do not apply the tokenizer's chat template to prompts")
    g.add_argument("--global-batch-size", type=int, default=16,
                   help="examples per optimizer step" if stage == "sft" else "pairs per optimizer step")
    if stage == "sft":
        g.add_argument("--pack", action="store_true",
                       help="pack several examples per row of --seq-length tokens")
    else:
        g.add_argument("--loss", choices=("bradley-terry", "dpo"), default="bradley-terry",
                       help="bradley-terry: train a reward model (scalar head); dpo: train the "
                            "policy directly on the pairs against a frozen reference")
        g.add_argument("--ref-load", default=None, help="DPO reference (default: --load-model)")
        g.add_argument("--beta", type=float, default=0.1, help="DPO inverse temperature")
        g.add_argument("--label-smoothing", type=float, default=0.0, help="conservative DPO epsilon")
    add_optimizer_args(p)
    g = p.add_argument_group("run")
    g.add_argument("--train-iters", type=int, default=100, help="optimizer steps")
    g.add_argument("--eval-interval", type=int, default=0,
                   help="evaluate on the held-out records every N steps (0: at the end)")
    g.add_argument("--save-interval", type=int, default=0, help="save every N steps (0: at the end)")
    g.add_argument("--keep-last-checkpoints", type=int, default=0, help="keep the newest N (0: all)")
    g.add_argument("--log-dir", default=None, help="metrics.jsonl and TensorBoard go here")

