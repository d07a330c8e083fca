"""Hugging Face Llama (Mistral, Qwen2, Qwen3; Qwen3-MoE and Mixtral with experts) <->
megatron-core tensor and config mapping.

Entry points: :func:`config_from_hf`, :func:`hf_to_mcore`, :func:`mcore_to_hf`. Tensors are
full (TP=1, one process).
"""
# dist_checkpointing then makes the result loadable at any TP size. megatron's names are the
# local layer spec's (megatron maps the TE spec's fused-norm names).

from __future__ import annotations

import torch

from megatron_rlhf.config import FAMILIES, ROPE_SCALING_KEYS, ModelConfig


class ShapeMismatch(ValueError):
    """A tensor whose shape does not match the model config; the message names it."""


ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "mixtral": "MixtralForCausalLM"}


# the fields config_from_hf has no default for, and each MoE family's own
REQUIRED_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
MOE_FIELDS = {"qwen3_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
              "mixtral": ("num_local_experts", "num_experts_per_tok")}
# another name a field is saved under (transformers 5 writes Qwen3-MoE's num_experts as
# num_local_experts; the published checkpoints say num_experts)
ALIASES = {"num_experts": "num_local_experts"}


def _field(hf: dict, name: str):
    value = hf.get(name)
    return hf.get(ALIASES[name]) if value is None and name in ALIASES else value
# families with a norm over each query and key head, and those whose window is opt-in
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe")
OPT_IN_WINDOW = ("qwen2", "qwen3", "qwen3_moe")


def config_from_hf(hf: dict, source: str = "config.json") -> ModelConfig:
    """ModelConfig from a HF config dict (``config.json``) of a supported family
    (:data:`ARCHITECTURES`); ``source`` names the file in errors."""
    family = hf.get("model_type") or "llama"
    if family not in FAMILIES:
        raise ValueError(f"model_type {family!r} is not supported; supported model types: "
                         f"{', '.join(FAMILIES)}")
    missing = [k for k in REQUIRED_FIELDS + MOE_FIELDS.get(family, ()) if _field(hf, k) is None]
    if missing:
        raise ValueError(f"{source} lacks {', '.join(missing)}, which a {family} model needs: "
                         "add them (transformers' config of the model lists them)")
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    rope_scaling = None
    if rope_type == "llama3":
        params = {**scaling, **rope}
        rope_scaling = {k: float(params[k]) for k in ROPE_SCALING_KEYS}
        rope_scaling["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
    elif rope_type != "default":
        raise ValueError(f"RoPE scaling {rope_type!r} is not supported; plain RoPE and llama3 are")
    if hf.get("mlp_bias") or (family != "qwen2" and hf.get("attention_bias")):
        raise ValueError(f"{family} checkpoints with MLP or output-projection biases are not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported; Llama uses silu")
    window = hf.get("sliding_window")
    if family in OPT_IN_WINDOW and not hf.get("use_sliding_window", False):
        window = None
    heads = hf["num_attention_heads"]
    eos = hf.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0]
    positions = hf.get("max_position_embeddings", 4096)
    return ModelConfig(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        vocab_size=hf["vocab_size"],
        max_position_embeddings=positions,
        rotary_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        norm_epsilon=float(hf.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=eos,
        family=family,
        rope_scaling=rope_scaling,
        qkv_bias=family == "qwen2",
        sliding_window=window if window and window < positions else None,
        qk_layernorm=family in QK_NORM_FAMILIES,
        **_experts_from_hf(hf, family, source),
    )


def _experts_from_hf(hf: dict, family: str, source: str) -> dict:
    """ModelConfig's expert fields from a Qwen3-MoE or Mixtral config (none for a dense one)."""
    if family == "mixtral":
        return dict(num_experts=hf["num_local_experts"], moe_router_topk=hf["num_experts_per_tok"],
                    moe_ffn_hidden_size=hf["intermediate_size"], moe_norm_topk=True)
    if family != "qwen3_moe":
        return {}
    dense = hf.get("mlp_only_layers") or []
    if dense or hf.get("decoder_sparse_step", 1) != 1:
        raise ValueError(f"{source} has dense MLP layers among the expert layers (mlp_only_layers "
                         f"{dense}, decoder_sparse_step {hf.get('decoder_sparse_step', 1)}), which is "
                         "not supported: every layer must have experts (mlp_only_layers [], "
                         "decoder_sparse_step 1)")
    return dict(num_experts=_field(hf, "num_experts"), moe_router_topk=hf["num_experts_per_tok"],
                moe_ffn_hidden_size=hf["moe_intermediate_size"],
                moe_norm_topk=bool(hf.get("norm_topk_prob", False)))


VALUE_ROLES = ("critic", "reward")


def hf_config_dict(cfg: ModelConfig, dtype: torch.dtype = torch.float32, role: str = "actor") -> dict:
    """A config dict of ``cfg``'s family that ``transformers`` loads (``*ForCausalLM``, or
    ``*ForSequenceClassification`` with one label for a critic or reward model)."""
    # One label is the convention of OpenRLHF's and TRL's reward models.

    rope = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    if cfg.rope_scaling is not None:
        rope = {"rope_type": "llama3", "rope_theta": cfg.rotary_base, **cfg.rope_scaling}
    out = {
        "architectures": [ARCHITECTURES[cfg.family]],
        "model_type": cfg.family,
        "num_hidden_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "head_dim": cfg.kv_channels,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rotary_base,
        "rope_parameters": rope,
        "rms_norm_eps": cfg.norm_epsilon,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if role in VALUE_ROLES:
        out["architectures"] = [ARCHITECTURES[cfg.family].replace("ForCausalLM", "ForSequenceClassification")]
        out.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0},
                   pad_token_id=cfg.eos_token_id)
    if cfg.family == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    elif cfg.family in ("mistral", "mixtral"):
        out["sliding_window"] = cfg.sliding_window
    else:
        out.update(use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window)
    if cfg.family in QK_NORM_FAMILIES:
        out.update(attention_bias=False, max_window_layers=cfg.num_layers)
    if cfg.family == "mixtral":
        out.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.moe_router_topk,
                   intermediate_size=cfg.moe_ffn_hidden_size, router_jitter_noise=0.0)
    elif cfg.family == "qwen3_moe":
        out.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.moe_router_topk,
                   moe_intermediate_size=cfg.moe_ffn_hidden_size, norm_topk_prob=cfg.moe_norm_topk,
                   decoder_sparse_step=1, mlp_only_layers=[])
    return out


