"""The generator's KV cache: preallocated per layer, one length per sample.

Entry point: :class:`KVCache`. Keys and values are ``[batch, kv_heads/TP, max_len, head_dim]``
per layer; past a row's length they are garbage and masked. An MoE actor's cache also holds
each cached token's routes, ``routes [batch, max_len, layers, top-k]`` (:mod:`~megatron_rlhf.models.routing`),
so that they are truncated, compacted and migrated with the keys. Invariant: they are views
of a store that never moves while rows are compacted or appended (CUDA graphs read it in place).
"""

from __future__ import annotations

import torch

from megatron_rlhf.models.routing import RECORD_DTYPE


# On CPU a bf16 model's attention is faster with an fp32 cache at small batches and a bf16
# one at large ones (docs/benchmarks.md). A dtype that followed the batch would make a
# sample's numerics depend on its batch (DP=1 against DP=2: other near-tie draws), so by
# default the CPU cache is fp32 at every batch; a batch size here brings bf16 back from it on.
CPU_HALF_CACHE_MIN_BATCH: int | None = None


def cache_dtype(weight: torch.Tensor, batch: int) -> torch.dtype:
    """The cache dtype for a model of ``weight``'s: the model's own on GPU and for fp32; on
    CPU fp32 (bf16 from :data:`CPU_HALF_CACHE_MIN_BATCH` rows on, when set)."""
    if weight.is_cuda or weight.dtype == torch.float32:
        return weight.dtype
    half_from = CPU_HALF_CACHE_MIN_BATCH
    if weight.dtype == torch.bfloat16 and half_from is not None and batch >= half_from:
        return weight.dtype
    return torch.float32


