"""Training on megatron-core's ``DistributedDataParallel`` and its (distributed) optimizer,
with a warmup + cosine learning rate.

Entry point: :func:`build_trainee`, then :meth:`Trainee.step` once per mini-batch.
Invariant: the update at any DP size is exactly the DP=1 update. Clipping is megatron's, one
global norm over every rank of the model. On CPU the optimizer runs inside
:func:`megatron_rlhf.runtime.cuda_as_cpu`.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rlhf import runtime
from megatron_rlhf.config import OptimConfig


@dataclass
class Trainee:
    """A model with what trains it."""

    model: torch.nn.Module  # forwards go through it; its parameters live in DDP's buffers
    ddp: torch.nn.Module  # megatron's DistributedDataParallel around model: the gradient buffers
    optimizer: object  # megatron's (a ChainedOptimizer of a DistributedOptimizer or not)
    scheduler: "WarmupCosine"
    pg: object  # the model's ProcessGroupCollection
    # The optimizer's states and masters are in host memory (rlhf.offload).
    parked: bool = False
    # The weights wait in host memory: offload.release_weights's storages and host copies.
    released: bool | list = False
    # Under overlap_param_gather: the last step's parameters are not all gathered yet.
    params_pending: bool = False

    def step(self) -> float:
        """Reduce the accumulated gradients, clip, step, advance the LR and zero the buffers.
        Returns the gradient norm before clipping (the same on every rank). Raises
        FloatingPointError on inf/nan gradients."""
        from megatron.core.distributed import finalize_model_grads

        with runtime.cuda_as_cpu():  # DP reduction; a tied embedding's two PP copies summed
            finalize_model_grads([self.ddp], pg_collection=self.pg)
            ok, norm, _ = self.optimizer.step()
        if not ok:  # bf16 has no loss scale: a skipped step means inf/nan gradients
            raise FloatingPointError(f"{self.model.mrlhf_role}: the optimizer found inf/nan gradients")
        self.scheduler.step()
        self.zero_grad()
        # Under overlap_param_gather the next forward's pre-hooks gather the updated parameters
        # bucket by bucket; gather_params completes that when a stage ends.
        self.params_pending = bool(self.ddp.ddp_config.overlap_param_gather)
        return float(norm) if norm is not None else 0.0

    def gather_params(self) -> None:
        """Complete the last step's parameter all-gather (no-op without overlap_param_gather).
        Call before anything but the modules' own forwards reads the weights."""
        if self.params_pending:
            with runtime.cuda_as_cpu():
                self.ddp.start_param_sync(force_sync=True)
            self.params_pending = False

    def accumulating(self, last: bool):
        """The context of one micro-batch's backward: reduction held back unless ``last``."""
        import contextlib

        # The last one reduces (bucket by bucket under overlap_grad_reduce): reduce-scattered
        # over DP when the distributed optimizer shards masters and Adam states, else all-reduced.
        return contextlib.nullcontext() if last else self.ddp.no_sync()

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        with runtime.cuda_as_cpu():
            self.optimizer.zero_grad()


def chained(optimizer) -> list:
    """megatron's optimizers behind ``optimizer`` (a ChainedOptimizer or one of them)."""
    return getattr(optimizer, "chained_optimizers", [optimizer])


def inner_optimizers(optimizer) -> list:
    """The torch optimizers (with the Adam states) behind megatron's ``optimizer``."""
    return [opt.optimizer for opt in chained(optimizer)]


