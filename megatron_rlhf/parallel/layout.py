"""A parallel layout of one model: TP x PP x DP over an explicit list of global ranks, with
the experts of an MoE split over EP of the DP ranks (expert parallelism).

:class:`Layout` is pure arithmetic; :mod:`~megatron_rlhf.parallel.groups` makes its process
groups. Several layouts of one model may coexist (reallocation moves weights between them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class RankCoords(NamedTuple):
    """Where one global rank sits in a layout."""

    tp: int
    dp: int
    pp: int


@dataclass(frozen=True)
class Layout:
    """A validated TP x PP x DP layout over ``ranks`` (global ranks, default 0..n-1); an MoE's
    experts are split over ``ep`` consecutive DP ranks (megatron's expert parallelism: the
    expert layers run TP x EP x expert-DP, ``ep`` dividing ``dp``)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    # The global ranks in layout order (None: range(tp*pp*dp)). TP neighbours are adjacent,
    # then DP replicas, then pipeline stages.
    ranks: tuple[int, ...] | None = None
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "ep"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"layout {name} size must be a positive integer, got {v!r}")
        if self.ranks is None:
            object.__setattr__(self, "ranks", tuple(range(self.size)))
        else:
            object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        if len(self.ranks) != self.size:
            raise ValueError(
                f"layout tp={self.tp} x pp={self.pp} x dp={self.dp} needs {self.size} ranks, "
                f"got {len(self.ranks)}: {list(self.ranks)}"
            )
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"layout ranks must be distinct, got {list(self.ranks)}")
        if min(self.ranks) < 0:
            raise ValueError(f"layout ranks must be non-negative, got {list(self.ranks)}")
        if self.dp % self.ep:
            raise ValueError(f"layout expert parallel size {self.ep} must divide its data parallel "
                             f"size {self.dp}: experts are split over data-parallel ranks")

    @classmethod
    def for_world(cls, world_size: int, tp: int = 1, pp: int = 1) -> "Layout":
        """The layout that fills ``world_size`` ranks, with DP taking what TP x PP leaves."""
        if world_size % (tp * pp):
            raise ValueError(
                f"tensor parallel size {tp} x pipeline parallel size {pp} must divide "
                f"the world size {world_size}"
            )
        return cls(tp=tp, pp=pp, dp=world_size // (tp * pp))

    @classmethod
    def parse(cls, text: str, pipeline: bool = True) -> "Layout":
        """``"TPxPPxDP"`` (``"TPxDP"`` without ``pipeline``), e.g. ``"2x1x4"``, over ranks
        ``0..size-1``, or with ``"@R"`` (``"1x1x2@2"``) from rank ``R`` on; ``":epE"`` splits
        the experts over ``E`` of the DP ranks (``"1x1x4:ep2"``, ``"1x4:ep4@4"``). Raises ValueError."""
        form = "TPxPPxDP, e.g. 2x1x4" if pipeline else "TPxDP, e.g. 1x8"
        body, at, first = str(text).lower().partition("@")
        body, colon, experts = body.partition(":")
        parts = body.split("x")
        if (len(parts) != (3 if pipeline else 2) or not all(p.isdigit() for p in parts)
                or (at and not first.isdigit())
                or (colon and not (experts.startswith("ep") and experts[2:].isdigit()))):
            raise ValueError(f"layout {text!r} is not of the form {form} (optionally :epE, then @FIRST_RANK)")
        sizes = [int(p) for p in parts]
        tp, pp, dp = sizes if pipeline else (sizes[0], 1, sizes[1])
        start = int(first) if at else 0
        return cls(tp=tp, pp=pp, dp=dp, ranks=tuple(range(start, start + tp * pp * dp)),
                   ep=int(experts[2:]) if colon else 1)

    @property
    def first_rank(self) -> int | None:
        """``R`` of a layout over the contiguous ranks ``R..R+size-1``; None otherwise."""
        r0 = self.ranks[0]
        return r0 if self.ranks == tuple(range(r0, r0 + self.size)) else None

    @property
    def size(self) -> int:
        return self.tp * self.pp * self.dp

    def __contains__(self, rank: int) -> bool:
        return rank in self.ranks

    def coords(self, rank: int) -> RankCoords:
        """TP, DP and PP index of a global rank; ValueError if it is not in the layout."""
        try:
            i = self.ranks.index(rank)
        except ValueError:
            raise ValueError(f"rank {rank} is not in layout ranks {list(self.ranks)}") from None
        return RankCoords(tp=i % self.tp, dp=(i // self.tp) % self.dp, pp=i // (self.tp * self.dp))

    def rank_at(self, tp: int, dp: int, pp: int) -> int:
        """The global rank at given coordinates (inverse of :meth:`coords`)."""
        if not (0 <= tp < self.tp and 0 <= dp < self.dp and 0 <= pp < self.pp):
            raise ValueError(f"coordinates tp={tp} dp={dp} pp={pp} outside {self}")
        return self.ranks[tp + self.tp * (dp + self.dp * pp)]

    def tp_groups(self) -> list[list[int]]:
        """Ranks that shard one copy of a stage's weights (one list per DP x PP index)."""
        return [[self.rank_at(t, d, p) for t in range(self.tp)]
                for p in range(self.pp) for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        """Ranks holding the same shard (gradient reduction), one list per TP x PP index."""
        return [[self.rank_at(t, d, p) for d in range(self.dp)]
                for p in range(self.pp) for t in range(self.tp)]

    def pp_groups(self) -> list[list[int]]:
        """Ranks forming one pipeline, one list per TP x DP index."""
        return [[self.rank_at(t, d, p) for p in range(self.pp)]
                for d in range(self.dp) for t in range(self.tp)]

    def mp_groups(self) -> list[list[int]]:
        """Ranks holding one full model copy (TP x PP), one list per DP index."""
        return [[self.rank_at(t, d, p) for p in range(self.pp) for t in range(self.tp)]
                for d in range(self.dp)]

    # Expert layers: a DP index d is expert rank d % ep in expert-DP replica d // ep (megatron's
    # tp-ep-dp-pp order: TP fastest, then EP).
    def _dp_index(self, edp: int, e: int) -> int:
        return edp * self.ep + e

    def ep_groups(self) -> list[list[int]]:
        """Ranks that split one copy of the experts (token exchange), one list per TP x PP x expert-DP index."""
        return [[self.rank_at(t, self._dp_index(x, e), p) for e in range(self.ep)]
                for p in range(self.pp) for x in range(self.dp // self.ep) for t in range(self.tp)]

    def expt_dp_groups(self) -> list[list[int]]:
        """Ranks holding the same experts' shard (their gradient reduction)."""
        return [[self.rank_at(t, self._dp_index(x, e), p) for x in range(self.dp // self.ep)]
                for p in range(self.pp) for e in range(self.ep) for t in range(self.tp)]

    def tp_ep_groups(self) -> list[list[int]]:
        """TP x EP ranks of one stage and expert-DP index (the allgather dispatcher's group)."""
        return [[self.rank_at(t, self._dp_index(x, e), p) for e in range(self.ep) for t in range(self.tp)]
                for p in range(self.pp) for x in range(self.dp // self.ep)]

    def tp_ep_pp_groups(self) -> list[list[int]]:
        """TP x EP x PP ranks of one expert-DP index (one full copy of the experts)."""
        return [[self.rank_at(t, self._dp_index(x, e), p)
                 for p in range(self.pp) for e in range(self.ep) for t in range(self.tp)]
                for x in range(self.dp // self.ep)]

    def embedding_groups(self) -> list[list[int]]:
        """First and last pipeline stage of each pipeline (tied embedding gradients)."""
        return [sorted({g[0], g[-1]}) for g in self.pp_groups()]

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The group of ``kind`` ('tp', 'dp', 'pp', 'mp', 'embd', 'ep', 'expt_dp') that contains ``rank``."""
        groups = {
            "tp": self.tp_groups, "dp": self.dp_groups, "pp": self.pp_groups,
            "mp": self.mp_groups, "embd": self.embedding_groups, "ep": self.ep_groups,
            "expt_dp": self.expt_dp_groups,
        }[kind]()
        for g in groups:
            if rank in g:
                return g
        raise ValueError(f"rank {rank} is not in layout ranks {list(self.ranks)}")

    def __str__(self) -> str:
        ep = f", ep={self.ep}" if self.ep > 1 else ""
        return f"Layout(tp={self.tp}, pp={self.pp}, dp={self.dp}{ep}, ranks={list(self.ranks)})"