def _expect(name: str, t: torch.Tensor, shape: tuple) -> torch.Tensor:
    if tuple(t.shape) != tuple(shape):
        raise ShapeMismatch(
            f"tensor {name} has shape {tuple(t.shape)}, the model config expects {tuple(shape)}"
        )
    return t


def _take(sd: dict, name: str, shape: tuple) -> torch.Tensor:
    if name not in sd:
        raise ShapeMismatch(f"tensor {name} is missing from the checkpoint")
    return _expect(name, sd[name], shape)


def _hf_router(cfg: ModelConfig, i: int) -> str:
    return f"model.layers.{i}.block_sparse_moe.gate.weight" if cfg.family == "mixtral" else \
        f"model.layers.{i}.mlp.gate.weight"


def _mlp_names(cfg: ModelConfig, i: int):
    """Layer ``i``'s MLP as ``(megatron name, (HF gate, up, down, width))`` pairs: one for a
    dense MLP, the router (``None``) then one per expert for a mixture."""
    # megatron's SwiGLU linear_fc1 is [gate; up]. Experts: Mixtral's w1, w3, w2 under
    # block_sparse_moe; Qwen3-MoE's gate/up/down_proj under mlp.
    m = f"model.layers.{i}.mlp."
    if cfg.num_experts is None:
        return [("mlp.", (m + "gate_proj.weight", m + "up_proj.weight", m + "down_proj.weight",
                          cfg.ffn_hidden_size))]
    names = [("mlp.router.weight", None)]
    for j in range(cfg.num_experts):
        if cfg.family == "mixtral":
            e = f"model.layers.{i}.block_sparse_moe.experts.{j}."
            hf = (e + "w1.weight", e + "w3.weight", e + "w2.weight")
        else:
            e = f"{m}experts.{j}."
            hf = (e + "gate_proj.weight", e + "up_proj.weight", e + "down_proj.weight")
        names.append((f"mlp.experts.local_experts.{j}.", (*hf, cfg.moe_ffn_hidden_size)))
    return names


def _experts_one_by_one(sd: dict, cfg: ModelConfig) -> dict:
    """``sd`` with transformers 5's in-memory experts (``mlp.experts.gate_up_proj [E, 2f, h]``,
    ``down_proj [E, h, f]``, ``mlp.gate``: a model's ``state_dict()``, a GGUF read through it)
    under the checkpoint files' names, one tensor per expert."""
    if cfg.num_experts is None or not any(k.endswith("mlp.experts.gate_up_proj") for k in sd):
        return sd
    sd = dict(sd)
    f = cfg.moe_ffn_hidden_size
    for i in range(cfg.num_layers):
        m = f"model.layers.{i}.mlp."
        if m + "experts.gate_up_proj" not in sd:
            continue
        fused = _take(sd, m + "experts.gate_up_proj", (cfg.num_experts, 2 * f, cfg.hidden_size))
        down = _take(sd, m + "experts.down_proj", (cfg.num_experts, cfg.hidden_size, f))
        del sd[m + "experts.gate_up_proj"], sd[m + "experts.down_proj"]
        sd[_hf_router(cfg, i)] = sd.pop(m + "gate.weight")
        for j, (_, (gate, up, down_name, _)) in enumerate(_mlp_names(cfg, i)[1:]):
            sd[gate], sd[up], sd[down_name] = fused[j, :f], fused[j, f:], down[j]
    return sd


