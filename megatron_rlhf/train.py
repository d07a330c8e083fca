"""RLHF training: ``python -m megatron_rlhf.train`` (under torchrun for TP/DP).

    torchrun --nproc_per_node 2 -m megatron_rlhf.train --actor-load CKPT --reward-fn concise \\
        --draft-load DRAFT --draft-distill --global-batch-size 8 --rollout-n 2 \\
        --micro-batch-size 4 --max-new-tokens 64 --lr 1e-6 --train-iters 20 \\
        --save out/run --save-interval 5 --log-dir out/run

Every rank runs every stage (generation, experience, PPO); ranks beyond the TP size are
data-parallel replicas. ``--load SAVE`` resumes a run from its newest checkpoint. All
flags, checkpoints and prompts are checked before any collective starts.
"""

from __future__ import annotations

import argparse
import sys

from megatron_rlhf import arguments
from megatron_rlhf.config import (
    EvalConfig,
    GenerationConfig,
    LoopConfig,
    MigrationConfig,
    OptimConfig,
    PPOConfig,
    RewardConfig,
    SpecConfig,
    dataclass_from_namespace,
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_rlhf.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    arguments.add_rlhf_args(p)
    arguments.add_parallel_args(p)
    arguments.add_layout_args(p)
    arguments.add_runtime_args(p)
    arguments.add_generation_args(p)
    arguments.add_migration_args(p)
    return p.parse_args(argv)


def precision(args: argparse.Namespace):
    """``(dtype, why)`` of the run (:func:`~megatron_rlhf.arguments.precision_from_args`;
    resuming without ``--bf16``/``--fp32``: the resumed actor's)."""
    resumed = None
    if args.load and args.bf16 is None:
        from megatron_rlhf.rlhf.state import find_training_checkpoint

        resumed = find_training_checkpoint(args.load) / "actor"
    return arguments.precision_from_args(args, resumed)


def validate(args: argparse.Namespace):
    """Flags -> a validated :class:`~megatron_rlhf.rlhf.train_plan.TrainPlan`; no collectives."""
    from megatron_rlhf.rlhf.train_plan import CheckpointPaths, make_plan

    paths = CheckpointPaths(actor=args.actor_load, reference=args.ref_load,
                            critic=args.critic_load, reward=args.reward_load,
                            draft=args.draft_load, resume=args.load)
    dtype, why = precision(args)
    plan = make_plan(
        ppo=dataclass_from_namespace(PPOConfig, args),
        optim=dataclass_from_namespace(OptimConfig, args),
        loop=dataclass_from_namespace(LoopConfig, args),
        gen=dataclass_from_namespace(GenerationConfig, args),
        spec=dataclass_from_namespace(SpecConfig, args),
        migration=dataclass_from_namespace(MigrationConfig, args),
        par=arguments.parallel_config_from_args(args),
        dtype=dtype,
        paths=paths, reward_fn=args.reward_fn, world_size=arguments.launch_world_size(),
        prompts_file=args.prompts, save_dir=args.save, log_dir=args.log_dir,
        reward=dataclass_from_namespace(RewardConfig, args),
        eval_prompts=args.eval_prompts, evaluation=dataclass_from_namespace(EvalConfig, args),
    )
    plan.precision = why
    return plan


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_rlhf import runtime

    runtime.quiet_third_party_warnings()
    plan = arguments.validated(validate, args)

    # --- distributed from here on ---
    from megatron_rlhf.parallel.groups import build_process_groups
    from megatron_rlhf.rlhf.build import build_trainer
    from megatron_rlhf.rlhf.train_plan import one_layout
    from megatron_rlhf.rlhf.rewards import RewardError

    rank, world = runtime.init_distributed(seed=plan.loop.seed,
                                            timeout_minutes=args.distributed_timeout_minutes)
    if not arguments.announce_precision(plan.dtype, plan.precision):
        runtime.shutdown()
        return 2
    train_layout, gen_layout = plan.par.layouts(world)
    pg = build_process_groups(train_layout)
    gen_pg = pg if one_layout(train_layout, gen_layout) else build_process_groups(gen_layout)
    trainer = build_trainer(plan, pg, gen_pg)
    try:
        history = trainer.run()
    except RewardError as e:
        print(f"error: rank {rank}: {e}", file=sys.stderr)
        runtime.shutdown()
        return 3
    except RuntimeError as e:  # a lost node: name its ranks (the process group is broken)
        return runtime.exit_on_lost_peers(e, f"rank {rank}: ")
    if rank == 0 and history:
        last = history[-1]
        print(f"done: {len(history)} iterations, last reward {last['reward_mean']:.4f}",
              file=sys.stderr)
    runtime.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
