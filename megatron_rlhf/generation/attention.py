"""Decode attention over the KV cache: the backends and the masks they read.

Entry points: :func:`default_backend` (the one choice, made once by the caller and passed
down), :func:`attention`, :func:`flash_attention`. Grouped-query heads as megatron lays them
out; the matmul backend's arithmetic lives in :mod:`~megatron_rlhf.generation.cpu_numerics`.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

# matmul: two batched matmuls and an fp32 softmax (the CPU's); sdpa: torch's fused attention
# (the GPU's without flash-attn); flash: flash_attn_with_kvcache on the cache in place (the
# GPU's with flash-attn; a half-precision cache only, an fp32 one takes sdpa)
BACKENDS = ("matmul", "sdpa", "flash")
ENV_OVERRIDE = "MRLHF_DECODE_ATTENTION"  # forces a backend on every device (read in default_backend only)

_flash_kvcache = None  # flash_attn_with_kvcache once imported (False: it does not import)


def flash_kvcache():
    """flash-attn's ``flash_attn_with_kvcache`` (None when flash-attn does not import)."""
    global _flash_kvcache
    if _flash_kvcache is None:
        try:
            from flash_attn import flash_attn_with_kvcache
        except Exception:  # noqa: BLE001 - not installed, or built for another torch/CUDA
            flash_attn_with_kvcache = False
        _flash_kvcache = flash_attn_with_kvcache
    return _flash_kvcache or None


def check_backend(name: str, where: str = "decode attention backend ") -> str:
    """``name`` when it is a usable backend; raises ValueError naming ``where`` otherwise."""
    if name not in BACKENDS:
        raise ValueError(f"{where}{name!r}: use one of {', '.join(BACKENDS)}")
    if name == "flash" and flash_kvcache() is None:
        raise ValueError(f"{where}{name!r}: flash-attn does not import here (pip install flash-attn); "
                         "use sdpa or matmul")
    return name


def default_backend(device) -> str:
    """The backend for tensors on ``device``: :data:`ENV_OVERRIDE` when set (the only place
    it is read), else on CUDA ``flash`` when flash-attn imports and ``sdpa`` when not, and
    ``matmul`` elsewhere."""
    name = os.environ.get(ENV_OVERRIDE) or None
    if name is not None:
        return check_backend(name, f"{ENV_OVERRIDE}=")
    if torch.device(device).type != "cuda":
        return "matmul"
    return "flash" if flash_kvcache() is not None else "sdpa"


def attention_mask(lengths: torch.Tensor, n: int, k_len: int) -> torch.Tensor:
    """``[B, 1, n, k_len]`` bool: query ``j`` of row ``b`` sees keys ``t <= lengths[b] + j``."""
    q_pos = lengths[:, None] + torch.arange(n, device=lengths.device)  # [B, n]
    keys = torch.arange(k_len, device=lengths.device)
    return (keys[None, None, :] <= q_pos[:, :, None])[:, None]


def flash_seqlens(lengths: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`flash_attention`'s int32 ``seqlens`` once ``n`` tokens were written after ``lengths``."""
    return (lengths + n).to(torch.int32)


def flash_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seqlens: torch.Tensor) -> torch.Tensor:
    """``q [n, B, H, d]`` over the cache as it lies (``keys, values [B, KV, L, d]``, row
    ``b``'s keys ending at ``seqlens[b]``) -> ``[n, B, H, d]``. Causal: query ``j`` sits at
    ``seqlens[b] - n + j``. Reads no host value, so a static step may pass the whole cache."""
    # [B, L, KV, d] views: strided is fine, only the last dimension must be contiguous
    out = flash_kvcache()(q.transpose(0, 1), keys.transpose(1, 2), values.transpose(1, 2),
                          cache_seqlens=seqlens, causal=True)
    return out.transpose(0, 1)


def group_bias(mask: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, 1, groups*n, L]`` additive mask (0 or -inf) of ``mask [B, 1, n, L]`` for the
    stacked query rows of :func:`fold`: built once per forward, read by every layer."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return bias.repeat(1, 1, groups, 1)


def fold(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``q [B, H, n, d]`` as ``[B, KV, g*n, d]``: a KV group's query heads stacked as rows."""
    b, h, n, d = q.shape
    return q.reshape(b, k.shape[1], h // k.shape[1] * n, d)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, backend: str,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped-query attention, ``q [B, H, n, d]``, ``k, v [B, KV, L, d]``, ``mask [B, 1, n, L]``
    -> ``[B, H, n, d]``. ``backend`` ``flash`` with an fp32 cache comes here as ``sdpa``.
    ``bias``: :func:`group_bias` of ``mask`` (the matmul backend's in fp32, sdpa's in the
    cache's dtype), when the caller made it once per forward."""
    if backend == "matmul":
        from megatron_rlhf.generation import cpu_numerics

        return cpu_numerics.matmul_attention(q, k, v, mask, bias)
    b, h, n, d = q.shape
    # folded rows: with grouped heads and a mask torch's SDPA has only its math kernel,
    # as plain multi-head attention the memory-efficient kernel takes it. The mask goes in
    # additive, the form SDPA would convert a bool mask to at every call.
    if bias is None:
        bias = group_bias(mask, h // k.shape[1], q.dtype)
    return F.scaled_dot_product_attention(fold(q, k), k, v, attn_mask=bias).reshape(b, h, n, d)


def sdpa_kernel_name(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> str:
    """The fused kernel torch's SDPA takes for the ``sdpa`` backend's call on these inputs
    (``flash``, ``efficient``, ``cudnn``, ``math``; ``none``), each tried alone in torch's order."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qg = fold(q, k)
    mask_rows = group_bias(mask, q.shape[1] // k.shape[1], q.dtype)  # as the forward passes it
    for name, kernel in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                         ("cudnn", SDPBackend.CUDNN_ATTENTION), ("math", SDPBackend.MATH)):
        try:
            with sdpa_kernel([kernel]):
                F.scaled_dot_product_attention(qg, k, v, attn_mask=mask_rows)
            return name
        except RuntimeError:
            continue
    return "none"
