"""The GPU check's report: stage rows, goals and measurements, rewritten to ``--out`` after
every stage (``summary.json``, ``measurements.jsonl``, ``table.txt``), and the summary table."""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path


class CheckFailed(Exception):
    """A stage ran but its check did not hold; the message is the table's detail."""


class StageTimeout(CheckFailed):
    """A stage ran past its deadline (its row says TIMEOUT, not FAIL)."""


def _replace(path: Path, text: str) -> None:
    # written beside and renamed: a check killed mid-save leaves the previous table, never an empty one
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(text)
    os.replace(tmp, path)


def fmt(x, digits=3) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        return f"{x:.{digits}g}" if abs(x) < 10 ** digits else f"{x:.0f}"
    return str(x)


class Report:
    """Stage rows, goals and measurements; rewritten to disk after every stage."""

    def __init__(self, out: Path, header: dict):
        self.out, self.header = out, header
        self.stages: list[dict] = []
        self.goals: list[dict] = []
        self.t0 = time.perf_counter()
        out.mkdir(parents=True, exist_ok=True)
        self.measurements = (out / "measurements.jsonl").open("w")
        self.lock = threading.Lock()
        self.finished = False  # set before the last save: the check printed its own table

    def measure(self, stage: str, **values) -> dict:
        row = {"stage": stage, **values}
        self.measurements.write(json.dumps(row) + "\n")
        self.measurements.flush()
        return row

    def goal(self, name: str, value, target: str, met: bool | None) -> None:
        self.goals.append({"goal": name, "value": value, "target": target, "met": met})
        self.measure("goal", goal=name, value=value, target=target, met=met)

    def table(self) -> str:
        h = self.header
        lines = [
            f"GPU check {h['date']}  mode {h['mode']}  device {h['device']}",
            f"python {h['python']}  torch {h['torch']}  CUDA {h.get('cuda')}  cuDNN {h.get('cudnn')}  "
            f"megatron-core {h['megatron_core']}  transformers {h['transformers']}  "
            f"flash-attn {h.get('flash_attn', '?')}",
            f"model {h['model']}  decode attention {h.get('decode_attention', '?')}  "
            f"cuda graphs {h.get('cuda_graphs', '?')}  budget {h.get('budget', '?')}",
            "",
            f"{'stage':<26}{'status':<8}{'seconds':<9}details",
        ]
        for s in self.stages:
            lines.append(f"{s['name']:<26}{s['status']:<8}{s['seconds']:<9.1f}{s['details']}")
            for r in s.get("rows", []):
                lines.append(f"  {r[0]:<41}{r[1]}")
        if self.goals:
            lines.append("")
            lines.append("goals (reported, not asserted):")
            for g in self.goals:
                met = {True: "met", False: "NOT MET", None: "n/a"}[g["met"]]
                lines.append(f"  {g['goal']:<44}{fmt(g['value']):<10}{g['target']:<14}{met}")
        failed = [s["name"] for s in self.stages if s["status"] == "FAIL"]
        late = [s["name"] for s in self.stages if s["status"] == "TIMEOUT"]
        short = self.skipped_for_time()
        verdict = [f"FAILED: {', '.join(failed)}"] if failed else []
        if late:
            verdict.append(f"TIMEOUT (ran past its deadline): {', '.join(late)}")
        if short:
            verdict.append(f"SKIPPED for time (not a failure): {', '.join(short)}")
        if not failed and not late:
            verdict.insert(0, "all stages run passed")
        install = h.get("install_s") or 0.0
        lines.append("")
        lines.append(f"total wall time {install + self.elapsed():.1f} s (install {install:.1f} s + check "
                     f"{self.elapsed():.1f} s); " + "; ".join(verdict))
        return "\n".join(lines)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def skipped_for_time(self) -> list[str]:
        """The stages the time budget left out."""
        return [s["name"] for s in self.stages if s.get("skipped") == "time"]

    def passed(self) -> bool:
        """Every stage passed or was skipped: not selected with --stages, or a decode stage
        the time budget left out (reported as such; a training stage that cannot start FAILs)."""
        return all(s["status"] in ("PASS", "SKIP") for s in self.stages)

    def save(self) -> str:
        """Rewrite ``summary.json`` and ``table.txt``; returns the table written."""
        with self.lock:
            summary = {"header": self.header, "stages": self.stages, "goals": self.goals,
                       "total_s": (self.header.get("install_s") or 0.0) + self.elapsed(),
                       "skipped_for_time": self.skipped_for_time(), "passed": self.passed(),
                       "finished": self.finished}
            table = self.table()
            _replace(self.out / "summary.json", json.dumps(summary, indent=1))
            _replace(self.out / "table.txt", table + "\n")
            return table
