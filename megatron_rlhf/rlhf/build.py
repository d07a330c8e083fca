"""From a validated :class:`~megatron_rlhf.rlhf.train_plan.TrainPlan` to a running trainer.

:func:`build_trainer` creates the models of this rank's process groups, loads weights,
optimizer states and the loop position, and wires generator, experience maker and trainer.
"""

from __future__ import annotations

from megatron_rlhf.rlhf.train_plan import TrainPlan


def _model(plan: TrainPlan, name: str, role: str, pg, skip: tuple[str, ...] = (),
           trains: bool = False, whole_sequences: bool = True):
    """``whole_sequences``: built for the train layout's whole-sequence forwards (sequence
    parallelism applies), not for generation only."""
    from megatron_rlhf.models.builder import build_model
    from megatron_rlhf.models.checkpoint import load_checkpoint

    info = plan.infos[name]
    config = info.config
    if trains and config.num_experts:  # the routers' auxiliary losses join the update
        config = config.replace(moe_aux_loss_coeff=plan.ppo.moe_aux_loss_coeff,
                                moe_z_loss_coeff=plan.ppo.moe_z_loss_coeff)
    model = build_model(config, role, pg, dtype=plan.dtype, seed=plan.loop.seed,
                        recompute=plan.par.recompute_granularity if trains else None,
                        sequence_parallel=plan.par.sequence_parallel and whole_sequences)
    load_checkpoint(model, pg, info.path, skip=skip)
    if trains and role == "actor" and plan.ppo.moe_freeze_router:
        from megatron_rlhf.models.moe import freeze_routers

        freeze_routers(model)
    if role in ("actor", "reference") and whole_sequences:  # the log-prob forwards
        from megatron_rlhf.models.forward import set_head_chunk

        set_head_chunk(model, plan.par.head_chunk_tokens)
    return model


def _trainee(plan: TrainPlan, model, pg, lr: float, schedule: bool):
    from megatron_rlhf.rlhf.optim import build_trainee

    o = plan.optim
    if not schedule:
        return build_trainee(model, pg, o, lr)  # constant
    steps = plan.ppo.ppo_epochs * plan.ppo.num_mini_batches
    total = (o.lr_decay_iters or plan.loop.train_iters) * steps
    return build_trainee(model, pg, o, lr, (o.min_lr * lr / o.lr if o.lr else 0.0,
                                            o.lr_warmup_iters * steps, total))


def _estimate_here(plan: TrainPlan, park_on_host: bool):
    """The run's memory estimate on this machine's GPUs; None without one (no GPU, or a
    layout the estimator cannot price)."""
    from megatron_rlhf import runtime
    from megatron_rlhf.rlhf.train_plan import local_gpus, memory_estimate

    if not runtime.has_cuda():
        return None
    try:
        return memory_estimate(plan, *local_gpus(), park_on_host=park_on_host)
    except ValueError:
        return None


def _log(message: str) -> None:
    import sys

    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, file=sys.stderr)


def _park_optimizer(plan: TrainPlan) -> bool:
    """``--park-optimizer`` resolved once (:func:`~megatron_rlhf.rlhf.offload.park_decision`),
    auto from the memory estimate on this machine's GPUs; the first rank logs the verdict."""
    from megatron_rlhf import runtime
    from megatron_rlhf.rlhf.offload import park_decision

    auto = plan.par.park_optimizer == "auto"
    unparked = _estimate_here(plan, park_on_host=False) if auto else None  # None: parked
    park, why = park_decision(plan.par.park_optimizer, runtime.has_cuda(), unparked)
    where = "in pinned host memory" if park else "on the device"
    _log(f"optimizer states during generation: {where} ({why})")
    return park


def _keep_graphs(plan: TrainPlan, park: bool) -> bool:
    """Whether the generator's KV cache store and decode graphs stay across rollouts
    (:func:`~megatron_rlhf.rlhf.offload.keep_graphs_decision`); the first rank logs it."""
    from megatron_rlhf import runtime
    from megatron_rlhf.rlhf.offload import keep_graphs_decision

    keep, why = keep_graphs_decision(runtime.has_cuda(), _estimate_here(plan, park_on_host=park))
    _log(f"decode graphs and KV cache store: {why}")
    return keep


