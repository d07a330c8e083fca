"""Held-out evaluation: the policy's reward and accuracy on records it does not train on.
The trainer generates and scores K responses per record as in its rollouts (penalties left
out); :func:`eval_metrics` reduces them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rlhf import runtime
from megatron_rlhf.config import EvalConfig


@dataclass
class HeldOut:
    """The held-out records of a run and how they are evaluated."""

    records: list  # data.prompts.Prompt records
    prompt_ids: list[list[int]]  # their token ids, chat template applied as for training
    cfg: EvalConfig


def eval_metrics(scores: torch.Tensor, lengths: torch.Tensor, k: int, threshold: float, group) -> dict:
    """``eval/*`` metrics of this rank's ``scores [R*K]`` and ``lengths [R*K]`` (K consecutive
    responses per record), summed over the data-parallel ``group``."""
    # reward_mean: over all responses. accuracy: responses scoring at least threshold.
    # pass@K (K > 1): records with a correct response among their K. response_length: tokens.
    correct = (scores.detach().double().cpu() >= threshold).double()
    local = torch.tensor([float(scores.double().sum()), float(correct.sum()), float(len(correct)),
                          float(lengths.double().sum()),
                          float(correct.view(-1, k).amax(dim=1).sum()) if len(correct) else 0.0],
                         dtype=torch.float64, device=runtime.device())
    total, right, n, tokens, solved = runtime.all_reduce(local, group=group).tolist()
    out = {"eval/reward_mean": total / max(n, 1), "eval/accuracy": right / max(n, 1),
           "eval/response_length": tokens / max(n, 1), "eval/responses": n}
    if k > 1:
        out[f"eval/pass@{k}"] = solved / max(n / k, 1)
    return out
