"""Prompt datasets, tokenizers and chat templates."""
