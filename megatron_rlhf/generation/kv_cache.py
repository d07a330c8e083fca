"""The generator's KV cache: preallocated per layer, one length per sample.

Storage per layer is ``[batch, kv_heads/TP, max_len, head_dim]`` for keys and values: the
same content as ``[batch, max_len, kv_heads/TP, head_dim]``, laid out so that attention
(SDPA, head-major) reads it without a copy. Samples in one batch hold different numbers
of tokens (prompts differ; under speculation each sample accepts a different number),
so ``lengths`` is per sample; positions beyond a sample's length are garbage and masked.

Rows (whole samples) can be packed into one tensor and appended to another cache:
sample migration between data-parallel ranks moves them.

The tensors live in a store of ``capacity`` rows that never moves while the batch shrinks
(finished rows compacted to the front) or grows within it (migrated rows appended):
``keys``, ``values`` and ``lengths`` are views of its first ``batch`` rows, and every
change to them is made in place. CUDA graphs of decode steps
(:mod:`megatron_rlhf.generation.graphs`) read and write the store at fixed addresses.
"""

from __future__ import annotations

import torch


# On CPU, bf16 batched matmuls over many tiny matrices carry a fixed cost per matrix that
# fp32 ones do not: for a bf16 model the attention is faster in fp32 at small batches and
# in bf16 (half the cache bytes read per step) at large ones. Measured on SmolLM2-135M, 2-core
# AVX512-BF16 EPYC, ~50-75 cached tokens, median decode step with an fp32 / a bf16 cache:
# batch 4 36.4 / 39.1 ms, 16 52.1 / 51.5, 32 81.1 / 79.5, 64 128.6 / 120.0.
# A cache whose dtype followed the batch made a sample's numerics depend on its batch
# (DP=1 at 32 samples against DP=2 at 16 each: other logits, other near-tie draws), so by
# default it does not: fp32 at every batch (7% slower at batch 64, no slower up to 32).
# A batch size here brings the bf16 cache back from that batch on.
CPU_HALF_CACHE_MIN_BATCH: int | None = None


def cache_dtype(weight: torch.Tensor, batch: int) -> torch.dtype:
    """The cache's dtype for a model whose weights are ``weight``'s: the model's own on GPU
    and for fp32 models; on CPU fp32 (bf16 from :data:`CPU_HALF_CACHE_MIN_BATCH` samples
    on when it is set; keys and values are computed in bf16 either way: the fp32 cache only
    widens them)."""
    if weight.is_cuda or weight.dtype == torch.float32:
        return weight.dtype
    half_from = CPU_HALF_CACHE_MIN_BATCH
    if weight.dtype == torch.bfloat16 and half_from is not None and batch >= half_from:
        return weight.dtype
    return torch.float32


