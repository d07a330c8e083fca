"""Whole-sequence core attention through torch SDPA, for megatron-core's local layer spec.

megatron-core's local ``DotProductAttention`` (the spec without Transformer Engine: every
CPU, and a GPU without TE such as the one lent to this project) materialises the scores
``[b, heads, s, s]``, repeats K/V per query head for grouped-query attention, and keeps the
scores, their fp32 softmax and the probabilities for the backward: for SmolLM2-135M on 8
sequences of 208 tokens in bf16, most of the 2.6 GiB a training forward holds. torch's
``scaled_dot_product_attention`` computes the same attention in blocks (flash or
memory-efficient kernels on a GPU, the flash kernel on a CPU), recomputing what its
backward needs: no ``s x s`` tensor is kept.

:class:`SDPAttention` is a drop-in ``core_attention`` submodule (same constructor, same
parameters and state dict): a KV group's query heads are folded into rows (plain
multi-head attention against the group's keys, the boolean mask repeated per row, as in
decoding, :func:`~megatron_rlhf.generation.incremental.attention`), the mask is
megatron's (True where attention is blocked, inverted for SDPA), the softmax scale and the
attention dropout are the module's. Cases it does not cover go to megatron's own forward:
a sliding window, a softmax offset (``softmax_type`` other than vanilla), an attention
bias, packed sequences, query-key layer scaling's fp16 coefficient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.utils import is_layer_window_attention


class SDPAttention(DotProductAttention):
    """megatron-core's ``DotProductAttention`` computed by torch SDPA (module docstring)."""

    def __init__(self, config, layer_number, *args, **kwargs):
        super().__init__(config, layer_number, *args, **kwargs)
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
        # [sq, b, np, hn] -> [b, ng, g * sq, hn]: a group's query heads stacked as rows
        q = query.permute(1, 2, 0, 3).reshape(b, groups, g * sq, d)
        k, v = key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3)
        mask = None
        if attention_mask is not None:
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
