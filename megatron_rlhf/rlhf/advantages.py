"""Advantages from an experience's rewards: token-level reward shaping and the estimators.

Entry point: :func:`estimate`, by the name in ``--advantage-estimator`` (:data:`ESTIMATORS`).
Shapes: ``B`` samples, ``T`` response positions (right-padded); ``mask`` is ``[B, T]``, 1 at
response tokens. Every ``[B, T]`` output is 0 at padding.
"""
# gae uses a critic, grpo group-relative scores (Dr. GRPO: not divided by the group's std,
# --no-grpo-std-norm), rloo leave-one-out baselines, reinforce++ whitened discounted
# returns. token_rewards shapes the reward with the KL penalty (gae, rloo, reinforce++).
# Whitening over a data-parallel group equals whitening the whole batch.

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_rlhf import runtime
from megatron_rlhf.config import ADVANTAGE_ESTIMATORS  # one list, also validated by PPOConfig
from megatron_rlhf.config import PPOConfig
from megatron_rlhf.rlhf.batch import Experience


def check_advantage_estimator(name: str) -> None:
    """Raise ``ValueError`` unless ``name`` is one of :data:`ADVANTAGE_ESTIMATORS`."""
    if name not in ADVANTAGE_ESTIMATORS:
        valid = ", ".join(ADVANTAGE_ESTIMATORS)
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {valid}")


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    """Sum of ``x`` [B, T] over the elements where ``mask`` [B, T] is set; a scalar."""
    return (x * mask.to(x.dtype)).sum()


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over masked elements, over everything or along ``dim`` (0 when empty)."""
    m = mask.to(x.dtype)
    if dim is None:
        return (x * m).sum() / m.sum().clamp(min=1)
    return (x * m).sum(dim) / m.sum(dim).clamp(min=1)


def _global_sum(t: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """``t`` summed over the ranks of ``group`` (unchanged without a group)."""
    return t if group is None else runtime.all_reduce(t, group=group)


def masked_whiten(x: Tensor, mask: Tensor, group: dist.ProcessGroup | None = None,
                  shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the masked elements of ``x`` [B, T], global
    over ``group``; ``shift_mean=False`` adds the mean back. [B, T], 0 at padding."""
    m = mask.to(x.dtype)  # [B, T]
    x = torch.where(m > 0, x, torch.zeros_like(x))  # padding may hold garbage
    # population statistics in two all-reduces (count and sum, then squared deviations):
    # a batch split over data-parallel ranks is whitened exactly as on one rank
    count_sum = _global_sum(torch.stack([m.sum(), (x * m).sum()]), group)  # [2]
    mean = count_sum[1] / count_sum[0].clamp(min=1)
    sq_dev = _global_sum(((x - mean) ** 2 * m).sum(), group)
    var = sq_dev / count_sum[0].clamp(min=1)
    out = (x - mean) * torch.rsqrt(var + eps)  # [B, T]
    if not shift_mean:
        out = out + mean
    return out * m


def token_rewards(scores: Tensor, kl: Tensor, mask: Tensor, kl_coef: float) -> Tensor:
    """Per-token rewards [B, T]: ``-kl_coef * kl`` at every response token, plus ``scores``
    [B] at each row's last one (none for an empty row); 0 at padding."""
    keep = mask.bool()  # [B, T]
    rewards = torch.where(keep, -kl_coef * kl, torch.zeros_like(kl))  # [B, T]
    lengths = keep.sum(dim=1)  # [B]
    rows = torch.nonzero(lengths > 0).squeeze(1)  # [B'] rows with a response
    rewards[rows, lengths[rows] - 1] += scores[rows].to(rewards.dtype)
    return rewards


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float,
        lam: float) -> tuple[Tensor, Tensor]:
    """GAE over right-padded responses: ``(advantages, returns = A + V)``, both [B, T] and 0
    at padding, from ``rewards``, ``values`` and ``mask`` [B, T]."""
    # delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}; V after the end is 0
    m = mask.to(values.dtype)  # [B, T]
    zero = torch.zeros_like(values)
    rewards = torch.where(m > 0, rewards, zero)  # [B, T], padding may hold garbage
    values = torch.where(m > 0, values, zero)  # [B, T]
    T = values.shape[1]
    next_value = torch.zeros_like(values[:, 0])  # [B]
    next_adv = torch.zeros_like(values[:, 0])  # [B]
    advantages = torch.zeros_like(values)  # [B, T]
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # [B]
        next_adv = (delta + gamma * lam * next_adv) * m[:, t]
        advantages[:, t] = next_adv
        next_value = values[:, t]  # 0 at padding, so V after the last token is 0
    returns = (advantages + values) * m  # [B, T]
    return advantages, returns


