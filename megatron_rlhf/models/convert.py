"""Checkpoint conversion: HF/GGUF -> megatron_rlhf and back, and a dense checkpoint upcycled
into a mixture of experts (one process, TP=1)."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_rlhf import runtime
from megatron_rlhf.config import ModelConfig
from megatron_rlhf.models import hf_mapping
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.models.checkpoint import load_checkpoint, read_checkpoint, save_checkpoint
from megatron_rlhf.models.hf_io import HFCheckpoint, read_hf, write_hf_dir
from megatron_rlhf.parallel.groups import build_process_groups
from megatron_rlhf.parallel.layout import Layout


def _single_process_groups():
    rank, world = runtime.init_distributed()
    if world != 1:
        raise RuntimeError(
            f"checkpoint conversion runs on one process; got world size {world} (run it with "
            "python, not torchrun)"
        )
    return build_process_groups(Layout())


def hf_to_mcore(src: str | Path, dst: str | Path, dtype: torch.dtype = torch.float32,
                role: str = "actor", step: int = 0) -> Path:
    """Convert a HF Llama directory or ``.gguf`` file to a megatron_rlhf checkpoint; returns
    its directory. A critic or reward comes from a one-label ``*ForSequenceClassification``."""
    ckpt = read_hf(src)
    cfg = hf_mapping.config_from_hf(ckpt.config, str(src))
    if role in hf_mapping.VALUE_ROLES and ckpt.config.get("num_labels", 1) != 1:
        raise ValueError(f"{src} scores {ckpt.config['num_labels']} labels; a {role} model has one")
    tensors = hf_mapping.hf_to_mcore(ckpt.tensors, cfg, role)  # validates shapes, names mismatches
    pg = _single_process_groups()
    model = build_model(cfg, role, pg, dtype=dtype)
    hf_mapping.load_into_model(model, tensors)
    return save_checkpoint(dst, step, model, pg, tokenizer=ckpt.tokenizer,
                           extra={"converted_from": str(src)})


def mcore_to_hf(src: str | Path, dst: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Convert a megatron_rlhf LM checkpoint to a directory ``transformers`` loads."""
    info = read_checkpoint(src)
    if info.config.head_vocab_size:
        raise ValueError(f"{info.path} has a reduced LM head ({info.config.head_vocab_size} tokens), "
                         "which Hugging Face Llama cannot represent")
    if info.config.feature_draft:
        raise ValueError(f"{info.path} is a feature (EAGLE) draft that reads a target's hidden "
                         "states; Hugging Face Llama cannot represent it")
    pg = _single_process_groups()
    model = build_model(info.config, info.role, pg, dtype=dtype or torch.float32)
    load_checkpoint(model, pg, info.path)
    tensors = hf_mapping.mcore_to_hf(hf_mapping.model_tensors(model), info.config, info.role)
    tokenizer = None
    if info.tokenizer_dir is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(info.tokenizer_dir))
    out_dtype = next(iter(tensors.values())).dtype
    write_hf_dir(dst, HFCheckpoint(hf_mapping.hf_config_dict(info.config, out_dtype, info.role),
                                   tensors, tokenizer))
    return Path(dst)


def upcycled_tensors(dense: dict[str, torch.Tensor], cfg: ModelConfig, moe: ModelConfig,
                     seed: int = 1234) -> dict[str, torch.Tensor]:
    """A TP=1 MoE ``moe``'s tensors from the dense ``cfg``'s (granular upcycling): each dense
    SwiGLU split into ``granularity`` pieces of ``moe.moe_ffn_hidden_size`` rows, the pieces
    repeated ``experts / granularity`` times (expert ``j``: piece ``j % g`` of replica ``j // g``),
    the router seeded with one row per replica shared by its pieces."""
    # Top-k over identical logits picks whole replicas, and a softmax over k = g of them gives
    # each piece 1/g: the down projections are scaled by g, so that with top-k = g the MoE
    # computes the dense MLP exactly (megatron's upcycling spreads the scale over both
    # projections, which silu makes inexact). Every replica starts the same: which one a
    # token picks changes nothing at step 0.
    f, g = moe.moe_ffn_hidden_size, cfg.ffn_hidden_size // moe.moe_ffn_hidden_size
    replicas = moe.num_experts // g
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in dense.items():
        layer, _, rest = name.partition(".mlp.")
        if not rest:
            out[name] = t
            continue
        if rest == "linear_fc1.weight":
            gate, up = t.chunk(2)
            for j in range(moe.num_experts):
                q = slice((j % g) * f, (j % g + 1) * f)
                out[f"{layer}.mlp.experts.local_experts.{j}.linear_fc1.weight"] = torch.cat([gate[q], up[q]])
        elif rest == "linear_fc2.weight":
            for j in range(moe.num_experts):
                piece = t[:, (j % g) * f:(j % g + 1) * f]
                out[f"{layer}.mlp.experts.local_experts.{j}.linear_fc2.weight"] = piece * g
            rows = torch.randn(replicas, cfg.hidden_size, generator=gen) * 0.02
            out[f"{layer}.mlp.router.weight"] = rows.repeat_interleave(g, 0).to(t.dtype)
        else:
            raise ValueError(f"{name}: a dense MLP of linear_fc1 and linear_fc2 was expected")
    return out


def upcycle(src: str | Path, dst: str | Path, num_experts: int, granularity: int, topk: int,
            seed: int = 1234) -> tuple[Path, float]:
    """The dense checkpoint ``src`` as an MoE of ``num_experts`` experts, each ``1 /
    granularity`` of its MLP, routed top-``topk`` (:func:`upcycled_tensors`), saved at ``dst``.
    Returns the directory and the largest |logit| difference from the dense model on a seeded
    batch (0 up to fp32 rounding where ``topk == granularity``)."""
    from megatron_rlhf.models.forward import lm_logits

    info = read_checkpoint(src)
    cfg = info.config
    if cfg.num_experts is not None:
        raise ValueError(f"{info.path} already has {cfg.num_experts} experts")
    if granularity < 1 or cfg.ffn_hidden_size % granularity or num_experts % granularity:
        raise ValueError(f"--granularity {granularity} must divide the MLP's {cfg.ffn_hidden_size} rows "
                         f"and --num-experts {num_experts}")
    # (the HF architecture it exports to: Qwen3-MoE where the heads have q/k norms)
    family = "qwen3_moe" if cfg.qk_layernorm else "mixtral"
    moe = cfg.replace(family=family, num_experts=num_experts, moe_router_topk=topk,
                      moe_ffn_hidden_size=cfg.ffn_hidden_size // granularity, moe_norm_topk=True)
    pg = _single_process_groups()
    dense = build_model(cfg, info.role, pg, dtype=torch.float32)
    load_checkpoint(dense, pg, info.path)
    model = build_model(moe, info.role, pg, dtype=torch.float32)
    hf_mapping.load_into_model(model, upcycled_tensors(hf_mapping.model_tensors(dense), cfg, moe, seed))
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        gap = float((lm_logits(model, ids) - lm_logits(dense, ids)).abs().max())
    tokenizer = None
    if info.tokenizer_dir is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(info.tokenizer_dir))
    out = save_checkpoint(dst, 0, model, pg, tokenizer=tokenizer,
                          extra={"upcycled_from": str(info.path), "step0_max_logit_diff": gap})
    return out, gap
