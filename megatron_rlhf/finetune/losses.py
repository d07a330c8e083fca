"""Losses of the fine-tuning stages: SFT, a reward model's Bradley-Terry and DPO
(Rafailov et al. 2023). Pure functions."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def token_logprobs(logits: Tensor, input_ids: Tensor) -> Tensor:
    """``[B, T-1]`` log-probabilities of tokens 1..T-1 under the logits at 0..T-2."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # [B, T-1, V]
    return logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def sft_loss(logits: Tensor, input_ids: Tensor, loss_mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(sum of -log p over targets, number of targets)``. ``loss_mask [B, T]`` is 1 at the
    response tokens; the prompt, its chat template and padding are context. Position 0 is
    never a target."""
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
    """DPO per pair, from sequence log-probs ``[P]``: ``(loss, chosen reward, rejected reward)``,
    each ``[P]``."""
    # Implicit reward beta * (log pi(y|x) - log pi_ref(y|x)). Conservative DPO with
    # label_smoothing eps: -(1-eps) log sigmoid(d) - eps log sigmoid(-d).
    chosen = beta * (policy_chosen - ref_chosen)
    rejected = beta * (policy_rejected - ref_rejected)
    d = chosen - rejected
    loss = -(1 - label_smoothing) * F.logsigmoid(d) - label_smoothing * F.logsigmoid(-d)
    return loss, chosen.detach(), rejected.detach()