def _pad_vocab(t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    pad = cfg.padded_vocab_size - t.shape[0]
    return torch.cat([t, t.new_zeros(pad, t.shape[1])]) if pad else t


def hf_to_mcore(sd: dict, cfg: ModelConfig, role: str = "actor") -> dict[str, torch.Tensor]:
    """HF ``*ForCausalLM`` state dict (the file's names: experts one by one) -> megatron
    ``GPTModel`` (local spec, TP=1); Qwen2's q/k/v biases go into ``linear_qkv.bias``, grouped
    as its weight."""
    # megatron's linear_qkv is grouped by KV head: for each group its heads/groups query heads,
    # then its key head, then its value head.
    h, d = cfg.hidden_size, cfg.kv_channels
    nh, ng, v = cfg.num_attention_heads, cfg.num_query_groups, cfg.vocab_size
    sd = _experts_one_by_one(sd, cfg)
    out = {"embedding.word_embeddings.weight": _pad_vocab(_take(sd, "model.embed_tokens.weight", (v, h)), cfg)}
    for i in range(cfg.num_layers):
        a = f"model.layers.{i}.self_attn."
        q = _take(sd, a + "q_proj.weight", (nh * d, h)).reshape(ng, nh // ng, d, h)
        k = _take(sd, a + "k_proj.weight", (ng * d, h)).reshape(ng, 1, d, h)
        vv = _take(sd, a + "v_proj.weight", (ng * d, h)).reshape(ng, 1, d, h)
        p = f"decoder.layers.{i}."
        out[p + "self_attention.linear_qkv.weight"] = torch.cat([q, k, vv], 1).reshape(-1, h)
        if cfg.qkv_bias:  # grouped like the weight's rows
            qb = _take(sd, a + "q_proj.bias", (nh * d,)).reshape(ng, nh // ng, d)
            kb = _take(sd, a + "k_proj.bias", (ng * d,)).reshape(ng, 1, d)
            vb = _take(sd, a + "v_proj.bias", (ng * d,)).reshape(ng, 1, d)
            out[p + "self_attention.linear_qkv.bias"] = torch.cat([qb, kb, vb], 1).reshape(-1)
        out[p + "self_attention.linear_proj.weight"] = _take(sd, a + "o_proj.weight", (h, nh * d))
        out[p + "input_layernorm.weight"] = _take(sd, f"model.layers.{i}.input_layernorm.weight", (h,))
        out[p + "pre_mlp_layernorm.weight"] = _take(
            sd, f"model.layers.{i}.post_attention_layernorm.weight", (h,)
        )
        if cfg.qk_layernorm:
            out[p + "self_attention.q_layernorm.weight"] = _take(sd, a + "q_norm.weight", (d,))
            out[p + "self_attention.k_layernorm.weight"] = _take(sd, a + "k_norm.weight", (d,))
        for name, t in _mlp_names(cfg, i):
            if t is None:  # the router
                out[p + name] = _take(sd, _hf_router(cfg, i), (cfg.num_experts, h))
            else:
                gate, up, down, width = t
                out[p + name + "linear_fc1.weight"] = torch.cat(
                    [_take(sd, gate, (width, h)), _take(sd, up, (width, h))])
                out[p + name + "linear_fc2.weight"] = _take(sd, down, (h, width))
    out["decoder.final_layernorm.weight"] = _take(sd, "model.norm.weight", (h,))
    if role in VALUE_ROLES:
        if "score.weight" not in sd:
            raise ShapeMismatch(f"a {role} model needs a scalar head: the checkpoint has no "
                                "score.weight (a *ForSequenceClassification with num_labels=1)")
        out["output_layer.weight"] = _take(sd, "score.weight", (1, h))
    elif not cfg.tie_embeddings:
        out["output_layer.weight"] = _pad_vocab(_take(sd, "lm_head.weight", (v, h)), cfg)
    return out


def mcore_to_hf(sd: dict, cfg: ModelConfig, role: str = "actor") -> dict[str, torch.Tensor]:
    """megatron ``GPTModel`` (local spec, TP=1) state dict -> HF ``*ForCausalLM`` of its family
    (a critic or reward model: ``*ForSequenceClassification``, its value head as ``score``)."""
    h, d = cfg.hidden_size, cfg.kv_channels
    nh, ng, v = cfg.num_attention_heads, cfg.num_query_groups, cfg.vocab_size
    qpg = nh // ng
    emb = _take(sd, "embedding.word_embeddings.weight", (cfg.padded_vocab_size, h))
    out = {"model.embed_tokens.weight": emb[:v]}
    for i in range(cfg.num_layers):
        p, a = f"decoder.layers.{i}.", f"model.layers.{i}.self_attn."
        qkv = _take(sd, p + "self_attention.linear_qkv.weight", ((nh + 2 * ng) * d, h))
        qkv = qkv.reshape(ng, qpg + 2, d, h)
        out[a + "q_proj.weight"] = qkv[:, :qpg].reshape(nh * d, h)
        out[a + "k_proj.weight"] = qkv[:, qpg].reshape(ng * d, h)
        out[a + "v_proj.weight"] = qkv[:, qpg + 1].reshape(ng * d, h)
        if cfg.qkv_bias:
            bias = _take(sd, p + "self_attention.linear_qkv.bias", ((nh + 2 * ng) * d,)).reshape(ng, qpg + 2, d)
            out[a + "q_proj.bias"] = bias[:, :qpg].reshape(nh * d)
            out[a + "k_proj.bias"] = bias[:, qpg].reshape(ng * d)
            out[a + "v_proj.bias"] = bias[:, qpg + 1].reshape(ng * d)
        out[a + "o_proj.weight"] = _take(sd, p + "self_attention.linear_proj.weight", (h, nh * d))
        out[f"model.layers.{i}.input_layernorm.weight"] = _take(sd, p + "input_layernorm.weight", (h,))
        out[f"model.layers.{i}.post_attention_layernorm.weight"] = _take(
            sd, p + "pre_mlp_layernorm.weight", (h,)
        )
        if cfg.qk_layernorm:
            out[a + "q_norm.weight"] = _take(sd, p + "self_attention.q_layernorm.weight", (d,))
            out[a + "k_norm.weight"] = _take(sd, p + "self_attention.k_layernorm.weight", (d,))
        for name, t in _mlp_names(cfg, i):
            if t is None:
                out[_hf_router(cfg, i)] = _take(sd, p + name, (cfg.num_experts, h))
            else:
                gate, up, down, width = t
                fc1 = _take(sd, p + name + "linear_fc1.weight", (2 * width, h))
                out[gate], out[up] = fc1[:width], fc1[width:]
                out[down] = _take(sd, p + name + "linear_fc2.weight", (h, width))
    out["model.norm.weight"] = _take(sd, "decoder.final_layernorm.weight", (h,))
    if role in VALUE_ROLES:
        out["score.weight"] = _take(sd, "output_layer.weight", (1, h))
    elif not cfg.tie_embeddings:
        out["lm_head.weight"] = _take(sd, "output_layer.weight", (cfg.padded_vocab_size, h))[:v]
    return {k: t.contiguous() for k, t in out.items()}


def load_into_model(model, tensors: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into a TP=1 model; every parameter must be provided."""
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(tensors))
    unexpected = sorted(set(tensors) - set(params))
    if missing or unexpected:
        raise ShapeMismatch(f"state dict does not match the model: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for name, t in tensors.items():
            _expect(name, t, params[name].shape)
            params[name].copy_(t)


def model_tensors(model) -> dict[str, torch.Tensor]:
    """The full tensors of a TP=1 model, by parameter name."""
    return {n: p.detach() for n, p in model.named_parameters()}
