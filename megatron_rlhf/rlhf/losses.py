"""The per-token losses the PPO update differentiates: the clipped policy surrogate and
the clipped value loss. Inputs ``[B, T]``; outputs per token and unmasked (the caller,
:mod:`~megatron_rlhf.rlhf.update`, weights and sums them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_rlhf.rlhf.kl import RATIO_LOG_CLAMP


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, clip_eps: float,
                clip_eps_high: float | None = None,
                dual_clip: float | None = None) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate ``max(-A r, -A clamp(r, 1 - clip_eps, 1 + clip_eps_high))``,
    capped at ``-A * dual_clip`` for A < 0. Returns ``(loss, clipped)``, [B, T] each,
    ``clipped`` True where a clip or the cap was active."""
    high = clip_eps if clip_eps_high is None else clip_eps_high  # clip-higher: a larger upper bound
    log_ratio = (logprobs - old_logprobs).clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP)
    ratio = torch.exp(log_ratio)  # [B, T]
    unclipped = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(1 - clip_eps, 1 + high)
    loss, clipped = torch.maximum(unclipped, clipped_loss), clipped_loss > unclipped
    if dual_clip is not None:
        cap = -advantages * dual_clip
        capped = (advantages < 0) & (loss > cap)
        loss, clipped = torch.where(capped, cap, loss), clipped | capped
    return loss, clipped


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor,
               clip_eps: float | None) -> tuple[Tensor, Tensor]:
    """``0.5 * (v - R)^2``, or with ``clip_eps`` the max with the term of ``v`` clipped to
    ``old +- clip_eps``. Returns ``(loss, clipped)``, [B, T] each."""
    unclipped = (values - returns).square()  # [B, T]
    if clip_eps is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    v_clip = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    clipped_sq = (v_clip - returns).square()  # [B, T]
    return 0.5 * torch.maximum(unclipped, clipped_sq), clipped_sq > unclipped
