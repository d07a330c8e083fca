"""Heartbeats in the rendezvous store, so that a failed collective names the ranks that are gone."""

from __future__ import annotations

import os

import torch.distributed as dist

_HOST_KEY, _BEAT_KEY = "mrlhf/host/", "mrlhf/beat/"
# Every rank adds 1 to its counter in the store this often (a daemon thread). After a failed
# collective, ranks whose counter stopped are the lost ones, whatever the living ones do.
HEARTBEAT_S = 1.0


def _where() -> str:
    import socket

    node = os.environ.get("GROUP_RANK")
    return socket.gethostname() + (f", node {node}" if node is not None else "")


def _store():
    return dist.distributed_c10d._get_default_store()


_heartbeat: dict = {}  # the running heartbeat's thread and the event that stops it


def _start_heartbeat() -> None:
    """Record where this rank runs and start its heartbeat, until :func:`stop_heartbeat`."""
    import atexit
    import threading

    try:
        store, rank = _store(), dist.get_rank()
        store.set(f"{_HOST_KEY}{rank}", _where())
        store.add(f"{_BEAT_KEY}{rank}", 1)
    except Exception:  # noqa: BLE001 (no store: nothing to name lost ranks with)
        return
    stop = threading.Event()

    def beat():
        while not stop.wait(HEARTBEAT_S):
            try:
                store.add(f"{_BEAT_KEY}{rank}", 1)
            except Exception:  # noqa: BLE001 (the store is gone: so is the job)
                return

    thread = threading.Thread(target=beat, daemon=True, name="mrlhf-heartbeat")
    _heartbeat.update(thread=thread, stop=stop)
    thread.start()
    atexit.register(stop_heartbeat)


def stop_heartbeat(timeout_s: float = 10.0) -> None:
    """Stop the heartbeat thread and wait for it."""
    # A daemon thread still inside a store call (C++, GIL released) when the interpreter
    # finalises is unwound through C++ frames: the process aborts ("terminate called without an
    # active exception") after a job that succeeded. So every clean exit stops it first.
    if not _heartbeat:
        return
    _heartbeat["stop"].set()
    _heartbeat["thread"].join(timeout_s)
    _heartbeat.clear()


def lost_peers(wait_s: float = 4 * HEARTBEAT_S) -> tuple[list[int], dict[int, str]] | None:
    """``(ranks whose heartbeat stood still over wait_s, {rank: host and node})``, or None
    when the rendezvous store is unreachable (its host is among the lost)."""
    import time

    world = dist.get_world_size()
    try:
        store = _store()
        before = [store.add(f"{_BEAT_KEY}{r}", 0) for r in range(world)]
        time.sleep(wait_s)
        after = [store.add(f"{_BEAT_KEY}{r}", 0) for r in range(world)]
        missing = [r for r in range(world) if after[r] == before[r]]
        where = {r: (store.get(f"{_HOST_KEY}{r}").decode() if store.check([f"{_HOST_KEY}{r}"]) else "?")
                 for r in missing}
    except Exception:  # noqa: BLE001
        return None
    return missing, where


def is_peer_failure(e: BaseException) -> bool:
    """Whether ``e`` is a collective that failed because a peer is gone (a closed or reset
    connection, a timed-out collective), not an error of this rank's own."""
    text = str(e)
    return (isinstance(e, getattr(dist, "DistBackendError", ())) or "Connection reset" in text
            or "Connection closed" in text or "Timed out" in text or "timed out" in text)


def lost_peers_message(e: BaseException, wait_s: float = 4 * HEARTBEAT_S) -> str | None:
    """A message naming the lost ranks when a lost peer broke collective ``e``; None when the
    error is this rank's own."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or not is_peer_failure(e):
        return None
    found = lost_peers(wait_s)
    if found is None:
        return (f"a collective failed ({str(e).splitlines()[0][:200]}) and the job's rendezvous "
                "store is unreachable: the node hosting it (the first node) is lost. "
                "Resubmit the job to resume from its last checkpoint.")
    missing, where = found
    if not missing:
        return None
    names = ", ".join(f"{r} ({where[r]})" for r in missing)
    return (f"lost rank{'s' if len(missing) > 1 else ''} {names}: a collective with "
            f"{'them' if len(missing) > 1 else 'it'} failed ({str(e).splitlines()[0][:200]}). "
            "The iteration in progress is lost; resubmit the job to resume from the last checkpoint.")


def exit_on_lost_peers(e: BaseException, label: str = "") -> int:
    """For an entry point's ``except RuntimeError``: print :func:`lost_peers_message` and
    return exit code 4. Re-raises ``e`` when no peer was lost."""
    import sys

    message = lost_peers_message(e)
    if message is None:
        raise e
    print(f"error: {label}{message}", file=sys.stderr, flush=True)
    return 4
