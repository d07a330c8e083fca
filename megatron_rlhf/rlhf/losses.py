"""Per-token PPO quantities: KL estimates, shaped rewards, log-probs, entropy, losses.

The trained policy is the distribution tokens are sampled from (:func:`policy_logits`):
the softmax of ``logits / temperature`` restricted to the top-k/top-p set of the current
logits, exactly as generation samples (``generation/sampling.py``), with the sampled token
always kept in that set so its log-prob stays finite as the policy moves. With greedy
generation, or at temperature 1 without truncation, it is the actor's own distribution.
The same policy gives the old, reference and new log-probs and the entropy.

Shapes: ``B`` samples, ``T`` response positions, ``V`` vocabulary. Losses are returned
per token and unmasked; the caller masks and reduces (token or sequence mean).
KL estimators are registered by name in :data:`KL_ESTIMATORS`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_rlhf.config import KL_ESTIMATORS  # one list, also validated by PPOConfig
from megatron_rlhf.config import GenerationConfig
from megatron_rlhf.generation.sampling import samples_actor, sampling_logits

RATIO_LOG_CLAMP = 20.0
"""Log-ratios are clamped to +-this before ``exp`` (k3, and the PPO ratio: a token whose
probability moved by e^20 would overflow the loss, not inform it)."""


def check_kl_estimator(name: str) -> None:
    """Raise ``ValueError`` unless ``name`` is one of :data:`KL_ESTIMATORS`."""
    if name not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {name!r}; valid: {', '.join(KL_ESTIMATORS)}")


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi.

    ``logprobs``, ``ref_logprobs``: [B, T] log pi(a|s), log pi_ref(a|s). Estimators
    (Schulman, "Approximating KL divergence"): ``k1 = logp - ref`` (unbiased, noisy),
    ``k2 = 0.5 * (logp - ref)^2``, ``k3 = exp(ref - logp) - (ref - logp) - 1`` (unbiased,
    low variance, >= 0; the log-ratio is clamped to [-20, 20] before ``exp``),
    ``abs = |logp - ref|``. Returns [B, T].
    """
    check_kl_estimator(estimator)
    diff = logprobs - ref_logprobs  # [B, T] log(pi / pi_ref)
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * diff.square()
    if estimator == "abs":
        return diff.abs()
    log_ratio = (-diff).clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP)  # log(pi_ref / pi)
    return torch.exp(log_ratio) - log_ratio - 1


def token_rewards(scores: Tensor, kl: Tensor, mask: Tensor, kl_coef: float) -> Tensor:
    """Shaped per-token rewards: ``-kl_coef * kl`` everywhere, plus the score at the end.

    ``scores`` [B] (one scalar per sample), ``kl`` [B, T], ``mask`` [B, T] right-padded.
    The score is added at the last response token of each row; a row without response
    tokens gets nothing. Returns [B, T], 0 at padding.
    """
    keep = mask.bool()  # [B, T]
    rewards = torch.where(keep, -kl_coef * kl, torch.zeros_like(kl))  # [B, T]
    lengths = keep.sum(dim=1)  # [B]
    rows = torch.nonzero(lengths > 0).squeeze(1)  # [B'] rows with a response
    rewards[rows, lengths[rows] - 1] += scores[rows].to(rewards.dtype)
    return rewards


def logprobs_from_logits(logits: Tensor, tokens: Tensor) -> Tensor:
    """``log softmax(logits)`` [B, T, V] gathered at ``tokens`` [B, T]; float32 [B, T]."""
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    logp = torch.log_softmax(logits, dim=-1)  # [B, T, V]
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: Tensor, truncated: bool = False) -> Tensor:
    """Entropy of ``softmax(logits)`` [..., V] as ``logsumexp - sum(softmax * logits)``; [...].

    ``truncated``: ``logits`` may hold ``-inf`` (tokens outside a top-k/top-p set), which
    count as probability 0 (one more ``[..., V]`` pass, so only when asked).
    """
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    probs = torch.softmax(logits, dim=-1)  # [..., V]
    inside = torch.where(probs > 0, logits, 0.0) if truncated else logits  # no 0 * -inf
    return torch.logsumexp(logits, dim=-1) - (probs * inside).sum(dim=-1)


def reshapes_policy(policy: GenerationConfig | None) -> bool:
    """True when the trained policy may differ from the actor's own distribution: sampling
    at a temperature other than 0 or 1, or with top-k/top-p truncation (a top-k of at least
    the vocabulary counts too: then the two agree, and treating them apart costs nothing)."""
    return (policy is not None and not policy.greedy
            and not samples_actor(policy, vocab=float("inf")))


def truncates(policy: GenerationConfig, vocab: int) -> bool:
    """Sampling keeps only a top-k/top-p set of the vocabulary (``-inf`` elsewhere)."""
    return bool(policy.top_k and policy.top_k < vocab) or policy.top_p < 1.0


def policy_logits(logits: Tensor, tokens: Tensor, policy: GenerationConfig | None) -> Tensor:
    """Logits ``[..., V]`` of the trained policy at the positions that chose ``tokens [...]``.

    ``policy`` None or greedy, or sampling the actor's own distribution: ``logits`` itself.
    Otherwise fp32 ``logits / temperature`` with ``-inf`` outside the top-k/top-p set of
    these ``logits`` (:func:`~megatron_rlhf.generation.sampling.sampling_logits`), except at
    ``tokens``, which always stay in: a token sampled from an earlier policy keeps a finite
    log-prob. Gradients flow through the kept logits (the renormalised softmax).
    """
    if policy is None or policy.greedy or samples_actor(policy, logits.shape[-1]):
        return logits
    z = sampling_logits(logits, policy)  # [..., V]
    if not truncates(policy, logits.shape[-1]):
        return z  # tempered only: every token, the sampled one too, is already in
    index = tokens.unsqueeze(-1)
    own = logits.float().gather(-1, index)
    if policy.temperature != 1.0:
        own = own / policy.temperature  # the same rounding as sampling_logits
    return z.scatter(-1, index, own)


def policy_logprobs(logits: Tensor, tokens: Tensor, policy: GenerationConfig | None) -> Tensor:
    """``log pi(tokens)`` [...] under the trained policy (:func:`policy_logits`); fp32."""
    return logprobs_from_logits(policy_logits(logits, tokens, policy), tokens)


def policy_logprobs_and_entropy(logits: Tensor, tokens: Tensor, policy: GenerationConfig | None,
                                entropy_grad: bool = True) -> tuple[Tensor, Tensor]:
    """``(log pi(tokens), entropy of pi)``, both [...], under the trained policy
    (:func:`policy_logits`, computed once). ``entropy_grad`` False: the entropy is a metric
    only, computed outside autograd (no ``[..., V]`` tensors kept for a backward)."""
    z = policy_logits(logits, tokens, policy)
    truncated = z is not logits and truncates(policy, logits.shape[-1])  # -inf outside the set
    if entropy_grad:
        return logprobs_from_logits(z, tokens), entropy_from_logits(z, truncated=truncated)
    z = z.float() if z.dtype in (torch.float16, torch.bfloat16) else z
    logp = torch.log_softmax(z, dim=-1)  # [..., V], shared by the log-probs and the entropy
    with torch.no_grad():
        inside = torch.where(torch.isfinite(logp), logp, 0.0) if truncated else logp
        entropy = -(logp.exp() * inside).sum(-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), entropy


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
