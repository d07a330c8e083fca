"""Prompt records for generation and RLHF: the shipped sets and users' dataset files.

Entry point: :func:`load_prompts`. A bad record raises ``ValueError`` naming the file, the
line or row, and what is wrong, before anything distributed starts.
"""
# A record is the prompt (--prompt-key: a string or a chat messages list) plus any other
# fields, which ride along untouched to the reward as RewardInput.meta.

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rlhf.data.tokenizer import encode_chat, encode_prompt

# The instruction prompts written for this project: id, prompt, category, split.
DEFAULT_PROMPTS: Path = Path(__file__).with_name("prompts.jsonl")
# Arithmetic word problems (tools/make_math_task.py): id, prompt, answer. The held-out split
# shares no problem with the training one.
MATH_TRAIN: Path = Path(__file__).with_name("math_train.jsonl")
MATH_HELDOUT: Path = Path(__file__).with_name("math_heldout.jsonl")

SPLITS = ("train", "heldout")  # the values of a prompt's split
# .jsonl: one object a line. .json: a list, or an object holding one list (datasets'
# to_json(lines=False)). .parquet: read with pyarrow (Hugging Face datasets' files).
FORMATS = (".jsonl", ".json", ".parquet")


@dataclass
class Prompt:
    """One prompt record."""

    id: str  # the record's id, else line{n} / row{n}
    prompt: str  # the user's text, no chat template (a messages record: its last user turn)
    category: str  # e.g. math or coding, else unknown
    split: str  # train or heldout, else train
    messages: list[dict] | None = None  # the chat turns of a messages record, None for a string
    meta: dict = field(default_factory=dict)  # every field but the prompt (RewardInput.meta)


def _check_split(split: str | None) -> None:
    if split is not None and split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: valid splits are {', '.join(map(repr, SPLITS))} or None (all)")


def _messages(value, where: str, key: str) -> tuple[list[dict], str]:
    """A chat ``messages`` list checked, and the text of its last user turn."""
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: {key!r}[{i}] must be an object with string 'role' and "
                             f"'content', got {m!r}")
    users = [m["content"] for m in value if m["role"] == "user"]
    if not users or value[-1]["role"] == "assistant":
        raise ValueError(f"{where}: the {key!r} chat must hold a user turn and not end with the "
                         "assistant's (the response is what gets generated)")
    return [dict(role=m["role"], content=m["content"]) for m in value], users[-1]


def parse_record(record, where: str, key: str = "prompt", default_id: str = "",
                 required: tuple[str, ...] = ()) -> Prompt:
    """The :class:`Prompt` of one record. ``where`` names it in errors (file and line/row).
    ``required``: fields the reward needs (e.g. the answer). Raises ValueError."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for name in required:
        if record.get(name) is None:
            raise ValueError(f"{where}: missing the {name!r} field that the reward function checks "
                             "answers against (--answer-key names it)")
    if key not in record:
        fields = ", ".join(map(repr, sorted(record))) or "none"
        raise ValueError(f"{where}: missing the {key!r} field (fields: {fields}); "
                         "--prompt-key names the prompt's field")
    value, messages = record[key], None
    if isinstance(value, (list, tuple)) and value:
        messages, value = _messages(list(value), where, key)
    elif not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: {key!r} must be a non-empty string or a chat messages list, "
                         f"got {value!r}")
    split = record.get("split", "train")
    if split not in SPLITS:
        raise ValueError(f"{where}: split {split!r} is not one of {', '.join(map(repr, SPLITS))}")
    return Prompt(id=str(record.get("id", default_id)), prompt=value,
                  category=str(record.get("category", "unknown")), split=split, messages=messages,
                  meta={k: v for k, v in record.items() if k != key})


def _read_jsonl(path: Path, key: str, required: tuple[str, ...]) -> list[Prompt]:
    out = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {n}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
            out.append(parse_record(record, where, key, f"line{n}", required))
    return out


def _rows(path: Path) -> list:
    """The records of a ``.json`` or ``.parquet`` file, in order."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow's errors name no file
            raise ValueError(f"{path}: not a readable parquet file ({e})") from None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON at line {e.lineno} ({e.msg}); a file of one "
                         "object per line must be named .jsonl") from None
    if isinstance(data, dict):  # {"data": [...]} / {"train": [...]}: the one list it holds
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise ValueError(f"{path}: expected a list of records, or an object holding exactly "
                             f"one such list; got an object with fields {sorted(data)}")
        data = lists[0]
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of records, got {type(data).__name__}")
    return data


def load_prompts(path: str | Path | None = None, split: str | None = None,
                 key: str = "prompt", required: tuple[str, ...] = ()) -> list[Prompt]:
    """Records of a dataset file (None: the shipped instruction prompts), in file order.

    ``split``: train, heldout or None (all); ``key``: the prompt's field; ``required``: fields
    every record must have. Raises ValueError naming the file and line or row, FileNotFoundError."""
    # Rows count from 0, as ``datasets`` counts.
    _check_split(split)
    path = DEFAULT_PROMPTS if path is None else Path(path)
    if path.suffix not in FORMATS:
        raise ValueError(f"{path}: unknown dataset format {path.suffix!r}; use one of "
                         f"{', '.join(FORMATS)}")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such prompts file")
    if path.suffix == ".jsonl":
        prompts = _read_jsonl(path, key, required)
    else:
        prompts = [parse_record(r, f"{path}, row {i}", key, f"row{i}", required)
                   for i, r in enumerate(_rows(path))]
    if not prompts:
        raise ValueError(f"{path}: holds no records")
    return [p for p in prompts if split is None or p.split == split]


def encode_record(tokenizer, p: Prompt, chat: bool = True) -> list[int]:
    """Token ids of a record's prompt: its ``messages`` through the chat template, or its text
    (as a user turn plus the assistant header when ``chat``)."""
    if p.messages is None:
        return encode_prompt(tokenizer, p.prompt, chat=chat)
    if not chat:
        raise ValueError(f"record {p.id}: its prompt is a chat messages list, which needs the "
                         "chat template: drop --no-chat")
    return encode_chat(tokenizer, p.messages)


def format_prompt(tokenizer, text: str, chat: bool = True) -> list[int]:
    """Token ids of ``text``, as a chat user turn plus assistant header when ``chat``."""
    return encode_prompt(tokenizer, text, chat=chat)
