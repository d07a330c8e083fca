"""The cached forward: a megatron-core GPTModel's own weights fed a few tokens per row after
each row's KV cache (prefill, a decode step, a verification).

Entry points: :func:`forward_cached`, :func:`prefill`. Plain Llama layers (:func:`plain_layers`)
run the same weights and ops without the modules' wrappers, bit-identical. The CPU's
numerics choices sit behind one switch (:mod:`~megatron_rlhf.generation.cpu_numerics`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from megatron_rlhf.generation import cpu_numerics
from megatron_rlhf.generation.attention import (attention, attention_mask, default_backend, flash_attention,
                                                flash_seqlens, group_bias, sdpa_kernel_name)
from megatron_rlhf.generation.cpu_numerics import attended_length
from megatron_rlhf.generation.kv_cache import KVCache
from megatron_rlhf.generation.packing import Packing, packed_positions, pad_right
from megatron_rlhf.generation.rope import RopeTable, rotate
from megatron_rlhf.models import routing, sequence_parallel

attention_backend = default_backend  # the name tools/ imports from here

# the last three are imported from here by tools/ (kept valid while tools/ moves)
__all__ = ["RopeTable", "forward_cached", "packed_positions", "pad_right", "plain_layers", "prefill",
           "attention_mask", "attention_backend", "sdpa_kernel_name"]


@dataclass
class _Step:
    """What every layer of one cached forward shares (computed once per forward)."""

    cos: torch.Tensor  # [n, B, 1, d] RoPE angles at each fed position
    sin: torch.Tensor
    mask: torch.Tensor  # [B, 1, n, k_len] bool
    slots: torch.Tensor  # cache rows of the fed positions (KVCache.slots)
    k_len: int
    backend: str
    linear: Callable  # the plain layer path's and the head's bias-free linear
    tp: object = None  # the TP group when its size > 1 (for the plain layer path's all-reduce)
    packing: Packing | None = None  # the layers' activations hold real tokens only
    seqlens: torch.Tensor | None = None  # flash_seqlens: the attention is flash_attention
    bias: torch.Tensor | None = None  # the additive mask of folded query rows (attention.group_bias)
    spans: cpu_numerics.Spans | None = None  # the matmul attention in spans of query positions
    static: bool = False  # a graph's step: every shape fixed, no host read
    # an MoE actor's records on the plain path: (records [rows, layers, k], the row of each
    # fed token, which tokens write theirs or None: all)
    routes: tuple | None = None


def _layer_step(layer, idx: int, x, cache, s: _Step):
    """One layer for ``x [n, B, h]`` through its own modules (any layer spec megatron builds);
    writes the layer's k, v into the cache."""
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


def _cached_attention(idx: int, q, k, v, cache, s: _Step, rotated: bool = False):
    """RoPE (unless ``rotated``), cache write and attention of one layer: ``q, k, v [n, B,
    heads, d]`` -> context ``[n, B, heads * d]`` (packed: ``[T, 1, ...]`` -> ``[T, 1, heads * d]``)."""
    if s.packing is not None:
        q, k, v = (s.packing.unpack(t) for t in (q, k, v))
    if not rotated:
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
        ctx = attention(q, keys, values, s.mask, s.backend, s.bias)  # [B, heads, n, d]
    b, n = q.shape[0], q.shape[2]
    ctx = ctx.permute(2, 0, 1, 3).reshape(n, b, -1).to(dtype)
    return ctx if s.packing is None else s.packing.pack(ctx)


