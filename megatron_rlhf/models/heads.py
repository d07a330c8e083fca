"""Heads that replace a GPTModel's LM head (:func:`attach_value_head`, :func:`attach_subset_head`)
and an EAGLE draft's input fusion (:func:`attach_feature_fusion`)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn


class ValueHead(nn.Module):
    """``hidden [s, b, h] -> values [s, b, 1]``, replicated over TP like the trunk's output."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, sequence_parallel: bool = False,
                 tp_group=None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        # megatron's output layer attribute (GPTModel reads it; sequence_parallel.disabled sets it)
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:  # the input is a sequence shard per TP rank
            from megatron_rlhf.models.sequence_parallel import gather

            hidden = gather(hidden, self.tp_group)
        return nn.functional.linear(hidden, self.weight), None


def _subset_head_class():
    from megatron.core.tensor_parallel import ColumnParallelLinear

    class SubsetLMHead(ColumnParallelLinear):
        """LM head over ``token_ids`` only: ``hidden [s, b, h] -> logits [s, b, V]``, -inf
        off-head. Its weight keeps megatron's ``output_layer.weight`` name (TP-sharded)."""

        # Full-vocabulary logits let every consumer work unchanged. Speculative decoding stays
        # lossless: the actor's p decides acceptance.

        def __init__(self, config, vocab_size: int, head_size: int, tp_group):
            super().__init__(config.hidden_size, head_size, config=config,
                             init_method=config.init_method, bias=False, gather_output=True,
                             tp_group=tp_group)
            self.register_buffer("token_ids", torch.arange(head_size))  # head row -> token id
            self.vocab_size = vocab_size
            self.head_only = False  # True: return [s, b, head_size] (training a draft)

        def forward(self, hidden, weight=None, runtime_gather_output=None):
            logits, _ = super().forward(hidden)
            return (logits if self.head_only else self.to_vocab(logits)), None

        def to_vocab(self, logits):
            """Head logits ``[..., head_size]`` -> ``[..., vocab]`` (-inf off the head)."""
            full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
            return full.index_copy_(-1, self.token_ids, logits)

    return SubsetLMHead


def attach_subset_head(model) -> None:
    """Replace ``model.output_layer`` with a :class:`SubsetLMHead` of ``head_vocab_size`` rows."""
    cfg = model.mrlhf_config
    model.output_layer = _subset_head_class()(
        model.config, cfg.padded_vocab_size, cfg.head_vocab_size, model.pg_collection.tp
    )


class FeatureFusion(nn.Module):
    """``(embedded tokens [s, b, h], target features [s, b, h]) -> decoder input [s, b, h]``:
    ``fc([embed(x_t), h_{t-1}])``, ``h`` the target's final-norm output one position earlier."""

    def __init__(self, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, 2 * hidden_size, dtype=dtype))
        with torch.no_grad():  # start as "token + feature", the sum of the two inputs
            eye = torch.eye(hidden_size, dtype=dtype)
            self.weight.copy_(torch.cat([eye, eye], 1))

    def forward(self, embedded: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(torch.cat([embedded, features.to(embedded.dtype)], -1), self.weight)


def attach_feature_fusion(model) -> None:
    """Give a feature draft its input fusion (``model.feature_fusion``)."""
    model.feature_fusion = FeatureFusion(model.config.hidden_size, model.config.params_dtype)


def attach_value_head(model) -> None:
    """Replace ``model.output_layer`` with a zero-initialised :class:`ValueHead`."""
    head = ValueHead(model.config.hidden_size, model.config.params_dtype,
                     model.config.sequence_parallel, model.pg_collection.tp)
    model.output_layer = head


@contextlib.contextmanager
def head_logits_only(model):
    """Within the block, a draft with a subset head returns logits over its head tokens only
    (``[..., head_vocab_size]``, in ``token_ids`` order): no full-vocabulary scatter."""
    head = model.output_layer
    if not hasattr(head, "head_only"):
        raise ValueError("head_logits_only needs a model with a reduced LM head (head_vocab_size)")
    head.head_only = True
    try:
        yield
    finally:
        head.head_only = False
