"""Incremental forward over a megatron-core GPTModel's own modules, with our KV cache.

No copy of the weights: each layer's ``input_layernorm``, ``self_attention``
(``get_query_key_value_tensors`` gives this rank's q, k, v shards; ``linear_proj`` is the
row-parallel output with its TP all-reduce), ``pre_mlp_layernorm`` and ``mlp`` are called
directly. For the plain Llama layers of the local spec (:func:`plain_layers`) the same
weights go through the same ops without the modules' wrappers (:func:`_plain_layer_step`:
bit-identical, a quarter faster at batch 1 on CPU). What is ours: RoPE at each sample's
own positions, the cache, the masks and the attention (:func:`attention`: torch SDPA on
GPU, batched matmuls on CPU, grouped query heads folded into rows for both; or
flash-attn's kernel on the cache in place, :func:`flash_attention`, when it imports).

Every sample feeds the same number of tokens ``n`` per call, each at its own offset
(``cache.lengths``): prefill of right-padded prompts, a 1-token decode step, or an
``n``-token verification. When rows carry padding (prefill), the layers run on the real
tokens only, packed (:class:`_Packing`); only the attention sees the padded shape.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_rlhf.data.padding import padded
from megatron_rlhf.generation.kv_cache import KVCache
from megatron_rlhf.models import sequence_parallel


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


def attention_mask(lengths: torch.Tensor, n: int, k_len: int) -> torch.Tensor:
    """``[B, 1, n, k_len]`` bool, True where query j of sample b may attend key t.

    Query j sits at position ``lengths[b] + j`` and sees keys ``t <= lengths[b] + j``.
    """
    q_pos = lengths[:, None] + torch.arange(n, device=lengths.device)  # [B, n]
    keys = torch.arange(k_len, device=lengths.device)
    return (keys[None, None, :] <= q_pos[:, :, None])[:, None]


BACKENDS = ("matmul", "sdpa", "flash")
"""Decode attention implementations (:func:`attention`): ``matmul``, two batched matmuls
and an fp32 softmax (the CPU default); ``sdpa``, torch's fused attention; ``flash``,
flash-attn's ``flash_attn_with_kvcache`` reading the cache in place (:func:`flash_attention`;
the GPU default when flash-attn imports, else ``sdpa``). ``matmul`` and ``sdpa`` take
grouped-query attention with a KV group's query heads folded into rows; ``flash`` takes it
as it is. ``flash`` needs a half-precision cache: an fp32 one goes through ``sdpa``."""

_backend_override: str | None = None
_flash_kvcache = None  # flash-attn's flash_attn_with_kvcache once imported (False: it does not import)


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


def _check_backend(name: str, where: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{where}{name!r}: use one of {', '.join(BACKENDS)}")
    if name == "flash" and flash_kvcache() is None:
        raise ValueError(f"{where}{name!r}: flash-attn does not import here (pip install flash-attn); "
                         "use sdpa or matmul")
    return name


def set_attention_backend(name: str | None) -> None:
    """Force the decode attention backend (one of :data:`BACKENDS`; None: per device).
    Also ``MRLHF_DECODE_ATTENTION`` in the environment."""
    global _backend_override
    _backend_override = None if name is None else _check_backend(name, "decode attention backend ")


def attention_backend(device) -> str:
    """The decode attention backend for tensors on ``device``: the forced one
    (:func:`set_attention_backend`, ``MRLHF_DECODE_ATTENTION``), else on CUDA ``flash``
    when flash-attn imports and ``sdpa`` when not, and ``matmul`` elsewhere."""
    name = _backend_override or os.environ.get("MRLHF_DECODE_ATTENTION") or None
    if name is not None:
        return _check_backend(name, "MRLHF_DECODE_ATTENTION=")
    if torch.device(device).type != "cuda":
        return "matmul"
    return "flash" if flash_kvcache() is not None else "sdpa"


def flash_seqlens(lengths: torch.Tensor, n: int) -> torch.Tensor:
    """``cache_seqlens`` for :func:`flash_attention` when ``n`` tokens per row were just
    written after ``lengths``: each row's keys end there (int32, as the kernel takes them)."""
    return (lengths + n).to(torch.int32)


