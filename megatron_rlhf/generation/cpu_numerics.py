"""Every CPU-only numerics choice of the cached forward, so the GPU path never meets them.

A CPU's matmuls sum in an order that depends on the shape, and many layers amplify a last
bit into a flipped near-tie draw. These choices keep a sample's tokens independent of its
batch, cache length and verification width. Entry point: :class:`CpuForward`, built by
:func:`~megatron_rlhf.generation.incremental.forward_cached` at its one switch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_rlhf.generation.attention import group_bias

ATTEND_ALIGN = 16  # the attention reads a multiple of this many cache positions; caches are sized to one
# widest forward (tokens per row) whose half-precision attention runs one query at a time:
# verifications and short catch-ups, never a prefill chunk
WIDTH_INVARIANT_MAX_TOKENS = 17

# Rows up to which an fp32 CPU linear runs as (w @ x^T)^T (see linear)
SWAPPED_GEMM_MAX_ROWS = 4
SWAPPED_GEMM_MAX_ROWS_THREADED = 8  # with two or more intra-op threads


def aligned_length(length: int) -> int:
    """``length`` rounded up to a multiple of :data:`ATTEND_ALIGN`."""
    return -(-length // ATTEND_ALIGN) * ATTEND_ALIGN


def attended_length(cache, needed: int) -> int:
    """Cache positions the attention reads when ``needed`` hold tokens (at most the cache)."""
    # Rounded up to ATTEND_ALIGN, a row's attention does not depend on the batch's longest
    # row nor on the forward's width: a CPU sums L keys in an order that changes with L.
    half = cache.keys[0].dtype != torch.float32 and not cache.keys[0].is_cuda
    # CPU bf16 matmuls copy a slice of the cache but read the whole contiguous cache in
    # place: past half of it the whole cache costs no more than the slice
    if half and 2 * needed >= cache.max_len:
        return cache.max_len
    return min(aligned_length(needed), cache.max_len)


def width_invariant(dtype: torch.dtype, n: int) -> bool:
    """Whether a matmul-backend forward of ``n`` tokens per row computes its attention one
    query position at a time, each as a one-token step computes it."""
    # In half precision, n query rows sum in another order than one, and rounding the
    # context to bf16 turns that into ulps that flip tokens: per position, a verification's
    # logits equal the steps' bit for bit. fp32 (differences from the GEMMs) is left as is.
    return 1 < n <= WIDTH_INVARIANT_MAX_TOKENS and dtype in (torch.bfloat16, torch.float16)


def matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """The ``matmul`` backend: ``q [B, H, n, d]``, ``k, v [B, KV, L, d]`` -> ``[B, H, n, d]``
    (fp32 softmax); ``bias``: :func:`group_bias` of ``mask``, built here when None."""
    b, h, n, d = q.shape
    kv = k.shape[1]
    g = h // kv
    qg = (q * d ** -0.5).reshape(b, kv, g * n, d)
    bias = group_bias(mask, g, torch.float32) if bias is None else bias
    if k.dtype == torch.float32 or k.is_contiguous():
        scores = torch.matmul(qg, k.transpose(-1, -2))  # [B, KV, g*n, L]
    else:  # keys first: bf16 keys sliced from the cache are copied less in this product
        scores = torch.matmul(k, qg.transpose(-1, -2)).transpose(-1, -2)
    scores = scores.float().add_(bias)
    return torch.matmul(scores.softmax(-1).to(v.dtype), v).reshape(b, h, n, d)


class Spans:
    """The matmul attention in spans of query positions ``[lo, hi)``, one call per span."""

    def __init__(self, mask: torch.Tensor, groups: int, spans: list[tuple[int, int]]):
        self.spans = [(lo, hi, group_bias(mask[:, :, lo:hi], groups, torch.float32)) for lo, hi in spans]

    @classmethod
    def of(cls, mask: torch.Tensor, groups: int, invariant: bool, ragged: bool) -> Spans | None:
        """Spans for ``mask [B, 1, n, L]``: each position when ``invariant``; for a ``ragged``
        feed the first query, then the rest; else None (one call)."""
        n = mask.shape[2]
        if invariant:
            return cls(mask, groups, [(j, j + 1) for j in range(n)])
        # ragged: the first query is what a plain step computes. Padding queries of shorter
        # rows are computed too (the packing drops them): cheaper than copying the drafting
        # rows' keys out of the cache at every layer.
        return cls(mask, groups, [(0, 1), (1, n)]) if ragged else None

    def attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``q [B, H, n, d]``, ``keys, values [B, KV, L, d]`` -> ``[B, H, n, d]``."""
        return torch.cat([matmul_attention(q[:, :, lo:hi], keys, values, None, bias)
                          for lo, hi, bias in self.spans], 2)


def swapped_gemm_max_rows() -> int:
    """Rows up to which an fp32 CPU linear runs as ``(w @ x^T)^T``."""
    return SWAPPED_GEMM_MAX_ROWS_THREADED if torch.get_num_threads() >= 2 else SWAPPED_GEMM_MAX_ROWS


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` without bias; fp32 on CPU with at most
    :func:`swapped_gemm_max_rows` rows as ``(weight @ x^T)^T`` (equal up to rounding)."""
    # With few rows, MKL's transposed-weight path streams the weight slowly; the weight read
    # in place streams it several times faster. bf16 takes F.linear at every row count.
    # Figures: docs/benchmarks.md.
    rows = x.numel() // x.shape[-1]
    if weight.dtype != torch.float32 or weight.is_cuda or rows > swapped_gemm_max_rows():
        return F.linear(x, weight)
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1:  # a matrix-vector product takes the slow path; two rows do not
        flat = flat.expand(2, -1).contiguous()
    # contiguous: a row-parallel output is all-reduced in place next
    out = (weight @ flat.t()).t()[:rows].contiguous()
    return out.view(*x.shape[:-1], weight.shape[0])


class CpuForward:
    """What a forward's layers share under the CPU's numerics: the linear, and the matmul
    backend's bias or spans for ``mask [B, 1, n, L]``."""

    def __init__(self, mask: torch.Tensor, groups: int, dtype: torch.dtype, backend: str, ragged: bool):
        self.bias = self.spans = None
        if backend == "matmul":
            self.spans = Spans.of(mask, groups, width_invariant(dtype, mask.shape[2]), ragged)
            self.bias = group_bias(mask, groups, torch.float32) if self.spans is None else None
        self.linear = linear
