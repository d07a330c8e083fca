"""Instruction prompts for generation and RLHF: the shipped set and user jsonl files.

Each line of a prompts file is a JSON object with at least ``{"prompt": "..."}``; the
shipped file (:data:`DEFAULT_PROMPTS`) also has ``id``, ``category`` and ``split``
(``train`` or ``heldout``, about one prompt in ten of every category held out).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megatron_rlhf.data.tokenizer import encode_prompt

DEFAULT_PROMPTS: Path = Path(__file__).with_name("prompts.jsonl")
"""The instruction prompts shipped with the package (written for this project)."""

SPLITS = ("train", "heldout")
"""Valid values of a prompt's ``split``."""


@dataclass
class Prompt:
    """One instruction prompt."""

    id: str
    """Stable identifier such as ``p0001``; ``line{n}`` when the file gives none."""
    prompt: str
    """The user's instruction text (without any chat template)."""
    category: str
    """Kind of task, e.g. ``math`` or ``coding``; ``unknown`` when the file gives none."""
    split: str
    """``train`` or ``heldout``; ``train`` when the file gives none."""


def _check_split(split: str | None) -> None:
    if split is not None and split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: valid splits are {', '.join(map(repr, SPLITS))} or None (all)")


def _parse_line(line: str, path: Path, n: int) -> Prompt:
    """The prompt on line ``n`` (1-based) of ``path``; ``ValueError`` naming both when invalid."""
    where = f"{path}, line {n}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "prompt" not in record:
        raise ValueError(f"{where}: missing the 'prompt' field")
    text = record["prompt"]
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{where}: 'prompt' must be a non-empty string, got {text!r}")
    split = record.get("split", "train")
    if split not in SPLITS:
        raise ValueError(f"{where}: split {split!r} is not one of {', '.join(map(repr, SPLITS))}")
    return Prompt(
        id=str(record.get("id", f"line{n}")),
        prompt=text,
        category=str(record.get("category", "unknown")),
        split=split,
    )


def load_prompts(path: str | Path | None = None, split: str | None = None) -> list[Prompt]:
    """Prompts from a jsonl file (the shipped set when ``path`` is None), in file order.

    ``split`` keeps only ``"train"`` or ``"heldout"`` prompts; None keeps all. Blank lines
    are skipped; an invalid line raises ``ValueError`` with the file and line number.
    """
    _check_split(split)
    path = DEFAULT_PROMPTS if path is None else Path(path)
    with path.open(encoding="utf-8") as f:
        prompts = [_parse_line(line, path, n) for n, line in enumerate(f, start=1) if line.strip()]
    return [p for p in prompts if split is None or p.split == split]


def format_prompt(tokenizer, text: str, chat: bool = True) -> list[int]:
    """Token ids of ``text``, as a chat user turn plus assistant header when ``chat``."""
    return encode_prompt(tokenizer, text, chat=chat)
