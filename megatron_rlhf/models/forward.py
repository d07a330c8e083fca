"""Whole-sequence forward passes with explicit masks (no KV cache). Tensors are batch-first
(megatron's are sequence-first inside); ``attention_mask`` marks real tokens of left-padded rows.
"""

from __future__ import annotations

import torch


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` positions counting real tokens only (left padding gets position 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def causal_padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, 1, T, T]`` bool, True where attention is *blocked* (megatron's convention).
    Query t sees real keys at positions <= t."""
    b, t = attention_mask.shape
    dev = attention_mask.device
    causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
    allowed = causal[None] & attention_mask.bool()[:, None, :]
    allowed |= torch.eye(t, dtype=torch.bool, device=dev)[None]  # no softmax row left empty
    return ~allowed[:, None]


def masked_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                   output_from: int = 0, **kw):
    """``model``'s raw output ``[B, T, ...]`` for a (left-)padded batch; ``kw`` go to the model.

    ``output_from``: the output covers columns ``output_from:`` only (under sequence
    parallelism: all). Raises ValueError when the model ignores explicit masks."""
    # Callers find the columns from the output's width (rlhf.batch.response_slice).
    from megatron_rlhf.models import sequence_parallel
    from megatron_rlhf.models.builder import check_mask_honoured

    check_mask_honoured(model)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if "decoder_input" in kw and sequence_parallel.enabled(model):
        raise ValueError("a decoder input is not split over the sequence: build this model "
                         "without sequence parallelism")
    # Under sequence parallelism the batch is right-padded to a multiple of TP (mask 0), and
    # the output cut back to the given length. Its output layer gathers the sequence itself,
    # so output_from does not apply there.
    length = input_ids.shape[1]
    input_ids, attention_mask = sequence_parallel.pad(model, input_ids, attention_mask)
    hooks = []
    if output_from > 0 and model.post_process and not sequence_parallel.enabled(model):
        # the output layer gets the kept columns batch-first ([s, b, h] -> [b, s', h]: its
        # matmul and TP gather act on the last dim only) and hands back a seq-first view of
        # its batch-first logits, which the model's closing transpose(0, 1).contiguous()
        # then returns without copying [b, s', V]
        layer = model.output_layer
        hooks = [layer.register_forward_pre_hook(
                     lambda _layer, args: (args[0][output_from:].transpose(0, 1), *args[1:])),
                 layer.register_forward_hook(
                     lambda _layer, _args, out: (out[0].transpose(0, 1), *out[1:]))]
    try:
        out = model(input_ids, position_ids(attention_mask), causal_padding_mask(attention_mask), **kw)
    finally:
        for h in hooks:
            h.remove()
    if hooks:
        return out
    return out[:, :length] if model.post_process and out.shape[1] != length else out


def lm_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
    """``[B, T, V]`` full-vocabulary logits (gathered over TP, vocab padding removed)."""
    return logits_of(model, masked_forward(model, input_ids, attention_mask))


def token_values(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
    """``[B, T]`` scalar values from a critic/reward model."""
    return values_of(masked_forward(model, input_ids, attention_mask))


def logits_of(model, output: torch.Tensor) -> torch.Tensor:
    """An LM's raw output ``[B, T, V_padded]`` -> its logits ``[B, T, V]``."""
    return output[..., : model.mrlhf_config.vocab_size]


def values_of(output: torch.Tensor) -> torch.Tensor:
    """A critic's or reward model's raw output ``[B, T, 1]`` -> values ``[B, T]``."""
    return output.squeeze(-1)
