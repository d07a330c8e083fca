"""Verifiers: reward functions that check a response against the record's ground truth.

``math`` (``--reward-fn math``) scores 1.0 when the response's final answer equals the
record's answer (``sample.meta[answer_key]``, ``--answer-key``, default ``"answer"``) as
decided by the `math-verify <https://github.com/huggingface/Math-Verify>`_ library, else
0.0. The final answer is found by math-verify's own extraction, in this order:

1. a ``\\boxed{...}`` anywhere in the response (the last one);
2. else, when the last ``####`` (GSM8K's marker) is followed by what starts like an answer
   (a digit, sign, ``.``, ``(``, ``$`` or ``\\``: not a markdown heading such as
   ``#### Step 2``), the rest of that line;
3. else math-verify's anchored patterns ("final answer is", "answer: ... ", "the answer
   is 42.") before any plain number or LaTeX;
4. else the last number or LaTeX expression in the response.

So "3 + 39 = 42. The answer is 42. (41 was a typo)" answers 42, and "I think 41" answers 41.
A response with no extractable answer scores 0.0.

The ground truth may be a number (``42``, ``0.5``), a string (``"42"``, ``"1/2"``,
``"\\frac{1}{2}"``, ``"x^2+1"``: read as the content of a ``\\boxed{}``; a string with
``$``, ``\\boxed`` or ``####`` is extracted like a response) or a list of acceptable
answers. Parsed answers are cached per process (the ``rollout_n`` samples of a prompt share
one). A record without the field raises :class:`MissingAnswerError` (the scorer stops the
run whatever its ``strict``: the configuration is wrong, not the response); an answer that
math-verify cannot read raises ValueError (a counted error, or a RewardError if strict).

The verifier is marked ``isolated``: :class:`~megatron_rlhf.rlhf.rewards.RewardScorer` runs
it in worker processes with a per-call timeout, since math-verify's sympy work is CPU-bound
and can be slow on adversarial text. math-verify's own signal-based timeouts are switched
off (they only work on a main thread); the scorer enforces the limit.

This module is a leaf (it imports nothing from the package); ``rewards`` registers its
functions, and ``math_verify`` is imported on first use.
"""

from __future__ import annotations

import decimal
import functools
import numbers
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_rlhf.rlhf.rewards import RewardInput


class MissingAnswerError(KeyError):
    """A record has no ground-truth field for a verifier: a configuration error
    (``--answer-key`` names the field), so the scorer raises it whatever its ``strict``."""

    def __init__(self, key: str, meta: dict):
        fields = ", ".join(repr(k) for k in sorted(meta, key=str)) or "none"
        super().__init__(
            f"the record has no {key!r} field for the verifier's ground-truth answer "
            f"(its fields: {fields}); --answer-key sets the field name")

    def __str__(self) -> str:  # KeyError's str() would quote the whole message
        return str(self.args[0])


@functools.cache
def _math_verify() -> tuple[Any, Any, tuple]:
    """``(parse, verify, extraction configs)``, imported on first use.

    One LaTeX and one expression config serve the gold answers and the responses alike:
    math-verify caches each kind's compiled regexes for one config only, so a second
    config would recompile them on every call. Boxed answers get priority 0 (before the
    anchored "answer is" patterns at 100-200 and plain numbers/LaTeX at 300)."""
    import math_verify.grader
    import math_verify.parser
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # we pass timeouts of None (signal.alarm only works on a main thread; the scorer
    # enforces the limit), which math-verify would warn about once per process
    math_verify.parser.TIMEOUT_WARNING_SHOWN = True
    math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    configs = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
    return parse, verify, configs


_ANSWER_START = re.compile(r"[-+.(\d$\\]")
"""How the text after a GSM8K ``####`` starts when it is an answer, not a heading."""


def _extract(text: str) -> list:
    """math-verify's parse of ``text`` (sympy values, then the matched string), with a
    ``####`` line taking precedence over the rest of the text unless there is a box."""
    parse, _, configs = _math_verify()
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


@functools.lru_cache(maxsize=4096)
def _parse_gold(text: str) -> tuple:
    """The parsed ground truth (cached: a prompt's samples share it); ValueError if
    math-verify reads nothing from it."""
    parse, _, configs = _math_verify()
    if "####" in text or "$" in text or "\\boxed" in text or "\\(" in text or "\\[" in text:
        found = _extract(text)
    else:  # a bare answer: the content of a box (so "x^2+1" and "\sqrt{2}" parse too)
        found = parse("\\boxed{" + text + "}", configs, parsing_timeout=None)
        found = found or parse(text, configs, parsing_timeout=None)
    if not found:
        raise ValueError(f"math-verify cannot read the ground-truth answer {text!r}")
    return tuple(found)


def gold_answers(value: Any) -> list:
    """math-verify's parse of a ground-truth answer: a number, a string, or a list/tuple of
    acceptable answers (any of them counts)."""
    values = value if isinstance(value, (list, tuple)) else [value]
    if not values:
        raise ValueError("the ground-truth answer is an empty list")
    return [parsed for v in values for parsed in _parse_gold(_gold_text(v))]


def math_answer_correct(response: str, gold: Any) -> bool:
    """Whether ``response``'s final answer equals ``gold`` (see the module docstring)."""
    _, verify, _ = _math_verify()
    gold_parsed = gold_answers(gold)
    predicted = _extract(response)
    return bool(predicted) and bool(verify(gold_parsed, predicted, timeout_seconds=None))


def math_reward(sample: RewardInput, *, answer_key: str = "answer") -> float:
    """1.0 if the response's final answer equals ``sample.meta[answer_key]`` (math-verify),
    else 0.0; registered as ``math``."""
    meta = sample.meta
    if answer_key not in meta:
        raise MissingAnswerError(answer_key, meta)
    return 1.0 if math_answer_correct(sample.response, meta[answer_key]) else 0.0


def _warmup() -> None:
    """Import math-verify and compile its patterns (a worker does it before its first call,
    so the first sample's timeout does not pay for it)."""
    math_answer_correct("\\boxed{1}", "1")
    math_answer_correct("#### 1", 1)


math_reward.isolated = True
math_reward.warmup = _warmup
