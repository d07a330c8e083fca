"""Whether a response's final answer equals a ground truth (:func:`math_answer_correct`),
decided by math-verify, imported on first use. A leaf: it imports nothing from the package
(a benchmark loads it by path)."""

from __future__ import annotations

import decimal
import functools
import numbers
import re
from typing import Any


@functools.cache
def _math_verify() -> tuple[Any, Any, tuple]:
    """``(parse, verify, extraction configs)``, imported on first use."""
    import math_verify.grader
    import math_verify.parser
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # Timeouts are passed as None (signal.alarm works on a main thread only; the scorer
    # enforces the limit): math-verify would warn about it once per process.
    math_verify.parser.TIMEOUT_WARNING_SHOWN = True
    math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    # One config per kind serves gold answers and responses alike: math-verify caches each
    # kind's compiled regexes for one config only. Boxed answers get priority 0, before the
    # anchored "answer is" patterns (100-200) and plain numbers or LaTeX (300).
    configs = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
    return parse, verify, configs


# How the text after a GSM8K "####" starts when it is an answer, not a markdown heading.
_ANSWER_START = re.compile(r"[-+.(\d$\\]")


def _extract(text: str) -> list:
    """math-verify's parse of ``text``: sympy values, then the matched string."""
    parse, _, configs = _math_verify()
    # The final answer, in order: the last \boxed{}; else the rest of the line after the last
    # "####" when it starts like an answer; else math-verify's anchored patterns ("the answer
    # is 42."); else the last number or LaTeX expression.
    if "####" in text and "\\boxed" not in text:
        line = text.rpartition("####")[2].lstrip().partition("\n")[0]
        if _ANSWER_START.match(line):
            found = parse(line, configs, parsing_timeout=None)
            if found:
                return found
    return parse(text, configs, parsing_timeout=None)


def _gold_text(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        raise ValueError(f"the ground-truth answer {value!r} is not a number or a string")
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, float):
        return format(decimal.Decimal(repr(value)), "f")  # 1e-07 -> 0.0000001
    return str(value)


@functools.lru_cache(maxsize=4096)  # the rollout_n samples of a prompt share one ground truth
def _parse_gold(text: str) -> tuple:
    """The parsed ground truth; ValueError if math-verify reads nothing from it."""
    parse, _, configs = _math_verify()
    if "####" in text or "$" in text or "\\boxed" in text or "\\(" in text or "\\[" in text:
        found = _extract(text)  # a worked answer (GSM8K's): extracted like a response
    else:  # a bare answer: the content of a box (so "x^2+1" and "\sqrt{2}" parse too)
        found = parse("\\boxed{" + text + "}", configs, parsing_timeout=None)
        found = found or parse(text, configs, parsing_timeout=None)
    if not found:
        raise ValueError(f"math-verify cannot read the ground-truth answer {text!r}")
    return tuple(found)


def gold_answers(value: Any) -> list:
    """math-verify's parse of a ground truth: a number, a string, or a list/tuple of
    acceptable answers (any of them counts). ValueError if one cannot be read."""
    values = value if isinstance(value, (list, tuple)) else [value]
    if not values:
        raise ValueError("the ground-truth answer is an empty list")
    return [parsed for v in values for parsed in _parse_gold(_gold_text(v))]


def math_answer_correct(response: str, gold: Any) -> bool:
    """Whether ``response``'s final answer equals ``gold``; False when it has none."""
    _, verify, _ = _math_verify()
    gold_parsed = gold_answers(gold)
    predicted = _extract(response)
    return bool(predicted) and bool(verify(gold_parsed, predicted, timeout_seconds=None))
