"""Datasets of the fine-tuning stages: SFT examples and preference pairs, held-out splits,
packing and batches with response masks.

Entry points: :func:`read_jsonl`, :func:`sft_examples`, :func:`pair_examples`,
:func:`token_batch`. Invariant: examples are tokenised the way the RLHF loop sees prompts
(the chat template with the assistant header), then the response and EOS.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from megatron_rlhf import runtime
from megatron_rlhf.data.padding import padded


@dataclass
class Example:
    """One tokenised sequence: ``prompt`` then ``response`` (ending with EOS)."""

    prompt: list[int]
    response: list[int]

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.response)

    @property
    def untargeted(self) -> int:
        """Leading response tokens that are no target (the first when the prompt is empty)."""
        return 0 if self.prompt else min(1, len(self.response))

    @property
    def targets(self) -> int:
        """Response tokens the SFT loss predicts."""
        return len(self.response) - self.untargeted


# Rows of one or more examples (packing), right-padded. segments numbers each row's examples
# from 1 (0: padding), so attention stays inside an example and positions restart at each.
@dataclass
class TokenBatch:
    input_ids: Tensor  # [B, T] right-padded
    segments: Tensor  # [B, T] example number within the row (1, 2, ...), 0 at padding
    loss_mask: Tensor  # [B, T] 1 at the targets: response tokens (an empty prompt's first excepted)
    last: Tensor  # [E] flat index (row * T + column) of each example's last token, in order
    ref: Tensor | None = None  # [B] DPO: the reference's summed response log-probs per row

    @property
    def examples(self) -> int:
        return self.last.shape[0]


def read_jsonl(path: str | Path, keys: tuple[str, ...]) -> list[dict]:
    """Records of a jsonl file, each checked for ``keys`` (or ``messages``). Raises
    ValueError naming the line."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"data file {p} does not exist")
    out = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{n}: not JSON ({e})") from None
        if not (all(isinstance(rec.get(k), str) for k in keys) or "messages" in rec and keys == SFT_KEYS):
            raise ValueError(f"{p}:{n}: a record needs string fields {list(keys)}"
                             + (" (or chat 'messages')" if keys == SFT_KEYS else ""))
        out.append(rec)
    if not out:
        raise ValueError(f"{p} holds no records")
    return out


# SFT records may instead hold chat "messages": the last is the assistant's response, the
# earlier ones the prompt.
SFT_KEYS = ("prompt", "response")
PAIR_KEYS = ("prompt", "chosen", "rejected")


def encode_prompt_messages(tokenizer, messages: list[dict], chat: bool) -> list[int]:
    """The prompt as the policy sees it: the chat template with the assistant header, or
    (``chat=False``) the messages' contents joined."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template: use --no-chat")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    text = "\n".join(m["content"] for m in messages)
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def encode_response(tokenizer, text: str, eos: int) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [eos]


def sft_examples(records: list[dict], tokenizer, eos: int, chat: bool, max_len: int) -> list[Example]:
    out = []
    for i, r in enumerate(records):
        if "messages" in r:
            msgs = r["messages"]
            if not msgs or msgs[-1].get("role") != "assistant":
                raise ValueError(f"SFT record {i}: the last message must be the assistant's response")
            prompt, response = msgs[:-1], msgs[-1]["content"]
        else:
            prompt, response = [{"role": "user", "content": r["prompt"]}], r["response"]
        ex = Example(encode_prompt_messages(tokenizer, prompt, chat), encode_response(tokenizer, response, eos))
        _check_length(ex, i, max_len)
        out.append(ex)
    return out


def pair_examples(records: list[dict], tokenizer, eos: int, chat: bool,
                  max_len: int) -> list[tuple[Example, Example]]:
    out = []
    for i, r in enumerate(records):
        prompt = encode_prompt_messages(tokenizer, [{"role": "user", "content": r["prompt"]}], chat)
        pair = (Example(prompt, encode_response(tokenizer, r["chosen"], eos)),
                Example(prompt, encode_response(tokenizer, r["rejected"], eos)))
        for ex in pair:
            _check_length(ex, i, max_len)
        out.append(pair)
    return out


def _check_length(ex: Example, i: int, max_len: int) -> None:
    if ex.length > max_len:
        raise ValueError(f"record {i} has {ex.length} tokens ({len(ex.prompt)} prompt + "
                         f"{len(ex.response)} response), more than --seq-length {max_len}: "
                         "raise it or shorten the record")


def split_held_out(items: list, fraction: float, seed: int) -> tuple[list, list]:
    """``(train, held_out)``: a seeded random ``fraction`` of ``items`` held out, at least one
    when positive."""
    if not 0 <= fraction < 1:
        raise ValueError(f"--held-out-fraction must lie in [0, 1), got {fraction}")
    n = round(len(items) * fraction)
    if fraction > 0:
        n = max(n, 1)
    order = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed)).tolist()
    held = set(order[:n])
    return [x for i, x in enumerate(items) if i not in held], [x for i, x in enumerate(items) if i in held]


def pack(examples: list[Example], width: int | None = None) -> list[list[Example]]:
    """Rows of examples filled first-fit, longest first, up to ``width`` tokens (None: one
    example per row)."""
    if width is None:
        return [[e] for e in examples]
    rows: list[list[Example]] = []
    room: list[int] = []
    for e in sorted(examples, key=lambda e: -e.length):
        for i, r in enumerate(room):
            if e.length <= r:
                rows[i].append(e)
                room[i] -= e.length
                break
        else:
            rows.append([e])
            room.append(width - e.length)
    return rows


def token_batch(rows: list[list[Example]], pad_id: int, device=None) -> TokenBatch:
    """Rows of examples as one right-padded :class:`TokenBatch` on ``device``."""
    ids, seg, mask, last = [], [], [], []
    width = max(sum(e.length for e in r) for r in rows)
    for r_i, row in enumerate(rows):
        i_row, s_row, m_row = [], [], []
        for k, e in enumerate(row, 1):
            i_row += e.prompt + e.response
            s_row += [k] * e.length
            m_row += [0] * (len(e.prompt) + e.untargeted) + [1] * e.targets
            last.append(r_i * width + len(i_row) - 1)
        ids.append(i_row)
        seg.append(s_row)
        mask.append(m_row)
    dev = runtime.device() if device is None else device
    return TokenBatch(padded(ids, pad_id, torch.long, dev, width),
                      padded(seg, 0, torch.long, dev, width),
                      padded(mask, 0, torch.long, dev, width),
                      torch.tensor(last, dtype=torch.long, device=dev))


def segment_inputs(segments: Tensor) -> tuple[Tensor, Tensor]:
    """``(position_ids [B, T], blocked mask [B, 1, T, T])`` for packed rows: positions restart
    at each example, and a token attends to earlier tokens of its own example only."""
    b, t = segments.shape
    start = torch.ones_like(segments, dtype=torch.bool)
    start[:, 1:] = segments[:, 1:] != segments[:, :-1]
    idx = torch.arange(t, device=segments.device).expand(b, t)
    first = torch.cummax(torch.where(start, idx, torch.zeros_like(idx)), dim=1).values
    positions = idx - first
    causal = torch.ones(t, t, dtype=torch.bool, device=segments.device).tril()
    same = (segments[:, :, None] == segments[:, None, :]) & (segments[:, None, :] > 0)
    allowed = causal[None] & same
    # Padding attends to itself, so no softmax row is empty.
    allowed |= torch.eye(t, dtype=torch.bool, device=segments.device)[None]
    return positions, ~allowed[:, None]