def _plain_layer_step(layer, idx: int, x, cache, s: _Step):
    """:func:`_layer_step` for a plain Llama layer (:func:`plain_layers`): the same weights
    and ops, bit-identical output, without the modules' wrappers."""
    # megatron's linears go through autograd functions and TP region mappings even under
    # inference_mode; the row-parallel outputs are all-reduced over the TP group here
    attn, mlp = layer.self_attention, layer.mlp
    n, b = x.shape[0], x.shape[1]
    groups = attn.num_query_groups_per_partition
    per_group = attn.num_attention_heads_per_partition // groups
    d = attn.hidden_size_per_attention_head
    ln = layer.input_layernorm
    h = F.rms_norm(x, ln.normalized_shape, ln.weight, ln.eps)
    # megatron's fused QKV layout per query group: its query heads, then k, then v
    mixed = s.linear(h, attn.linear_qkv.weight).view(n, b, groups, per_group + 2, d)
    qk, rotated = mixed[:, :, :, :per_group + 1], s.packing is None
    qn, kn = getattr(attn, "q_layernorm", None), getattr(attn, "k_layernorm", None)
    if type(qn) is torch.nn.RMSNorm:  # Qwen3's per-head q and k norms, before RoPE
        qk = torch.cat([F.rms_norm(qk[:, :, :, :per_group], qn.normalized_shape, qn.weight, qn.eps),
                        F.rms_norm(qk[:, :, :, per_group:], kn.normalized_shape, kn.weight, kn.eps)], 3)
    if rotated:  # RoPE of the q and k heads in one expression (a packed feed rotates unpacked)
        qk = rotate(qk, s.cos[:, :, None], s.sin[:, :, None])
    q = qk[:, :, :, :per_group].reshape(n, b, groups * per_group, d)
    ctx = _cached_attention(idx, q, qk[:, :, :, per_group], mixed[:, :, :, per_group + 1], cache, s, rotated)
    x = x + _row_parallel(s.linear(ctx, attn.linear_proj.weight), s.tp)
    ln = layer.pre_mlp_layernorm
    h = F.rms_norm(x, ln.normalized_shape, ln.weight, ln.eps)
    out = _plain_experts(mlp, idx, h, s) if hasattr(mlp, "router") else _swiglu(mlp, h, s.linear)
    return x + _row_parallel(out, s.tp)


def _swiglu(mlp, h: torch.Tensor, linear: Callable, scale: torch.Tensor | None = None) -> torch.Tensor:
    """A SwiGLU MLP's row-parallel partial output for ``h``; ``scale [tokens]``: each token's
    weight, applied to the activation in its dtype as megatron's experts apply it."""
    gate, up = linear(h, mlp.linear_fc1.weight).chunk(2, -1)
    act = F.silu(gate) * up
    if scale is not None:
        act = (act * scale[:, None]).to(act.dtype)
    return linear(act, mlp.linear_fc2.weight)


def _plain_experts(moe, idx: int, h: torch.Tensor, s: _Step) -> torch.Tensor:
    """A plain MoE layer (:func:`plain_layers`) for ``h [n, B, hidden]``: the top-k router
    (recording each token's experts in ``s.routes``), the experts summed in expert order as
    megatron's dropless layer sums them; the row-parallel partial output."""
    cfg, router = moe.config, moe.router
    x = h.reshape(-1, h.shape[-1])
    dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(cfg.moe_router_dtype, x.dtype)
    logits = s.linear(x.to(dtype), router.weight.to(dtype))  # [T, E]
    if cfg.moe_router_pre_softmax:
        probs, top = torch.topk(torch.softmax(logits, -1, dtype=torch.float32).type_as(logits), router.topk, dim=1)
    else:
        top_logits, top = torch.topk(logits, router.topk, dim=1)
        probs = torch.softmax(top_logits, -1, dtype=torch.float32).type_as(logits)
    if cfg.moe_router_topk_scaling_factor:
        probs = probs * cfg.moe_router_topk_scaling_factor
    if s.routes is not None:
        records, rows, keep = s.routes
        new = top.to(records.dtype)
        if keep is not None:  # (a masked write: the rows stay where the graph has them)
            new = torch.where(keep[:, None], new, records[rows, idx])
        records[rows, idx] = new
    weights = torch.zeros_like(logits).scatter_(1, top, probs)  # [T, E]: 0 where not routed
    experts = moe.experts.local_experts
    out = torch.zeros_like(x)
    if s.static:
        # every expert over every token, weight 0 where not routed: a graph's shapes cannot
        # follow the routes, and a dropless fixed capacity would hold every token per expert
        # (any token may pick any expert): the same matmuls plus a gather
        for e, expert in enumerate(experts):
            out += _swiglu(expert, x, s.linear, weights[:, e])
    else:  # each expert's tokens gathered (a host read per layer)
        routed = torch.zeros_like(weights, dtype=torch.bool).scatter_(1, top, True)
        for e, count in enumerate(routed.sum(0).tolist()):
            if count:
                rows_e = routed[:, e].nonzero()[:, 0]
                out.index_add_(0, rows_e, _swiglu(experts[e], x[rows_e], s.linear, weights[rows_e, e]))
    return out.view(*h.shape[:-1], out.shape[-1])


