"""Scalar value head for critic and reward models.

The critic/reward model is the actor's ``GPTModel`` trunk with its LM head replaced by a
linear map ``hidden -> 1`` per token (replicated over TP: the trunk's output is already
replicated). ``GPTModel.forward`` then returns ``[batch, seq, 1]`` values.
"""

from __future__ import annotations

import torch
from torch import nn


class ValueHead(nn.Module):
    """``hidden [s, b, h] -> values [s, b, 1]``, called like megatron's output layer."""

    def __init__(self, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        # megatron's output layer attributes that GPTModel reads
        self.sequence_parallel = False

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        return nn.functional.linear(hidden, self.weight), None


def attach_value_head(model) -> None:
    """Replace ``model.output_layer`` with a zero-initialised :class:`ValueHead`."""
    head = ValueHead(model.config.hidden_size, model.config.params_dtype)
    model.output_layer = head
