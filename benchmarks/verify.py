#!/usr/bin/env python
"""Throughput of the ``math`` verifier (``--reward-fn math``): answers verified per second,
in this process and over the scorer's worker pool.

    python -m benchmarks.verify [--count 2000] [--batch 32] [--group 8] [--workers 0,1,2] [--timeout 5] [--out FILE.jsonl]

The answers are seeded rollout-like responses to arithmetic problems in four answer styles, a third
wrong, ``--group`` of them per problem (a GRPO group). Variants on the same answers: ``direct``
(``math_reward`` in a loop), ``workers=0`` (``RewardScorer`` in this process) and
``workers=K`` (its pool of K processes; start-up timed apart). One ``measurement`` line per
variant, then a ``summary`` line with the ratios to ``workers=0`` and the goal.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time

from benchmarks.harness import cpu_model
from megatron_rlhf.rlhf.rewards import RewardInput, RewardScorer, math_reward

GOAL_ANSWERS_PER_S = 1000.0
STYLES = ("boxed", "hash", "answer_is", "last_number")
FILLER = ("Let me check the arithmetic once more.", "Each step follows from the previous one.",
          "We keep track of the units carefully.", "Nothing else changes in the problem.")


def problem(rng: random.Random) -> tuple[str, str, str]:
    """A word problem: (prompt, its worked steps, the gold answer as a string)."""
    a, b, c = rng.randint(2, 40), rng.randint(2, 12), rng.randint(1, 90)
    if rng.random() < 0.1:  # a fractional answer
        q = rng.choice([2, 4, 5, 8])
        p = rng.randint(1, 4 * q)
        while p % q == 0:
            p += 1
        prompt = f"A rope of {p} meters is cut into {q} equal pieces. How long is each piece?"
        steps = f"Each piece is {p} / {q} meters long, since the {q} pieces share {p} meters equally."
        return prompt, steps, rng.choice([f"{p}/{q}", str(p / q)])
    prompt = f"Sam buys {a} boxes of {b} pencils and finds {c} more. How many pencils does Sam have?"
    steps = (f"First, {a} boxes of {b} pencils make {a} * {b} = {a * b} pencils. "
             f"Then Sam finds {c} more, so {a * b} + {c} = {a * b + c}.")
    return prompt, steps, str(a * b + c)


def final_answer(gold: str, wrong: bool, rng: random.Random) -> str:
    if "/" in gold or "." in gold:
        p, q = (gold.split("/") + ["1"])[:2] if "/" in gold else (gold, "1")
        value = float(p) / float(q) + (rng.choice([0.25, -0.5, 1]) if wrong else 0)
        if rng.random() < 0.5 and value == int(value * 8) / 8 and "/" in gold:
            return f"\\frac{{{int(value * 8)}}}{{8}}"
        return f"{value:g}"
    return str(int(gold) + (rng.choice([-10, -2, -1, 1, 3]) if wrong else 0))


def response(steps: str, gold: str, style: str, wrong: bool, rng: random.Random) -> str:
    """100-300 characters of steps ending in ``style``'s answer (off by a little if wrong)."""
    ans = final_answer(gold, wrong, rng)
    text = steps
    while len(text) < rng.randint(100, 240):
        text += " " + rng.choice(FILLER)
    if style == "boxed":
        return f"{text} So the final answer is $\\boxed{{{ans}}}$."
    if style == "hash":
        return f"{text}\n#### {ans}"
    if style == "answer_is":
        return f"{text} The answer is {ans}."
    return f"{text} That gives {ans}"


