"""Tiny random Hugging Face Llama models built from our presets (no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_rlhf.config import preset
from megatron_rlhf.models.hf_mapping import hf_config_dict


def make_hf_llama(name: str, seed: int = 0):
    """A ``LlamaForCausalLM`` with the shape of preset ``name`` and random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = preset(name)
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(LlamaConfig(**hf_config_dict(cfg))).eval()
    with torch.no_grad():  # norms are ones at init: make them informative
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.2)
    return hf


def save_hf_llama(name: str, directory: Path, seed: int = 0) -> Path:
    hf = make_hf_llama(name, seed)
    hf.save_pretrained(str(directory))
    return directory
