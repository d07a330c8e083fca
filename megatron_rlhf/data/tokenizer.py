"""Tokenizers stored in checkpoints, and prompt encoding with the chat template."""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(directory: str | Path | None):
    """The ``transformers`` tokenizer saved in a checkpoint's ``tokenizer/`` directory."""
    if directory is None:
        raise ValueError(
            "this checkpoint has no tokenizer/ directory: convert it with "
            "tools/convert_checkpoint.py from a source that has a tokenizer"
        )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def encode_prompt(tokenizer, text: str, chat: bool = False) -> list[int]:
    """Token ids of ``text``; with ``chat`` wrapped as a user turn plus the assistant header."""
    if chat:
        return encode_chat(tokenizer, [{"role": "user", "content": text}])
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of chat ``messages`` through the tokenizer's template, plus the assistant header."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template: encode prompts as plain text "
                         "(generate: drop --chat; train: --no-chat)")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
