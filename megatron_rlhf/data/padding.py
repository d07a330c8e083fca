"""Padding ragged rows into one tensor, moved to the device in one copy."""

from __future__ import annotations

import torch

from megatron_rlhf.runtime.devices import device


def padded(rows: list, fill, dtype: torch.dtype, to=None, width: int | None = None,
           left: bool = False) -> torch.Tensor:
    """``[len(rows), width]`` tensor of the lists (or 1-D tensors) ``rows``, padded with
    ``fill`` on the right (or ``left``), on device ``to`` (default: this rank's)."""
    # Assembled on the host and moved in one copy: a tensor per row would be a transfer each.
    width = max([0] + [len(r) for r in rows]) if width is None else width
    out = torch.full((len(rows), width), fill, dtype=dtype, device="cpu")
    for i, r in enumerate(rows):
        if len(r):
            (out[i, width - len(r):] if left else out[i, : len(r)]).copy_(
                torch.as_tensor(r, dtype=dtype, device="cpu"))
    to = torch.device(to) if to is not None else device()
    return out if to.type == "cpu" else out.pin_memory().to(to, non_blocking=True)
