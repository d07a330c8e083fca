"""The per-token losses the PPO update differentiates: the clipped policy surrogate and
the clipped value loss.

Inputs are ``[B, T]`` over response positions. Losses are returned per token and
unmasked; the caller (:mod:`~megatron_rlhf.rlhf.update`) weights and sums them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_rlhf.rlhf.kl import RATIO_LOG_CLAMP


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, clip_eps: float,
                clip_eps_high: float | None = None,
                dual_clip: float | None = None) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate per token.

    ``ratio = exp(clamp(logprobs - old_logprobs, +-RATIO_LOG_CLAMP))``; ``loss = max(-A * ratio,
    -A * clamp(ratio, 1 - clip_eps, 1 + (clip_eps_high or clip_eps)))`` (clip-higher: a
    larger upper bound); with ``dual_clip`` C, the loss of a negative advantage is at most
    ``-A * C``. All inputs [B, T]. Returns ``(loss [B, T], clipped [B, T] bool)`` where
    ``clipped`` marks tokens where a clip was active (the clipped branch strictly larger, or
    the dual clip's cap taken). Unmasked.
    """
    high = clip_eps if clip_eps_high is None else clip_eps_high
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
    """Value-function loss per token, optionally clipped around the rollout's values.

    With ``clip_eps``: ``0.5 * max((v - R)^2, (old + clamp(v - old, -eps, eps) - R)^2)``;
    without: ``0.5 * (v - R)^2``. All inputs [B, T]. Returns ``(loss [B, T],
    clipped [B, T] bool)``, ``clipped`` marking where the clipped term is strictly larger
    (all False without clipping). Unmasked.
    """
    unclipped = (values - returns).square()  # [B, T]
    if clip_eps is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    v_clip = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    clipped_sq = (v_clip - returns).square()  # [B, T]
    return 0.5 * torch.maximum(unclipped, clipped_sq), clipped_sq > unclipped
