"""tools/plot_metrics.py draws a PNG from metrics.jsonl and rejects corrupt lines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

TOOL = Path(__file__).resolve().parents[2] / "tools" / "plot_metrics.py"


def write_metrics(path: Path) -> None:
    lines = []
    for it in range(1, 7):
        row = {
            "iteration": it,
            "reward_mean": 0.1 * it,
            "reward_std": 0.05,
            "kl": 0.01 * it,
            "time_rollout_s": 1.5,
            "time_experience_s": 0.5,
            "time_train_s": 2.0,
        }
        if it == 3:
            del row["kl"]  # missing keys are tolerated
        lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=120
    )


def test_plot_from_directory(tmp_path):
    write_metrics(tmp_path / "metrics.jsonl")
    result = run(str(tmp_path))
    assert result.returncode == 0, result.stderr
    png = tmp_path / "metrics.png"
    assert result.stdout.strip() == str(png)
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_plot_explicit_output(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    write_metrics(metrics)
    out = tmp_path / "sub.png"
    result = run(str(metrics), "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert out.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_corrupt_line_exits_2(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    write_metrics(metrics)
    lines = metrics.read_text().splitlines()
    lines[3] = '{"iteration": 4, "reward_mean": '
    metrics.write_text("\n".join(lines) + "\n")
    result = run(str(metrics))
    assert result.returncode == 2
    assert f"{metrics}:4:" in result.stderr
    assert not (tmp_path / "metrics.png").exists()
