"""Right-padded token feeds and their real tokens, packed position-major.

Entry points: :func:`pad_right`, :class:`Packing` (the layers run on real tokens only) and
:func:`packed_positions` (where each packed token sits in the ``[B, n]`` feed).
"""

from __future__ import annotations

import torch

from megatron_rlhf.data.padding import padded


def pad_right(seqs: list[list[int]], pad_id: int, device) -> torch.Tensor:
    """``[B, longest]`` right-padded token ids."""
    return padded(seqs, pad_id, torch.long, device)


def packed_positions(valid: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows [T], columns [T])`` of the real tokens of a ``[B, n]`` feed with ``valid [B]``
    per row, position-major."""
    real = torch.arange(n, device=valid.device)[:, None] < valid[None, :]  # [n, B]
    cols, rows = real.nonzero(as_tuple=True)
    return rows, cols


class Packing:
    """The real tokens of a right-padded ``[n, B]`` feed as ``[T, 1, ...]``, position-major:
    the residual stream and the linears run on those; the attention unpacks and repacks."""

    def __init__(self, valid: torch.Tensor, n: int, b: int):
        real = torch.arange(n, device=valid.device)[:, None] < valid[None, :]  # [n, B]
        self.keep = real.reshape(-1).nonzero()[:, 0]  # flat [n, B] index of each real token
        self.n, self.b = n, b

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """``[n, B, ...]`` -> ``[T, 1, ...]``."""
        return t.reshape(self.n * self.b, *t.shape[2:]).index_select(0, self.keep)[:, None]

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        """``[T, 1, ...]`` -> ``[n, B, ...]``, zeros at padding."""
        t = t[:, 0]
        out = t.new_zeros((self.n * self.b, *t.shape[1:]))
        return out.index_copy_(0, self.keep, t).view(self.n, self.b, *t.shape[1:])
