"""What the generator holds per sample: :class:`Outputs` (tokens and log-probs by global
index) and :class:`Rows`, the live batch: ``sid``, ``emitted``, ``pending`` (newest token,
not yet in the actor cache), ``alive``, and with a draft model its catch-up buffer
(``catch_tokens``, ``catch_count``, ``catch_features``), row-aligned with the KV caches.
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
        """Remove and return sample ``sid``'s record ``(sid, tokens, lps, slps, reason)``."""
        return (sid, self.tokens.pop(sid), self.logprobs.pop(sid),
                self.sampling_logprobs.pop(sid), self.reasons.pop(sid))

    def put(self, record: tuple) -> None:
        sid, toks, lps, slps, reason = record
        if sid in self.tokens:
            raise RuntimeError(f"sample {sid} arrived twice")
        self.tokens[sid], self.logprobs[sid] = list(toks), list(lps)
        self.sampling_logprobs[sid], self.reasons[sid] = list(slps), reason


class Rows:
    """The live batch: per-row tensors (``fields``) and KV caches (``caches``), row-aligned."""

    def __init__(self, fields: dict[str, torch.Tensor], caches: dict[str, KVCache]):
        self.fields, self.caches = fields, caches

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
        """Drop finished rows (``filled`` as in :meth:`select`)."""
        if not bool(self.fields["alive"].all()):
            self.select(self.fields["alive"].nonzero()[:, 0], filled)

    def pack(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Rows ``rows`` as tensors (what migration sends): every field, each cache packed
        by :meth:`KVCache.pack_rows` (``cache:NAME`` and ``cache_len:NAME``)."""
        out = {key: val[rows] for key, val in self.fields.items()}
        for name, cache in self.caches.items():
            out[f"cache:{name}"], out[f"cache_len:{name}"] = cache.pack_rows(rows)
        return out

    def append(self, packed: dict[str, torch.Tensor]) -> None:
        """Add rows packed by :meth:`pack` (on another rank) after this batch's rows."""
        for key, val in self.fields.items():
            self.fields[key] = join_rows(val, packed[key].to(val.device))
        for name, cache in self.caches.items():
            cache.append_rows(packed[f"cache:{name}"].to(cache.lengths.device),
                              packed[f"cache_len:{name}"])


def join_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a`` then ``b`` along rows; a second dimension that differs is zero-padded."""
    if a.dim() > 1 and a.shape[1] != b.shape[1]:
        width = max(a.shape[1], b.shape[1])
        a, b = (torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, width - t.shape[1]))
                for t in (a, b))
    return torch.cat([a, b.to(a.dtype)])
