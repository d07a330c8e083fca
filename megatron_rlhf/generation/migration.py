"""Sample reallocation between data-parallel ranks during generation (RLHFSpec).

Entry point: :class:`Migrator` (``agree``, ``start``, ``poll`` every round, ``return_results``).
Every ``interval`` rounds each rank posts its live count in a non-blocking all-gather over
the DP group; once it completed and the imbalance passes ``threshold``, unfinished samples
move whole (row state, KV cache rows, outputs so far) from busy to idle ranks
(:func:`plan_transfers`). Invariants: a sample's random numbers are keyed by its global
index, so it continues exactly as where it started; at the end every sample returns to its
owner once, in order; a peer lost mid-transfer raises :class:`MigrationError`. Under TP each
TP rank exchanges with the same TP rank of the other replicas and ships its own shards.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megatron_rlhf.config import MigrationConfig
from megatron_rlhf.generation.rollout import GenerationStats
from megatron_rlhf.generation.state import Outputs, Rows

_DTYPES = [torch.int64, torch.float32, torch.bfloat16, torch.float16, torch.bool, torch.float64, torch.int16]
_MAX_TENSORS, _MAX_DIMS = 32, 5
_OUT_KEYS = ("out:tokens", "out:logprobs", "out:sampling_logprobs", "out:count")


class MigrationError(RuntimeError):
    """A peer failed while samples moved (or counts were exchanged)."""


def plan_transfers(counts: list[int], threshold: float) -> list[tuple[int, int, int]]:
    """Moves ``(src, dst, samples)`` that bring every rank within one of the mean live count
    (none below ``threshold``); every rank only sends or only receives."""
    total, size = sum(counts), len(counts)
    if not total or size < 2:
        return []
    if max(counts) <= (1 + threshold) * total / size or max(counts) - min(counts) < 2:
        return []
    target = [total // size] * size
    for r in sorted(range(size), key=lambda r: -counts[r])[: total % size]:
        target[r] += 1
    surplus = [[r, counts[r] - target[r]] for r in range(size) if counts[r] > target[r]]
    deficit = [[r, target[r] - counts[r]] for r in range(size) if counts[r] < target[r]]
    moves, i, j = [], 0, 0
    while i < len(surplus) and j < len(deficit):
        n = min(surplus[i][1], deficit[j][1])
        moves.append((surplus[i][0], deficit[j][0], n))
        surplus[i][1] -= n
        deficit[j][1] -= n
        i += surplus[i][1] == 0
        j += deficit[j][1] == 0
    return moves


class Migrator:
    """Exchanges live counts and moves samples within one data-parallel group."""

    def __init__(self, group, cfg: MigrationConfig, device: torch.device, tp_group=None):
        self.group, self.device = group, device
        self.tp = tp_group if tp_group is not None and tp_group.size() > 1 else None
        self.interval, self.threshold = cfg.migration_interval, cfg.migration_threshold
        self.rank, self.size = group.rank(), group.size()

    def _global(self, r: int) -> int:
        return dist.get_global_rank(self.group, r)

    def _fail(self, what: str, peer: int | None, err: Exception) -> MigrationError:
        who = (f"data-parallel rank {peer} (global rank {self._global(peer)})" if peer is not None
               else f"a rank of the data-parallel group (global ranks "
                    f"{[self._global(r) for r in range(self.size)]})")
        return MigrationError(f"sample migration: {what} failed on global rank {dist.get_rank()}: "
                              f"{who} did not answer ({type(err).__name__}: {err}); it has "
                              "probably died, see its own log")

    def agree(self, max_len: int, batch: int) -> tuple[int, int]:
        """The longest cache and the largest batch of any rank (every rank sizes for any sample)."""
        t = torch.tensor([max_len, batch], device=self.device)
        try:
            dist.all_reduce(t, dist.ReduceOp.MAX, group=self.group)
        except RuntimeError as e:
            raise self._fail("agreeing on the cache length", None, e) from e
        return int(t[0]), int(t[1])

    def start(self) -> None:
        """Reset the exchange state at the start of a generate call."""
        self._posted = None  # (work, buffers) of the count all-gather in flight
        self._since = 0  # rounds since the last exchange completed
        self._sending: list = []  # (work, dst, tensors kept alive) of sends in flight

    def _post(self, live: int) -> None:
        t = torch.tensor([live], device=self.device)
        out = [torch.zeros_like(t) for _ in range(self.size)]
        try:
            work = dist.all_gather(out, t, group=self.group, async_op=True)
        except RuntimeError as e:
            raise self._fail("the exchange of live counts", None, e) from e
        self._posted = (work, out, t)

    def _counts(self, block: bool) -> list[int] | None:
        work, out, _ = self._posted
        if not block:
            done = torch.tensor([int(work.is_completed())], device=self.device)
            if self.tp is not None:  # the TP ranks of a replica act in the same round
                dist.all_reduce(done, dist.ReduceOp.MIN, group=self.tp)
            if not int(done):
                return None
        try:
            work.wait()
        except RuntimeError as e:
            raise self._fail("the exchange of live counts", None, e) from e
        self._posted = None
        return [int(x) for x in out]

    def poll(self, rows: Rows, out: Outputs, stats: GenerationStats) -> bool:
        """Call at every round boundary: posts the live count every ``interval`` rounds (at
        once when idle) and moves samples once an exchange completed. True when every rank
        posted zero (generation is over everywhere)."""
        # Busy ranks never wait for each other: only an idle rank waits for the exchange.
        # Finished rows are dropped only before samples move (a compaction copies the caches).
        live = int(rows["alive"].sum())
        if self._posted is None:
            if live and self._since < self.interval:
                self._since += 1
                return False
            self._post(live)
        t0 = time.perf_counter()
        counts = self._counts(block=live == 0)
        waited = time.perf_counter() - t0
        stats.sync_s += waited
        if live == 0:
            stats.idle_s += waited
        if counts is None:
            return False
        self._since = 0
        self._reap()
        if not sum(counts):
            self._reap(block=True)
            return True
        plan = plan_transfers(counts, self.threshold)
        if plan:
            t1 = time.perf_counter()
            rows.compact()
            self._move(plan, counts, rows, out, stats)
            stats.migration_s += time.perf_counter() - t1
        return False

    def _reap(self, block: bool = False) -> None:
        """Complete the sends in flight that are done (all of them with ``block``)."""
        keep = []
        for work, dst, tensors in self._sending:
            if block or work.is_completed():
                try:
                    work.wait()
                except RuntimeError as e:
                    raise self._fail(f"sending samples to rank {dst}", dst, e) from e
            else:
                keep.append((work, dst, tensors))
        self._sending = keep

    # ------------------------------------------------------------------ transfers
    def _move(self, plan, counts: list[int], rows: Rows, out: Outputs, stats: GenerationStats) -> None:
        sends = [(dst, n) for src, dst, n in plan if src == self.rank]
        recvs = [src for src, dst, n in plan if dst == self.rank]
        names = sorted([*rows.packed_names(), *_OUT_KEYS])
        if sends:
            # samples finished since the count was posted: keep what the plan leaves here
            keep = counts[self.rank] - sum(n for _, n in sends)
            spare = max(len(rows) - keep, 0)
            order = torch.argsort(rows.caches["actor"].lengths, stable=True)  # fewest bytes first
            start = 0
            for dst, n in sends:
                n = min(n, spare - start)
                package = None
                if n > 0:
                    chosen = order[start:start + n]
                    start += n
                    package = rows.pack(chosen)
                    package.update(_records(out, package["sid"].tolist(), self.device))
                    if sorted(package) != names:
                        raise RuntimeError(f"migration package {sorted(package)} != {names}")
                    stats.migrated_out += n
                self._sending += self._send(package, dst, stats)
            rows.select(order[start:].sort().values)
        for src in recvs:
            package = self._recv(src, names, stats)
            if package is None:
                continue
            stats.migrated_in += len(package["sid"])
            for record in _unpack_records(package):
                out.put(record)
            rows.append(package)

    def _send(self, package: dict[str, torch.Tensor] | None, dst: int, stats) -> list:
        """Post the sends of ``package`` (None: no samples after all) to ``dst``; returns
        ``(work, dst, tensors)`` (the tensors must outlive the send)."""
        names = sorted(package) if package is not None else []
        header = torch.zeros(max(len(names), 1), 2 + _MAX_DIMS, dtype=torch.long)
        if package is None:
            header[0, 0] = -1
        for i, name in enumerate(names):
            t = package[name]
            header[i, 0], header[i, 1] = _DTYPES.index(t.dtype), t.dim()
            header[i, 2:2 + t.dim()] = torch.tensor(t.shape)
        header = _pad_header(header).to(self.device)
        peer = self._global(dst)
        try:
            works = [(dist.isend(header, peer, group=self.group, tag=0), dst, header)]
            for i, name in enumerate(names):
                t = package[name].contiguous()
                if t.numel():
                    works.append((dist.isend(t, peer, group=self.group, tag=1 + i), dst, t))
                    stats.migration_bytes += t.numel() * t.element_size()
        except RuntimeError as e:
            raise self._fail(f"sending samples to rank {dst}", dst, e) from e
        return works

    def _recv(self, src: int, names: list[str], stats) -> dict[str, torch.Tensor] | None:
        peer = self._global(src)
        header = torch.zeros(_MAX_TENSORS, 2 + _MAX_DIMS, dtype=torch.long, device=self.device)
        try:
            dist.recv(header, peer, group=self.group, tag=0)
            header = header.cpu()
            if int(header[0, 0]) < 0:
                return None
            package = {}
            for i, name in enumerate(names):
                code, ndim = int(header[i, 0]), int(header[i, 1])
                shape = header[i, 2:2 + ndim].tolist()
                t = torch.empty(shape, dtype=_DTYPES[code], device=self.device)
                if t.numel():
                    dist.recv(t, peer, group=self.group, tag=1 + i)
                    stats.migration_bytes += t.numel() * t.element_size()
                package[name] = t
        except RuntimeError as e:
            raise self._fail(f"receiving samples from rank {src}", src, e) from e
        return package

    # ------------------------------------------------------------------ results
    def return_results(self, out: Outputs, mine: list[int]) -> None:
        """Send every finished sample to the rank that owns it; afterwards ``out`` holds
        exactly this rank's samples ``mine``, each once."""
        own = set(mine)
        foreign = [out.pop(s) for s in list(out.tokens) if s not in own]
        gathered = [None] * self.size
        try:
            dist.all_gather_object(gathered, foreign, group=self.group)
        except RuntimeError as e:
            raise self._fail("returning samples to their owners", None, e) from e
        for records in gathered:
            for record in records:
                if record[0] in own:
                    out.put(record)  # raises if a sample arrives twice
        lost = [s for s in mine if s not in out.tokens or out.reasons[s] is None]
        if lost:
            raise MigrationError(f"samples {lost[:8]} did not come back from migration")


