"""Rotary position embeddings at each sample's own positions, from the model's rotary module.

Entry point: :class:`RopeTable`, built once per request for the longest cache. The rotation is
four ops (:func:`rotate`) and bit-identical to megatron's rotate-half form.
"""

from __future__ import annotations

import torch


class RopeTable:
    """RoPE angles for positions ``0..max_len-1`` from the model's own rotary module."""

    def __init__(self, model, max_len: int):
        freqs = model.rotary_pos_emb(max_len)  # [max_len, 1, 1, rot_dim]
        self.freqs = freqs[:, 0, 0]  # [max_len, rot_dim]
        self.cos = torch.cos(self.freqs)
        sin = torch.sin(self.freqs)
        half = sin.shape[-1] // 2
        # rotate-half's sign folded into the table: -x2 * s == x2 * -s exactly
        self.sin = torch.cat([-sin[:, :half], sin[:, half:]], -1)

    def angles(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, signed sin)`` at positions ``pos [B, n]``, each ``[n, B, 1, dim]`` in ``dtype``."""
        return (self.cos[pos].transpose(0, 1)[:, :, None].to(dtype),
                self.sin[pos].transpose(0, 1)[:, :, None].to(dtype))

    def apply(self, t: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """RoPE on ``t [n, B, heads, dim]`` at positions ``pos [B, n]`` (rotate-half form)."""
        return rotate(t, *self.angles(pos, t.dtype))


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``t [..., dim]`` with angles broadcast to it (``sin``: the signed
    table of :meth:`RopeTable.angles`): ``t * cos + [x2, x1] * [-s, s]``."""
    swapped = t.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return t * cos + swapped * sin
