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


def test_eval_metrics_are_plotted(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("plot_metrics", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    rows = [{"iteration": 0, "eval/accuracy": 0.2, "eval/reward_mean": 0.2, "eval/pass@4": 0.5,
             "eval/time_s": 3.0}]
    rows += [{"iteration": it, "reward_mean": 0.1 * it, "time_train_s": 2.0} for it in (1, 2)]
    rows[-1].update({"eval/accuracy": 0.4, "eval/reward_mean": 0.4, "eval/pass@4": 0.7, "eval/time_s": 3.0})
    fig = tool.draw(rows, "t")
    reward_axes, _, time_axes = fig.axes
    lines = {line.get_label(): list(line.get_xdata()) for line in reward_axes.lines}
    assert lines["eval/accuracy (held out)"] == [0, 2] and lines["eval/pass@4 (held out)"] == [0, 2]
    assert "eval" in [t.get_text() for t in time_axes.get_legend().get_texts()]
