"""The trained policy's log-probs and entropy from a model's logits.

The trained policy is the distribution generation samples from (:func:`policy_logits`).
Shapes: ``B`` samples, ``T`` response positions, ``V`` vocabulary.
"""
# It is logits / temperature within the current top-k/top-p set, the sampled token always
# kept. The experience's old and reference log-probs and the update's new log-probs and
# entropy all come from here.

from __future__ import annotations

import torch
from torch import Tensor

from megatron_rlhf.config import GenerationConfig
from megatron_rlhf.generation.sampling import samples_actor, sampling_logits


def logprobs_from_logits(logits: Tensor, tokens: Tensor) -> Tensor:
    """``log softmax(logits)`` [B, T, V] gathered at ``tokens`` [B, T]; float32 [B, T]."""
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    logp = torch.log_softmax(logits, dim=-1)  # [B, T, V]
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: Tensor, truncated: bool = False) -> Tensor:
    """Entropy [...] of ``softmax(logits)`` [..., V]; ``truncated``: ``logits`` may hold ``-inf``
    (probability 0; one more ``[..., V]`` pass, so only when asked)."""
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    probs = torch.softmax(logits, dim=-1)  # [..., V]
    inside = torch.where(probs > 0, logits, 0.0) if truncated else logits  # no 0 * -inf
    return torch.logsumexp(logits, dim=-1) - (probs * inside).sum(dim=-1)


def reshapes_policy(policy: GenerationConfig | None) -> bool:
    """Whether the trained policy may differ from the actor's own distribution (tempered or
    truncated sampling)."""
    # a top-k of at least the vocabulary counts too: treating it apart costs nothing
    return (policy is not None and not policy.greedy
            and not samples_actor(policy, vocab=float("inf")))


def truncates(policy: GenerationConfig, vocab: int) -> bool:
    """Sampling keeps only a top-k/top-p set of the vocabulary (``-inf`` elsewhere)."""
    return bool(policy.top_k and policy.top_k < vocab) or policy.top_p < 1.0


def policy_logits(logits: Tensor, tokens: Tensor, policy: GenerationConfig | None) -> Tensor:
    """Logits ``[..., V]`` of the trained policy at the positions that chose ``tokens [...]``."""
    # ``logits`` itself for the actor's own distribution, else fp32 logits / temperature with
    # -inf outside the top-k/top-p set except at ``tokens``.
    if policy is None or policy.greedy or samples_actor(policy, logits.shape[-1]):
        return logits
    # tokens stay in the set: one sampled from an earlier policy keeps a finite log-prob;
    # gradients flow through the kept logits (the renormalised softmax)
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
    """``(log pi(tokens), entropy of pi)``, both [...], under the trained policy;
    ``entropy_grad`` False: the entropy outside autograd (a metric only)."""
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
