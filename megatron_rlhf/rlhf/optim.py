"""AdamW, warmup + cosine learning rate, data-parallel gradient reduction, TP-aware clipping.

Losses are normalised by the token count of the whole (all-DP) mini-batch, so summing
gradients over data-parallel ranks gives exactly the gradient of the DP=1 run.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron_rlhf import platform
from megatron_rlhf.config import OptimConfig


def _groups(params: list, weight_decay: float) -> list[dict]:
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


class MixedPrecisionAdamW(torch.optim.AdamW):
    """AdamW over fp32 master copies of low-precision (bf16) model parameters, as
    Megatron's mixed-precision optimizer does: gradients are copied up to the masters,
    the step runs in fp32, and the result is copied back into the model's bf16 weights.
    The masters are part of the state dict (a resume keeps their fp32 precision)."""

    def __init__(self, params: list, weight_decay: float, **kwargs):
        self.model_params = list(params)
        self.masters = [p.detach().float().clone() for p in self.model_params]
        groups = _groups(self.masters, weight_decay)
        super().__init__(groups, **kwargs)

    @torch.no_grad()
    def step(self, closure=None):
        for p, m in zip(self.model_params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
        loss = super().step(closure)
        for p, m in zip(self.model_params, self.masters):
            p.copy_(m)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:
            p.grad = None
        super().zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "fp32_masters": [m.detach().cpu() for m in self.masters]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        for m, saved, p in zip(self.masters, state.pop("fp32_masters"), self.model_params):
            m.copy_(saved)
            p.copy_(m)
        super().load_state_dict(state)


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, lr: float) -> torch.optim.AdamW:
    """AdamW over ``model``'s trainable parameters; no weight decay on norms and biases.
    Low-precision (bf16) models get fp32 master weights (:class:`MixedPrecisionAdamW`)."""
    params = [p for p in model.parameters() if p.requires_grad]
    kwargs = dict(lr=lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    if any(p.dtype != torch.float32 for p in params):
        return MixedPrecisionAdamW(params, cfg.weight_decay, **kwargs)
    return torch.optim.AdamW(_groups(params, cfg.weight_decay), **kwargs)


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
        for g in self.optimizer.param_groups:
            g["lr"] = self.lr(self.num_steps)

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


def reduce_gradients(model: torch.nn.Module, dp_group) -> None:
    """Sum every gradient over the data-parallel group (one flat all-reduce per dtype)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if dp_group is None or dist.get_world_size(dp_group) == 1:
        return
    by_dtype: dict[torch.dtype, list] = {}
    for p in params:
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=dp_group)
        for g, r in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(r)


def grad_norm(model: torch.nn.Module, tp_group) -> float:
    """Global L2 norm of the gradients over the model's TP ranks.

    TP-sharded parameters (megatron marks them ``tensor_model_parallel``) contribute their
    shard from every rank; replicated ones (norms, value head) are counted once.
    """
    sharded = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        if p.grad is None:
            continue
        sq = p.grad.detach().double().pow(2).sum().cpu()
        if getattr(p, "tensor_model_parallel", False):
            sharded += sq
        else:
            replicated += sq
    if tp_group is not None:
        sharded = platform.all_reduce(sharded, group=tp_group)
    return math.sqrt(float(sharded + replicated))


def clip_gradients(model: torch.nn.Module, max_norm: float, tp_group) -> float:
    """Scale gradients so their global norm is at most ``max_norm`` (0: no clipping).
    Returns the norm before clipping."""
    norm = grad_norm(model, tp_group)
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm
