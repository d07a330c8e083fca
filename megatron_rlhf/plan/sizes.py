"""Bytes per GPU of a model's pieces (parameters per stage, weights, activations, logits,
KV caches), which :mod:`~megatron_rlhf.plan.memory` adds up. Pure arithmetic, no torch."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rlhf.config import ModelConfig
from megatron_rlhf.parallel.layout import Layout
from megatron_rlhf.plan.workload import MemoryOptions, Workload

LM_ROLES = ("actor", "reference", "draft")  # Roles with an LM head (logits over the vocabulary).
# Roles whose LM head is replaced by a scalar head ``hidden -> 1``.
VALUE_ROLES = ("critic", "reward")
# Whole-sequence logits: the head's bf16 output, its fp32 copy, and the fp32 log-softmax
# (the softmax saved for backward, or the gradient, in training).
LOGIT_BYTES_PER_ENTRY = 2 + 4 + 4
CHUNKED_HEAD_ROLES = ("actor", "reference")  # (a draft's head is its own: never chunked)


@dataclass(frozen=True)
class StageParams:
    """Parameters of one pipeline stage of one model, before tensor parallelism."""

    # Split over TP: attention and MLP matrices, the vocab-parallel embedding and LM head.
    sharded: int
    # Held whole by every TP rank: RMSNorm weights, a value head, a feature draft's fusion,
    # the routers.
    replicated: int
    # The experts' matrices: split over TP and over the layout's expert-parallel ranks.
    experts: int = 0

    @property
    def total(self) -> int:
        return self.sharded + self.replicated + self.experts

    def per_gpu(self, tp: int, ep: int = 1) -> int:
        return self.dense_per_gpu(tp) + self.experts_per_gpu(tp, ep)

    def dense_per_gpu(self, tp: int) -> int:
        """What one GPU holds of the parameters outside the experts (reduced over DP)."""
        return self.sharded // tp + self.replicated

    def experts_per_gpu(self, tp: int, ep: int = 1) -> int:
        """What one GPU holds of the experts (reduced over the expert-DP ranks, DP / EP)."""
        return self.experts // (tp * ep)


# ---------------------------------------------------------------- parameters

def layer_params(cfg: ModelConfig) -> StageParams:
    """One transformer layer: q, k, v, o (GQA), SwiGLU's three matrices (each expert's, and a
    router, for a mixture of experts), two RMSNorms (and q/k norms)."""
    h, d = cfg.hidden_size, cfg.kv_channels
    attention = 2 * h * cfg.num_attention_heads * d + 2 * h * cfg.num_query_groups * d
    norms = 2 * h + (2 * d if cfg.qk_layernorm else 0)
    if cfg.num_experts:
        return StageParams(sharded=attention, replicated=norms + cfg.num_experts * h,
                           experts=cfg.num_experts * 3 * h * cfg.moe_ffn_hidden_size)
    return StageParams(sharded=attention + 3 * h * cfg.ffn_hidden_size, replicated=norms)


def active_layer_params(cfg: ModelConfig) -> int:
    """The parameters one token's forward through a layer multiplies with, before TP: the
    router and top-k experts of a mixture, every matrix of a dense layer."""
    layer = layer_params(cfg)
    if not cfg.num_experts:
        return layer.sharded
    return layer.sharded + cfg.num_experts * cfg.hidden_size \
        + cfg.moe_router_topk * 3 * cfg.hidden_size * cfg.moe_ffn_hidden_size


def stage_params(cfg: ModelConfig, role: str, pp: int = 1, stage: int = 0) -> StageParams:
    """Parameters on pipeline stage ``stage`` of ``pp``."""
    # Its layers, the embedding on the first stage, final norm and head on the last. A tied
    # LM head on a last stage that is not also the first holds its own copy of the embedding
    # (as megatron does).
    check_pipeline(cfg, pp, role)
    if not 0 <= stage < pp:
        raise ValueError(f"pipeline stage {stage} outside 0..{pp - 1}")
    h, n = cfg.hidden_size, cfg.num_layers // pp
    layer = layer_params(cfg)
    sharded, replicated, experts = n * layer.sharded, n * layer.replicated, n * layer.experts
    first, last = stage == 0, stage == pp - 1
    if first:
        sharded += cfg.padded_vocab_size * h
        if role == "draft" and cfg.feature_draft:
            replicated += 2 * h * h  # fc([embed(x_t), h_{t-1}]), replicated over TP
    if last:
        replicated += h  # final norm
        if role in VALUE_ROLES:
            replicated += h  # value head hidden -> 1, replicated over TP
        elif not cfg.tie_embeddings:
            sharded += (cfg.head_vocab_size or cfg.padded_vocab_size) * h
        elif not first:
            sharded += cfg.padded_vocab_size * h
    return StageParams(sharded=sharded, replicated=replicated, experts=experts)


def count_parameters(cfg: ModelConfig, role: str = "actor") -> int:
    """Parameters of the whole model (a tied embedding counted once)."""
    return stage_params(cfg, role).total


def weight_bytes(cfg: ModelConfig, role: str, layout: Layout, stage: int,
                 options: MemoryOptions) -> int:
    """Weights on one GPU of pipeline stage ``stage``."""
    return stage_params(cfg, role, layout.pp, stage).per_gpu(layout.tp, layout.ep) * options.param_bytes


# ---------------------------------------------------------------- activations

def layer_activation_bytes(cfg: ModelConfig, seq: int, batch: int, tp: int = 1,
                           sequence_parallel: bool = False, recompute: str = "none",
                           param_bytes: int = 2) -> int:
    """Bytes one layer keeps for backward per micro-batch of ``batch`` x ``seq`` tokens."""
    # Korthikanti et al. 2022, Sec. 4, adapted to SwiGLU.
    # The paper (16-bit, GeLU MLP 4h wide): s*b*h*(10 + 24/t + 5*a*s/(h*t)) with TP t,
    # s*b*h*(34 + 5*a*s/h)/t with sequence parallelism. Its 24/t is attention's 8 (Q, K, V,
    # the output projection's input) plus the MLP's 16 (4*ffn/h). SwiGLU keeps its fc1 output
    # (2*ffn wide) and silu(gate)*up (ffn wide): 6*ffn/h. GQA changes nothing: the unfused
    # attention stores K and V expanded to all heads. The replicated 10 keeps two dropout
    # masks Llama does not use: conservative. Selective recompute drops the 5*a*s/h core
    # term; full recompute keeps only the layer input 2*s*b*h (/t with sequence
    # parallelism), the recomputed layer added once by training_activation_bytes.
    s, b, h, a, t = seq, batch, cfg.hidden_size, cfg.num_attention_heads, tp
    scale = param_bytes / 2  # the formulas count 2-byte elements
    if recompute == "full":
        return int(scale * 2 * s * b * h / (t if sequence_parallel else 1))
    # an MoE token keeps each of its top-k experts' SwiGLU activations, and its permuted copy
    # in and out of the experts (2 + 2 per expert)
    mlp = cfg.moe_router_topk * (6 * cfg.moe_ffn_hidden_size / h + 4) if cfg.num_experts \
        else 6 * cfg.ffn_hidden_size / h
    sharded = 8 + mlp
    core = 5 * a * s / h if recompute == "none" else 0.0
    if sequence_parallel:
        per_sbh = (10 + sharded + core) / t
    else:
        per_sbh = 10 + (sharded + core) / t
    return int(scale * s * b * h * per_sbh)


def logits_bytes(cfg: ModelConfig, tokens: int, tp: int, options: MemoryOptions, role: str = "actor") -> int:
    """Bytes of ``role``'s logits over ``tokens`` positions on the last stage: a chunk's where
    its head is chunked (``options.head_chunk_tokens``), else the whole sequence's."""
    # LOGIT_BYTES_PER_ENTRY: bf16 output, fp32 copy, fp32 log-softmax. The vocabulary splits
    # over TP unless options.vocab_parallel_logits is False; a chunk's is gathered over TP.
    vocab = cfg.head_vocab_size or cfg.padded_vocab_size
    if options.head_chunk_tokens and role in CHUNKED_HEAD_ROLES:
        return min(tokens, options.head_chunk_tokens) * vocab * LOGIT_BYTES_PER_ENTRY
    if options.vocab_parallel_logits:
        vocab //= tp
    return tokens * vocab * LOGIT_BYTES_PER_ENTRY


def training_activation_bytes(cfg: ModelConfig, role: str, workload: Workload, layout: Layout,
                              stage: int, options: MemoryOptions) -> int:
    """Activation bytes on pipeline stage ``stage`` under 1F1B."""
    # Stage i holds min(PP - i, micro-batches) micro-batches in flight; the last adds the logits.
    s, b = workload.seq_length, workload.micro_batch_size
    n_layers = cfg.num_layers // layout.pp
    in_flight = min(layout.pp - stage, workload.micro_batches(layout.dp))
    kw = dict(tp=layout.tp, sequence_parallel=options.sequence_parallel,
              param_bytes=options.param_bytes)
    stored = n_layers * in_flight * layer_activation_bytes(cfg, s, b, recompute=options.recompute, **kw)
    if options.recompute == "full":  # the layer being recomputed holds its full set
        stored += layer_activation_bytes(cfg, s, b, recompute="none", **kw)
    if stage == layout.pp - 1 and role in LM_ROLES:
        stored += logits_bytes(cfg, s * b, layout.tp, options, role)
    return stored


def forward_working_bytes(cfg: ModelConfig, seq: int, batch: int, tp: int,
                          param_bytes: int = 2) -> int:
    """Peak bytes of one layer's forward with nothing kept for backward (inference, prefill)."""
    # The residual input and the norm output, the larger of attention's intermediates (q, k,
    # v expanded to all heads, scores and probabilities [b, a/t, s, s], the context) and the
    # MLP's (fc1 output 2*ffn wide, the product), and the output before the all-reduce.
    s, b, h, t = seq, batch, cfg.hidden_size, tp
    attention = 4 * s * b * h / t + 2 * cfg.num_attention_heads * s * s * b / t
    mlp = 3 * s * b * cfg.ffn_hidden_size / t
    return int(param_bytes * (3 * s * b * h + max(attention, mlp)))


def kv_cache_bytes(cfg: ModelConfig, samples: int, length: int, tp: int, param_bytes: int = 2) -> int:
    """Bytes of every layer's keys and values."""
    # 2 * layers * (kv_heads/TP) * head_dim * bytes * samples * length
    return (2 * cfg.num_layers * (cfg.num_query_groups // tp) * cfg.kv_channels * param_bytes
            * samples * length)


def check_pipeline(cfg: ModelConfig, pp: int, role: str = "model") -> None:
    """ValueError naming the sizes that work when ``pp`` does not divide the layers."""
    # The model's own check, ModelConfig.check_pipeline_parallel.
    try:
        cfg.check_pipeline_parallel(pp)
    except ValueError as e:
        raise ValueError(f"{e} (the {role})") from None
