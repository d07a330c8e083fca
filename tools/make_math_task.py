#!/usr/bin/env python
"""Generate the verifiable-reward arithmetic task: ``math_train.jsonl`` and ``math_heldout.jsonl``.

  python tools/make_math_task.py [--seed 1234] [--train 1500] [--heldout 200] [--min-steps 1] [--max-steps 1]
                                 [--max-start 20] [--max-operand 9] [--ops +-] [--instruction end] [--out-dir DIR]

Each problem is a short story about one person and one kind of item, built together with its
arithmetic expression (evaluated left to right; every intermediate value a positive integer).
Each line: ``{"id", "prompt": "<problem> <instruction>", "answer", "expr", "steps"}``. Train and
held-out problems come from one seeded stream, deduplicated on the text. The output is a pure
function of the arguments; tests/unit/test_math_task.py checks the shipped files equal the default.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

DEFAULT_OUT_DIR = Path(__file__).resolve().parent.parent / "megatron_rlhf" / "data"

INSTRUCTIONS = {
    "hash": "Solve it step by step, then write the final answer as a number after ####.",
    "end": "Answer with the final number at the end.",
    "boxed": "Reason step by step, and put your final answer within \\boxed{}.",
    "short": "Give a short solution, then the final answer as a number after ####.",
    "oneline": "Write the calculation in one short sentence that ends with the result.",
}
DEFAULT_INSTRUCTION = "end"

NAMES = [
    ("Sam", "he", "his"), ("Maria", "she", "her"), ("Leo", "he", "his"), ("Aisha", "she", "her"),
    ("Tom", "he", "his"), ("Nina", "she", "her"), ("Omar", "he", "his"), ("Lucy", "she", "her"),
    ("Ben", "he", "his"), ("Emma", "she", "her"), ("Ravi", "he", "his"), ("Sofia", "she", "her"),
    ("Jack", "he", "his"), ("Mia", "she", "her"), ("Kenji", "he", "his"), ("Zoe", "she", "her"),
    ("Carlos", "he", "his"), ("Hana", "she", "her"), ("Ivan", "he", "his"), ("Grace", "she", "her"),
]

# (plural item, container)
ITEMS = [
    ("apples", "bags"), ("pencils", "boxes"), ("stickers", "sheets"), ("marbles", "jars"),
    ("cookies", "plates"), ("books", "shelves"), ("cards", "packs"), ("shells", "buckets"),
    ("eggs", "cartons"), ("balloons", "bunches"), ("coins", "purses"), ("stamps", "albums"),
    ("candies", "bowls"), ("flowers", "vases"), ("toy cars", "crates"), ("oranges", "baskets"),
]

ADD_TEMPLATES = [
    "Then {pron} buys {n} more {item}.",
    "Then {pron} finds {n} more {item}.",
    "Then a friend gives {obj} {n} more {item}.",
    "Then {pron} gets {n} more {item} as a gift.",
]
SUB_TEMPLATES = [
    "Then {pron} gives {n} {item} to a friend.",
    "Then {pron} loses {n} {item}.",
    "Then {pron} sells {n} {item}.",
    "Then {pron} gives away {n} {item}.",
]
MUL_TEMPLATES = {
    2: ["Then the number of {item} {pron2} has doubles."],
    3: ["Then the number of {item} {pron2} has triples."],
}
DIV_TEMPLATES = [
    "Then {pron} splits all the {item} equally into {n} groups and keeps just one group.",
    "Then {pron} shares all the {item} equally among {n} friends, including {self_}, and keeps {pos} share.",
]
QUESTIONS = [
    "How many {item} does {name} have now?",
    "How many {item} does {name} have in the end?",
]


def _clause(rng: random.Random, op: str, value: int, pron: str, pos: str, item: str, max_operand: int):
    """One step applied to ``value``: returns (sentence, expr fragment, new value) or None."""
    obj = "him" if pron == "he" else "her"
    self_ = "himself" if pron == "he" else "herself"
    if op == "+":
        n = rng.randint(2, max_operand)
        return rng.choice(ADD_TEMPLATES).format(pron=pron, n=n, item=item, obj=obj), f"+ {n}", value + n
    if op == "-":
        if value < 3:
            return None
        n = rng.randint(2, min(max_operand, value - 1))
        return rng.choice(SUB_TEMPLATES).format(pron=pron, n=n, item=item), f"- {n}", value - n
    if op == "*":
        n = rng.choice([2, 3])
        text = rng.choice(MUL_TEMPLATES[n]).format(item=item, pron2=pron)
        return text, f"* {n}", value * n
    if op == "/":
        divisors = [d for d in range(2, min(max_operand, 6) + 1) if value % d == 0 and value // d >= 1]
        if not divisors:
            return None
        n = rng.choice(divisors)
        text = rng.choice(DIV_TEMPLATES).format(pron=pron, n=n, item=item, self_=self_, pos=pos)
        return text, f"/ {n}", value // n
    raise ValueError(op)


OP_WEIGHTS = {"+": 4, "-": 4, "*": 1, "/": 1}


def make_problem(rng: random.Random, steps: int, max_start: int, max_operand: int, ops: str = "+-*/") -> dict:
    """One problem with exactly ``steps`` arithmetic operations (the start may be a product)."""
    while True:
        name, pron, pos = rng.choice(NAMES)
        item, container = rng.choice(ITEMS)
        ops_left = steps
        if steps >= 2 and "*" in ops and rng.random() < 0.35:
            a, b = rng.randint(2, 6), rng.randint(2, max_operand)
            text = [f"{name} has {a} {container} with {b} {item} in each."]
            expr, value = f"{a} * {b}", a * b
            ops_left -= 1
        else:
            a = rng.randint(3, max_start)
            text = [f"{name} has {a} {item}."]
            expr, value = f"{a}", a
        ok = True
        for _ in range(ops_left):
            op = rng.choices(list(ops), weights=[OP_WEIGHTS[o] for o in ops])[0]
            step = _clause(rng, op, value, pron, pos, item, max_operand)
            if step is None:
                ok = False
                break
            sentence, frag, value = step
            text.append(sentence)
            expr = f"({expr}) {frag}" if " " in expr else f"{expr} {frag}"
        if not ok or value <= 0:
            continue
        text.append(rng.choice(QUESTIONS).format(item=item, name=name))
        return {"problem": " ".join(text), "expr": expr, "answer": value, "steps": steps}


def eval_expr(expr: str) -> int:
    """Evaluate a generator expression (integers, + - * /, parentheses) exactly; division must be exact."""
    tokens = expr.replace("(", " ( ").replace(")", " ) ").split()
    pos = 0

    def atom() -> int:
        nonlocal pos
        tok = tokens[pos]
        pos += 1
        if tok == "(":
            v = chain()
            assert tokens[pos] == ")"
            pos += 1
            return v
        return int(tok)

    def chain() -> int:  # left-to-right, as the generator builds it (every step is parenthesised)
        nonlocal pos
        v = atom()
        while pos < len(tokens) and tokens[pos] in "+-*/":
            op = tokens[pos]
            pos += 1
            w = atom()
            if op == "+":
                v += w
            elif op == "-":
                v -= w
            elif op == "*":
                v *= w
            else:
                assert v % w == 0, expr
                v //= w
        return v

    value = chain()
    assert pos == len(tokens), expr
    return value


def generate(seed: int = 1234, n_train: int = 1500, n_heldout: int = 200, min_steps: int = 1,
             max_steps: int = 1, max_start: int = 20, max_operand: int = 9, ops: str = "+-",
             instruction: str = DEFAULT_INSTRUCTION) -> tuple[list[dict], list[dict]]:
    """Return (train, heldout) rows; deterministic in the arguments."""
    if instruction not in INSTRUCTIONS:
        raise ValueError(f"unknown instruction {instruction!r}; choose from {sorted(INSTRUCTIONS)}")
    if not ops or len(set(ops)) != len(ops) or set(ops) - set(OP_WEIGHTS):
        raise ValueError(f"ops must be distinct characters of {''.join(OP_WEIGHTS)!r}, got {ops!r}")
    if not 1 <= min_steps <= max_steps:
        raise ValueError("need 1 <= min_steps <= max_steps")
    rng = random.Random(seed)
    seen: set[str] = set()
    problems: list[dict] = []
    attempts = 0
    while len(problems) < n_train + n_heldout:
        attempts += 1
        if attempts > 100 * (n_train + n_heldout):
            raise RuntimeError("too few distinct problems for these settings; widen the ranges")
        p = make_problem(rng, rng.randint(min_steps, max_steps), max_start, max_operand, ops)
        if p["problem"] in seen:
            continue
        seen.add(p["problem"])
        problems.append(p)
    text = INSTRUCTIONS[instruction]
    rows = [
        {"id": f"m{i + 1:05d}", "prompt": f"{p['problem']} {text}", "answer": str(p["answer"]),
         "expr": p["expr"], "steps": p["steps"]}
        for i, p in enumerate(problems)
    ]
    return rows[:n_train], rows[n_train:]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--train", type=int, default=1500, help="number of training problems")
    ap.add_argument("--heldout", type=int, default=200, help="number of held-out problems")
    ap.add_argument("--min-steps", type=int, default=1, help="fewest arithmetic operations per problem")
    ap.add_argument("--max-steps", type=int, default=1, help="most arithmetic operations per problem")
    ap.add_argument("--max-start", type=int, default=20, help="largest starting amount")
    ap.add_argument("--max-operand", type=int, default=9, help="largest number added, taken away or divided by")
    ap.add_argument("--ops", default="+-", help="operations used by the steps (a subset of '+-*/')")
    ap.add_argument("--instruction", choices=sorted(INSTRUCTIONS), default=DEFAULT_INSTRUCTION,
                    help="answer-format instruction appended to every problem")
    ap.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    args = ap.parse_args(argv)
    train, heldout = generate(args.seed, args.train, args.heldout, args.min_steps, args.max_steps,
                              args.max_start, args.max_operand, args.ops, args.instruction)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out_dir / "math_train.jsonl", train)
    write_jsonl(args.out_dir / "math_heldout.jsonl", heldout)
    print(f"wrote {len(train)} train and {len(heldout)} held-out problems to {args.out_dir}")


if __name__ == "__main__":
    main()
