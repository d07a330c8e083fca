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


def _tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("plot_metrics", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def _panels(fig) -> dict:
    """``{y label: axes}`` of a figure (a second y axis under its own label)."""
    return {ax.get_ylabel(): ax for ax in fig.axes}


def test_eval_metrics_are_plotted(tmp_path):
    tool = _tool()
    rows = [{"iteration": 0, "eval/accuracy": 0.2, "eval/reward_mean": 0.2, "eval/pass@4": 0.5,
             "eval/time_s": 3.0}]
    rows += [{"iteration": it, "reward_mean": 0.1 * it, "time_train_s": 2.0} for it in (1, 2)]
    rows[-1].update({"eval/accuracy": 0.4, "eval/reward_mean": 0.4, "eval/pass@4": 0.7, "eval/time_s": 3.0})
    fig = tool.draw(rows, "t")
    reward_axes, time_axes = fig.axes  # no KL, length or entropy logged: no panel for them
    lines = {line.get_label(): list(line.get_xdata()) for line in reward_axes.lines}
    assert lines["eval/accuracy (held out)"] == [0, 2] and lines["eval/pass@4 (held out)"] == [0, 2]
    assert "eval" in [t.get_text() for t in time_axes.get_legend().get_texts()]


def test_only_the_runs_terms_get_panels(tmp_path):
    """A panel per kind of metric the run logged: KL where the run has a KL term, else
    response length with entropy on a second axis (or whichever of the two is there)."""
    tool = _tool()
    base = [{"iteration": it, "reward_mean": 0.1 * it, "response_length": 20.0 + it, "entropy": 2.0 - 0.1 * it,
             "time_rollout_s": 1.0, "time_train_s": 2.0} for it in (1, 2, 3)]
    with_kl = [dict(r, kl=0.01 * r["iteration"]) for r in base]
    fig = tool.draw(with_kl, "t")
    assert list(_panels(fig)) == ["reward", "kl", "time per stage (s)"]
    assert [line.get_label() for line in _panels(fig)["kl"].lines] == ["kl"]

    fig = tool.draw(base, "t")  # GRPO without KL: length and entropy instead
    assert list(_panels(fig)) == ["reward", "response length (tokens)", "time per stage (s)", "entropy (nats)"]
    length, entropy = _panels(fig)["response length (tokens)"], _panels(fig)["entropy (nats)"]
    assert list(length.lines[0].get_ydata()) == [21.0, 22.0, 23.0]
    assert list(entropy.lines[0].get_ydata()) == pytest.approx([1.9, 1.8, 1.7])
    assert [t.get_text() for t in length.get_legend().get_texts()] == ["response_length", "entropy"]

    fig = tool.draw([{k: v for k, v in r.items() if k != "response_length"} for r in base], "t")
    assert list(_panels(fig)) == ["reward", "entropy (nats)", "time per stage (s)"]
    fig = tool.draw([{"iteration": 1, "kl": 0.1}], "t")  # a panel only for what is there
    assert list(_panels(fig)) == ["kl"]
    with pytest.raises(ValueError, match="no metrics to plot"):
        tool.draw([{"iteration": 1, "samples": 8.0}], "t")


def test_a_file_without_plottable_metrics_exits_2(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"iteration": 1, "samples": 8.0}) + "\n")
    result = run(str(metrics))
    assert result.returncode == 2 and "no metrics to plot" in result.stderr
    assert not (tmp_path / "metrics.png").exists()
