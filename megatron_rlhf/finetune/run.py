"""``train_sft`` and ``train_rm``: flags -> a validated run (no collectives) -> the loop.

The model to train is built from ``--load-model`` (an LM checkpoint; a reward model gets a
zero-initialised value head on its trunk), trained by :class:`~.loop.FinetuneTrainer`
under TP x DP with megatron-core's DDP and optimizer, and saved as an ordinary
megatron_rlhf checkpoint with resumable trainer state (``SAVE/iter_X/{actor|reward}``,
``--load SAVE`` resumes). SFT and DPO write an ``actor`` (the next stage's ``--actor-load``),
the reward model a ``reward`` (PPO's ``--reward-load``).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from megatron_rlhf import arguments
from megatron_rlhf.config import FinetuneConfig, OptimConfig, dataclass_from_namespace


@dataclass
class FinetunePlan:
    cfg: FinetuneConfig
    optim: OptimConfig
    dtype: torch.dtype
    info: object
    ref_info: object
    tokenizer: object
    train: list
    held_out: list
    tp: int
    world_size: int
    save_dir: str | None
    log_dir: str | None
    resume_dir: Path | None
    resume_state: dict
    precision: str = ""
    """Why ``dtype`` (the run header's reason)."""

    @property
    def name(self) -> str:
        return "reward" if self.cfg.loss == "bradley-terry" else "actor"


def validate(args: argparse.Namespace) -> FinetunePlan:
    """Everything checkable from files: checkpoints, tokenizer, data, sizes."""
    from megatron_rlhf.data.tokenizer import load_tokenizer
    from megatron_rlhf.finetune import data as D
    from megatron_rlhf.models.checkpoint import read_checkpoint
    from megatron_rlhf.rlhf.state import find_training_checkpoint, read_training_state

    cfg = dataclass_from_namespace(FinetuneConfig, args)
    optim = dataclass_from_namespace(OptimConfig, args)
    world = arguments.launch_world_size()
    tp = args.tensor_model_parallel_size
    if args.pipeline_model_parallel_size != 1:
        raise ValueError("fine-tuning runs TP x DP: drop --pipeline-model-parallel-size")
    if world % tp:
        raise ValueError(f"tensor parallel size {tp} must divide the world size {world}")
    cfg.check_data_parallel(world // tp)
    name = "reward" if cfg.loss == "bradley-terry" else "actor"
    resume, state = None, {}
    if args.load:
        resume = find_training_checkpoint(args.load)
        state = read_training_state(resume)
        if state.get("stage") != cfg.loss:
            raise ValueError(f"{resume} was written by a {state.get('stage')} run, not {cfg.loss}")
    info = read_checkpoint(resume / name if resume else args.model_load)
    source = read_checkpoint(args.model_load)
    if source.role not in ("actor", "reference", "draft") and name == "actor":
        raise ValueError(f"--load-model {args.model_load} holds a {source.role} model; "
                         f"{cfg.loss} trains a language model")
    info.config.check_tensor_parallel(tp)
    ref_info = read_checkpoint(args.ref_load or args.model_load) if cfg.loss == "dpo" else None
    tokenizer = load_tokenizer(source.tokenizer_dir)
    eos = source.config.eos_token_id
    if eos is None:
        raise ValueError(f"{args.model_load} has no EOS token in its config: responses end with it")
    if cfg.loss == "sft":
        items = D.sft_examples(D.read_jsonl(cfg.data, D.SFT_KEYS), tokenizer, eos, cfg.chat, cfg.seq_length)
    else:
        items = D.pair_examples(D.read_jsonl(cfg.data, D.PAIR_KEYS), tokenizer, eos, cfg.chat, cfg.seq_length)
    if cfg.seq_length > info.config.max_position_embeddings:
        raise ValueError(f"--seq-length {cfg.seq_length} exceeds the model's "
                         f"{info.config.max_position_embeddings} positions")
    info.config.check_attention_span(cfg.seq_length)
    train, held_out = D.split_held_out(items, cfg.held_out_fraction, cfg.seed)
    if len(train) < cfg.global_batch_size:
        raise ValueError(f"{len(train)} training records are fewer than --global-batch-size "
                         f"{cfg.global_batch_size}")
    dtype, why = arguments.precision_from_args(args, resume / name if resume else None)
    return FinetunePlan(cfg, optim, dtype, info, ref_info, tokenizer, train, held_out, tp, world,
                        args.save, args.log_dir, resume, state, precision=why)


def run(plan: FinetunePlan, timeout_minutes: float = 30) -> list[dict]:
    """Build on this rank and train (collectives from here on)."""
    from megatron_rlhf import runtime
    from megatron_rlhf.finetune.loop import FinetuneTrainer
    from megatron_rlhf.models.builder import build_model
    from megatron_rlhf.models.checkpoint import load_checkpoint
    from megatron_rlhf.parallel.groups import build_process_groups
    from megatron_rlhf.parallel.layout import Layout
    from megatron_rlhf.rlhf.metrics import MetricsLog
    from megatron_rlhf.rlhf.optim import build_trainee
    from megatron_rlhf.rlhf.state import load_trainer_states, save_training

    cfg = plan.cfg
    runtime.init_distributed(seed=cfg.seed, timeout_minutes=timeout_minutes)
    if not arguments.announce_precision(plan.dtype, plan.precision):
        runtime.shutdown()
        raise SystemExit(2)
    pg = build_process_groups(Layout(tp=plan.tp, dp=plan.world_size // plan.tp))
    role = "reward" if plan.name == "reward" else "actor"
    model = build_model(plan.info.config, role, pg, dtype=plan.dtype, seed=cfg.seed)
    fresh_head = role == "reward" and plan.info.role not in ("reward", "critic")
    load_checkpoint(model, pg, plan.info.path, skip=("output_layer.",) if fresh_head else ())
    o = plan.optim
    t = build_trainee(model, pg, o, o.lr, (o.min_lr, o.lr_warmup_iters, o.lr_decay_iters or cfg.train_iters))
    reference = None
    if cfg.loss == "dpo":
        reference = build_model(plan.ref_info.config, "reference", pg, dtype=plan.dtype, seed=cfg.seed)
        load_checkpoint(reference, pg, plan.ref_info.path)
        reference.eval()
    start = 0
    if plan.resume_dir is not None:
        load_trainer_states(plan.resume_dir, {plan.name: t})
        start = plan.resume_state["iteration"]

    def save(it: int) -> None:
        state = {"stage": cfg.loss, "finetune": asdict(cfg), "tp": plan.tp}
        save_training(plan.save_dir, it, {plan.name: (model, pg)}, {plan.name: t}, state,
                      plan.tokenizer if plan.name == "actor" else None, keep_last=cfg.keep_last_checkpoints)

    tok = plan.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else plan.info.config.eos_token_id
    log = MetricsLog(plan.log_dir, runtime.is_rank0(), resume_from=start)
    trainer = FinetuneTrainer(cfg, t, plan.train, plan.held_out, pg, pad, reference=reference,
                              log=log, save=save if plan.save_dir else None, start=start)
    history = trainer.run()
    return history


def parser(stage: str, prog: str, doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    arguments.add_finetune_args(p, stage)
    arguments.add_parallel_args(p)
    arguments.add_runtime_args(p)
    return p


def main(argv, stage: str, prog: str, doc: str) -> int:
    args = parser(stage, prog, doc).parse_args(argv)
    from megatron_rlhf import runtime

    runtime.quiet_third_party_warnings()
    plan = arguments.validated(validate, args)
    try:
        history = run(plan, timeout_minutes=args.distributed_timeout_minutes)
    except RuntimeError as e:  # a lost node: name its ranks (the process group is broken)
        return runtime.exit_on_lost_peers(e)
    if runtime.is_rank0() and history:
        last = {k: round(v, 4) for k, v in history[-1].items() if isinstance(v, float)}
        print(f"done: {len(history)} steps, last {last}", file=sys.stderr)
    runtime.shutdown()
    return 0
