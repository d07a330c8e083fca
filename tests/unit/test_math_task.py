"""The shipped arithmetic task (tools/make_math_task.py -> megatron_rlhf/data/math_*.jsonl)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "megatron_rlhf" / "data"
FILES = ("math_train.jsonl", "math_heldout.jsonl")


def _load_tool():
    spec = importlib.util.spec_from_file_location("make_math_task", ROOT / "tools" / "make_math_task.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text(encoding="utf-8").splitlines()]


def test_shipped_files_equal_default_output(tmp_path):
    tool = _load_tool()
    tool.main(["--out-dir", str(tmp_path)])
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), name


def test_generation_is_deterministic_and_seeded():
    tool = _load_tool()
    a = tool.generate(seed=7, n_train=50, n_heldout=10)
    assert a == tool.generate(seed=7, n_train=50, n_heldout=10)
    assert a != tool.generate(seed=8, n_train=50, n_heldout=10)


def test_train_and_heldout_are_disjoint():
    train, heldout = _rows(FILES[0]), _rows(FILES[1])
    assert len(train) >= 1000 and 100 <= len(heldout) <= 400
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in heldout}
    assert len({r["prompt"] for r in train}) == len(train)
    assert len({r["prompt"] for r in heldout}) == len(heldout)
    ids = [r["id"] for r in train + heldout]
    assert len(set(ids)) == len(ids) and all(re.fullmatch(r"m\d{5}", i) for i in ids)


def test_answers_match_expressions_and_problem_text():
    tool = _load_tool()
    for name in FILES:
        for row in _rows(name):
            assert set(row) >= {"id", "prompt", "answer", "expr"}
            assert re.fullmatch(r"\d+", row["answer"]), row
            assert str(tool.eval_expr(row["expr"])) == row["answer"], row
            # every operand of the expression is a number stated in the problem
            stated = re.findall(r"\d+", row["prompt"])
            for operand in re.findall(r"\d+", row["expr"]):
                if operand in ("2", "3") and ("doubles" in row["prompt"] or "triples" in row["prompt"]):
                    continue
                assert operand in stated, (operand, row)


def test_files_are_small():
    assert sum((DATA / n).stat().st_size for n in FILES) < 500_000


def test_eval_expr_and_bad_arguments():
    tool = _load_tool()
    assert tool.eval_expr("((4 * 5) - 4) + 9") == 25
    assert tool.eval_expr("(15 / 3) - 3") == 2
    with pytest.raises(AssertionError):
        tool.eval_expr("7 / 2")
    with pytest.raises(ValueError):
        tool.generate(n_train=1, n_heldout=1, ops="+x")
    with pytest.raises(ValueError):
        tool.generate(n_train=1, n_heldout=1, instruction="nope")


def test_baseline_final_answer_rule():
    spec = importlib.util.spec_from_file_location("eval_math_baseline", ROOT / "tools" / "eval_math_baseline.py")
    ev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ev)
    assert ev.final_answer("3 + 4 = 7, so \\boxed{7}. Then 9.") == "\\boxed{7}"
    assert ev.final_answer("3 + 4 = 7\n#### 7\nThe answer is 8.") == "7"
    assert ev.final_answer("Tom has 3 + 5 = 8 balloons.\nTom has 8 - 5 = 3 now.") == "3"
    assert ev.final_answer("no number here") is None
    assert ev.appears("so 1,200 in all", "1200") and not ev.appears("12 apples", "1")
    pytest.importorskip("math_verify")
    assert ev.is_correct("Tom has 3 + 5 = 8 balloons.", "8")
    assert not ev.is_correct("Tom has 3 + 5 = 8 balloons, not 9.", "8")
