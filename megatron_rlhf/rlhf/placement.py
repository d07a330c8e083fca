"""Calls on layouts of their own: the data edges of the experience and training stages.

A call placed on another layout (``--ref-layout``, ``--reward-layout``, ``--critic-layout``,
``--critic-infer-layout``) computes for the samples *its* data-parallel ranks hold: token
lists travel there and per-sample results come back by global sample index, so nothing
depends on which rank computed what. Each move is one world all-gather of per-sample
Python lists (:func:`gather_tables`). The inference calls all compute before one exchange,
so calls on disjoint ranks run at the same time (ReaLHF's concurrent calls).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass
class Elsewhere:
    """A model this rank does not hold (its layout covers other ranks); it computes nothing here."""

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
    """``{name: {global sample index: row}}`` on every rank from each rank's ``{name:
    (sample_ids, rows)}``, in one world all-gather (a rank may have none)."""
    tables: dict[str, dict] = {}
    for theirs in all_gather_object({k: (list(ids), rows) for k, (ids, rows) in mine.items()}):
        for name, (ids, rows) in theirs.items():
            tables.setdefault(name, {}).update(zip(ids, rows))
    return tables


def gather_rows(sample_ids: list[int], rows: list) -> dict:
    """:func:`gather_tables` of one table: every rank's ``rows`` by global sample index."""
    return gather_tables({"rows": (sample_ids, rows)}).get("rows", {})
