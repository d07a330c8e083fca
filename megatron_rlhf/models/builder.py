"""Build Llama-family megatron-core ``GPTModel``s for each RLHF role.

Entry point: :func:`build_model`.
"""
# The layer spec is local on CPU, Transformer-Engine when it imports on GPU. actor, reference
# and draft carry the LM head, critic and reward a scalar value head per token (.heads).

from __future__ import annotations

import functools
import importlib
import importlib.util

import torch
import torch.nn.functional as F

from megatron_rlhf import runtime
from megatron_rlhf.config import ModelConfig, check_role

VALUE_ROLES = ("critic", "reward")


@functools.cache
def transformer_engine_available() -> bool:
    """True when Transformer-Engine imports and a GPU is present."""
    if not runtime.has_cuda():
        return False
    try:
        importlib.import_module("transformer_engine")
    except Exception:
        return False
    return True


@functools.cache
def fused_softmax_available() -> bool:
    """True when megatron's fused masked-softmax kernel (built only with apex) imports and a
    GPU is present."""
    # With masked_softmax_fusion on, FusedScaleMaskSoftmax imports scaled_masked_softmax_cuda
    # at the first half-precision call, and raises without it.
    return runtime.has_cuda() and importlib.util.find_spec("scaled_masked_softmax_cuda") is not None


def transformer_config(cfg: ModelConfig, tp: int, dtype: torch.dtype, pp: int = 1,
                       recompute: str | None = None, sequence_parallel: bool = False, ep: int = 1):
    """megatron-core ``TransformerConfig`` for a Llama-family model at TP ``tp`` and PP ``pp``
    (layers split evenly), its experts over ``ep`` ranks. ``recompute``: None, ``full`` or
    ``selective``."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_gpu = runtime.has_cuda()
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=cfg.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel and tp > 1,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        # CPU init builds the full weight and slices it, so a seed gives the same model
        # at every TP size; on GPU megatron initialises each shard on the device.
        use_cpu_initialization=not on_gpu,
        # megatron's fused SwiGLU and bias-dropout-add are torch.compile'd at their first
        # call (megatron.core.jit): a compile per process and shape family at start-up,
        # for elementwise ops; off (the decode path never used them).
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=fused_softmax_available(),
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        # full: every layer's input kept, the layer re-run in backward; selective: the
        # attention core only.
        recompute_granularity=recompute,
        recompute_method="uniform" if recompute == "full" else None,
        recompute_num_layers=1 if recompute == "full" else None,
        qk_layernorm=cfg.qk_layernorm,
        **moe_fields(cfg, ep),
    )


def moe_fields(cfg: ModelConfig, ep: int = 1) -> dict:
    """``TransformerConfig`` fields of ``cfg``'s experts over ``ep`` ranks (none for a dense model)."""
    if cfg.num_experts is None:
        return {}
    cfg.check_expert_parallel(ep)
    return dict(
        num_moe_experts=cfg.num_experts,
        expert_model_parallel_size=ep,
        moe_router_topk=cfg.moe_router_topk,
        moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
        # top-k of the logits then a softmax over them is the renormalised top-k of the full
        # softmax (Mixtral; Qwen3-MoE with norm_topk_prob); pre-softmax keeps the full
        # softmax's top-k weights as they are
        moe_router_pre_softmax=not cfg.moe_norm_topk,
        # every expert sees its tokens (no capacity, nothing dropped), as transformers runs them
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        moe_router_load_balancing_type="aux_loss" if cfg.moe_aux_loss_coeff else "none",
        moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
        moe_z_loss_coeff=cfg.moe_z_loss_coeff or None,
    )


# Attention mask types under which every backend applies the explicit [B, 1, T, T] mask of
# forward.causal_padding_mask. Under causal the fused kernels (apex's upper-triangular softmax,
# Transformer Engine) drop it, and left padding would be attended silently.
MASK_HONOURING = ("arbitrary",)


def layer_spec(use_te: bool | None = None, cfg: ModelConfig | None = None):
    """Transformer-Engine spec when available (or requested), else the local spec with
    :class:`~megatron_rlhf.models.attention.SDPAttention`; self-attention masks ``arbitrary``.
    ``cfg``: its q/k norms and experts (None: a dense Llama layer)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.enums import AttnMaskType

    if use_te is None:
        use_te = transformer_engine_available()
    shape = {}
    if cfg is not None:
        # experts one by one (SequentialMLP): grouped GEMM needs TE or a CUDA kernel
        shape = dict(num_experts=cfg.num_experts, moe_grouped_gemm=False, qk_layernorm=cfg.qk_layernorm)
        if cfg.num_experts is not None:
            _shim_moe_without_te()
    if use_te:
        spec = specs.get_gpt_layer_with_transformer_engine_spec(**shape)
    else:
        from megatron_rlhf.models.attention import SDPAttention

        spec = specs.get_gpt_layer_local_spec(normalization="RMSNorm", **shape)
        # torch SDPA in place of the local spec's materialised scores (models/attention.py)
        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    # Whole-sequence forwards pass a mask combining causality and padding: every backend honours it.
    spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.arbitrary
    return spec


def _shim_moe_without_te() -> None:
    """megatron-core's router gating reads ``te_general_gemm``, a module global defined only
    when Transformer Engine imports (a NameError without it): None takes its torch path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def check_mask_honoured(model) -> None:
    """Raise ValueError unless every attention layer of ``model`` applies explicit masks (a
    model built with megatron's default ``causal`` spec would ignore left padding)."""
    if getattr(model, "_mrlhf_mask_ok", False):
        return
    for i, layer in enumerate(model.decoder.layers):
        kind = getattr(layer.self_attention, "attn_mask_type", None)
        if kind is None or kind.name not in MASK_HONOURING:
            raise ValueError(
                f"layer {i}'s attention mask type is {getattr(kind, 'name', kind)!r}, which "
                "may ignore the padding mask of whole-sequence forwards: build models with "
                "megatron_rlhf.models.builder.build_model (mask type 'arbitrary')")
    model._mrlhf_mask_ok = True


def _scale_rope(model, scaling: dict) -> None:
    """Llama-3.x RoPE scaling with every parameter the checkpoint gives."""
    # megatron-core's own rope_scaling takes the factor only, the rest fixed to Llama-3.1's.
    rope = model.rotary_pos_emb
    rope.inv_freq = rope._apply_scaling(
        rope.inv_freq, factor=scaling["factor"], low_freq_factor=scaling["low_freq_factor"],
        high_freq_factor=scaling["high_freq_factor"],
        original_max_position_embeddings=scaling["original_max_position_embeddings"])


def build_model(
    cfg: ModelConfig,
    role: str,
    pg_collection,
    dtype: torch.dtype | None = None,
    use_te: bool | None = None,
    seed: int = 1234,
    recompute: str | None = None,
    sequence_parallel: bool = False,
):
    """The model of ``role`` on this rank's device, sharded over ``pg_collection.tp``, and at
    PP > 1 this rank's stage (embedding first, head last, ``num_layers / PP`` layers each).
    ``seed`` fixes the initialisation (identical at every TP size on CPU)."""
    from megatron.core.models.gpt import GPTModel

    check_role(role)
    tp, pp = pg_collection.tp.size(), pg_collection.pp.size()
    cfg.check_tensor_parallel(tp)
    cfg.check_pipeline_parallel(pp)
    stage = pg_collection.pp.rank()
    dtype = dtype or runtime.default_dtype()
    if use_te is None:
        use_te = transformer_engine_available()
    # (a dense model ignores the layout's expert parallelism)
    ep = pg_collection.ep.size() if cfg.num_experts else 1
    config = transformer_config(cfg, tp, dtype, pp, recompute, sequence_parallel, ep)
    spec = layer_spec(use_te, cfg)
    if config.sequence_parallel and not use_te:  # (TE's norms handle it themselves)
        from megatron_rlhf.models.sequence_parallel import block_spec

        spec = block_spec(spec, cfg.num_layers // pp)
    runtime.seed_model_parallel_rng(seed, pg_collection.tp.rank())
    # (a tied embedding's last-stage copy is synchronised with ``.cuda()`` under PP)
    with torch.random.fork_rng(devices=[]), runtime.cuda_as_cpu():
        torch.manual_seed(seed)
        value = role in VALUE_ROLES
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=cfg.padded_vocab_size,
            max_sequence_length=cfg.max_position_embeddings,
            parallel_output=False,
            share_embeddings_and_output_weights=cfg.tie_embeddings and not value,
            position_embedding_type="rope",
            rotary_base=cfg.rotary_base,
            pg_collection=pg_collection,
            pre_process=stage == 0,
            post_process=stage == pp - 1,
        )
        model.mrlhf_config = cfg
        model.mrlhf_role = role
        if cfg.rope_scaling is not None:
            _scale_rope(model, cfg.rope_scaling)
        if value and model.post_process:
            from megatron_rlhf.models.heads import attach_value_head

            attach_value_head(model)
        elif cfg.head_vocab_size and model.post_process:
            from megatron_rlhf.models.heads import attach_subset_head

            attach_subset_head(model)
        if cfg.feature_draft:
            from megatron_rlhf.models.heads import attach_feature_fusion

            attach_feature_fusion(model)
        if cfg.num_experts is not None:
            from megatron_rlhf.models.moe import prepare_moe

            prepare_moe(model)
    # Like Megatron-LM's Float16Module: every parameter in the model dtype (megatron's torch
    # norms are created in fp32 whatever params_dtype says).
    return model.to(device=runtime.device(), dtype=dtype)
