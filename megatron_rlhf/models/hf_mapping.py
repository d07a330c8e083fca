"""Hugging Face Llama (and Mistral, Qwen2) <-> megatron-core tensor and config mapping.

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


ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


# the fields config_from_hf has no default for
REQUIRED_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")


def config_from_hf(hf: dict, source: str = "config.json") -> ModelConfig:
    """ModelConfig from a HF config dict (``config.json``) of a Llama, Mistral or Qwen2;
    ``source`` names the file in errors."""
    family = hf.get("model_type") or "llama"
    if family not in FAMILIES:
        raise ValueError(f"model_type {family!r} is not supported; supported model types: "
                         f"{', '.join(FAMILIES)}")
    missing = [k for k in REQUIRED_FIELDS if hf.get(k) is None]
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
    if family == "qwen2" and not hf.get("use_sliding_window", False):
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
    )


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
    elif cfg.family == "mistral":
        out["sliding_window"] = cfg.sliding_window
    else:
        out.update(use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window)
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


def _pad_vocab(t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    pad = cfg.padded_vocab_size - t.shape[0]
    return torch.cat([t, t.new_zeros(pad, t.shape[1])]) if pad else t


def hf_to_mcore(sd: dict, cfg: ModelConfig, role: str = "actor") -> dict[str, torch.Tensor]:
    """HF ``LlamaForCausalLM`` (Mistral, Qwen2) state dict -> megatron ``GPTModel`` (local
    spec, TP=1); Qwen2's q/k/v biases go into ``linear_qkv.bias``, grouped as its weight."""
    # megatron's linear_qkv is grouped by KV head: for each group its heads/groups query heads,
    # then its key head, then its value head. SwiGLU's linear_fc1 is [gate; up].
    h, d, f = cfg.hidden_size, cfg.kv_channels, cfg.ffn_hidden_size
    nh, ng, v = cfg.num_attention_heads, cfg.num_query_groups, cfg.vocab_size
    out = {"embedding.word_embeddings.weight": _pad_vocab(_take(sd, "model.embed_tokens.weight", (v, h)), cfg)}
    for i in range(cfg.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
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
        out[p + "mlp.linear_fc1.weight"] = torch.cat(
            [_take(sd, m + "gate_proj.weight", (f, h)), _take(sd, m + "up_proj.weight", (f, h))]
        )
        out[p + "mlp.linear_fc2.weight"] = _take(sd, m + "down_proj.weight", (h, f))
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
    """megatron ``GPTModel`` (local spec, TP=1) state dict -> HF ``LlamaForCausalLM`` (a
    critic or reward model: ``LlamaForSequenceClassification``, its value head as ``score``)."""
    h, d, f = cfg.hidden_size, cfg.kv_channels, cfg.ffn_hidden_size
    nh, ng, v = cfg.num_attention_heads, cfg.num_query_groups, cfg.vocab_size
    qpg = nh // ng
    emb = _take(sd, "embedding.word_embeddings.weight", (cfg.padded_vocab_size, h))
    out = {"model.embed_tokens.weight": emb[:v]}
    for i in range(cfg.num_layers):
        p, a, m = f"decoder.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
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
        fc1 = _take(sd, p + "mlp.linear_fc1.weight", (2 * f, h))
        out[m + "gate_proj.weight"], out[m + "up_proj.weight"] = fc1[:f], fc1[f:]
        out[m + "down_proj.weight"] = _take(sd, p + "mlp.linear_fc2.weight", (h, f))
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
