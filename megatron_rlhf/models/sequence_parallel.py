"""Sequence parallelism (Korthikanti et al., 2022): outside the TP regions each TP rank holds
``1/TP`` of the sequence. What megatron-core lacks for the local spec: an RMSNorm
(:func:`block_spec`), padding (:func:`pad`), :func:`gather`, and :func:`disabled` for decoding.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

# Module attributes through which megatron's modules act on sequence parallelism (besides the
# shared config.sequence_parallel).
FLAGS = ("sequence_parallel", "reduce_scatter_embeddings")


def enabled(model) -> bool:
    return bool(getattr(model.config, "sequence_parallel", False))


class SequenceParallelRMSNorm:
    """Torch's RMSNorm, its weight marked ``sequence_parallel`` when the config is."""

    # megatron's torch-norm wrapper refuses sequence parallelism (only apex's and TE's norms
    # mark their weights). A norm over a sequence shard needs its weight's gradient summed over
    # TP, which finalize_model_grads does for parameters marked sequence_parallel.
    # Like megatron's WrappedTorchNorm, the class returns the torch module itself.
    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_):
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


def block_spec(layer_spec, layers: int):
    """megatron's block spec of ``layers`` layers of the local ``layer_spec``, every norm (the
    final one included) a :class:`SequenceParallelRMSNorm`."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    sub = layer_spec.submodules
    sub.input_layernorm = sub.pre_mlp_layernorm = SequenceParallelRMSNorm
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * layers,
                                      layer_norm=SequenceParallelRMSNorm)


def padded_length(model, length: int) -> int:
    """``length`` rounded up to a multiple of TP when ``model`` splits sequences."""
    if not enabled(model):
        return length
    tp = model.pg_collection.tp.size()
    return -(-length // tp) * tp


def pad(model, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """``(input_ids, attention_mask)`` right-padded to :func:`padded_length` (mask 0)."""
    # Mask 0: no real token attends to the padding. masked_forward cuts the outputs back.
    extra = padded_length(model, input_ids.shape[1]) - input_ids.shape[1]
    if extra == 0:
        return input_ids, attention_mask
    return F.pad(input_ids, (0, extra)), F.pad(attention_mask, (0, extra))


def gather(x: torch.Tensor, group) -> torch.Tensor:
    """``[s / TP, ...]`` shards -> ``[s, ...]`` on every TP rank, for a consumer replicated
    over TP (a value head, a feature draft's targets); the gradient is split back, not summed."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=group)


def gather_output(model, x: torch.Tensor) -> torch.Tensor:
    """:func:`gather` over ``model``'s TP group when it splits sequences, else ``x``."""
    return gather(x, model.pg_collection.tp) if enabled(model) else x


@contextlib.contextmanager
def disabled(model):
    """Within the block, ``model``'s modules run without sequence parallelism. No-grad
    forwards only (RuntimeError otherwise)."""
    # A cached decoding step feeds 1 to n+1 tokens, which cannot be split over TP.
    if not enabled(model):
        yield
        return
    # The modules' backward settings (e.g. a column-parallel linear's input-gradient all-reduce)
    # were fixed when they were built.
    if torch.is_grad_enabled():
        raise RuntimeError("sequence_parallel.disabled is for no-grad forwards (decoding): "
                           "wrap the call in torch.no_grad()")
    known = getattr(model, "_mrlhf_sp_flags", None)
    if known is None:  # (the modules' flags and configs, found once per model)
        flipped = [(m, f) for m in model.modules() for f in FLAGS if getattr(m, f, None) is True]
        configs = list({id(m.config): m.config for m in model.modules()
                        if getattr(getattr(m, "config", None), "sequence_parallel", False) is True}.values())
        known = model._mrlhf_sp_flags = (flipped, configs)
    flipped, configs = known
    try:
        for m, f in flipped:
            setattr(m, f, False)
        for c in configs:
            c.sequence_parallel = False
        yield
    finally:
        for m, f in flipped:
            setattr(m, f, True)
        for c in configs:
            c.sequence_parallel = True
