"""Packed forwards: a micro-batch's rows, their real tokens concatenated without padding into one
sequence, each row attending within itself (megatron-core's ``thd`` format).

Entry points: :func:`pack_rows` (a padded micro-batch -> :class:`Packed`), :func:`packed_forward`
(the model's output laid out as the padded forward's), :func:`supports_packing`.
Invariants: RoPE positions restart at each row; each row's outputs equal the padded forward's up
to the rounding of matmuls over other shapes (the tests state the tolerance).
"""
# The model sees input_ids [1, L] and a PackedSeqParams; megatron applies RoPE per segment
# (rope_utils' thd path) and hands the core attention [t, heads, d] tensors, which
# models.attention.SDPAttention attends segment by segment. The output [1, L, ...] is gathered
# back into the padded micro-batch's columns, so every consumer (response_slice, the chunked
# head, the values' last token) reads it as it reads a padded output.

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor


@dataclass
class PackedSequences(PackedSeqParams):
    """megatron's ``thd`` parameters, with the segments' lengths on the host (the CPU attention
    splits by them without reading ``cu_seqlens`` back)."""

    lengths: tuple = ()


@dataclass
class Packed:
    """A micro-batch of ``b`` rows ``[b, W]`` packed into one sequence of ``L`` tokens."""

    input_ids: Tensor         # [1, L] the rows' real tokens, then padding (a segment of its own)
    params: PackedSequences   # segments: the rows, then the padding if any
    index: Tensor             # [b, W] each padded column's position in the L tokens (0 at padding)

    @property
    def tokens(self) -> int:
        return self.input_ids.shape[1]


def pack_rows(input_ids: Tensor, attention_mask: Tensor, lengths: list[int],
              length: int | None = None, multiple: int = 1) -> Packed:
    """The rows of a padded micro-batch (``attention_mask`` 1 at each row's real tokens, one
    contiguous run of ``lengths[i]`` per row) packed into ``length`` tokens (None: just theirs),
    rounded up to a multiple of ``multiple``; ValueError if they do not fit."""
    real = attention_mask.bool()
    n = sum(lengths)
    size = n if length is None else length
    if size < n:
        raise ValueError(f"{len(lengths)} rows of {n} tokens do not fit a packed length of {size}")
    size = -(-size // multiple) * multiple
    segments = [*lengths, size - n] if size > n else list(lengths)
    if min(segments) < 1:
        raise ValueError(f"a packed row needs at least one token, got lengths {list(lengths)}")
    ids = F.pad(input_ids[real], (0, size - n))[None]  # row-major: each row's tokens in order
    dev = input_ids.device
    cu = torch.tensor([0, *itertools.accumulate(segments)], dtype=torch.int32, device=dev)
    longest = max(segments)
    params = PackedSequences(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                             max_seqlen_kv=longest, lengths=tuple(segments))
    index = (real.flatten().long().cumsum(0) - 1).view(real.shape).clamp(min=0) * real
    return Packed(ids, params, index)


def packed_forward(model, packed: Packed, output_from: int = 0, **kw) -> Tensor:
    """``model``'s raw output for the packed rows laid out as :func:`~.forward.masked_forward`'s
    for the padded micro-batch: ``[b, W - output_from, ...]`` on the last stage (an earlier
    pipeline stage's output is its hidden states ``[L, 1, h]``); ``kw`` go to the model."""
    out = model(packed.input_ids, None, None, packed_seq_params=packed.params, **kw)
    if not model.post_process:
        return out
    return out[0][packed.index[:, output_from:]]


def supports_packing(model) -> bool:
    """Whether every attention layer of ``model`` attends within packed segments here: the
    SDPA core attention of the local layer spec (Transformer Engine's needs a padding-causal
    mask type, which these models are not built with)."""
    from megatron_rlhf.models.attention import SDPAttention

    layers = getattr(getattr(model, "decoder", None), "layers", [])
    return all(isinstance(layer.self_attention.core_attention, SDPAttention)
               and layer.self_attention.core_attention.sdpa for layer in layers)