def _row_parallel(partial: torch.Tensor, group) -> torch.Tensor:
    """Sum a row-parallel linear's partial outputs over the TP group (``group`` None: TP 1)."""
    if group is not None:
        torch.distributed.all_reduce(partial, group=group)
    return partial


def plain_layers(model) -> bool:
    """True when every layer of ``model`` is what :func:`_plain_layer_step` reproduces (checked
    once per model): the local spec's RMSNorms (q and k norms too), bias-free column/row-parallel
    linears, plain GQA with at least one KV group per TP rank, a SwiGLU MLP or an MoE layer of
    SwiGLU experts (:func:`_plain_moe`), no fp8."""
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
    def qk_norms(attn) -> bool:  # none, or an RMSNorm of q's heads and one of k's
        kinds = {type(getattr(attn, "q_layernorm", None)), type(getattr(attn, "k_layernorm", None))}
        return kinds <= {type(None), IdentityOp} or kinds == {torch.nn.RMSNorm}

    def swiglu(mlp) -> bool:
        return (type(mlp) is MLP and type(mlp.linear_fc1) is ColumnParallelLinear
                and type(mlp.linear_fc2) is RowParallelLinear)

    for layer in model.decoder.layers:
        attn = layer.self_attention
        ok = ok and (type(layer.input_layernorm) is torch.nn.RMSNorm
                     and type(layer.pre_mlp_layernorm) is torch.nn.RMSNorm
                     and qk_norms(attn)
                     and type(attn.linear_qkv) is ColumnParallelLinear
                     and type(attn.linear_proj) is RowParallelLinear
                     and (swiglu(layer.mlp) or _plain_moe(model, layer.mlp, swiglu)))
    model._mrlhf_plain_layers = bool(ok)
    return model._mrlhf_plain_layers


