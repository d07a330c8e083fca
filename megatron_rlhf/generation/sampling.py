"""Token sampling: greedy, temperature, top-k, top-p, and the log-probs PPO needs.

All functions work on a batch of logits ``[..., V]``. ``probs_for_sampling`` turns raw
logits into the distribution tokens are drawn from; the speculative rule uses the same
function for the actor and the draft, so it samples exactly what plain sampling would.
"""

from __future__ import annotations

import torch

from megatron_rlhf.config import GenerationConfig


def probs_for_sampling(logits: torch.Tensor, params: GenerationConfig) -> torch.Tensor:
    """The distribution tokens are drawn from, ``[..., V]`` in fp32 (one-hot when greedy)."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum - sorted_logits.softmax(-1) >= params.top_p  # mass before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs [..., V]``; identical on ranks with identical generators."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def sample(logits: torch.Tensor, params: GenerationConfig, generator: torch.Generator | None):
    """Tokens ``[...]`` and the sampling distribution ``[..., V]`` for ``logits [..., V]``."""
    probs = probs_for_sampling(logits, params)
    if params.greedy:
        return probs.argmax(-1), probs
    return draw(probs, generator), probs


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log pi(token)`` under the unmodified distribution at temperature 1 (what PPO uses)."""
    return torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None])[..., 0]
