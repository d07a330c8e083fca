"""Whole-sequence core attention through torch SDPA, for megatron-core's local layer spec.

Entry point: :class:`SDPAttention`, a drop-in ``core_attention`` submodule (same constructor,
parameters and state dict).
"""
# Unlike megatron's local DotProductAttention it keeps no s x s tensor for the backward
# (docs/benchmarks has the memory).

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.utils import is_layer_window_attention


class SDPAttention(DotProductAttention):
    """megatron-core's ``DotProductAttention`` computed by torch SDPA."""

    # megatron's local attention materialises [b, heads, s, s] scores, repeats K/V per query
    # head, and keeps scores, fp32 softmax and probabilities for the backward. SDPA works in
    # blocks (flash or memory-efficient kernels) and recomputes what its backward needs.

    def __init__(self, config, layer_number, *args, **kwargs):
        super().__init__(config, layer_number, *args, **kwargs)
        # Cases SDPA does not cover go to megatron's own forward: a sliding window, a softmax
        # offset, query-key layer scaling's fp16 coefficient (and, per call, a bias, or packed
        # rows without their lengths on the host).
        self.sdpa = (config.softmax_type == "vanilla" and not config.apply_query_key_layer_scaling
                     and not is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                                       layer_number))

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """``query [sq, b, np, hn]``, ``key, value [sk, b, ng, hn]``, ``attention_mask
        [b, 1, sq, sk]`` bool (True: blocked) or None (causal) -> ``[sq, b, np * hn]``; packed
        rows (``models.packed``'s parameters) -> ``[t, np * hn]``."""
        packed = getattr(packed_seq_params, "lengths", None)
        if not self.sdpa or attention_bias is not None or (packed_seq_params is not None and not packed):
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params)
        if packed:
            return self._segments(query, key, value, packed)
        sq, b, heads, d = query.shape
        groups = key.shape[2]
        g = heads // groups
        # [sq, b, np, hn] -> [b, ng, g * sq, hn]: a group's query heads stacked as rows, plain
        # multi-head attention against the group's keys (as in decoding)
        q = query.permute(1, 2, 0, 3).reshape(b, groups, g * sq, d)
        k, v = key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3)
        mask = None
        if attention_mask is not None:  # megatron's True is blocked; SDPA's True is allowed
            mask = (~attention_mask).expand(b, 1, sq, key.shape[0]).repeat(1, 1, g, 1)
        ctx = self._sdpa(q, k, v, attn_mask=mask, is_causal=mask is None)
        # [b, ng, g * sq, hn] -> [sq, b, np * hn]
        return ctx.reshape(b, heads, sq, d).permute(2, 0, 1, 3).reshape(sq, b, heads * d)

    def _segments(self, query, key, value, lengths):
        """Packed rows (``models.packed``): ``query [t, np, hn]``, ``key, value [t, ng, hn]``,
        each segment of ``lengths`` causal within itself -> ``[t, np * hn]``."""
        t, heads, d = query.shape
        gqa = key.shape[1] != heads
        out = []
        for q, k, v in zip(*(x.split(lengths) for x in (query, key, value))):
            # [s, n, hn] -> [1, n, s, hn]; the query heads of a group share its keys (enable_gqa)
            q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))
            out.append(self._sdpa(q, k, v, is_causal=True, enable_gqa=gqa)[0].transpose(0, 1))
        return torch.cat(out).reshape(t, heads * d)

    def _sdpa(self, q, k, v, **kw):
        p = self.attention_dropout.p if self.training else 0.0
        if p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p, scale=self.softmax_scale, **kw)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, scale=self.softmax_scale, **kw)
