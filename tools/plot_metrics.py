#!/usr/bin/env python
"""Plot a training run's metrics.jsonl (one JSON object per iteration) to a PNG.

  python tools/plot_metrics.py LOG_DIR_OR_METRICS_JSONL [-o out.png]

Given a directory, reads ``DIR/metrics.jsonl``. The PNG goes next to the file
(``metrics.png``) unless ``-o`` is given. Up to three panels share the ``iteration`` axis,
each only where the run logged its metrics: ``reward_mean`` with a +-``reward_std`` band
and a dashed moving average (window 5); ``kl`` (and ``kl_loss``), or for a run without a KL
term ``response_length`` with ``entropy`` on a second axis; and the stage times
``time_*_s`` as stacked bars. A run with held-out evaluation (``eval/*``) adds its
accuracy, pass@K and mean reward as marked lines in the reward panel (iteration 0: the
baseline) and its time to the bars. Points whose keys are missing are skipped; a line that
is not valid JSON, or a file with none of these metrics, is an error (exit 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

STAGE_KEYS = ("time_rollout_s", "time_experience_s", "time_train_s", "time_draft_s", "eval/time_s")
EVAL_KEYS = ("eval/accuracy", "eval/reward_mean")
KL_KEYS = ("kl", "kl_loss")
POLICY_KEYS = ("response_length", "entropy")
MA_WINDOW = 5


def read_metrics(path: Path) -> list[dict]:
    """The JSON objects of ``path``, one per non-blank line; ValueError names the bad line."""
    rows = []
    with path.open() as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                kind = type(row).__name__
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {kind}")
            rows.append(row)
    return rows


def series(rows: list[dict], *keys: str) -> list[tuple]:
    """(iteration, key values...) for the rows that have ``iteration`` and all ``keys``."""
    need = ("iteration", *keys)
    return [tuple(r[k] for k in need) for r in rows if all(r.get(k) is not None for k in need)]


def panels(rows: list[dict]) -> list[str]:
    """The panels ``rows`` have metrics for, top to bottom: ``reward``, ``kl`` or (without a
    KL term) ``policy``, ``time``."""
    keys = {k for r in rows if "iteration" in r for k, v in r.items() if v is not None}
    out = []
    if "reward_mean" in keys or keys & set(EVAL_KEYS) or any(k.startswith("eval/pass@") for k in keys):
        out.append("reward")
    if keys & set(KL_KEYS):
        out.append("kl")
    elif keys & set(POLICY_KEYS):
        out.append("policy")
    if keys & set(STAGE_KEYS):
        out.append("time")
    return out


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values (shorter at the start)."""
    windows = (values[max(0, i - window + 1) : i + 1] for i in range(len(values)))
    return [sum(w) / len(w) for w in windows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="log directory or metrics.jsonl file")
    parser.add_argument(
        "-o", "--output", type=Path, help="output PNG (default: metrics.png next to the file)"
    )
    args = parser.parse_args(argv)

    path = args.path / "metrics.jsonl" if args.path.is_dir() else args.path
    if not path.is_file():
        print(f"error: {path} does not exist", file=sys.stderr)
        return 2
    try:
        rows = read_metrics(path)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    output = args.output or path.with_name("metrics.png")
    import matplotlib.pyplot as plt

    try:
        fig = draw(rows, str(path))
    except ValueError as exc:
        print(f"error: {path}: {exc}", file=sys.stderr)
        return 2
    fig.savefig(output, dpi=100)
    plt.close(fig)
    print(output)
    return 0


def draw(rows: list[dict], title: str):
    """The figure of ``rows`` (see the module docstring); ValueError when no panel has data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = panels(rows)
    if not kinds:
        raise ValueError("no metrics to plot: none of reward_mean, eval/*, kl, response_length, "
                         "entropy or time_*_s")
    fig, axes = plt.subplots(len(kinds), 1, sharex=True, figsize=(9, 3 * len(kinds)), squeeze=False)
    for kind, ax in zip(kinds, axes[:, 0]):
        {"reward": _reward, "kl": _kl, "policy": _policy, "time": _times}[kind](ax, rows)
    axes[-1, 0].set_xlabel("iteration")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _reward(ax, rows: list[dict]) -> None:
    reward = series(rows, "reward_mean")
    if reward:
        it, mean = zip(*reward)
        ax.plot(it, mean, label="reward_mean")
        band = series(rows, "reward_mean", "reward_std")
        if band:
            bit, bmean, bstd = zip(*band)
            lo = [m - s for m, s in zip(bmean, bstd)]
            hi = [m + s for m, s in zip(bmean, bstd)]
            ax.fill_between(bit, lo, hi, alpha=0.25, label="+-reward_std")
        ma = moving_average(list(mean), MA_WINDOW)
        ax.plot(it, ma, "--", label=f"moving avg ({MA_WINDOW})")
    passes = sorted({k for r in rows for k in r if k.startswith("eval/pass@")})
    for key in (*EVAL_KEYS, *passes):
        points = series(rows, key)
        if points:
            ax.plot(*zip(*points), "o-", markersize=4, label=f"{key} (held out)")
    ax.legend(loc="best", fontsize="small")
    ax.set_ylabel("reward")


def _kl(ax, rows: list[dict]) -> None:
    for key, color in zip(KL_KEYS, ("tab:red", "tab:purple")):
        points = series(rows, key)
        if points:
            ax.plot(*zip(*points), color=color, label=key)
    ax.legend(loc="best", fontsize="small")
    ax.set_ylabel("kl")


def _policy(ax, rows: list[dict]) -> None:
    """Response length (tokens) and, on a second axis, the policy's entropy (nats)."""
    length, entropy = series(rows, "response_length"), series(rows, "entropy")
    lines = []
    if length:
        lines += ax.plot(*zip(*length), color="tab:green", label="response_length")
        ax.set_ylabel("response length (tokens)")
    if entropy:
        other = ax.twinx() if length else ax
        lines += other.plot(*zip(*entropy), color="tab:orange", label="entropy")
        other.set_ylabel("entropy (nats)")
    ax.legend(handles=lines, loc="best", fontsize="small")


def _times(ax, rows: list[dict]) -> None:
    bottoms: dict = {}
    for key in STAGE_KEYS:
        points = series(rows, key)  # empty when the key is absent from the file
        if not points:
            continue
        it, secs = zip(*points)
        base = [bottoms.get(i, 0.0) for i in it]
        label = key.removeprefix("time_").removeprefix("eval/").removesuffix("_s")
        ax.bar(it, secs, bottom=base, label="eval" if key.startswith("eval/") else label)
        for i, s in zip(it, secs):
            bottoms[i] = bottoms.get(i, 0.0) + s
    ax.legend(loc="best", fontsize="small")
    ax.set_ylabel("time per stage (s)")


if __name__ == "__main__":
    sys.exit(main())
