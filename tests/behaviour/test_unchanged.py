"""Behaviour held bit for bit across a refactor: this tree's fixed-seed runs against a base commit's.

    BEHAVIOUR_BASE=337a440 python -m pytest -q tests/behaviour     # or: make behaviour-check

The base is checked out in a temporary git worktree; both trees run ``runs.py`` on fixtures
the base converts, on this machine, so float results compare exactly. Skipped unless
``BEHAVIOUR_BASE`` names a commit: it runs six 2-rank jobs (about 3 minutes on 2 cores).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNS = Path(__file__).resolve().parent / "runs.py"
BASE = os.environ.get("BEHAVIOUR_BASE")


def _runs(tree: Path, *args: str) -> None:
    r = subprocess.run([sys.executable, str(RUNS), *args], cwd=tree, capture_output=True, text=True,
                       timeout=3600)
    assert r.returncode == 0, f"{tree}: runs.py {' '.join(args)} failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"


@pytest.mark.skipif(not BASE, reason="set BEHAVIOUR_BASE=<commit> to compare this tree with it")
def test_runs_equal_the_base_commits(tmp_path):
    base = tmp_path / "base"
    subprocess.run(["git", "worktree", "add", "--detach", str(base), BASE], cwd=ROOT, check=True,
                   capture_output=True)
    try:
        _runs(base, "fixtures", str(tmp_path / "fix"))
        _runs(base, "run", str(tmp_path / "fix"), str(tmp_path / "base_out"))
        _runs(ROOT, "run", str(tmp_path / "fix"), str(tmp_path / "head_out"))
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, capture_output=True)
    want, got = (json.loads((tmp_path / d / "fingerprint.json").read_text()) for d in ("base_out", "head_out"))
    if want != got:
        metrics = [json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("base_out", "head_out")]
        diff = {run: [{k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
                      for a, b in zip(metrics[0][run], metrics[1][run])] for run in metrics[0]}
        pytest.fail(f"fingerprints differ from {BASE}'s:\nbase {want}\nhead {got}\nmetrics that differ: {diff}")
