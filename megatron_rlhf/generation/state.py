"""What the generator holds per sample: :class:`Outputs` (tokens and log-probs by global
index) and :class:`Rows`, the live batch: ``sid``, ``emitted``, ``pending`` (newest token,
not yet in the actor cache), ``alive``, and with a draft model its catch-up buffer
(``catch_tokens``, ``catch_count``, ``catch_features``), row-aligned with the KV caches. An MoE
actor's cache keeps its tokens' routes; a finished row's go to :attr:`Outputs.routes` when
the row is dropped (:meth:`Rows.compact`, :meth:`Rows.harvest`).
"""

from __future__ import annotations

import torch

from megatron_rlhf.generation.kv_cache import KVCache

WIDE = ("catch_tokens", "catch_features")  # per-row tensors whose width differs between batches


class Outputs:
    """Emitted tokens, log-probs and finish reasons per sample, keyed by global index."""

    def __init__(self, max_new_tokens: int, stop_on_eos: bool, eos: int | None):
        self.tokens: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[float]] = {}
        self.sampling_logprobs: dict[int, list[float]] = {}
        self.reasons: dict[int, str | None] = {}
        # [positions, layers, k] on the host once finished: the fed tokens' routes, then garbage
        self.routes: dict[int, torch.Tensor] = {}
        self.max_new, self.stop_on_eos, self.eos = max_new_tokens, stop_on_eos, eos

    def open(self, sid: int) -> None:
        self.put((sid, [], [], [], None))

    def emit(self, sid: int, tokens: list[int], lps: list[float], slps: list[float]) -> bool:
        """Append tokens to sample ``sid`` up to EOS or the budget; True if it finished."""
        toks, lp, slp = self.tokens[sid], self.logprobs[sid], self.sampling_logprobs[sid]
        for t, a, b in zip(tokens, lps, slps):
            toks.append(t)
            lp.append(a)
            slp.append(b)
            if self.stop_on_eos and t == self.eos:
                self.reasons[sid] = "eos"
                return True
            if len(toks) >= self.max_new:
                self.reasons[sid] = "length"
                return True
        return False

    def pop(self, sid: int) -> tuple:
        """Remove and return sample ``sid``'s record ``(sid, tokens, lps, slps, reason, routes)``."""
        return (sid, self.tokens.pop(sid), self.logprobs.pop(sid),
                self.sampling_logprobs.pop(sid), self.reasons.pop(sid), self.routes.pop(sid, None))

    def put(self, record: tuple) -> None:
        """Add a record of :meth:`pop` (its routes may be left out)."""
        sid, toks, lps, slps, reason, *routes = record
        if sid in self.tokens:
            raise RuntimeError(f"sample {sid} arrived twice")
        self.tokens[sid], self.logprobs[sid] = list(toks), list(lps)
        self.sampling_logprobs[sid], self.reasons[sid] = list(slps), reason
        if routes and routes[0] is not None:
            self.routes[sid] = routes[0]


class Rows:
    """The live batch: per-row tensors (``fields``) and KV caches (``caches``), row-aligned."""

    def __init__(self, fields: dict[str, torch.Tensor], caches: dict[str, KVCache],
                 routes: dict[int, torch.Tensor] | None = None):
        self.fields, self.caches = fields, caches
        self.routes = routes  # where finished rows' routes go (Outputs.routes), if the actor keeps them

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.fields[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self.fields[key] = value

    def __contains__(self, key: str) -> bool:
        return key in self.fields

    def __len__(self) -> int:
        return int(self.fields["sid"].shape[0])

    def select(self, keep: torch.Tensor, filled: dict[str, int] | None = None) -> None:
        """Keep rows ``keep`` (in that order); ``filled``: per cache name, a bound on its
        rows' lengths (only that prefix of the cache is copied)."""
        for key, val in self.fields.items():
            self.fields[key] = val[keep]
        for name, cache in self.caches.items():
            cache.select(keep, (filled or {}).get(name))

    def compact(self, filled: dict[str, int] | None = None) -> None:
        """Drop finished rows (``filled`` as in :meth:`select`), their routes harvested."""
        if not bool(self.fields["alive"].all()):
            self.harvest()
            self.select(self.fields["alive"].nonzero()[:, 0], filled)

    def harvest(self) -> None:
        """The routes of the rows finished since the last call to :attr:`routes`, on the host,
        every position (a graph's step zeroes finished rows' lengths: they bound nothing); the
        caller keeps the fed tokens' (engine ``_routes``). Call before a dynamic round reuses
        finished rows' cache (a graph's step leaves their routes as they are)."""
        cache = self.caches["actor"]
        if self.routes is None or cache.routes is None:
            return
        dead = (~self.fields["alive"]).nonzero()[:, 0]
        if not len(dead):
            return
        new = [(i, sid) for i, sid in enumerate(self.fields["sid"][dead].tolist()) if sid not in self.routes]
        if not new:
            return
        rows = dead[torch.tensor([i for i, _ in new], device=dead.device)]
        records = cache.routes[rows].cpu()
        for j, (_, sid) in enumerate(new):
            self.routes[sid] = records[j]

    def pack(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Rows ``rows`` as tensors (what migration sends): every field, each cache packed
        by :meth:`KVCache.pack_rows` (``cache:NAME`` and ``cache_len:NAME``)."""
        out = {key: val[rows] for key, val in self.fields.items()}
        for name, cache in self.caches.items():
            packed, out[f"cache_len:{name}"] = cache.pack_rows(rows)
            out[f"cache:{name}"] = packed
            if cache.routes is not None:  # (the filled prefix pack_rows took)
                out[f"cache_routes:{name}"] = cache.routes[rows, :packed.shape[3]]
        return out

    def packed_names(self) -> list[str]:
        """The names :meth:`pack` gives its tensors, sorted."""
        names = list(self.fields)
        for name, cache in self.caches.items():
            names += [f"cache:{name}", f"cache_len:{name}"] + ([f"cache_routes:{name}"] if cache.routes is not None else [])
        return sorted(names)

    def append(self, packed: dict[str, torch.Tensor]) -> None:
        """Add rows packed by :meth:`pack` (on another rank) after this batch's rows."""
        for key, val in self.fields.items():
            self.fields[key] = join_rows(val, packed[key].to(val.device))
        for name, cache in self.caches.items():
            routes = packed.get(f"cache_routes:{name}")
            cache.append_rows(packed[f"cache:{name}"].to(cache.lengths.device),
                              packed[f"cache_len:{name}"], None if routes is None else routes.to(cache.lengths.device))


def join_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a`` then ``b`` along rows; a second dimension that differs is zero-padded."""
    if a.dim() > 1 and a.shape[1] != b.shape[1]:
        width = max(a.shape[1], b.shape[1])
        a, b = (torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, width - t.shape[1]))
                for t in (a, b))
    return torch.cat([a, b.to(a.dtype)])