def _plain_moe(model, mlp, swiglu: Callable) -> bool:
    """Whether ``mlp`` is an MoE layer :func:`_plain_experts` reproduces: a plain softmax top-k
    router (no bias, groups, jitter or capacity), all SwiGLU experts of a SequentialMLP on
    this rank, split like the dense layers; no shared experts."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router import TopKRouter

    if type(mlp) is not MoELayer:
        return False
    cfg, router = mlp.config, mlp.router
    tp = model.pg_collection.tp.size()
    return (type(router) is TopKRouter and router.bias is None and router.expert_bias is None
            and cfg.moe_router_score_function == "softmax" and cfg.moe_router_load_balancing_type != "sinkhorn"
            and not cfg.moe_router_group_topk and cfg.moe_expert_capacity_factor is None
            and cfg.moe_input_jitter_eps is None and not cfg.moe_router_force_load_balancing
            and not cfg.moe_router_fusion and not cfg.moe_apply_probs_on_input
            and getattr(mlp, "shared_experts", None) is None
            and model.pg_collection.ep.size() == 1 and (cfg.expert_tensor_parallel_size or tp) == tp
            and type(mlp.experts) is SequentialMLP
            and len(mlp.experts.local_experts) == cfg.num_moe_experts
            and all(swiglu(e) for e in mlp.experts.local_experts))


def _plain_head(model) -> str | None:
    """How the forward applies the LM head's weight itself: ``"full"`` (a bias-free
    column-parallel linear), ``"subset"`` (a draft's ``SubsetLMHead``), both at TP 1 with
    :func:`plain_layers`; None: through the module (value heads, TP-sharded heads)."""
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
    """:func:`_forward_cached`, with a sequence-parallel model's modules running whole
    sequences (:func:`~megatron_rlhf.models.sequence_parallel.disabled`)."""
    with sequence_parallel.disabled(model):
        return _forward_cached(model, cache, tokens, rope, *args, **kw)


def _forward_cached(model, cache, tokens: torch.Tensor, rope: RopeTable,
                    last_index: torch.Tensor | None = None, features: torch.Tensor | None = None,
                    return_features: bool = False, valid: torch.Tensor | None = None,
                    static: bool = False, packed_logits: bool = False, backend: str | None = None,
                    attend: int | None = None):
    """Feed ``tokens [B, n]`` after each row's cached prefix (the cache advances by ``n``);
    returns logits ``[B, n, V]``, or ``[B, 1, V]`` at ``last_index [B]``, and with
    ``return_features`` the final-norm hidden states ``[B, n, h]``. ``features [B, n, h]``: a
    feature draft's. ``valid [B]``: real tokens per row (the layers compute only those; with
    ``packed_logits`` logits ``[T, V]`` in :func:`packed_positions` order). ``static``: the step
    a CUDA graph captures (no host read), attending over the first ``attend`` cache positions
    (default: all; the caller guarantees every row's tokens fit). ``backend``: None for the
    device's default.
    Raises ValueError on an inconsistent combination."""
    b, n = tokens.shape
    if packed_logits and (valid is None or last_index is not None or return_features):
        raise ValueError("packed_logits needs valid, and neither last_index nor return_features")
    if static and valid is not None:
        raise ValueError("a static step feeds every row n tokens (no packing of the valid ones)")
    if not static:
        cache.check_room(n)
    pos = cache.lengths[:, None] + torch.arange(n, device=tokens.device)  # [B, n]
    k_len = (attend or cache.max_len) if static else attended_length(cache, int(cache.lengths.max()) + n)
    mask = attention_mask(cache.lengths, n, k_len)
    x = model.embedding(input_ids=tokens, position_ids=pos)  # [n, B, h]
    cfg = model.mrlhf_config
    backend = backend or default_backend(x.device)
    # flash needs a half-precision cache (an fp32 one goes through SDPA)
    flash = backend == "flash" and cache.keys[0].dtype in (torch.float16, torch.bfloat16)
    tp = model.pg_collection.tp
    packing = Packing(valid, n, b) if valid is not None and int(valid.min()) < n else None
    step = _Step(*rope.angles(pos, x.dtype), mask, cache.slots(n), k_len, backend, F.linear,
                 tp=tp if tp.size() > 1 else None, packing=packing,
                 seqlens=flash_seqlens(cache.lengths, n) if flash else None, static=static)
    if backend == "matmul" or not x.is_cuda:  # the one switch into the CPU's numerics
        cpu = cpu_numerics.CpuForward(mask, cfg.num_attention_heads // cfg.num_query_groups, x.dtype,
                                      backend, ragged=packing is not None)
        step.linear, step.bias, step.spans = cpu.linear, cpu.bias, cpu.spans
    if backend != "matmul" and not flash:  # sdpa: the additive mask of the stacked query rows, once for every layer
        step.bias = group_bias(mask, cfg.num_attention_heads // cfg.num_query_groups, cache.keys[0].dtype)
    layer_step = _plain_layer_step if plain_layers(model) else _layer_step
    if getattr(model, "feature_fusion", None) is not None:
        if features is None:
            raise ValueError("a feature draft needs the target's features")
        x = model.feature_fusion(x, features.transpose(0, 1))
    if packing is not None:
        x = packing.pack(x)
    records = cache.route_records()  # an MoE actor's: each fed token's routes
    rows = None
    if records is not None:
        rows = cache.route_rows(n) if packing is None else cache.route_rows(n)[packing.keep]
    if records is not None and layer_step is _plain_layer_step:  # (no router module runs)
        # a graph's step feeds finished and padding rows at length 0: their records stay
        keep = cache.lengths.gt(0).repeat(n) if static else None
        step.routes, records = (records, rows, keep), None
    with routing.recording(model, records, rows):
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
        logits = step.linear(x, model.output_layer.weight if weight is None else weight)
    elif head == "subset":
        logits = model.output_layer.to_vocab(step.linear(x, model.output_layer.weight))
    else:
        logits, _ = model.output_layer(x, weight=weight)
    if packed_logits:
        return logits[:, 0, : model.mrlhf_config.vocab_size]
    logits = logits.transpose(0, 1)[..., : model.mrlhf_config.vocab_size]
    return (logits, hidden) if return_features else logits


# real tokens per run of rows in prefill, by device: a CPU's matmuls are compute-bound from a
# few hundred tokens on; a GPU needs thousands per forward to fill its SMs
PREFILL_CHUNK_TOKENS = {"cpu": 2048, "cuda": 8192}


def prefill_chunk_tokens(device) -> int:
    """:data:`PREFILL_CHUNK_TOKENS` for ``device`` (the CPU's value for any non-CUDA device)."""
    return PREFILL_CHUNK_TOKENS["cuda" if torch.device(device).type == "cuda" else "cpu"]


# a prefix shared by all distinct prompts (a chat template's system turn) is computed once
# when it is at least this long
MIN_SHARED_PREFIX = 8


def prefill(model, cache, prompts: list[list[int]], rope: RopeTable, pad_id: int = 0,
            return_features: bool = False, chunk_tokens: int | None = None, share_prefix: bool = True,
            backend: str | None = None):
    """Fill an empty cache with ``prompts``; returns next-token logits ``[B, V]`` (and with
    ``return_features`` the final-norm hidden states ``[B, longest, h]``, padding past each
    prompt). Runs of rows hold about ``chunk_tokens`` real tokens (default:
    :func:`prefill_chunk_tokens`). ``share_prefix``: identical prompts are prefilled once,
    and a prefix all distinct prompts share (>= :data:`MIN_SHARED_PREFIX`) is computed once.
    ``backend`` as in :func:`forward_cached`. Raises ValueError on a non-empty cache."""
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
    shared = min(shared, min(len(p) for p in distinct) - 1)  # each prompt keeps a token of its own
    prefix_hidden = None
    if shared >= MIN_SHARED_PREFIX:
        one = KVCache.like(cache, 1, shared)
        out = forward_cached(model, one, torch.tensor([distinct[0][:shared]], device=dev), rope,
                             last_index=torch.tensor([shared - 1], device=dev),
                             return_features=return_features, backend=backend)
        prefix_hidden = out[1] if return_features else None  # [1, shared, h]
        for dst, src in zip(target.keys + target.values, one.keys + one.values):
            dst[:, :, :shared] = src[:, :, :shared]
        if one.routes is not None:
            target.routes[:, :shared] = one.routes[:, :shared]
        target.lengths.fill_(shared)
    else:
        shared = 0
    logits, hidden = _prefill_rows(model, target, [p[shared:] for p in distinct], rope, pad_id,
                                   return_features, chunk_tokens, backend)
    target.lengths.copy_(torch.tensor([len(p) for p in distinct], device=dev, dtype=cache.lengths.dtype))
    if return_features and prefix_hidden is not None:
        hidden = torch.cat([prefix_hidden.expand(len(distinct), -1, -1), hidden], 1)
    if target is not cache:  # copy each distinct prompt's rows to its duplicates
        rows = torch.tensor(rep, device=dev)
        for dst, src in zip(cache.keys + cache.values, target.keys + target.values):
            dst[:, :, :longest] = src.index_select(0, rows)
        if cache.routes is not None:
            cache.routes[:, :longest] = target.routes[:, :longest].index_select(0, rows)
        cache.lengths.copy_(target.lengths[rows])
        logits = logits[rows]
        hidden = hidden[rows] if return_features else None
    return (logits, hidden) if return_features else logits


def _prefill_rows(model, cache, suffixes: list[list[int]], rope: RopeTable, pad_id: int,
                  return_features: bool, chunk_tokens: int, backend: str | None):
    """Feed ``suffixes`` (one per row, after its cached tokens) in runs of rows; returns
    last-token logits ``[B, V]`` and hidden states ``[B, longest suffix, h]`` (or None).
    The cache's lengths are left for the caller to set."""
    dev = cache.lengths.device
    lens = [len(p) for p in suffixes]
    logits, hidden = [], []
    start = 0
    while start < len(suffixes):
        end = start + 1
        # a run holds about chunk_tokens real tokens and at most twice that padded
        while end < len(suffixes) and sum(lens[start:end + 1]) <= chunk_tokens \
                and (end + 1 - start) * max(lens[start:end + 1]) <= 2 * chunk_tokens:
            end += 1
        sub = cache.view_rows(start, end)
        valid = torch.tensor(lens[start:end], device=dev)
        out = forward_cached(model, sub, pad_right(suffixes[start:end], pad_id, dev), rope,
                             last_index=valid - 1, return_features=return_features, valid=valid,
                             backend=backend)
        if return_features:
            out, h = out
            hidden.append(F.pad(h, (0, 0, 0, max(lens) - h.shape[1])))
        logits.append(out[:, 0])
        start = end
    return torch.cat(logits), (torch.cat(hidden) if return_features else None)