class KVCache:
    """Keys and values of every layer for a batch of samples."""

    def __init__(self, num_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", capacity: int | None = None,
                 routes: tuple[int, int] | None = None):
        shape = (max(batch, capacity or 0), kv_heads, max_len, head_dim)
        self.store_keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.store_values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.store_lengths = torch.zeros(shape[0], dtype=torch.long, device=device)
        # routes: (MoE layers, top-k) of the routes kept per cached token (None: none kept)
        self.store_routes = None if routes is None else torch.full(
            (shape[0], max_len, *routes), -1, dtype=RECORD_DTYPE, device=device)
        self.max_len = max_len
        self.resize(batch)

    def resize(self, batch: int) -> None:
        """Make the store's first ``batch`` rows the cache's (rows past them hold length 0)."""
        if batch > self.capacity:
            raise ValueError(f"{batch} rows do not fit a cache of {self.capacity}")
        self.keys = [k[:batch] for k in self.store_keys]  # [B, kv_heads, max_len, head_dim]
        self.values = [v[:batch] for v in self.store_values]
        self.lengths = self.store_lengths[:batch]  # [B] tokens held per sample
        self.routes = None if self.store_routes is None else self.store_routes[:batch]
        self.store_lengths[batch:] = 0

    @property
    def capacity(self) -> int:
        return self.store_lengths.shape[0]

    @classmethod
    def for_model(cls, model, batch: int, max_len: int, capacity: int | None = None,
                  routes: bool = False) -> "KVCache":
        """A cache shaped for this rank's shard of ``model``'s attention; ``routes``: keeping
        the routes of an MoE model's tokens."""
        cfg = model.mrlhf_config
        tp = model.pg_collection.tp.size()
        weight = model.embedding.word_embeddings.weight
        return cls(cfg.num_layers, batch, max_len, cfg.num_query_groups // tp, cfg.kv_channels,
                   cache_dtype(weight, max(batch, capacity or 0)), weight.device, capacity,
                   routes=(cfg.num_layers, cfg.moe_router_topk) if routes and cfg.num_experts else None)

    @classmethod
    def like(cls, other: "KVCache", batch: int, max_len: int) -> "KVCache":
        """An empty cache with ``other``'s layers, heads, dtype, device and routes."""
        _, heads, _, dim = other.keys[0].shape
        return cls(len(other.keys), batch, max_len, heads, dim, other.keys[0].dtype,
                   other.keys[0].device, routes=None if other.routes is None else other.routes.shape[2:])

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def nbytes(self) -> int:
        """Bytes of the store (every row of its capacity)."""
        return sum(t.numel() * t.element_size() for t in self._stores())

    def _stores(self) -> list[torch.Tensor]:
        return self.store_keys + self.store_values + ([] if self.store_routes is None else [self.store_routes])

    def check_room(self, n: int) -> None:
        need = int(self.lengths.max()) + n if self.batch else n
        if need > self.max_len:
            raise ValueError(f"KV cache overflow: {need} tokens needed, the cache holds {self.max_len}")

    def slots(self, n: int) -> torch.Tensor:
        """``[B * kv_heads * n]`` rows of a layer's cache viewed as ``[B * kv_heads * max_len,
        head_dim]`` at positions ``lengths .. lengths+n-1``, in ``[B, kv_heads, n]`` order."""
        b, h, length, _ = self.keys[0].shape
        pos = self.lengths[:, None] + torch.arange(n, device=self.lengths.device)  # [B, n]
        first = torch.arange(b * h, device=pos.device).view(b, h, 1) * length
        return (first + pos[:, None, :]).reshape(-1)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor | None = None) -> None:
        """Store ``k, v [B, kv_heads, n, head_dim]`` at positions ``lengths .. lengths+n-1``
        (``slots``: :meth:`slots`); ``lengths`` advance only in :meth:`advance`."""
        # index_copy_: scatter_ copies a whole bf16 cache on CPU
        slots = self.slots(k.shape[2]) if slots is None else slots
        d = k.shape[-1]
        for cache, new in ((self.keys[layer], k), (self.values[layer], v)):
            cache.view(-1, d).index_copy_(0, slots, new.reshape(-1, d).to(cache.dtype))

    def route_rows(self, n: int) -> torch.Tensor:
        """``[n * B]`` rows of :attr:`routes` viewed as ``[B * max_len, layers, k]`` at positions
        ``lengths .. lengths+n-1``, in megatron's token order (position-major ``[n, B]``)."""
        b = self.lengths.shape[0]
        first = torch.arange(b, device=self.lengths.device) * self.max_len + self.lengths  # [B]
        return (first[None, :] + torch.arange(n, device=first.device)[:, None]).reshape(-1)

    def route_records(self) -> torch.Tensor | None:
        """:attr:`routes` as ``[B * max_len, layers, k]`` (None: none kept)."""
        return None if self.routes is None else self.routes.view(-1, *self.routes.shape[2:])

    def advance(self, n: int | torch.Tensor) -> None:
        self.lengths += n

    def truncate(self, lengths: torch.Tensor) -> None:
        """Roll back to ``lengths [B]`` (each at most the current one); raises ValueError
        otherwise, checked on the CPU only (on a GPU it would be a host sync per round)."""
        if not self.lengths.is_cuda and (bool((lengths > self.lengths).any()) or bool((lengths < 0).any())):
            raise ValueError("truncate can only shorten samples")
        self.lengths.copy_(lengths)

    def pack_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``rows`` as ``[2 * layers, n, kv_heads, filled, head_dim]`` (keys, then
        values; the filled prefix) and their ``lengths [n]``: what migration sends."""
        n = int(self.lengths[rows].max()) if len(rows) else 0
        return torch.stack([t[rows, :, :n] for t in self.keys + self.values]), self.lengths[rows].clone()

    def append_rows(self, packed: torch.Tensor, lengths: torch.Tensor, routes: torch.Tensor | None = None) -> None:
        """Add rows packed by :meth:`pack_rows` (and their ``routes [n, filled, layers, k]``) after this cache's;
        raises ValueError when they do not fit its layers or length."""
        layers, n, _, filled, _ = packed.shape
        if (routes is None) != (self.routes is None):
            raise ValueError("rows with routes join a cache that keeps them, and only those")
        if layers != 2 * len(self.keys):
            raise ValueError(f"packed rows hold {layers // 2} layers, this cache {len(self.keys)}")
        if filled > self.max_len:
            raise ValueError(f"rows hold {filled} tokens, the cache holds {self.max_len}")
        b = self.batch
        if b + n > self.capacity:  # a new store (graphs bound to the old one stop serving it)
            grown = [torch.cat([t[:b], t.new_zeros((n, *t.shape[1:]))])
                     for t in self.store_keys + self.store_values]
            self.store_keys, self.store_values = grown[: len(self.keys)], grown[len(self.keys):]
            self.store_lengths = torch.cat([self.lengths, self.lengths.new_zeros(n)])
            if routes is not None:
                self.store_routes = torch.cat([self.routes, self.routes.new_full((n, *self.routes.shape[1:]), -1)])
        for store, new in zip(self.store_keys + self.store_values, packed):
            store[b:b + n, :, :filled] = new
        if routes is not None:
            self.store_routes[b:b + n, :filled] = routes.to(self.store_routes)
        self.store_lengths[b:b + n] = lengths.to(self.lengths)
        self.resize(b + n)

    def view_rows(self, start: int, end: int) -> "KVCache":
        """Rows ``start:end`` sharing this cache's storage, with lengths of their own."""
        sub = KVCache.__new__(KVCache)
        sub.store_keys = [k[start:end] for k in self.keys]
        sub.store_values = [v[start:end] for v in self.values]
        sub.store_lengths = self.lengths[start:end].clone()
        sub.store_routes = None if self.routes is None else self.routes[start:end]
        sub.max_len = self.max_len
        sub.resize(end - start)
        return sub

    def select(self, rows: torch.Tensor, filled: int | None = None) -> None:
        """Keep only ``rows``, in that order, moved to the front of the store in place;
        ``filled``: no row holds more tokens (only that prefix is copied)."""
        end = self.max_len if filled is None else min(filled, self.max_len)
        for store, t in zip(self.store_keys + self.store_values, self.keys + self.values):
            store[: len(rows), :, :end] = t[:, :, :end].index_select(0, rows)
        if self.routes is not None:
            self.store_routes[: len(rows), :end] = self.routes[:, :end].index_select(0, rows)
        self.store_lengths[: len(rows)] = self.lengths.index_select(0, rows)
        self.resize(len(rows))
