"""Rotary position embeddings at each sample's own positions, from the model's rotary module.

Entry point: :class:`RopeTable`, built once per request for the longest cache.
"""

from __future__ import annotations

import torch


class RopeTable:
    """RoPE angles for positions ``0..max_len-1`` from the model's own rotary module."""

    def __init__(self, model, max_len: int):
        freqs = model.rotary_pos_emb(max_len)  # [max_len, 1, 1, rot_dim]
        self.freqs = freqs[:, 0, 0]  # [max_len, rot_dim]
        self.cos = torch.cos(self.freqs)
        self.sin = torch.sin(self.freqs)

    def angles(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` at positions ``pos [B, n]``, each ``[n, B, 1, dim]`` in ``dtype``."""
        return (self.cos[pos].transpose(0, 1)[:, :, None].to(dtype),
                self.sin[pos].transpose(0, 1)[:, :, None].to(dtype))

    def apply(self, t: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """RoPE on ``t [n, B, heads, dim]`` at positions ``pos [B, n]`` (rotate-half form)."""
        return rotate(t, *self.angles(pos, t.dtype))


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``t [n, B, heads, dim]`` with angles ``[n, B, 1, dim]``."""
    half = t.shape[-1] // 2
    rotated = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
    return t * cos + rotated * sin
