"""A run's validated plan: :func:`make_plan` checks everything that can be wrong
(checkpoints, layouts, batch arithmetic, reward name, prompt lengths, a resume directory)
from files alone, before any collective, and returns a :class:`TrainPlan`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_rlhf.config import (
    MODEL_LAYOUTS,
    ConfigError,
    GenerationConfig,
    LoopConfig,
    MigrationConfig,
    OptimConfig,
    ParallelConfig,
    PPOConfig,
    EvalConfig,
    RewardConfig,
    SpecConfig,
)
from megatron_rlhf.models.checkpoint import CheckpointInfo, read_checkpoint
from megatron_rlhf.rlhf.evaluation import HeldOut
from megatron_rlhf.rlhf.planning import execution_plan


@dataclass
class CheckpointPaths:
    """Where each model comes from."""

    actor: str
    """The policy's initial weights (an LM checkpoint)."""
    reference: str | None = None
    """The KL reference (default: the initial actor)."""
    critic: str | None = None
    """The critic (default: the actor's trunk with a zero value head)."""
    reward: str | None = None
    """A reward model (a critic/reward checkpoint); or use a rule reward function."""
    draft: str | None = None
    """A draft model for speculative generation."""
    resume: str | None = None
    """A --save directory (or one of its iter_* directories) to resume from."""


