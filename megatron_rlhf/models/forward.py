"""Whole-sequence forward passes with explicit masks (no KV cache). Tensors are batch-first
(megatron's are sequence-first inside); ``attention_mask`` marks real tokens of left-padded rows.

An LM's forward returns its logits, or with ``hidden`` its head's input (:func:`head_input`),
which ``rlhf.chunked_head`` multiplies by :func:`head_weight` a chunk of tokens at a time: where
:func:`head_chunk` is set, ``models.pipeline.model_output`` asks for that.
"""

from __future__ import annotations

import contextlib
import functools

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
                   output_from: int = 0, hidden: bool = False, **kw):
    """``model``'s raw output ``[B, T, ...]`` for a (left-)padded batch; ``kw`` go to the model.

    ``output_from``: the output covers columns ``output_from:`` only (under sequence
    parallelism: all). ``hidden``: an LM's output is its head's input ``[B, T, h]``
    (:func:`head_input`), not its logits. Raises ValueError when the model ignores explicit masks."""
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
        with head_as_output(model, hidden):
            out = model(input_ids, position_ids(attention_mask), causal_padding_mask(attention_mask), **kw)
    finally:
        for h in hooks:
            h.remove()
    if hooks:
        return out
    return out[:, :length] if model.post_process and out.shape[1] != length else out


@contextlib.contextmanager
def head_as_output(model, on: bool = True):
    """Within the block (where ``on``) an LM's forward returns its head's input
    (:func:`head_input`), not its logits."""
    head = model.output_layer if on and model.post_process else None
    if head is not None:  # (an instance attribute: it shadows the class's forward until deleted)
        head.forward = functools.partial(head_input, head)
    try:
        yield
    finally:
        if head is not None:
            del head.forward


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


def head_chunk(model) -> int:
    """Tokens per chunk of ``model``'s LM head in its log-prob forwards (:func:`set_head_chunk`);
    0: those forwards return the logits."""
    return getattr(model, "mrlhf_head_chunk", 0)


def set_head_chunk(model, tokens: int) -> None:
    """From now on ``model``'s log-prob forwards (``models.pipeline.model_output``) return its
    head's input, the head applied ``tokens`` at a time (``rlhf.chunked_head``); 0: the logits.
    ValueError for a negative ``tokens`` or a head other than megatron's bias-free,
    output-gathering column-parallel linear (a value head, a draft's subset head)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    if not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"the LM head's chunk must be a number of tokens >= 0 (0: off), got {tokens!r}")
    head = model.output_layer if tokens and model.post_process else None
    if head is not None and (type(head) is not ColumnParallelLinear or head.bias is not None
                             or not head.gather_output):
        raise ValueError(f"the chunked LM head applies a bias-free ColumnParallelLinear that gathers "
                         f"its output; this {model.mrlhf_role}'s output layer is a {type(head).__name__}: "
                         "set its chunk to 0 (--head-chunk-tokens 0)")
    model.mrlhf_head_chunk = tokens


def head_input(head, x: torch.Tensor, weight=None, runtime_gather_output=None):
    """``(x, None)``: what ``head``, a column-parallel LM head, multiplies by its weight shard,
    in its forward's signature: under sequence parallelism ``x`` gathered over the sequence,
    else ``x`` with its gradient summed over TP."""
    # Each TP rank's head shard gives a partial gradient of x: megatron's own column-parallel
    # linear sums them the same ways (a reduce-scatter, or an all-reduce).
    from megatron.core.tensor_parallel import (copy_to_tensor_model_parallel_region,
                                               gather_from_sequence_parallel_region)

    tp = head.tp_group
    if tp is None or tp.size() == 1:
        return x, None
    if head.sequence_parallel:
        return gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=tp), None
    return copy_to_tensor_model_parallel_region(x, group=tp), None


def head_weight(model) -> torch.Tensor:
    """The LM head's weight ``[V_padded / TP, h]`` (the embedding's where they are tied)."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight
