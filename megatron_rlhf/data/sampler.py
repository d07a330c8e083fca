"""Which prompts an RLHF iteration trains on: a pure function of (seed, iteration). No prompt
repeats before every prompt has been seen."""

from __future__ import annotations

import torch


def epoch_order(num_prompts: int, epoch: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_prompts, generator=g).tolist()


def batch_indices(num_prompts: int, batch: int, iteration: int, seed: int) -> list[int]:
    """Prompt indices of ``iteration`` (1-based)."""
    # The next batch prompts of an endless sequence of epochs, each a fresh permutation.
    if num_prompts < 1:
        raise ValueError("no prompts to train on")
    start = (iteration - 1) * batch
    out = []
    while len(out) < batch:
        epoch, pos = divmod(start + len(out), num_prompts)
        order = epoch_order(num_prompts, epoch, seed)
        out.extend(order[pos: pos + batch - len(out)])
    return out
