"""Losses of the fine-tuning stages (pure functions; shapes in comments).

- :func:`sft_loss`: next-token cross entropy on response tokens only (the prompt, the chat
  template around it and padding are context, not targets);
- :func:`bradley_terry_loss`: a reward model's ``-log sigmoid(r_chosen - r_rejected)``;
- :func:`dpo_loss`: DPO (Rafailov et al. 2023) from the policy's and the reference's
  sequence log-probabilities of the chosen and rejected responses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def token_logprobs(logits: Tensor, input_ids: Tensor) -> Tensor:
    """``[B, T-1]`` log-probabilities of tokens 1..T-1 under the logits at 0..T-2."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # [B, T-1, V]
    return logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def sft_loss(logits: Tensor, input_ids: Tensor, loss_mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(sum of -log p over target tokens, number of target tokens)``; ``loss_mask [B, T]``
    is 1 at the tokens to predict (response tokens), 0 elsewhere; position 0 is never a
    target. The caller divides by the token count over all ranks."""
    target = loss_mask[:, 1:].to(torch.float32)  # [B, T-1]
    nll = -token_logprobs(logits, input_ids) * target
    return nll.sum(), target.sum()


def sequence_logprobs(logits: Tensor, input_ids: Tensor, loss_mask: Tensor) -> Tensor:
    """``[B]`` sum of log-probabilities of the masked (response) tokens of each row."""
    return (token_logprobs(logits, input_ids) * loss_mask[:, 1:].to(torch.float32)).sum(-1)


def bradley_terry_loss(chosen: Tensor, rejected: Tensor, margin: Tensor | None = None) -> Tensor:
    """``[P]`` ``-log sigmoid(r_c - r_r - margin)`` per pair (rewards ``[P]``)."""
    diff = chosen.float() - rejected.float()
    if margin is not None:
        diff = diff - margin
    return -F.logsigmoid(diff)


def dpo_loss(policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor,
             ref_rejected: Tensor, beta: float, label_smoothing: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """DPO per pair: ``(loss [P], chosen reward [P], rejected reward [P])`` where the
    implicit reward is ``beta * (log pi(y|x) - log pi_ref(y|x))`` and the loss
    ``-log sigmoid(r_c - r_r)`` (conservative DPO with ``label_smoothing`` eps:
    ``-(1-eps) log sigmoid(d) - eps log sigmoid(-d)``)."""
    chosen = beta * (policy_chosen - ref_chosen)
    rejected = beta * (policy_rejected - ref_rejected)
    d = chosen - rejected
    loss = -(1 - label_smoothing) * F.logsigmoid(d) - label_smoothing * F.logsigmoid(-d)
    return loss, chosen.detach(), rejected.detach()
