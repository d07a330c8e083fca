"""Checkpoint conversion: HF/GGUF -> megatron_rlhf and back (one process, TP=1)."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_rlhf import runtime
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
