#!/usr/bin/env python
"""Regenerate ``megatron_rlhf/data/prompts.jsonl`` from the hand-written lists in ``prompt_lists.jsonl``.

  python tools/make_prompts.py [--output PATH]

Every prompt was written for this project. Ids follow category order: a prompt appended to a
category's list shifts later ids; a new category at the end of ``CATEGORIES`` keeps them.
Within each category every 10th prompt (positions 10, 20, ...) is held out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HELDOUT_EVERY = 10
LISTS_FILE = Path(__file__).resolve().with_name("prompt_lists.jsonl")


def read_lists(path: Path = LISTS_FILE) -> dict[str, list[str]]:
    """``prompt_lists.jsonl`` (one ``{"list", "text"}`` per line) -> list name -> its texts in order."""
    lists: dict[str, list[str]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        lists.setdefault(row["list"], []).append(row["text"])
    return lists


def _turn(i: int, n: int) -> int:
    """Template index for item ``i`` of ``n`` templates; it skips one every ten items so the
    held-out items (every 10th) do not all land on the same few templates."""
    return (i + i // HELDOUT_EVERY) % n


def _cycle(templates: list[str], items: list[str]) -> list[str]:
    """Each item placed into the next template in turn."""
    return [templates[_turn(i, len(templates))].format(item) for i, item in enumerate(items)]


def _summaries(lists: dict[str, list[str]]) -> list[str]:
    n = len(lists["summary_instructions"])
    return [f"{lists['summary_instructions'][_turn(i, n)]}\n\n{p}" for i, p in enumerate(lists["passages"])]


def _classification(lists: dict[str, list[str]]) -> list[str]:
    return (
        _cycle(lists["sentiment_templates"], lists["sentiment_sentences"])
        + _cycle(lists["topic_templates"], lists["headlines"])
        + [f'Is this message spam or not spam? Explain briefly. "{m}"' for m in lists["spam_messages"]]
        + [f'Is this statement a fact or an opinion? "{s}"' for s in lists["fact_or_opinion"]]
    )


def _formatting(lists: dict[str, list[str]]) -> list[str]:
    formats = lists["formats"]
    return [f"{q} {formats[_turn(i, len(formats))]}" for i, q in enumerate(lists["format_questions"])]


def categories(lists: dict[str, list[str]]) -> dict[str, list[str]]:
    """Category -> its prompts, built from the hand-written lists."""
    return {
        "explanation": lists["explanation"],
        "math": lists["math"],
        "coding": lists["coding"],
        "summarization": _summaries(lists),
        "rewriting": lists["rewriting"],
        "creative": _cycle(lists["creative_templates"], lists["creative_subjects"]),
        "advice": lists["advice"],
        "comparison": lists["comparison"],
        "classification": _classification(lists),
        "list": lists["lists"],
        "factual": lists["factual"],
        "translation": _cycle(lists["translation_templates"], lists["translation_sentences"]),
        "reasoning": lists["reasoning"],
        "formatting": _formatting(lists),
        "writing": lists["writing"],
    }


def records(lists: dict[str, list[str]] | None = None) -> list[dict[str, str]]:
    """All prompts with stable ids; every ``HELDOUT_EVERY``-th of each category held out."""
    out, seen = [], set()
    for category, prompts in categories(lists or read_lists()).items():
        for i, text in enumerate(prompts):
            key = " ".join(text.lower().split())
            if key in seen:
                raise ValueError(f"duplicate prompt in {category}: {text!r}")
            seen.add(key)
            split = "heldout" if i % HELDOUT_EVERY == HELDOUT_EVERY - 1 else "train"
            out.append({"id": f"p{len(out) + 1:04d}", "prompt": text, "category": category, "split": split})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = Path(__file__).resolve().parents[1] / "megatron_rlhf" / "data" / "prompts.jsonl"
    p.add_argument("--output", type=Path, default=default, help="jsonl file to write")
    args = p.parse_args(argv)
    rows = records()
    with args.output.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    heldout = sum(r["split"] == "heldout" for r in rows)
    n_categories = len({r["category"] for r in rows})
    print(f"wrote {len(rows)} prompts ({heldout} held out, {n_categories} categories) to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
