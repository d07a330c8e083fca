"""Per-token KL(pi || pi_ref) estimates from sampled tokens, by name (:data:`KL_ESTIMATORS`).
Shapes: ``[B, T]`` over response positions."""
# Read twice in an iteration: by the experience (the KL penalty that shapes the reward,
# advantages.token_rewards) and by the update (grpo's KL loss term).

from __future__ import annotations

import torch
from torch import Tensor

from megatron_rlhf.config import KL_ESTIMATORS  # one list, also validated by PPOConfig

# log-ratios are clamped to +-this before exp (k3, the PPO ratio): a token whose
# probability moved by e^20 would overflow the loss, not inform it
RATIO_LOG_CLAMP = 20.0
# k3 itself is clamped to at most this (verl's bound): past it a token adds a constant, no
# gradient; without it one token at the log-ratio clamp adds e^20 - 21 = 4.85e8 to the loss
K3_CLAMP = 10.0


def check_kl_estimator(name: str) -> None:
    """Raise ``ValueError`` unless ``name`` is one of :data:`KL_ESTIMATORS`."""
    if name not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {name!r}; valid: {', '.join(KL_ESTIMATORS)}")


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """[B, T] estimate of KL(pi || pi_ref) from ``logprobs`` and ``ref_logprobs`` [B, T] of
    tokens sampled from pi; ValueError for an unknown ``estimator``."""
    # Schulman, "Approximating KL divergence": k1 unbiased and noisy; k2 = (k1^2)/2;
    # k3 = exp(-k1) + k1 - 1, unbiased, low variance and >= 0 (clamped to K3_CLAMP); abs = |k1|
    check_kl_estimator(estimator)
    diff = logprobs - ref_logprobs  # [B, T] log(pi / pi_ref)
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * diff.square()
    if estimator == "abs":
        return diff.abs()
    log_ratio = (-diff).clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP)  # log(pi_ref / pi)
    return (torch.exp(log_ratio) - log_ratio - 1).clamp(max=K3_CLAMP)


def mismatch(trainer: Tensor, generator: Tensor, mask: Tensor, group=None) -> dict[str, float]:
    """The train-inference mismatch on the sampled tokens (``mask``), over the ranks of
    ``group``: mean and max |log pi_trainer - log pi_generator| and the k3 estimate of
    KL(generator || trainer) (the generator sampled them)."""
    from megatron_rlhf import runtime

    gap = (trainer - generator).abs() * mask
    k3 = kl_estimate(generator, trainer, "k3") * mask
    sums = runtime.all_reduce(torch.stack([gap.sum(), k3.sum(), mask.sum()]).double(), group=group)
    top = runtime.all_reduce(gap.max().reshape(1).double() if gap.numel() else torch.zeros(1, dtype=torch.float64),
                             op=torch.distributed.ReduceOp.MAX, group=group)
    tokens = max(float(sums[2]), 1.0)
    return {"mismatch_logprob_abs_mean": float(sums[0]) / tokens, "mismatch_logprob_abs_max": float(top[0]),
            "mismatch_k3": float(sums[1]) / tokens}
