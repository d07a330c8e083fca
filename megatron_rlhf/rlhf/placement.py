"""Calls on layouts of their own: the data edges of the experience and training stages.

The train layout's data-parallel ranks hold the iteration's samples (after generation,
:mod:`~megatron_rlhf.rlhf.regroup`). A model placed on another layout (``--ref-layout``,
``--reward-layout``, ``--critic-layout``: every call of that model over all the ranks, with
its own TP x PP x DP) computes for the samples *its* data-parallel ranks hold: the token
lists travel there and the per-sample results come back, by global sample index, so that
nothing depends on which rank computed what. Both moves are one world all-gather of
per-sample Python lists (token ids, or result rows trimmed to the response): a few MB per
iteration even for 512 samples of 2048 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass
class Share:
    """The samples one rank holds under a layout: their global indices, in batch order."""

    sample_ids: list[int]


def _all_gather(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_rows(sample_ids: list[int], rows: list) -> dict:
    """Every rank's ``rows`` (one per sample of ``sample_ids``) by global sample index, on
    every rank (TP and PP ranks of one data-parallel rank give the same rows)."""
    table = {}
    for sids, values in _all_gather((list(sample_ids), rows)):
        table.update(zip(sids, values))
    return table
