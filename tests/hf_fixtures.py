"""Tiny random Hugging Face Llama models built from our presets (no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_rlhf.config import preset
from megatron_rlhf.models.hf_mapping import hf_config_dict


def make_hf_llama(name: str, seed: int = 0):
    """A ``LlamaForCausalLM`` (``MistralForCausalLM``, ``Qwen2ForCausalLM`` for presets of
    those families) with the shape of preset ``name`` and random weights."""
    import transformers

    cfg = preset(name)
    d = hf_config_dict(cfg)
    kind = d["architectures"][0]
    config_cls = getattr(transformers, kind.replace("ForCausalLM", "Config"))
    torch.manual_seed(seed)
    hf = getattr(transformers, kind)(config_cls(**d)).eval()
    with torch.no_grad():  # norms are ones and biases zeros at init: make them informative
        for n, p in hf.named_parameters():
            if "norm" in n or n.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.2)
    return hf


def save_hf_llama(name: str, directory: Path, seed: int = 0) -> Path:
    hf = make_hf_llama(name, seed)
    hf.save_pretrained(str(directory))
    return directory
