"""Peak host memory of this process, read from and reset through ``/proc``."""

from __future__ import annotations


def _proc_status_kib(*keys: str) -> dict[str, int]:
    """The given ``/proc/self/status`` sizes (kB lines), read in one pass; {} where unreadable."""
    found = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in keys:
                    found[key] = int(line.split()[1])
    except OSError:
        return {}
    return found


# How far the peak may stay above the current size right after a reset and still count as
# reset: another thread may free memory between the reset and the read.
_RESET_SLACK_KIB = 64 * 1024


def reset_peak_host_memory() -> bool:
    """Restart the process's peak resident size (Linux ``VmHWM``) from its current size.
    Returns False where that is not possible, or not confirmed."""
    # The reset is checked, not assumed: a kernel or sandbox may accept the write and keep the
    # old peak. After it the peak must be near the current size.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    sizes = _proc_status_kib("VmHWM", "VmRSS")
    return len(sizes) == 2 and sizes["VmHWM"] - sizes["VmRSS"] <= _RESET_SLACK_KIB


def peak_host_memory_bytes() -> int | None:
    """The process's peak resident size since it started or since :func:`reset_peak_host_memory`
    (Linux ``VmHWM``); None where ``/proc`` does not say."""
    kib = _proc_status_kib("VmHWM").get("VmHWM")
    return None if kib is None else kib * 1024