def make_samples(count: int, group: int, seed: int) -> list[RewardInput]:
    rng = random.Random(seed)
    samples = []
    while len(samples) < count:
        prompt, steps, gold = problem(rng)
        for _ in range(min(group, count - len(samples))):
            text = response(steps, gold, rng.choice(STYLES), rng.random() < 1 / 3, rng)
            samples.append(RewardInput(prompt=prompt, response=text, prompt_ids=[1, 2, 3],
                                       response_ids=list(range(4, 4 + len(text) // 4)),
                                       finish_reason="eos", eos_token_id=2,
                                       meta={"answer": gold, "id": len(samples)}, answer=gold))
    return samples


def batches(samples: list, size: int) -> list[list]:
    return [samples[i:i + size] for i in range(0, len(samples), size)]


def run_direct(samples: list[RewardInput], batch: int) -> tuple[float, list[float], dict]:
    fn = math_reward
    for s in samples[:batch]:  # untimed warm-up
        fn(s)
    t = time.perf_counter()
    values = [fn(s) for s in samples]
    return time.perf_counter() - t, values, {"reward_timeouts": 0, "reward_errors": 0}


def run_scorer(samples: list[RewardInput], batch: int, workers: int, timeout: float) -> tuple:
    counts = {"reward_timeouts": 0, "reward_errors": 0}
    scorer = RewardScorer("math", timeout_s=timeout, workers=workers)
    try:
        t = time.perf_counter()
        scorer(samples[:batch])  # untimed warm-up (for a pool: its start)
        startup = time.perf_counter() - t
        values = []
        t = time.perf_counter()
        for i, chunk in enumerate(batches(samples, batch)):
            scores, c = scorer(chunk, i * batch)
            values += scores.tolist()
            for k in counts:
                counts[k] += c[k]
        return time.perf_counter() - t, values, counts, startup
    finally:
        scorer.close()




def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=2000, help="answers per variant")
    p.add_argument("--batch", type=int, default=32, help="answers per scorer call")
    p.add_argument("--group", type=int, default=8, help="answers per problem (rollout_n)")
    p.add_argument("--workers", default="0,1,2",
                   help="comma-separated scorer worker counts (0: in process); 'direct' runs always")
    p.add_argument("--timeout", type=float, default=5.0, help="the scorer's timeout_s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="also append the JSON lines to this file")
    args = p.parse_args(argv)
    try:
        args.workers = [int(w) for w in args.workers.split(",") if w.strip()]
    except ValueError:
        p.error(f"--workers takes comma-separated integers, got {args.workers!r}")
    if args.count < 1 or args.batch < 1 or args.group < 1 or any(w < 0 for w in args.workers):
        p.error("--count, --batch and --group must be >= 1 and --workers >= 0")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    samples = make_samples(args.count, args.group, args.seed)
    chars = [len(s.response) for s in samples]
    base = {"bench": "verify", "answers": len(samples), "batch": args.batch, "group": args.group,
            "chars_mean": round(sum(chars) / len(chars), 1), "cpus": os.cpu_count(),
            "cpu": cpu_model(), "python": platform.python_version()}
    records = []

    def emit(record: dict) -> None:
        records.append(record)
        line = json.dumps(record)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")

    rates = {}
    for variant in ["direct"] + [f"workers={w}" for w in args.workers]:
        if variant == "direct":
            seconds, values, counts = run_direct(samples, args.batch)
            startup = None
        else:
            workers = int(variant.split("=")[1])
            seconds, values, counts, startup = run_scorer(samples, args.batch, workers, args.timeout)
        rates[variant] = len(samples) / seconds
        emit({**base, "kind": "measurement", "variant": variant, "seconds": round(seconds, 4),
              "answers_per_s": round(rates[variant], 1),
              "us_per_answer": round(1e6 * seconds / len(samples), 1),
              "accuracy": round(sum(values) / len(values), 4),
              **counts, **({"startup_s": round(startup, 3)} if startup is not None else {})})
    one_core = rates.get("workers=0", rates["direct"])
    emit({**base, "kind": "summary", "one_core_answers_per_s": round(one_core, 1),
          "goal_answers_per_s": GOAL_ANSWERS_PER_S, "goal_met": one_core >= GOAL_ANSWERS_PER_S,
          "ratio_to_workers0": {v: round(r / one_core, 3) for v, r in rates.items()}})
    return records


if __name__ == "__main__":
    main()
