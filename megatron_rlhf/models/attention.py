"""Whole-sequence core attention through torch SDPA, for megatron-core's local layer spec.

Entry point: :class:`SDPAttention`, a drop-in ``core_attention`` submodule (same constructor,
parameters and state dict).
"""
# Unlike megatron's local DotProductAttention it keeps no s x s tensor for the backward
# (docs/benchmarks has the memory).

from __future__ import annotations

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
        # offset, query-key layer scaling's fp16 coefficient (and, per call, a bias or packing).
        self.sdpa = (config.softmax_type == "vanilla" and not config.apply_query_key_layer_scaling
                     and not is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                                       layer_number))

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """``query [sq, b, np, hn]``, ``key, value [sk, b, ng, hn]``, ``attention_mask
        [b, 1, sq, sk]`` bool (True: blocked) or None (causal) -> ``[sq, b, np * hn]``."""
        if not self.sdpa or attention_bias is not None or packed_seq_params is not None:
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params)
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
        p = self.attention_dropout.p if self.training else 0.0
        if p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                                     is_causal=mask is None, scale=self.softmax_scale)
        else:
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                                 is_causal=mask is None, scale=self.softmax_scale)
        # [b, ng, g * sq, hn] -> [sq, b, np * hn]
        return ctx.reshape(b, heads, sq, d).permute(2, 0, 1, 3).reshape(sq, b, heads * d)