@dataclass
class TrainPlan:
    """Everything a run needs, validated."""

    ppo: PPOConfig
    optim: OptimConfig
    loop: LoopConfig
    gen: GenerationConfig
    spec: SpecConfig
    par: ParallelConfig
    dtype: torch.dtype
    paths: CheckpointPaths
    reward_fn: str | None
    infos: dict[str, CheckpointInfo]
    tokenizer: object
    prompts: list
    prompt_ids: list[list[int]]
    world_size: int
    save_dir: str | None = None
    log_dir: str | None = None
    resume_dir: Path | None = None
    resume_state: dict = field(default_factory=dict)
    migration: MigrationConfig = field(default_factory=MigrationConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    heldout: HeldOut | None = None
    """The held-out records and how they are evaluated (None: no evaluation)."""
    precision: str = ""
    """Why ``dtype`` (the run header's reason)."""


def _infos(paths: CheckpointPaths, ppo: PPOConfig, resume: Path | None) -> dict[str, CheckpointInfo]:
    infos = {"actor": read_checkpoint(resume / "actor" if resume else paths.actor),
             "reference": read_checkpoint(paths.reference or paths.actor)}
    if ppo.use_critic:
        src = resume / "critic" if resume else paths.critic
        infos["critic"] = read_checkpoint(src) if src else infos["reference"]
    if paths.reward:
        infos["reward"] = read_checkpoint(paths.reward)
        if infos["reward"].role not in ("reward", "critic"):
            raise ValueError(f"--reward-load {paths.reward} holds a model of role "
                             f"'{infos['reward'].role}'; a reward model has a scalar head "
                             "(role reward)")
    if paths.draft:
        infos["draft"] = read_checkpoint(resume / "draft" if resume and (resume / "draft").is_dir()
                                         else paths.draft)
    return infos


def make_plan(ppo: PPOConfig, optim: OptimConfig, loop: LoopConfig, gen: GenerationConfig,
              spec: SpecConfig, par: ParallelConfig, dtype: torch.dtype, paths: CheckpointPaths,
              reward_fn: str | None, world_size: int, prompts_file=None,
              save_dir: str | None = None, log_dir: str | None = None,
              migration: MigrationConfig | None = None, reward: RewardConfig | None = None,
              eval_prompts=None, evaluation: EvalConfig | None = None) -> TrainPlan:
    """Validate a run from files alone (no collectives); raises ValueError saying what to change."""
    from megatron_rlhf.data.prompts import encode_record, load_prompts
    from megatron_rlhf.data.tokenizer import load_tokenizer
    from megatron_rlhf.generation.request import check_draft
    from megatron_rlhf.rlhf.rewards import get_reward_fn, reads_answer
    from megatron_rlhf.rlhf.state import find_training_checkpoint, read_training_state

    if (reward_fn is None) == (paths.reward is None):
        raise ValueError("give exactly one of --reward-fn NAME and --reward-load CHECKPOINT")
    reward = reward or RewardConfig()
    if eval_prompts is not None and reward_fn is None:
        raise ValueError("--eval-prompts scores the held-out responses with the run's reward "
                         "function: it needs --reward-fn (a reward model is not evaluated)")
    if reward_fn is not None:
        get_reward_fn(reward_fn)
    ppo.check_generation(gen.max_new_tokens, loop.max_prompt_length)
    spec.check_sources(bool(paths.draft))
    if not spec.auto and spec.num_draft_tokens and not paths.draft and not spec.uses_history:
        raise ValueError("--num-draft-tokens > 0 needs a draft: --draft-load, or --draft-source history")
    if loop.draft_distill and not paths.draft:
        raise ValueError("--draft-distill needs a draft model (--draft-load)")
    resume, state = None, {}
    if paths.resume:
        resume = find_training_checkpoint(paths.resume)
        state = read_training_state(resume)
        if state["iteration"] >= loop.train_iters:
            raise ValueError(f"{resume} is at iteration {state['iteration']}: raise "
                             f"--train-iters above it to train further")
    infos = _infos(paths, ppo, resume)
    tokenizer = load_tokenizer(infos["actor"].tokenizer_dir)
    required = (reward.answer_key,) if reward_fn and reads_answer(get_reward_fn(reward_fn)) else ()
    prompts = load_prompts(prompts_file, split="train" if prompts_file is None else None,
                           key=loop.prompt_key, required=required)
    if len(prompts) < ppo.global_batch_size:
        raise ValueError(f"{len(prompts)} prompts are fewer than --global-batch-size "
                         f"{ppo.global_batch_size}")
    prompt_ids = [encode_record(tokenizer, p, chat=loop.chat) for p in prompts]
    heldout = None
    if eval_prompts is not None:
        records = load_prompts(eval_prompts, key=loop.prompt_key, required=required)
        evaluation = evaluation or EvalConfig()
        records = records[:evaluation.eval_limit or None]
        heldout = HeldOut(records, [encode_record(tokenizer, p, chat=loop.chat) for p in records], evaluation)
    if par.plan is not None:  # (priced at the longest prompt there is, not the flag's limit)
        longest = min(loop.max_prompt_length, max((len(ids) for ids in prompt_ids), default=1))
        par = execution_plan(par, infos, ppo, loop, gen, spec, dtype, world_size, prompt_len=longest)
    train_layout, gen_layout = par.layouts(world_size)
    _check_extras(ppo, loop, par, reward_fn, train_layout, gen_layout, world_size)
    from megatron_rlhf.rlhf.experience import recomputes

    if ppo.rollout_is_cap and not recomputes(ppo, dtype, gen):
        raise ValueError(f"--rollout-is-cap {ppo.rollout_is_cap} weighs each token by the training "
                         "forward's log pi_old against the generator's: add --recompute-logprobs")
    if not infos["actor"].config.num_experts:
        for flag, on in (("--routing-replay", ppo.routing_replay != "off"), ("--moe-freeze-router", ppo.moe_freeze_router)):
            if on:
                raise ValueError(f"{flag} acts on the routers of a mixture of experts; the actor "
                                 f"({infos['actor'].path}) is dense: drop the flag")
    ppo.check_data_parallel(train_layout.dp)
    if ppo.global_batch_size % gen_layout.dp:
        raise ValueError(f"--global-batch-size {ppo.global_batch_size} prompts must split evenly "
                         f"over the generation layout's {gen_layout.dp} data-parallel ranks "
                         f"(--gen-layout {gen_layout.tp}x{gen_layout.dp})")
    own = par.model_layouts(world_size)
    for name, lay in own.items():
        model = name.removesuffix("_inf")
        if model not in infos:
            raise ConfigError(f"{{{MODEL_LAYOUTS[name]}}} places a model this run does not have "
                              f"(the {model}): drop it")
        ppo.check_data_parallel(lay.dp)
    for name, info in infos.items():
        if name in own:
            _check_layout(info, name, name, own[name].tp, own[name].pp)
        elif name != "draft":
            _check_layout(info, name, "train", train_layout.tp, train_layout.pp)
        if name == "critic" and "critic_inf" in own:
            _check_layout(info, name, "critic inference", own["critic_inf"].tp, own["critic_inf"].pp)
        if name in ("actor", "draft"):
            _check_layout(info, name, "gen", gen_layout.tp)
        if info.config.vocab_size != infos["actor"].config.vocab_size:
            raise ValueError(f"{info.path} has a {info.config.vocab_size}-token vocabulary, the "
                             f"actor {infos['actor'].config.vocab_size}: models must share a tokenizer")
    if "draft" in infos:
        check_draft(infos["actor"].config, infos["draft"].config)
    if par.draft_train_layout == "train":
        if not loop.draft_distill:
            raise ValueError("--draft-train-layout train places the draft's distillation: it needs "
                             "--draft-distill (or drop the flag)")
        if train_layout.size != world_size:
            raise ValueError(f"--draft-train-layout train needs a train layout over all {world_size} "
                             f"ranks (it covers {train_layout.size}): use --draft-train-layout gen")
        if train_layout.pp != 1:
            raise ValueError(f"--draft-train-layout train needs a train layout without pipeline "
                             f"stages (it has PP={train_layout.pp}): the draft trains unpipelined; "
                             "use --draft-train-layout gen")
        _check_layout(infos["draft"], "draft", "train", train_layout.tp)
    _check_lengths(prompts, prompt_ids, loop, gen, spec.base_tokens(bool(paths.draft)), infos)
    if heldout is not None:
        if len(heldout.records) < gen_layout.dp:
            raise ValueError(f"--eval-prompts {eval_prompts}: {len(heldout.records)} records are fewer "
                             f"than the generation layout's {gen_layout.dp} data-parallel ranks")
        _check_lengths(heldout.records, heldout.prompt_ids, loop, gen, spec.base_tokens(bool(paths.draft)), infos)
    plan = TrainPlan(ppo=ppo, optim=optim, loop=loop, gen=gen, spec=spec, par=par, dtype=dtype,
                     paths=paths, reward_fn=reward_fn, infos=infos, tokenizer=tokenizer,
                     prompts=prompts, prompt_ids=prompt_ids, world_size=world_size,
                     save_dir=save_dir, log_dir=log_dir, resume_dir=resume, resume_state=state,
                     migration=migration or MigrationConfig(), reward=reward, heldout=heldout)
    if torch.cuda.is_available():  # a warning on stderr, by the first rank of each node
        warning = memory_warning(plan, *local_gpus())
        if warning and os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"warning: {warning}", file=sys.stderr)
    return plan


