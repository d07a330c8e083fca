"""The generator's KV cache: preallocated per layer, one length per sample.

Storage per layer is ``[batch, kv_heads/TP, max_len, head_dim]`` for keys and values: the
same content as ``[batch, max_len, kv_heads/TP, head_dim]``, laid out so that attention
(SDPA, head-major) reads it without a copy. Samples in one batch hold different numbers
of tokens (prompts differ; under speculation each sample accepts a different number),
so ``lengths`` is per sample; positions beyond a sample's length are garbage and masked.

Rows (whole samples) can be taken out and put back: sample migration between
data-parallel ranks moves them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CacheRows:
    """Whole samples taken out of a cache (what migration ships between ranks)."""

    keys: list[torch.Tensor]
    """Per layer ``[n, kv_heads_local, length_max, head_dim]``."""
    values: list[torch.Tensor]
    """Per layer ``[n, kv_heads_local, length_max, head_dim]``."""
    lengths: torch.Tensor
    """``[n]`` tokens held per sample."""


class KVCache:
    """Keys and values of every layer for a batch of samples."""

    def __init__(self, num_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (batch, kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)  # [B]
        self.max_len = max_len

    @classmethod
    def for_model(cls, model, batch: int, max_len: int) -> "KVCache":
        """A cache shaped for this rank's shard of ``model``'s attention."""
        cfg = model.mrlhf_config
        tp = model.pg_collection.tp.size()
        weight = model.embedding.word_embeddings.weight
        # On CPU, attention in bf16 is 4-6x slower than in fp32 (no bf16 SDPA kernel): keep
        # the cache, and so the attention, in fp32 there; the model's dtype on GPU.
        dtype = weight.dtype if weight.is_cuda else torch.float32
        device = weight.device
        return cls(cfg.num_layers, batch, max_len, cfg.num_query_groups // tp, cfg.kv_channels,
                   dtype, device)

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def check_room(self, n: int) -> None:
        need = int(self.lengths.max()) + n if self.batch else n
        if need > self.max_len:
            raise ValueError(f"KV cache overflow: {need} tokens needed, the cache holds {self.max_len}")

    def slots(self, n: int) -> torch.Tensor:
        """``[B, kv_heads, n, head_dim]`` positions ``lengths .. lengths+n-1`` per sample, as
        :meth:`write` scatters them (one index for every layer of a forward)."""
        b, h, _, d = self.keys[0].shape
        pos = self.lengths[:, None] + torch.arange(n, device=self.lengths.device)  # [B, n]
        return pos[:, None, :, None].expand(b, h, n, d)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor | None = None) -> None:
        """Store ``k, v [B, kv_heads, n, head_dim]`` at positions ``lengths .. lengths+n-1``.

        Does not advance ``lengths`` (every layer writes at the same offsets; call
        :meth:`advance` once after the last layer). ``slots`` is :meth:`slots` ``(n)``.
        """
        slots = self.slots(k.shape[2]) if slots is None else slots
        self.keys[layer].scatter_(2, slots, k.to(self.keys[layer].dtype))
        self.values[layer].scatter_(2, slots, v.to(self.values[layer].dtype))

    def advance(self, n: int | torch.Tensor) -> None:
        self.lengths += n

    def truncate(self, lengths: torch.Tensor) -> None:
        """Roll back to ``lengths`` ([B], each at most the current length): drops rejected tokens."""
        if bool((lengths > self.lengths).any()) or bool((lengths < 0).any()):
            raise ValueError("truncate can only shorten samples")
        self.lengths = lengths.to(self.lengths).clone()

    def take(self, rows: torch.Tensor) -> CacheRows:
        """Copy out whole samples ``rows`` (only the filled prefix)."""
        n = int(self.lengths[rows].max()) if len(rows) else 0
        return CacheRows(
            keys=[k[rows, :, :n].clone() for k in self.keys],
            values=[v[rows, :, :n].clone() for v in self.values],
            lengths=self.lengths[rows].clone(),
        )

    def put(self, rows: torch.Tensor, data: CacheRows) -> None:
        """Write samples into ``rows`` (the inverse of :meth:`take`)."""
        n = data.keys[0].shape[2] if data.keys else 0
        if n > self.max_len:
            raise ValueError(f"rows hold {n} tokens, the cache holds {self.max_len}")
        for dst, src in zip(self.keys + self.values, data.keys + data.values):
            dst[rows, :, :n] = src
        self.lengths[rows] = data.lengths.to(self.lengths)

    def view_rows(self, start: int, end: int) -> "KVCache":
        """A cache over rows ``start:end`` that shares this one's storage (writes land here);
        its lengths are its own: set this cache's lengths after using it."""
        sub = KVCache.__new__(KVCache)
        sub.keys = [k[start:end] for k in self.keys]
        sub.values = [v[start:end] for v in self.values]
        sub.lengths = self.lengths[start:end].clone()
        sub.max_len = self.max_len
        return sub

    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (in that order), shrinking the batch: drops finished samples."""
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.lengths = self.lengths[rows]
