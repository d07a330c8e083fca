"""The GPU check's time per stage: minimums from the CPU smoke run's seconds
(``stage_sizes.json``, written by ``--smoke --record-sizes``), scaled, and the running stage's
deadline."""

from __future__ import annotations

import functools
import json
from pathlib import Path

SIZES = Path(__file__).with_name("stage_sizes.json")
SIZE_SCALE = 3.0  # the 1b shape on one GPU against the smoke run on the CPU (an estimate)
FLOOR_S = 10.0  # the least a stage is given: a process start and a model load
FAKE_S = 1.0  # the minimum of a --fake-stages stand-in
GRACE_S = 3.0  # from a stage's deadline to the end of its process (SIGTERM, then SIGKILL)
RESTART_S = 5.0  # a fresh stage process's start, kept for the stages after a stage that overran
DEFAULT_BUDGET_S = 270.0  # the stages only: with the install and start-up, 6 minutes of device time
WATCHDOG_S = 15.0  # after the budget, the last resort: the table is written and the check ends


@functools.lru_cache(maxsize=1)
def sizes() -> dict[str, float]:
    """Seconds per stage of the recorded smoke run ({} when none is recorded)."""
    if not SIZES.is_file():
        return {}
    return dict(json.loads(SIZES.read_text())["seconds"])


def minimum(name: str, fake: bool = False) -> float:
    """Seconds stage ``name`` needs left to start."""
    if fake:
        return FAKE_S
    return max(FLOOR_S, SIZE_SCALE * sizes().get(name, FLOOR_S))


def stage_end(now: float, end: float | None, need: float, later: list[float]) -> float | None:
    """The deadline of a stage starting at ``now``: all the budget left (to ``end``) but the
    ``later`` stages' minimums, a restart and a grace; at least ``need``, at most ``end``."""
    if end is None:
        return None
    reserve = sum(later) + (GRACE_S + RESTART_S if later else 0.0)
    return min(end, now + max(need, end - now - reserve))


def record(stages: list[dict], mode: str) -> dict:
    """Write ``stage_sizes.json`` from a run's stage rows (the passed ones); returns it."""
    seconds = {s["name"]: round(s["seconds"], 1) for s in stages
               if s["status"] == "PASS" and s["name"] != "install"}
    data = {"recorded_by": f"python -m gpu_check --smoke --record-sizes ({mode})",
            "seconds": seconds}
    SIZES.write_text(json.dumps(data, indent=1) + "\n")
    return data