def build_trainer(plan: TrainPlan, pg, gen_pg=None):
    """Models, optimizers, generator and experience maker on this rank; resumes if asked.
    ``pg``: the train layout's process groups; ``gen_pg``: the generation layout's (None or
    ``pg``: the same layout, one copy of the actor)."""
    from megatron_rlhf.generation.engine import Generator, history_drafter
    from megatron_rlhf.rlhf.experience import ExperienceMaker, recomputes
    from megatron_rlhf.rlhf.state import load_trainer_states
    from megatron_rlhf.parallel.groups import build_process_groups
    from megatron_rlhf.plan import memory as mem
    from megatron_rlhf.parallel.reshard import Absent
    from megatron_rlhf.rlhf.trainer import Models, RLHFTrainer

    train_layout, gen_layout = plan.par.layouts(plan.world_size)
    own = plan.par.model_layouts(plan.world_size)
    groups = {train_layout: pg}  # one set of process groups per distinct layout (None: not here)
    for lay in own.values():
        if lay not in groups:
            groups[lay] = build_process_groups(lay)
    layouts = {name: own.get(name, train_layout) for name in ("reference", "reward", "critic")}
    layouts["critic_inf"] = own.get("critic_inf", layouts["critic"])
    pgs = {name: groups[lay] for name, lay in layouts.items()}
    gen_pg = pg if gen_pg is None else gen_pg
    # the ranks that hold the samples for the experience: the train layout's, or, where it
    # covers part of the world, the generation layout's (the actor's calls are then placed)
    anchor = pg if train_layout.size == plan.world_size else gen_pg

    def held(name, lay, g, role=None, **kw):
        """Checkpoint ``name`` as a ``role`` model in the process groups ``g`` of layout
        ``lay``; on the ranks outside a layout over part of the world (``g`` None) an
        :class:`~megatron_rlhf.parallel.reshard.Absent` copy, after this rank's part in the
        load (the loader is collective over the world)."""
        if g is not None:
            return _model(plan, name, role or name, g, **kw)
        from megatron_rlhf.models.builder import transformer_config
        from megatron_rlhf.models.checkpoint import load_elsewhere

        info = plan.infos[name]
        load_elsewhere(info.path)
        return Absent(transformer_config(info.config, lay.tp, plan.dtype, lay.pp,
                                         sequence_parallel=plan.par.sequence_parallel),
                      role or name, info.config)

    def trainee(model, g, lr):  # None outside its layout
        return _trainee(plan, model, g, lr, True) if g is not None else None

    actor = held("actor", train_layout, pg, trains=True)
    models = Models(actor=trainee(actor, pg, plan.optim.lr))
    places = {}  # call -> its process groups
    if plan.ppo.uses_reference:  # else no KL term reads it: neither loaded nor run
        models.reference = held("reference", layouts["reference"], pgs["reference"])
        places["reference"] = pgs["reference"]
    critic = None
    if plan.ppo.use_critic:
        skip = ("output_layer.",) if plan.infos["critic"].role not in ("critic", "reward") else ()
        critic = held("critic", layouts["critic"], pgs["critic"], skip=skip, trains=True)
        models.critic = trainee(critic, pgs["critic"], plan.optim.critic_lr)
        if layouts["critic_inf"] != layouts["critic"]:  # a second copy; its weights follow each update
            models.critic_inf = held("critic", layouts["critic_inf"], pgs["critic_inf"], skip=skip)
        places.update(critic=pgs["critic_inf"], critic_train=pgs["critic"])
    if "reward" in plan.infos:
        models.reward_model = held("reward", layouts["reward"], pgs["reward"])
        places["reward"] = pgs["reward"]
    places["actor_train"] = pg
    recompute = recomputes(plan.ppo, plan.dtype, plan.gen)
    if recompute:  # the old log-probs: a forward of the actor's training copy
        places["actor"] = pg
    models.elsewhere = {name: m for name, m in (("actor", actor), ("critic", critic)) if isinstance(m, Absent)}
    if gen_pg is not pg:
        models.actor_gen = _model(plan, "actor", "actor", gen_pg, whole_sequences=False)
    if "draft" in plan.infos:
        models.draft = _model(plan, "draft", "draft", gen_pg, whole_sequences=False)
        if plan.loop.draft_distill:
            draft_pg, trained = gen_pg, models.draft
            if plan.par.draft_train_layout == "train" and gen_pg is not pg:  # a second copy
                draft_pg, trained = pg, _model(plan, "draft", "draft", pg, whole_sequences=False)
            models.draft_trainee = _trainee(plan, trained, draft_pg, plan.optim.draft_lr, False)
    start = 0
    if plan.resume_dir is not None:
        load_trainer_states(plan.resume_dir, models.trainees(plan.ppo.use_critic))
        start = plan.resume_state["iteration"]
    tok = plan.tokenizer
    pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else 0
    eos = plan.infos["actor"].config.eos_token_id
    generator = Generator(models.generating_actor, models.draft, pad_id=pad, history=history_drafter(plan.spec))
    from megatron_rlhf.rlhf.placement import Elsewhere

    def here(model, name):  # what the experience maker calls: the model, or where it is not
        return Elsewhere(name) if model is None or isinstance(model, Absent) else model

    reward_model = here(models.reward_model, "reward") if plan.paths.reward else None
    critic = here(models.inferring_critic, "critic") if plan.ppo.use_critic else None
    reference = here(models.reference, "reference") if plan.ppo.uses_reference else None
    maker = ExperienceMaker(plan.ppo, reference, actor=here(actor, "actor"),
                            critic=critic, reward_model=reward_model, reward_fn=plan.reward_fn,
                            tokenizer=tok, pad_id=pad, eos_id=eos, dp_group=anchor.dp, gen=plan.gen,
                            reward=plan.reward, recompute=recompute, mp_group=anchor.mp)
    run_info = {"tp": train_layout.tp, "seed": plan.loop.seed,
                "train_layout": mem.layout_text(train_layout),
                "gen_layout": mem.layout_text(gen_layout, pipeline=False),
                "sequence_parallel": bool(actor.config.sequence_parallel),
                **({"draft_train_layout": "train" if models.draft_on_train_layout else "gen"}
                   if models.draft_trainee is not None else {}),
                **{f"{n}_layout": mem.layout_text(lay) for n, lay in own.items()},
                "actor_init": str(plan.paths.actor), "reference": str(plan.infos["reference"].path)}
    park = _park_optimizer(plan)
    return RLHFTrainer(models, generator, maker, plan.ppo, plan.loop, plan.gen, plan.spec,
                       plan.prompts, plan.prompt_ids, anchor, tokenizer=tok, save_dir=plan.save_dir,
                       log_dir=plan.log_dir, start_iteration=start, run_info=run_info,
                       migration=plan.migration, gen_pg=gen_pg,
                       release_train_copy=plan.par.release_train_copy,
                       model_pgs={n: g for n, g in places.items() if g is not anchor},
                       heldout=plan.heldout, park_optimizer=park, keep_graphs=_keep_graphs(plan, park))
