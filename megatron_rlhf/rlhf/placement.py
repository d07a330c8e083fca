"""Calls on layouts of their own: the data edges of the experience and training stages.

The train layout's data-parallel ranks hold the iteration's samples (after generation,
:mod:`~megatron_rlhf.rlhf.regroup`). A call placed on another layout (``--ref-layout``,
``--reward-layout``, ``--critic-layout``, ``--critic-infer-layout``, each with its own
TP x PP x DP) computes for the samples *its* data-parallel ranks hold: the token lists
travel there and the per-sample results come back, by global sample index, so that nothing
depends on which rank computed what. Both moves are one world all-gather of per-sample
Python lists (token ids, or result rows trimmed to the response): a few MB per iteration
even for 512 samples of 2048 tokens. The inference calls all compute before their results
are exchanged, in one all-gather: the reference and the reward model on disjoint ranks
(``--ref-layout 1x1x4 --reward-layout 1x1x4@4`` on 8 ranks) run at the same time, each
model held by its own ranks only (ReaLHF's concurrent calls).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass
class Elsewhere:
    """A model this rank does not hold: its layout covers other ranks (``--ref-layout
    1x1x2@2``); it computes nothing here (an empty :class:`Share`)."""

    name: str


@dataclass
class Share:
    """The samples one rank holds under a layout: their global indices, in batch order."""

    sample_ids: list[int]


def all_gather_object(obj) -> list:
    """Every rank's ``obj``, in rank order (a world all-gather)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_tables(mine: dict[str, tuple[list[int], list]]) -> dict[str, dict]:
    """``{name: (sample_ids, rows)}`` of every rank (one row per sample) as ``{name: {global
    sample index: row}}``, on every rank, in one world all-gather (TP and PP ranks of one
    data-parallel rank give the same rows; a rank may have none)."""
    tables: dict[str, dict] = {}
    for theirs in all_gather_object({k: (list(ids), rows) for k, (ids, rows) in mine.items()}):
        for name, (ids, rows) in theirs.items():
            tables.setdefault(name, {}).update(zip(ids, rows))
    return tables


def gather_rows(sample_ids: list[int], rows: list) -> dict:
    """:func:`gather_tables` of one table: every rank's ``rows`` by global sample index."""
    return gather_tables({"rows": (sample_ids, rows)}).get("rows", {})