class KVCache:
    """Keys and values of every layer for a batch of samples."""

    def __init__(self, num_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", capacity: int | None = None):
        shape = (max(batch, capacity or 0), kv_heads, max_len, head_dim)
        self.store_keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.store_values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.store_lengths = torch.zeros(shape[0], dtype=torch.long, device=device)
        self.max_len = max_len
        self.resize(batch)

    def resize(self, batch: int) -> None:
        """Make the store's first ``batch`` rows the cache's (rows past them hold length 0)."""
        if batch > self.capacity:
            raise ValueError(f"{batch} rows do not fit a cache of {self.capacity}")
        self.keys = [k[:batch] for k in self.store_keys]  # [B, kv_heads, max_len, head_dim]
        self.values = [v[:batch] for v in self.store_values]
        self.lengths = self.store_lengths[:batch]  # [B] tokens held per sample
        self.store_lengths[batch:] = 0

    @property
    def capacity(self) -> int:
        return self.store_lengths.shape[0]

    @classmethod
    def for_model(cls, model, batch: int, max_len: int, capacity: int | None = None) -> "KVCache":
        """A cache shaped for this rank's shard of ``model``'s attention."""
        cfg = model.mrlhf_config
        tp = model.pg_collection.tp.size()
        weight = model.embedding.word_embeddings.weight
        return cls(cfg.num_layers, batch, max_len, cfg.num_query_groups // tp, cfg.kv_channels,
                   cache_dtype(weight, max(batch, capacity or 0)), weight.device, capacity)

    @classmethod
    def like(cls, other: "KVCache", batch: int, max_len: int) -> "KVCache":
        """An empty cache with ``other``'s layers, heads, dtype and device."""
        _, heads, _, dim = other.keys[0].shape
        return cls(len(other.keys), batch, max_len, heads, dim, other.keys[0].dtype,
                   other.keys[0].device)

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def nbytes(self) -> int:
        """Bytes of the store (every row of its capacity)."""
        return sum(t.numel() * t.element_size() for t in self.store_keys + self.store_values)

    def check_room(self, n: int) -> None:
        need = int(self.lengths.max()) + n if self.batch else n
        if need > self.max_len:
            raise ValueError(f"KV cache overflow: {need} tokens needed, the cache holds {self.max_len}")

    def slots(self, n: int) -> torch.Tensor:
        """``[B * kv_heads * n]`` rows of a layer's cache viewed as ``[B * kv_heads * max_len,
        head_dim]`` for positions ``lengths .. lengths+n-1`` of every sample and head, in
        ``[B, kv_heads, n]`` order, as :meth:`write` copies them (one index for every layer
        of a forward)."""
        b, h, length, _ = self.keys[0].shape
        pos = self.lengths[:, None] + torch.arange(n, device=self.lengths.device)  # [B, n]
        first = torch.arange(b * h, device=pos.device).view(b, h, 1) * length
        return (first + pos[:, None, :]).reshape(-1)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor | None = None) -> None:
        """Store ``k, v [B, kv_heads, n, head_dim]`` at positions ``lengths .. lengths+n-1``.

        Does not advance ``lengths`` (every layer writes at the same offsets; call
        :meth:`advance` once after the last layer). ``slots`` is :meth:`slots` ``(n)``.
        Rows are copied with ``index_copy_`` (``scatter_`` copies a whole bf16 cache on CPU).
        """
        slots = self.slots(k.shape[2]) if slots is None else slots
        d = k.shape[-1]
        for cache, new in ((self.keys[layer], k), (self.values[layer], v)):
            cache.view(-1, d).index_copy_(0, slots, new.reshape(-1, d).to(cache.dtype))

    def advance(self, n: int | torch.Tensor) -> None:
        self.lengths += n

    def truncate(self, lengths: torch.Tensor) -> None:
        """Roll back to ``lengths`` ([B], each at most the current length): drops rejected tokens.
        Checked on the CPU only (on a GPU the check would be a host sync per round)."""
        if not self.lengths.is_cuda and (bool((lengths > self.lengths).any()) or bool((lengths < 0).any())):
            raise ValueError("truncate can only shorten samples")
        self.lengths.copy_(lengths)

    def pack_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``rows`` as one tensor ``[2 * layers, n, kv_heads, length_max, head_dim]``
        (keys of every layer, then values; only the filled prefix) and their ``lengths [n]``:
        what migration sends."""
        n = int(self.lengths[rows].max()) if len(rows) else 0
        return torch.stack([t[rows, :, :n] for t in self.keys + self.values]), self.lengths[rows].clone()

    def append_rows(self, packed: torch.Tensor, lengths: torch.Tensor) -> None:
        """Add samples packed by :meth:`pack_rows` (of a cache with this one's layers and
        heads) after this cache's rows, in this cache's dtype."""
        layers, n, _, filled, _ = packed.shape
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
        for store, new in zip(self.store_keys + self.store_values, packed):
            store[b:b + n, :, :filled] = new
        self.store_lengths[b:b + n] = lengths.to(self.lengths)
        self.resize(b + n)

    def view_rows(self, start: int, end: int) -> "KVCache":
        """A cache over rows ``start:end`` that shares this one's storage (writes land here);
        its lengths are its own: set this cache's lengths after using it."""
        sub = KVCache.__new__(KVCache)
        sub.store_keys = [k[start:end] for k in self.keys]
        sub.store_values = [v[start:end] for v in self.values]
        sub.store_lengths = self.lengths[start:end].clone()
        sub.max_len = self.max_len
        sub.resize(end - start)
        return sub

    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (in that order), shrinking the batch: drops finished samples.
        The kept rows move to the front of the store, in place."""
        for store, t in zip(self.store_keys + self.store_values, self.keys + self.values):
            store[: len(rows)] = t.index_select(0, rows)
        self.store_lengths[: len(rows)] = self.lengths.index_select(0, rows)
        self.resize(len(rows))