def _pad_header(header: torch.Tensor) -> torch.Tensor:
    if header.shape[0] > _MAX_TENSORS:
        raise ValueError(f"a migration package has {header.shape[0]} tensors (at most {_MAX_TENSORS})")
    return torch.cat([header, header.new_zeros(_MAX_TENSORS - header.shape[0], header.shape[1])])


def _records(out: Outputs, sids: list[int], device) -> dict[str, torch.Tensor]:
    """Samples ``sids``' outputs so far as padded tensors (removed from ``out``)."""
    recs = [out.pop(s) for s in sids]
    width = max(len(r[1]) for r in recs)
    toks = torch.zeros(len(recs), width, dtype=torch.long)
    lps = torch.zeros(len(recs), width, dtype=torch.float64)
    slps = torch.zeros(len(recs), width, dtype=torch.float64)
    for i, (_, t, lp, slp, *_) in enumerate(recs):
        toks[i, :len(t)] = torch.tensor(t, dtype=torch.long)
        lps[i, :len(t)] = torch.tensor(lp, dtype=torch.float64)
        slps[i, :len(t)] = torch.tensor(slp, dtype=torch.float64)
    n = torch.tensor([len(r[1]) for r in recs], dtype=torch.long)
    return {"out:tokens": toks.to(device), "out:logprobs": lps.to(device),
            "out:sampling_logprobs": slps.to(device), "out:count": n.to(device)}


def _unpack_records(package: dict[str, torch.Tensor]) -> list[tuple]:
    sids = package["sid"].tolist()
    counts = package["out:count"].tolist()
    toks, lps = package.pop("out:tokens").tolist(), package.pop("out:logprobs").tolist()
    slps = package.pop("out:sampling_logprobs").tolist()
    package.pop("out:count")
    return [(s, toks[i][:c], lps[i][:c], slps[i][:c], None) for i, (s, c) in enumerate(zip(sids, counts))]