def grpo_advantages(scores: Tensor, group_size: int, mask: Tensor, eps: float = 1e-6,
                    scale_by_std: bool = True) -> Tensor:
    """GRPO: ``(score - group mean) / (group std + eps)`` (the unbiased std and eps 1e-6, as
    verl; Dr. GRPO's ``score - group mean`` when not ``scale_by_std``) of ``scores`` [B] in
    consecutive groups of ``group_size``, broadcast over ``mask`` [B, T]. Returns [B, T], 0
    at padding; raises ValueError for a bad group."""
    B = scores.shape[0]
    if group_size < 1 or B % group_size != 0:
        raise ValueError(f"batch size {B} must be a multiple of the group size {group_size}")
    grouped = scores.view(B // group_size, group_size)  # [G, group_size]
    if group_size == 1:  # no unbiased std, and one sample carries no relative signal
        adv = torch.zeros_like(grouped)
    else:
        adv = grouped - grouped.mean(dim=1, keepdim=True)
        if scale_by_std:
            adv = adv / (grouped.std(dim=1, keepdim=True) + eps)
        adv = adv.masked_fill(_all_equal(grouped), 0.0)
    return adv.reshape(B, 1) * mask.to(scores.dtype)  # [B, T]


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """``G_t = r_t + gamma * G_{t+1}`` [B, T] over each right-padded response; 0 at padding."""
    m = mask.to(rewards.dtype)
    rewards = torch.where(m > 0, rewards, torch.zeros_like(rewards))
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])  # [B]
    for t in reversed(range(rewards.shape[1])):
        running = (rewards[:, t] + gamma * running) * m[:, t]
        out[:, t] = running
    return out


def leave_one_out(scores: Tensor, group_size: int) -> Tensor:
    """``scores`` [B] minus the mean of the others in their group of ``group_size`` (>= 2)."""
    B = scores.shape[0]
    if group_size < 2 or B % group_size:
        raise ValueError(f"leave-one-out needs groups of >= 2 samples dividing the batch "
                         f"({B} samples, groups of {group_size})")
    g = scores.view(B // group_size, group_size)
    baseline = (g.sum(dim=1, keepdim=True) - g) / (group_size - 1)
    return (g - baseline).masked_fill(_all_equal(g), 0.0).reshape(B)


def _all_equal(grouped: Tensor) -> Tensor:
    """``[G, 1]`` True where a group's scores are all equal: exactly 0 advantage, no signal."""
    # Their float mean can be an ulp off (3 x 0.1), which std + eps = eps would blow up to ~1e-2.
    return (grouped == grouped[:, :1]).all(dim=1, keepdim=True)


def rloo_advantages(scores: Tensor, kl: Tensor, mask: Tensor, group_size: int,
                    kl_coef: float) -> Tensor:
    """RLOO (Ahmadian et al. 2024, as OpenRLHF runs it): the undiscounted return of the
    KL-shaped leave-one-out score. [B, T], 0 at padding."""
    return discounted_returns(token_rewards(leave_one_out(scores, group_size), kl, mask, kl_coef), mask)


def reinforce_pp_advantages(scores: Tensor, kl: Tensor, mask: Tensor, kl_coef: float,
                            gamma: float = 1.0, group: dist.ProcessGroup | None = None) -> Tensor:
    """REINFORCE++ (Hu 2025): the discounted return of the KL-shaped reward, whitened over
    the batch's response tokens on ``group``'s ranks. [B, T], 0 at padding."""
    returns = discounted_returns(token_rewards(scores, kl, mask, kl_coef), mask, gamma)
    return masked_whiten(returns, mask, group=group)


# ---------------------------------------------------------------------------- by name
def _gae_of(exp: Experience, cfg: PPOConfig, group) -> tuple[Tensor, Tensor]:
    mask = exp.response_mask
    adv, returns = gae(token_rewards(exp.scores, exp.kl, mask, cfg.kl_coef), exp.values, mask, cfg.gamma, cfg.lam)
    return (masked_whiten(adv, mask, group=group) if cfg.whiten_advantages else adv), returns


def _grpo_of(exp: Experience, cfg: PPOConfig, group) -> tuple[Tensor, None]:
    return grpo_advantages(exp.scores, cfg.rollout_n, exp.response_mask,
                           scale_by_std=cfg.grpo_std_norm), None


def _rloo_of(exp: Experience, cfg: PPOConfig, group) -> tuple[Tensor, None]:
    return rloo_advantages(exp.scores, exp.kl, exp.response_mask, cfg.rollout_n, cfg.kl_coef), None


def _reinforce_pp_of(exp: Experience, cfg: PPOConfig, group) -> tuple[Tensor, None]:
    return reinforce_pp_advantages(exp.scores, exp.kl, exp.response_mask, cfg.kl_coef, cfg.gamma,
                                   group=group), None


# Name (:data:`ADVANTAGE_ESTIMATORS`) -> ``fn(exp, cfg, group) -> (advantages, returns or None)``.
ESTIMATORS = {"gae": _gae_of, "grpo": _grpo_of, "rloo": _rloo_of, "reinforce++": _reinforce_pp_of}


def estimate(exp: Experience, cfg: PPOConfig, group=None) -> None:
    """Set ``exp.advantages`` (and gae's ``exp.returns``) by ``cfg.advantage_estimator`` from
    ``exp.scores``, ``exp.kl`` and ``exp.values``; whitening spans ``group``."""
    check_advantage_estimator(cfg.advantage_estimator)
    advantages, returns = ESTIMATORS[cfg.advantage_estimator](exp, cfg, group)
    exp.advantages = advantages
    if returns is not None:
        exp.returns = returns
