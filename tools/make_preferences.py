#!/usr/bin/env python
"""Regenerate the shipped fine-tuning sets from the shipped prompts (nothing downloaded).

  python tools/make_preferences.py [--pairs megatron_rlhf/data/preferences.jsonl] [--sft megatron_rlhf/data/sft.jsonl] [--seed 0]

The sets teach style, not facts: for each train-split prompt, a direct reply from short sentences
of its category (``chosen``) is preferred over the same sentences padded with an opener, hedges and
a closing repetition (``rejected``); the SFT set pairs the prompts with the chosen replies. Records
are a pure function of the prompts and the seed.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SENTENCES = {
    "explanation": [
        "The short answer is that one main cause explains most of it.",
        "Think of it as energy moving from one place to another.",
        "The effect depends on size, distance and time.",
        "Small differences add up until the result is easy to see.",
        "Scientists test this idea with simple, repeatable measurements.",
        "A familiar example makes it clear.",
    ],
    "howto": [
        "Start with the simplest step and check the result.",
        "Gather what you need before you begin.",
        "Work in small batches so mistakes stay small.",
        "Write the steps down and follow them in order.",
        "Test the result, then adjust one thing at a time.",
        "Finish by cleaning up and noting what worked.",
    ],
    "creative": [
        "The lamp flickered once, and the room remembered its name.",
        "Rain wrote quiet letters on the window.",
        "She kept the map, though the roads had changed.",
        "Morning arrived like a friend who knocks twice.",
        "The old boat listened to the harbor sleep.",
        "Every step on the stairs told a small story.",
    ],
    "advice": [
        "Pick one goal and make the first step tiny.",
        "Set a time for it and protect that time.",
        "Ask someone you trust for honest feedback.",
        "Rest is part of the plan, not a break from it.",
        "Measure progress weekly instead of daily.",
        "Keep what works and drop what does not.",
    ],
}
FALLBACK = "explanation"
BANK_OF = {"coding": "howto", "formatting": "howto", "list": "howto", "math": "howto",
           "comparison": "advice", "reasoning": "advice", "writing": "creative", "rewriting": "creative"}
OPENERS = ["Well, that is a really great question, and I am glad you asked it.",
           "Okay, so, let me think about this for a moment before I answer.",
           "Great question! There are honestly many things one could say here.",
           "Hmm, this is one of those topics where it really depends on a lot of things."]
HEDGES = ["basically", "you know", "to be honest", "I think", "sort of", "in a way", "actually"]
CLOSERS = ["So, as I said, basically that is more or less the answer, I think.",
           "Anyway, I hope that helps, and again, it really depends on the situation.",
           "To sum up what I already said above, it is basically what I explained.",
           "In conclusion, as mentioned, there is a lot more one could say about all of this."]


def chosen_reply(category: str, rng: random.Random) -> list[str]:
    bank = SENTENCES[BANK_OF.get(category, category if category in SENTENCES else FALLBACK)]
    return rng.sample(bank, 2)


def rejected_reply(sentences: list[str], rng: random.Random) -> str:
    padded = []
    for s in sentences:
        hedge = rng.choice(HEDGES)
        padded.append(f"{hedge.capitalize()}, {s[0].lower()}{s[1:]}")
    return " ".join([rng.choice(OPENERS), *padded, rng.choice(CLOSERS)])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", default=str(ROOT / "megatron_rlhf/data/prompts.jsonl"))
    p.add_argument("--pairs", default=str(ROOT / "megatron_rlhf/data/preferences.jsonl"))
    p.add_argument("--sft", default=str(ROOT / "megatron_rlhf/data/sft.jsonl"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    pairs, sft = [], []
    for line in Path(args.prompts).read_text().splitlines():
        rec = json.loads(line)
        if rec.get("split") != "train":
            continue
        sentences = chosen_reply(rec.get("category", FALLBACK), rng)
        chosen = " ".join(sentences)
        pairs.append({"prompt": rec["prompt"], "chosen": chosen, "rejected": rejected_reply(sentences, rng)})
        sft.append({"prompt": rec["prompt"], "response": chosen})
    for path, records in ((args.pairs, pairs), (args.sft, sft)):
        Path(path).write_text("".join(json.dumps(r) + "\n" for r in records))
        print(f"{path}: {len(records)} records")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