def flash_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seqlens: torch.Tensor) -> torch.Tensor:
    """Attention of ``q [n, B, H, d]`` (query j of row b at position ``seqlens[b] - n + j``)
    over the cache as it lies, ``keys, values [B, KV, L, d]`` with each row's keys ending
    at ``seqlens [B]`` (int32): ``flash_attn_with_kvcache`` on the ``[B, L, KV, d]`` views
    (strided: only the last dimension must be contiguous), causal, which aligns the query
    rows to the end of each row's keys. Grouped query heads as they come (head ``h`` reads
    KV group ``h // (H / KV)``, as megatron lays them out). Reads no host value and only
    each row's own keys, so the whole cache can be passed in a static step. Returns
    ``[n, B, H, d]``."""
    out = flash_kvcache()(q.transpose(0, 1), keys.transpose(1, 2), values.transpose(1, 2),
                          cache_seqlens=seqlens, causal=True)
    return out.transpose(0, 1)


def sdpa_kernel_name(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> str:
    """Which fused kernel torch's SDPA takes for :func:`attention`'s folded call on these
    inputs (``flash``, ``efficient``, ``cudnn`` or ``math``): each is tried alone, in
    torch's own order of preference. For the GPU check's table and the generator's log."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qg, mask_rows = _fold(q, k, mask)
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION), ("math", SDPBackend.MATH)):
        try:
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(qg, k, v, attn_mask=mask_rows)
            return name
        except RuntimeError:
            continue
    return "none"


def _fold(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [B, H, n, d]`` with each KV group's ``g`` query heads stacked as rows:
    ``[B, KV, g*n, d]`` (plain multi-head attention against ``k [B, KV, L, d]``), and
    ``mask [B, 1, n, L]`` repeated for those rows: ``[B, 1, g*n, L]``."""
    b, h, n, d = q.shape
    g = h // k.shape[1]
    return q.reshape(b, k.shape[1], g * n, d), mask.repeat(1, 1, g, 1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped-query attention: ``q [B, H, n, d]``, ``k, v [B, KV, L, d]``, ``mask [B, 1, n, L]``.

    A KV group's query heads are adjacent: they are stacked as rows (:func:`_fold`), so k
    and v are used as they lie in the cache, with no copy per query head, and the call is
    plain multi-head attention. Backend (:func:`attention_backend`):

    * ``flash`` (the GPU's when flash-attn imports) does not come here: the cached forward
      calls :func:`flash_attention` on the cache itself; an fp32 cache takes ``sdpa``.
    * ``sdpa`` (GPU): torch SDPA on the folded rows with the repeated boolean mask. Given
      grouped heads (``enable_gqa``) and a mask, torch 2.11 has only its math kernel (fp32
      upcast, K/V repeated per head); folded, the memory-efficient kernel takes it.
    * ``matmul`` (CPU): two batched matmuls, at decode and verification shapes ~5x faster
      than the CPU SDPA kernel (measured at batch 64, fp32). With a bf16 cache (large
      batches, see :func:`~megatron_rlhf.generation.kv_cache.cache_dtype`) the scores come
      from ``k @ q^T`` (the shape bf16 kernels handle best) and the softmax runs in fp32.
      ``bias`` is :func:`group_bias` of ``mask`` in fp32 (made once per forward and shared
      by the layers; built here when not given).
    """
    b, h, n, d = q.shape
    if attention_backend(q.device) != "matmul":  # sdpa; flash with an fp32 cache
        qg, mask_rows = _fold(q, k, mask)
        return F.scaled_dot_product_attention(qg, k, v, attn_mask=mask_rows).reshape(b, h, n, d)
    kv = k.shape[1]
    g = h // kv
    qg = (q * d ** -0.5).reshape(b, kv, g * n, d)
    bias = group_bias(mask, g, torch.float32) if bias is None else bias
    if k.dtype == torch.float32 or k.is_contiguous():
        scores = torch.matmul(qg, k.transpose(-1, -2))  # [B, KV, g*n, L]
    else:  # bf16 keys sliced from the cache: this product copies them less
        scores = torch.matmul(k, qg.transpose(-1, -2)).transpose(-1, -2)
    scores = scores.float().add_(bias)
    return torch.matmul(scores.softmax(-1).to(v.dtype), v).reshape(b, h, n, d)


WIDTH_INVARIANT_MAX_TOKENS = 17
"""Widest forward (tokens per row) whose attention runs one query position at a time in
half precision on the CPU (:func:`width_invariant`): verifications (``n + 1`` tokens,
``n`` up to 8 drafts doubled for long samples) and short catch-ups, never a prefill chunk."""


def width_invariant(dtype: torch.dtype, device, n: int) -> bool:
    """Whether a cached forward of ``n`` tokens per row computes its attention one query
    position at a time, each exactly as a one-token step computes it.

    In bf16 on the CPU a verification over ``n + 1`` positions and ``n + 1`` one-token
    steps gave logits up to 0.75 apart (SmolLM2, 12 rows): the attention's fp32 matmuls
    sum in another order for ``n`` query rows than for one, and rounding the context to
    bf16 turns those last-bit differences into bf16 ulps that 30 layers amplify. Computed
    per position, the verification's logits equal the steps' bit for bit (measured: max
    difference 0; the bf16 linears there are row-invariant), so exact verification keeps
    the tokens of plain decoding in bf16 too. It costs ``n`` attention calls per layer
    instead of one: a 5-token verification of SmolLM2 took 10-15% longer (batch 8: 121 ->
    133 ms; batch 32: 327 -> 376 ms, one EPYC core), the price of speculation that changes
    no token. fp32 is left as is (its differences, ~3e-5 in the logits, come from the fp32
    GEMMs); so is the GPU (SDPA)."""
    return (1 < n <= WIDTH_INVARIANT_MAX_TOKENS and dtype in (torch.bfloat16, torch.float16)
            and attention_backend(device) == "matmul")


ATTEND_ALIGN = 16
"""The attention reads a multiple of this many cache positions (:func:`attended_length`),
and generation sizes its caches to one (:func:`aligned_length`)."""


def aligned_length(length: int) -> int:
    """``length`` rounded up to a multiple of :data:`ATTEND_ALIGN`."""
    return -(-length // ATTEND_ALIGN) * ATTEND_ALIGN


def attended_length(cache, needed: int) -> int:
    """How many cache positions the attention reads when ``needed`` hold tokens: ``needed``
    rounded up to a multiple of :data:`ATTEND_ALIGN` (at most the cache), or on CPU with a
    half-precision cache the whole cache once ``needed`` reaches half of it.

    Rounded, a sample's attention does not depend on how long the batch's longest sample
    is, nor on how many tokens a forward feeds: a CPU's batched matmuls and softmax sum a
    row of ``L`` keys in an order that changes with ``L`` in its last few (measured on the
    2-core EPYC: fp32 results over 61-63 keys differ in the last bit from those over 64; over
    64, 72, 80, ..., 256 keys, positions past the row's length masked, they are equal), and
    such a bit, amplified by 30 layers, flips a near-tie draw. With the linears row-invariant
    (bf16 on the CPUs measured) a decode step then computes each sample as it would in any
    batch and any verification: DP=1 and DP=2, speculation on and off, agree token for token.

    CPU bf16 batched matmuls copy a slice of the cache (its samples lie ``max_len`` apart)
    but read the whole contiguous cache in place: at batch 64 on SmolLM2's shapes, the
    attention over all 146 positions (positions past a sample's length are masked) takes
    what it takes over a slice of 50-70 of them (measured on the 2-core EPYC)."""
    half = cache.keys[0].dtype != torch.float32 and not cache.keys[0].is_cuda
    if half and 2 * needed >= cache.max_len:
        return cache.max_len
    return min(aligned_length(needed), cache.max_len)


def group_bias(mask: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, 1, groups*n, L]`` additive mask (0 or -inf) for :func:`attention`'s stacked rows."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return bias.repeat(1, 1, groups, 1)


class _Packing:
    """Real tokens of a right-padded ``[n, B]`` feed, packed: the residual stream and every
    linear layer run on ``[T, 1, h]`` (T real tokens, position-major) instead of ``[n, B, h]``;
    the attention unpacks q, k, v to ``[n, B, ...]`` and packs its output back. Prefill of
    prompts of different lengths thus spends no matmul work on padding (a third of the
    tokens of SmolLM2's held-out prompts in one run of rows)."""

    def __init__(self, valid: torch.Tensor, n: int, b: int):
        real = torch.arange(n, device=valid.device)[:, None] < valid[None, :]  # [n, B]
        self.keep = real.reshape(-1).nonzero()[:, 0]  # flat [n, B] index of each real token
        self.n, self.b = n, b

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """``[n, B, ...]`` -> ``[T, 1, ...]``."""
        return t.reshape(self.n * self.b, *t.shape[2:]).index_select(0, self.keep)[:, None]

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        """``[T, 1, ...]`` -> ``[n, B, ...]`` (zeros at padding)."""
        t = t[:, 0]
        out = t.new_zeros((self.n * self.b, *t.shape[1:]))
        return out.index_copy_(0, self.keep, t).view(self.n, self.b, *t.shape[1:])


@dataclass
class _Step:
    """What every layer of one cached forward shares (computed once per forward)."""

    cos: torch.Tensor  # [n, B, 1, d] RoPE angles at each fed position
    sin: torch.Tensor
    mask: torch.Tensor  # [B, 1, n, k_len] bool
    bias: torch.Tensor | None  # group_bias(mask) in fp32 on CPU
    slots: torch.Tensor  # cache rows of the fed positions (KVCache.slots)
    k_len: int
    tp: object = None  # the TP group when its size > 1 (for the plain layer path's all-reduce)
    packing: _Packing | None = None  # the layers' activations hold real tokens only
    seqlens: torch.Tensor | None = None  # flash_seqlens: the attention is flash_attention
    spans: "_Spans | None" = None  # the attention in spans of query positions (CPU: _Spans.of)


class _Spans:
    """The matmul attention in spans of query positions ``[lo, hi)``, one call per span,
    each over the whole batch's cache in place, with its own part of the mask's bias."""

    def __init__(self, mask: torch.Tensor, groups: int, spans: list[tuple[int, int]]):
        self.spans = [(lo, hi, group_bias(mask[:, :, lo:hi], groups, torch.float32)) for lo, hi in spans]

    @classmethod
    def of(cls, mask: torch.Tensor, groups: int, invariant: bool, ragged: bool) -> "_Spans | None":
        """The spans of a forward of ``n`` query positions (``mask [B, 1, n, L]``), or None
        (one call): one position at a time when the attention is :func:`width_invariant`
        (each then as a one-token step of the batch computes it); for a ``ragged`` feed (rows
        of ``valid`` real tokens, right-padded) otherwise, every row's first query (what a
        plain step computes), then the later positions. The padding queries of rows that
        verify fewer drafts are computed too (over their own keys; the packing drops their
        outputs): less than copying the drafting rows' keys and values out of the cache for
        every position of every layer, as ragged rounds did before (bf16 SmolLM2 on one EPYC
        core, 16 rows of which 8 verify 4 drafts: 205 ms a round against 217)."""
        n = mask.shape[2]
        if invariant:
            return cls(mask, groups, [(j, j + 1) for j in range(n)])
        return cls(mask, groups, [(0, 1), (1, n)]) if ragged else None

    def attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``q [B, H, n, d]``, ``keys, values [B, KV, L, d]`` -> ``[B, H, n, d]``."""
        return torch.cat([attention(q[:, :, lo:hi], keys, values, None, bias) for lo, hi, bias in self.spans], 2)


def _layer_step(layer, idx: int, x, cache, s: _Step):
    """One transformer layer for ``x [n, B, h]`` through its own modules; writes this
    layer's k, v into the cache. Any layer spec megatron builds (e.g. Transformer Engine's
    fused norm + linear on GPU) runs here."""
    attn = layer.self_attention
    residual = x
    h = layer.input_layernorm(x)
    q, k, v = attn.get_query_key_value_tensors(h, None)  # [n, B, heads_local, d]
    ctx = _cached_attention(idx, q, k, v, cache, s)
    out, bias = attn.linear_proj(ctx)
    x = residual + (out if bias is None else out + bias)
    residual = x
    out, bias = layer.mlp(layer.pre_mlp_layernorm(x))
    return residual + (out if bias is None else out + bias)


def _cached_attention(idx: int, q, k, v, cache, s: _Step):
    """RoPE, cache write and attention of one layer: ``q, k, v [n, B, heads, d]`` ->
    context ``[n, B, heads * d]`` (packed: ``[T, 1, ...]`` -> ``[T, 1, heads * d]``)."""
    if s.packing is not None:
        q, k, v = (s.packing.unpack(t) for t in (q, k, v))
    q, k = rotate(q, s.cos, s.sin), rotate(k, s.cos, s.sin)
    dtype = q.dtype
    cache.write(idx, k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), s.slots)
    if s.seqlens is not None:
        n, b = q.shape[0], q.shape[1]
        ctx = flash_attention(q.to(cache.keys[idx].dtype), cache.keys[idx], cache.values[idx], s.seqlens)
        ctx = ctx.reshape(n, b, -1).to(dtype)
        return ctx if s.packing is None else s.packing.pack(ctx)
    keys, values = cache.keys[idx][:, :, :s.k_len], cache.values[idx][:, :, :s.k_len]
    q = q.permute(1, 2, 0, 3).to(keys.dtype)
    if s.spans is not None:
        ctx = s.spans.attention(q, keys, values)
    else:
        ctx = attention(q, keys, values, s.mask, s.bias)  # [B, heads, n, d]
    b, n = q.shape[0], q.shape[2]
    ctx = ctx.permute(2, 0, 1, 3).reshape(n, b, -1).to(dtype)
    return ctx if s.packing is None else s.packing.pack(ctx)


def _plain_layer_step(layer, idx: int, x, cache, s: _Step):
    """:func:`_layer_step` for a plain Llama layer (:func:`plain_layers`), on the same
    weights with the same ops (bit-identical output) but without the modules' wrappers:
    megatron's linear layers go through autograd functions and TP region mappings even
    under ``inference_mode``, ~0.3 ms per layer on CPU (a quarter of a batch-1 decode
    step of SmolLM2). Row-parallel outputs are all-reduced over the TP group here."""
    attn, mlp = layer.self_attention, layer.mlp
    n, b = x.shape[0], x.shape[1]
    groups = attn.num_query_groups_per_partition
    per_group = attn.num_attention_heads_per_partition // groups
    d = attn.hidden_size_per_attention_head
    ln = layer.input_layernorm
    h = F.rms_norm(x, ln.normalized_shape, ln.weight, ln.eps)
    # megatron's fused QKV layout per query group: its query heads, then k, then v
    mixed = _linear(h, attn.linear_qkv.weight).view(n, b, groups, per_group + 2, d)
    q = mixed[:, :, :, :per_group].reshape(n, b, groups * per_group, d)
    ctx = _cached_attention(idx, q, mixed[:, :, :, per_group], mixed[:, :, :, per_group + 1], cache, s)
    x = x + _row_parallel(_linear(ctx, attn.linear_proj.weight), s.tp)
    ln = layer.pre_mlp_layernorm
    gate, up = _linear(F.rms_norm(x, ln.normalized_shape, ln.weight, ln.eps),
                       mlp.linear_fc1.weight).chunk(2, -1)
    return x + _row_parallel(_linear(F.silu(gate) * up, mlp.linear_fc2.weight), s.tp)


# fp32 GEMMs with a few rows on CPU: ``x @ w^T`` (``F.linear``, MKL's transposed-weight path)
# streams the weight at ~11 GB/s for one row and takes twice that for two, while ``(w @ x^T)^T``
# (same weight, read in place) streams it at ~30 GB/s from two rows on. Measured on the 2-core
# EPYC on SmolLM2's four layer shapes and its head: 2.3-2.7x faster at one row (padded to
# two), 4-6x at two, ~2x at four, with one thread or two; at 5-8 rows faster with two threads
# (a batch-4 verification of 2 tokens: 97 -> 82 ms) but slower with one (a batch-8 step:
# 97 -> 106 ms); from ~16 rows on about even. bf16 is unaffected (F.linear is the faster
# form there at every row count).
SWAPPED_GEMM_MAX_ROWS = 4
SWAPPED_GEMM_MAX_ROWS_THREADED = 8  # with two or more intra-op threads


def swapped_gemm_max_rows() -> int:
    """Rows up to which an fp32 CPU linear runs as ``(w @ x^T)^T`` (see the comment above)."""
    return SWAPPED_GEMM_MAX_ROWS_THREADED if torch.get_num_threads() >= 2 else SWAPPED_GEMM_MAX_ROWS


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` without bias, as ``(weight @ x^T)^T`` for fp32 on CPU with at
    most :func:`swapped_gemm_max_rows` rows; the same product up to float rounding (a
    different summation order)."""
    rows = x.numel() // x.shape[-1]
    if weight.dtype != torch.float32 or weight.is_cuda or rows > swapped_gemm_max_rows():
        return F.linear(x, weight)
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1:  # a matrix-vector product takes the slow path; two rows do not
        flat = flat.expand(2, -1).contiguous()
    # contiguous: a row-parallel output is all-reduced in place next
    out = (weight @ flat.t()).t()[:rows].contiguous()
    return out.view(*x.shape[:-1], weight.shape[0])


def _row_parallel(partial: torch.Tensor, group) -> torch.Tensor:
    """Sum a row-parallel linear's partial outputs over the TP group (``group`` None: TP 1)."""
    if group is not None:
        torch.distributed.all_reduce(partial, group=group)
    return partial


def plain_layers(model) -> bool:
    """True when every layer of ``model`` is what :func:`_plain_layer_step` reproduces: the
    local (non-TE) spec's RMSNorms and megatron column/row-parallel linears without biases,
    plain GQA self-attention (no q/k norms, no output gate, at least one KV group per TP
    rank), a SwiGLU MLP, no fp8 (sequence parallelism is irrelevant: decoding runs whole
    sequences, see :func:`forward_cached`). Checked once per model."""
    known = getattr(model, "_mrlhf_plain_layers", None)
    if known is not None:
        return known
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP

    cfg = model.config
    ok = (cfg.gated_linear_unit and cfg.activation_func is F.silu and not cfg.add_bias_linear
          and not getattr(cfg, "add_qkv_bias", False)
          and getattr(cfg, "glu_linear_offset", 0.0) == 0.0
          and getattr(cfg, "activation_func_clamp_value", None) is None
          and not getattr(cfg, "attention_output_gate", False) and not getattr(cfg, "fp8", None)
          and (cfg.num_query_groups or cfg.num_attention_heads) >= model.pg_collection.tp.size())
    for layer in model.decoder.layers:
        attn = layer.self_attention
        ok = ok and (type(layer.input_layernorm) is torch.nn.RMSNorm
                     and type(layer.pre_mlp_layernorm) is torch.nn.RMSNorm
                     and type(getattr(attn, "q_layernorm", None)) in (type(None), IdentityOp)
                     and type(getattr(attn, "k_layernorm", None)) in (type(None), IdentityOp)
                     and type(attn.linear_qkv) is ColumnParallelLinear
                     and type(attn.linear_proj) is RowParallelLinear
                     and type(layer.mlp) is MLP
                     and type(layer.mlp.linear_fc1) is ColumnParallelLinear
                     and type(layer.mlp.linear_fc2) is RowParallelLinear)
    model._mrlhf_plain_layers = bool(ok)
    return model._mrlhf_plain_layers


def _plain_head(model) -> str | None:
    """``"full"`` when the LM head is a plain megatron column-parallel linear without bias,
    ``"subset"`` for a draft's subset head (:class:`~megatron_rlhf.models.heads` ``SubsetLMHead``
    returning the full vocabulary), both at TP 1 and only when the layers take the plain
    path (:func:`plain_layers`): then the engine applies the head's weight itself
    (:func:`_linear`). Value heads and TP-sharded heads (gathered) go through the module."""
    if not plain_layers(model):
        return None
    head = model.output_layer
    known = getattr(model, "_mrlhf_plain_head", False)
    if known is False:
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear

        known = None
        if model.pg_collection.tp.size() == 1 and getattr(head, "bias", None) is None:
            if type(head) is ColumnParallelLinear:
                known = "full"
            elif isinstance(head, ColumnParallelLinear) and hasattr(head, "to_vocab"):
                known = "subset"
        model._mrlhf_plain_head = known
    return None if known == "subset" and head.head_only else known


def forward_cached(model, cache, tokens: torch.Tensor, rope: RopeTable, *args, **kw):
    """:func:`_forward_cached` (documented there), with a sequence-parallel model's modules
    running whole sequences (:func:`~megatron_rlhf.models.sequence_parallel.disabled`)."""
    with sequence_parallel.disabled(model):
        return _forward_cached(model, cache, tokens, rope, *args, **kw)


def _forward_cached(model, cache, tokens: torch.Tensor, rope: RopeTable,
                    last_index: torch.Tensor | None = None, features: torch.Tensor | None = None,
                    return_features: bool = False, valid: torch.Tensor | None = None,
                    static: bool = False, packed_logits: bool = False):
    """Feed ``tokens [B, n]`` after each sample's cached prefix; returns logits.

    Logits are ``[B, n, V]`` (vocabulary padding removed, gathered over TP), or ``[B, 1, V]``
    at ``last_index [B]`` (a position in ``0..n-1`` per sample) when given. The cache
    advances by ``n`` for every sample. A feature draft also reads the target's features
    ``[B, n, h]`` (see :class:`~megatron_rlhf.models.heads.FeatureFusion`). With
    ``return_features`` the result is ``(logits, final-norm hidden states [B, n, h])`` at
    every fed position (what a feature draft reads next). ``valid [B]``: real tokens per
    row (the rest is right padding, whose outputs are garbage): the layers then compute the
    real tokens only (:class:`_Packing`); the cache still advances by ``n``.

    ``static``: the step a CUDA graph captures (:mod:`megatron_rlhf.generation.graphs`):
    no host value is read (no room check: the caller guarantees it; the attention reads
    the whole cache, positions past each sample's length masked), so every shape and
    address is fixed by the batch and ``n`` (``last_index`` is allowed: a gather; ``valid``
    is not: packing reads the host). Same result as the dynamic step.

    ``packed_logits`` (with ``valid``): logits ``[T, V]`` of the real tokens only, in
    :func:`packed_positions` order (a ragged verification: no LM head, softmax or draw is
    spent on padding).
    """
    b, n = tokens.shape
    if packed_logits and (valid is None or last_index is not None or return_features):
        raise ValueError("packed_logits needs valid, and neither last_index nor return_features")
    if static and valid is not None:
        raise ValueError("a static step feeds every row n tokens (no packing of the valid ones)")
    if not static:
        cache.check_room(n)
    pos = cache.lengths[:, None] + torch.arange(n, device=tokens.device)  # [B, n]
    k_len = cache.max_len if static else attended_length(cache, int(cache.lengths.max()) + n)
    mask = attention_mask(cache.lengths, n, k_len)
    x = model.embedding(input_ids=tokens, position_ids=pos)  # [n, B, h]
    cfg = model.mrlhf_config
    groups = cfg.num_attention_heads // cfg.num_query_groups
    backend = attention_backend(x.device)
    # flash needs a half-precision cache (an fp32 one goes through SDPA)
    flash = backend == "flash" and cache.keys[0].dtype in (torch.float16, torch.bfloat16)
    seqlens = flash_seqlens(cache.lengths, n) if flash else None
    tp = model.pg_collection.tp
    packing = spans = bias = None
    if valid is not None and int(valid.min()) < n:
        packing = _Packing(valid, n, b)
    if backend == "matmul":
        spans = _Spans.of(mask, groups, width_invariant(x.dtype, x.device, n), packing is not None)
        bias = group_bias(mask, groups, torch.float32) if spans is None else None
    step = _Step(*rope.angles(pos, x.dtype), mask, bias, cache.slots(n), k_len,
                 tp if tp.size() > 1 else None, packing, seqlens, spans)
    layer_step = _plain_layer_step if plain_layers(model) else _layer_step
    if getattr(model, "feature_fusion", None) is not None:
        if features is None:
            raise ValueError("a feature draft needs the target's features")
        x = model.feature_fusion(x, features.transpose(0, 1))
    if packing is not None:
        x = packing.pack(x)
    for i, layer in enumerate(model.decoder.layers):
        x = layer_step(layer, i, x, cache, step)
    cache.advance(n)
    if packed_logits:  # [T, 1, h], position-major like the packing
        x = x if packing is not None else x.reshape(n * b, 1, x.shape[-1])
    elif packing is not None:
        x = packing.unpack(x)
    hidden = None
    if return_features:
        x = model.decoder.final_layernorm(x)
        hidden = x.transpose(0, 1)  # [B, n, h]
    if last_index is not None:
        x = x[last_index, torch.arange(b, device=x.device)][None]  # [1, B, h]
    if not return_features:
        x = model.decoder.final_layernorm(x)
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    head = _plain_head(model)
    if head == "full":
        logits = _linear(x, model.output_layer.weight if weight is None else weight)
    elif head == "subset":
        logits = model.output_layer.to_vocab(_linear(x, model.output_layer.weight))
    else:
        logits, _ = model.output_layer(x, weight=weight)
    if packed_logits:
        return logits[:, 0, : model.mrlhf_config.vocab_size]
    logits = logits.transpose(0, 1)[..., : model.mrlhf_config.vocab_size]
    return (logits, hidden) if return_features else logits


def packed_positions(valid: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows [T], columns [T])`` of the real tokens of a right-padded ``[B, n]`` feed with
    ``valid [B]`` real tokens per row, in the order :class:`_Packing` (and
    ``packed_logits``) holds them: position-major (every row's first token, then every
    second, ...)."""
    real = torch.arange(n, device=valid.device)[:, None] < valid[None, :]  # [n, B]
    cols, rows = real.nonzero(as_tuple=True)
    return rows, cols


PREFILL_CHUNK_TOKENS = {"cpu": 2048, "cuda": 8192}
"""Real tokens per run of rows in :func:`prefill`, by device: on a CPU a run's matmuls are
compute-bound from a few hundred tokens on and larger runs only hold more memory; a GPU
needs thousands of tokens per forward to amortise its launches and fill its SMs."""


def prefill_chunk_tokens(device) -> int:
    """:data:`PREFILL_CHUNK_TOKENS` for ``device`` (the CPU's value for any non-CUDA device)."""
    return PREFILL_CHUNK_TOKENS["cuda" if torch.device(device).type == "cuda" else "cpu"]


# A prefix shared by all distinct prompts of a batch (a chat template's system turn: 24
# tokens of SmolLM2's) is computed once when it is at least this long.
MIN_SHARED_PREFIX = 8


def prefill(model, cache, prompts: list[list[int]], rope: RopeTable, pad_id: int = 0,
            return_features: bool = False, chunk_tokens: int | None = None, share_prefix: bool = True):
    """Fill an empty cache with the prompts; returns next-token logits ``[B, V]`` (and, with
    ``return_features``, the final-norm hidden states ``[B, longest, h]``; positions past a
    prompt's end hold padding).

    With ``share_prefix``, work common to several prompts is done once: identical prompts
    (a GRPO group, ``--rollout-n`` samples) are prefilled once and their cache rows copied,
    and the longest prefix all distinct prompts share (at least :data:`MIN_SHARED_PREFIX`
    tokens, each prompt keeping one token of its own) is computed once and copied into
    every row before the rest is prefilled. Runs of consecutive rows are prefilled
    together, each run holding about ``chunk_tokens`` real tokens (default: the device's
    :func:`prefill_chunk_tokens`) and at most twice that padded: the attention works on each
    run right-padded to its longest, the rest of the layers on real tokens only.
    """
    dev = cache.lengths.device
    chunk_tokens = chunk_tokens or prefill_chunk_tokens(dev)
    if bool(cache.lengths.any()):
        raise ValueError("prefill fills an empty cache")
    index: dict[tuple, int] = {}
    rep = [index.setdefault(tuple(p), len(index)) for p in prompts] if share_prefix else None
    distinct = [list(p) for p in index] if share_prefix else prompts
    longest = max(len(p) for p in prompts)
    target = cache if len(distinct) == len(prompts) else KVCache.like(cache, len(distinct), longest)
    shared = len(os.path.commonprefix(distinct)) if share_prefix and len(distinct) > 1 else 0
    shared = min(shared, min(len(p) for p in distinct) - 1)
    prefix_hidden = None
    if shared >= MIN_SHARED_PREFIX:
        one = KVCache.like(cache, 1, shared)
        out = forward_cached(model, one, torch.tensor([distinct[0][:shared]], device=dev), rope,
                             last_index=torch.tensor([shared - 1], device=dev),
                             return_features=return_features)
        prefix_hidden = out[1] if return_features else None  # [1, shared, h]
        for dst, src in zip(target.keys + target.values, one.keys + one.values):
            dst[:, :, :shared] = src[:, :, :shared]
        target.lengths.fill_(shared)
    else:
        shared = 0
    logits, hidden = _prefill_rows(model, target, [p[shared:] for p in distinct], rope, pad_id,
                                   return_features, chunk_tokens)
    target.lengths.copy_(torch.tensor([len(p) for p in distinct], device=dev, dtype=cache.lengths.dtype))
    if return_features and prefix_hidden is not None:
        hidden = torch.cat([prefix_hidden.expand(len(distinct), -1, -1), hidden], 1)
    if target is not cache:  # copy each distinct prompt's rows to its duplicates
        rows = torch.tensor(rep, device=dev)
        for dst, src in zip(cache.keys + cache.values, target.keys + target.values):
            dst[:, :, :longest] = src.index_select(0, rows)
        cache.lengths.copy_(target.lengths[rows])
        logits = logits[rows]
        hidden = hidden[rows] if return_features else None
    return (logits, hidden) if return_features else logits


def _prefill_rows(model, cache, suffixes: list[list[int]], rope: RopeTable, pad_id: int,
                  return_features: bool, chunk_tokens: int):
    """Feed ``suffixes`` (one per row, after each row's cached tokens) in runs of rows;
    returns last-token logits ``[B, V]`` and hidden states ``[B, longest suffix, h]`` (or
    None). The cache's lengths are left for the caller to set."""
    dev = cache.lengths.device
    lens = [len(p) for p in suffixes]
    logits, hidden = [], []
    start = 0
    while start < len(suffixes):
        end = start + 1
        while end < len(suffixes) and sum(lens[start:end + 1]) <= chunk_tokens \
                and (end + 1 - start) * max(lens[start:end + 1]) <= 2 * chunk_tokens:
            end += 1
        sub = cache.view_rows(start, end)
        valid = torch.tensor(lens[start:end], device=dev)
        out = forward_cached(model, sub, pad_right(suffixes[start:end], pad_id, dev), rope,
                             last_index=valid - 1, return_features=return_features, valid=valid)
        if return_features:
            out, h = out
            hidden.append(F.pad(h, (0, 0, 0, max(lens) - h.shape[1])))
        logits.append(out[:, 0])
        start = end
    return torch.cat(logits), (torch.cat(hidden) if return_features else None)


def pad_right(seqs: list[list[int]], pad_id: int, device) -> torch.Tensor:
    """``[B, longest]`` right-padded token ids."""
    return padded(seqs, pad_id, torch.long, device)