@contextlib.contextmanager
def _param_groups_aligned_within(pg):
    """Within this, world-sized ``all_gather_object`` calls run over ``pg``'s layout alone."""
    # megatron's optimizer aligns its parameter groups with a world-sized all_gather_object.
    # Ranks outside a layout over part of the world (e.g. --critic-layout 1x1x2@2) do not join,
    # so the gather runs over the layout's ranks and the other entries stay empty.
    everyone = pg.intra_dist_opt  # (the whole layout: see parallel.groups)
    world = dist.get_world_size()
    if everyone.size() == world:
        yield
        return
    gather = dist.all_gather_object

    def within(out, obj, group=None):
        if group is not None or len(out) != world:
            return gather(out, obj, group=group)
        mine = [None] * everyone.size()
        gather(mine, obj, group=everyone)
        out[:] = mine + [[] for _ in range(world - len(mine))]

    dist.all_gather_object = within
    try:
        yield
    finally:
        dist.all_gather_object = gather


def build_trainee(model: torch.nn.Module, pg, cfg: OptimConfig, lr: float,
                  schedule: tuple[float, int, int] | None = None) -> Trainee:
    """Wrap ``model`` in megatron's DDP and build its AdamW (bf16 models step fp32 masters).
    ``schedule = (min_lr, warmup, total)`` for warmup + cosine from ``lr``; None: constant."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    dtype = next(p.dtype for p in model.parameters())
    # Losses are normalised by the whole (all-DP) mini-batch's token count and summed over DP
    # (DDP does not divide by the DP size): the update is exactly the DP=1 update.
    model.config.calculate_per_token_loss = True
    overlap = runtime.has_cuda() if cfg.overlap_grad_reduce is None else cfg.overlap_grad_reduce
    gather = overlap and cfg.use_distributed_optimizer if cfg.overlap_param_gather is None \
        else cfg.overlap_param_gather
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=overlap, overlap_param_gather=gather,
        use_distributed_optimizer=cfg.use_distributed_optimizer)
    with runtime.cuda_as_cpu():
        ddp = DistributedDataParallel(model.config, ddp_cfg, model, pg_collection=pg)
        opt_cfg = OptimizerConfig(
            optimizer="adam", lr=lr, min_lr=0.0, weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
            clip_grad=cfg.clip_grad, bf16=dtype == torch.bfloat16, params_dtype=dtype,
            use_distributed_optimizer=cfg.use_distributed_optimizer)
        with _param_groups_aligned_within(pg):
            optimizer = get_megatron_optimizer(opt_cfg, [ddp], pg_collection=pg,
                                               use_gloo_process_groups=False)
    min_lr, warmup, total = schedule or (lr, 0, 1)
    scheduler = WarmupCosine(optimizer, lr, min_lr, warmup, total)
    return Trainee(model=model, ddp=ddp, optimizer=optimizer, scheduler=scheduler, pg=pg)


class WarmupCosine:
    """Linear warmup from 0 to ``peak`` over ``warmup`` steps, then cosine to ``min_lr``."""

    def __init__(self, optimizer, peak: float, min_lr: float, warmup: int, total: int):
        self.optimizer, self.peak, self.min_lr = optimizer, peak, min_lr
        self.warmup, self.total = warmup, max(total, 1)
        self.num_steps = 0
        self._apply()

    def lr(self, step: int) -> float:
        if self.warmup and step < self.warmup:
            return self.peak * (step + 1) / self.warmup
        span = max(self.total - self.warmup, 1)
        progress = min(max(step - self.warmup, 0) / span, 1.0)
        return self.min_lr + 0.5 * (self.peak - self.min_lr) * (1 + math.cos(math.pi * progress))

    def _apply(self) -> None:
        lr = self.lr(self.num_steps)
        for g in self.optimizer.param_groups:
            # megatron's groups carry multipliers that its own scheduler applies: wd_mult 0
            # exempts norms and biases from weight decay
            g["lr"] = lr * g.get("lr_mult", 1.0)
            if "wd_mult" in g:
                g.setdefault("base_weight_decay", g["weight_decay"])
                g["weight_decay"] = g["base_weight_decay"] * g["wd_mult"]

    def step(self) -> None:
        self.num_steps += 1
        self._apply()

    @property
    def current_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = int(state["num_steps"])
        self._apply()
