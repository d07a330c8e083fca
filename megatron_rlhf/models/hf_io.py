"""Read and write Hugging Face checkpoints: safetensors directories and GGUF files.

Entry points: :func:`read_hf`, :func:`write_hf_dir`. Reading returns plain data; the mapping
onto megatron's names lives in :mod:`megatron_rlhf.models.hf_mapping`.
"""

from __future__ import annotations

import functools
import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

SHARD_BYTES = 4 * 1024**3


@dataclass
class HFCheckpoint:
    """A HF Llama checkpoint in memory."""

    config: dict  # config.json
    tensors: dict[str, torch.Tensor]  # full tensors by HF name
    tokenizer: object | None  # a transformers tokenizer, when the source has one


@contextmanager
def _gguf_parsed_once():
    """Within the block, gguf's reader of a file is made once, and its tensor-name map once
    per (architecture, layers)."""
    # transformers parses a GGUF header (a whole vocabulary, field by field) once each for the
    # config, the weights and the tokenizer, and builds the name map anew for every module:
    # most of a conversion's time (docs/benchmarks). Both objects are read-only.
    import gguf

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers = {}

    def reader(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(real_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


def read_gguf(path: Path, dtype: torch.dtype = torch.float32) -> HFCheckpoint:
    """Dequantize a Llama GGUF file through ``transformers`` (needs ``gguf``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    return HFCheckpoint(config, tensors, tokenizer)


def read_hf_dir(path: Path) -> HFCheckpoint:
    """A HF directory with ``config.json`` and ``*.safetensors`` (sharded or not)."""
    from safetensors.torch import load_file

    from megatron_rlhf.models.hf_mapping import config_from_hf

    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json: is it a Hugging Face model directory?")
    config = json.loads(cfg_file.read_text())
    config_from_hf(config, str(cfg_file))  # an unsupported architecture or a missing field, named first
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{path} has no *.safetensors files (convert .bin checkpoints with transformers first)"
        )
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    return HFCheckpoint(config, tensors, _maybe_tokenizer(path))


def _maybe_tokenizer(path: Path):
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    if not any((path / n).is_file() for n in names):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def read_hf(path: str | Path) -> HFCheckpoint:
    """A ``.gguf`` file or a HF safetensors directory."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p} does not exist")
    if p.is_file():
        if p.suffix != ".gguf":
            raise ValueError(f"{p}: expected a .gguf file or a Hugging Face model directory")
        return read_gguf(p)
    return read_hf_dir(p)


def write_hf_dir(path: str | Path, ckpt: HFCheckpoint) -> None:
    """Write ``config.json``, safetensors (sharded with an index above 4 GiB) and tokenizer."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in ckpt.tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
        total = sum(t.numel() * t.element_size() for t in ckpt.tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (out / "config.json").write_text(json.dumps(ckpt.config, indent=1))
    if ckpt.tokenizer is not None:
        ckpt.tokenizer.save_pretrained(str(out))