def local_gpus() -> tuple[float, int]:
    """This node's GPU memory in GB (GPU 0's) and GPUs per node, as the estimator prices them."""
    gb = torch.cuda.get_device_properties(0).total_memory / 1e9
    return gb, int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count() or 1))


def memory_warning(plan: TrainPlan, gpu_memory_gb: float, gpus_per_node: int) -> str | None:
    """The memory estimator's verdict on this run (:func:`memory_estimate`): None when every
    stage fits GPUs of ``gpu_memory_gb``, else its message. A warning, not an error: the
    estimate errs on the safe side (see docs/memory_plan.md)."""
    from megatron_rlhf.plan import memory as mem

    # (auto parks the optimizer states wherever they would not fit beside generation)
    park = plan.par.park_optimizer != "off"
    try:
        mem.fits_or_raise(memory_estimate(plan, gpu_memory_gb, gpus_per_node, park_on_host=park))
    except ValueError as e:
        return f"memory estimate: {e}"
    return None


def memory_estimate(plan: TrainPlan, gpu_memory_gb: float, gpus_per_node: int,
                    park_on_host: bool = True):
    """:func:`megatron_rlhf.plan.memory.estimate` of this run on GPUs of ``gpu_memory_gb``;
    ``park_on_host=False``: the optimizer states stay on the device through every stage.
    A train layout over part of the world is priced on its own GPUs, generation's samples
    per GPU as if generated there too (more than they are: on the safe side). Raises
    ValueError where a layout cannot be priced."""
    from megatron_rlhf.parallel.layout import Layout
    from megatron_rlhf.plan import memory as mem

    train, gen = plan.par.layouts(plan.world_size)
    gpus = plan.world_size
    if train.size != gpus:
        gpus, train = train.size, Layout(train.tp, train.pp, train.dp, ep=train.ep)
        tp = gen.tp if gpus % gen.tp == 0 else train.tp
        gen = Layout(tp=tp, dp=gpus // tp)
    models = {role: info.config for role, info in plan.infos.items()}
    nodes = max(gpus // gpus_per_node, 1)
    return mem.estimate(
        models, mem.Cluster(nodes=nodes, gpus_per_node=gpus // nodes, gpu_memory_gb=gpu_memory_gb),
        mem.StageLayouts(train=train, gen=gen),
        mem.Workload.from_configs(plan.ppo, plan.loop, plan.gen, plan.spec, "draft" in plan.infos),
        mem.MemoryOptions(param_bytes=plan.dtype.itemsize,
                          distributed_optimizer=plan.optim.use_distributed_optimizer,
                          recompute=plan.par.recompute_granularity or "none",
                          sequence_parallel=plan.par.sequence_parallel,
                          head_chunk_tokens=plan.par.head_chunk_tokens,
                          release_train_copy=plan.par.release_train_copy is not False,
                          park_on_host=park_on_host))


def _check_layout(info, name: str, stage: str, tp: int, pp: int = 1) -> None:
    try:
        info.config.check_tensor_parallel(tp)
        info.config.check_pipeline_parallel(pp)
    except ValueError as e:
        raise ValueError(f"the {name} ({info.path}) in the {stage} layout: {e}") from None


def one_layout(train_layout, gen_layout) -> bool:
    """Whether generation runs on the train layout's process groups (no copy of its own); not
    where training splits experts over ranks (generation runs each DP rank on its own)."""
    return (gen_layout.tp, gen_layout.dp, 1, 1) == (train_layout.tp, train_layout.dp, train_layout.pp,
                                                     train_layout.ep)


def _check_extras(ppo, loop, par, reward_fn, train_layout, gen_layout, world_size) -> None:
    """Flags that need a reward function, one layout or an optional package."""
    if ppo.filter_groups:
        if reward_fn is None:
            raise ValueError("--filter-groups scores each round's samples with the reward function: "
                             "it needs --reward-fn (not --reward-load)")
        if par.model_layouts(world_size) or not one_layout(train_layout, gen_layout):
            raise ValueError("--filter-groups keeps each group on the rank that generated it: it "
                             "needs one layout for generation and training (drop --gen-layout and "
                             "the per-model --*-layout flags, or --filter-groups)")
    if loop.wandb_project:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ValueError(f"--wandb-project {loop.wandb_project}: wandb is not installed "
                             "(pip install wandb), or drop the flag") from None


def _check_lengths(prompts, prompt_ids, loop, gen, drafts: int, infos) -> None:
    for p, ids in zip(prompts, prompt_ids):
        if len(ids) > loop.max_prompt_length:
            raise ValueError(
                f"prompt {p.id} has {len(ids)} tokens, more than --max-prompt-length "
                f"{loop.max_prompt_length}: raise the limit or drop the prompt")
    need = loop.max_prompt_length + gen.max_new_tokens + drafts + 1
    for name, info in infos.items():
        try:
            info.config.check_attention_span(loop.max_prompt_length + gen.max_new_tokens)
        except ValueError as e:
            raise ValueError(f"the {name} ({info.path}): {e}") from None
        if need > info.config.max_position_embeddings:
            raise ValueError(
                f"--max-prompt-length {loop.max_prompt_length} + --max-new-tokens "
                f"{gen.max_new_tokens} (+{drafts + 1} for verification) = {need} "
                f"exceeds the {name}'s {info.config.max_position_embeddings} positions")
