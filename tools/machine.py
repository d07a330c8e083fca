"""What a benchmark reports about the machine it ran on (no heavy imports: the TRL worker
of bench_peer.py runs in a venv of its own)."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (else what ``platform`` says, or "unknown")."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
