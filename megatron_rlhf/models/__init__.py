"""Llama-family models on megatron-core: builders, value heads, checkpoints, HF/GGUF mapping."""
