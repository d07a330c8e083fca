"""runtime.serial_helper_threads: torch's intra-op threads stay with the main thread.

Checked in a fresh process each (the thread setup of a process happens once).
"""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, os, threading, torch
    from megatron_rlhf import runtime
    runtime.quiet_third_party_warnings()
    before = torch.get_num_threads()
    runtime.init_distributed()
    import torch.distributed as dist
    seen = {}
    th = threading.Thread(target=lambda: seen.update(helper=torch.get_num_threads()))
    th.start(); th.join()
    # a collective big enough for gloo's worker thread to split its copies
    out = [None]
    dist.all_gather_object(out, "x" * 400_000)

    def switches():
        total = 0
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/status") as f:
                total += sum(int(l.split()[1]) for l in f if l.startswith("voluntary_ctxt_switches"))
        return total

    x = torch.randn(64, 4096)
    ops = 3000
    s0 = switches()
    for _ in range(ops):
        x.mul_(1.0)
    print(json.dumps({"before": before, "main": torch.get_num_threads(), "helper": seen["helper"],
                      "switches_per_op": (switches() - s0) / ops}))
""")


def run(env_extra=None):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(env_extra or {})
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to have intra-op threads")
def test_helper_threads_serial_and_main_thread_keeps_its_workers_spinning():
    r = run()
    assert r["main"] == r["before"] >= 2, r  # the main thread keeps its thread count
    assert r["helper"] == 1, r  # other threads (gloo's workers) run ops serially
    # After a collective large enough to be split in gloo's thread, the main thread's
    # OpenMP workers still spin between back-to-back parallel ops instead of sleeping
    # (with MRLHF_SERIAL_HELPER_THREADS=0 this machine measured ~1 sleep per op).
    assert r["switches_per_op"] < 0.3, r


def test_escape_hatch_leaves_threads_alone():
    r = run({"MRLHF_SERIAL_HELPER_THREADS": "0"})
    assert r["main"] == r["before"] and r["helper"] == r["before"], r


def test_stage_memory_records_each_stage_peak_on_the_cpu():
    """Per stage, the peak resident size of the process during that stage (issue 29)."""
    import torch

    from megatron_rlhf import runtime
    from megatron_rlhf.rlhf.offload import StageMemory

    # Probe that this kernel honours the reset: after a freed 256 MiB block the peak is far
    # above the current size, and only a reset that took brings it back within the slack.
    block = torch.ones(64 * 2**20)
    del block
    if not runtime.reset_peak_host_memory():
        import pytest

        pytest.skip("this kernel does not restart the peak resident size (/proc/self/clear_refs)")
    stages = StageMemory()
    with stages.stage("big"):
        block = torch.ones(64 * 2**20)  # 256 MiB, touched
        del block
    with stages.stage("small"):
        torch.ones(2**20)
    big, small = stages.metrics["peak_mem_big_gb"], stages.metrics["peak_mem_small_gb"]
    # the first stage's 0.25 GiB is not the second's
    assert big - small > 0.2, (big, small, runtime.memory._proc_status_kib("VmHWM", "VmRSS"))
    assert stages.metrics["time_big_s"] >= 0


def test_a_peak_reset_the_kernel_ignores_gives_no_stage_peak(monkeypatch, tmp_path):
    """A kernel may accept the write to clear_refs and keep the old peak: then a stage has no
    peak metric, never the process's lifetime peak (CI failed so on 2026-12-03)."""
    from megatron_rlhf import runtime
    from megatron_rlhf.rlhf.offload import StageMemory

    sizes = {"VmHWM": 2_097_552, "VmRSS": 1_200_000}  # kB: the peak stays far above
    monkeypatch.setattr(runtime.memory, "_proc_status_kib", lambda *keys: {k: sizes[k] for k in keys})
    monkeypatch.setattr(runtime, "has_cuda", lambda: False)
    real_open = open

    def fake_open(path, *args, **kwargs):  # a clear_refs that accepts any write
        if path == "/proc/self/clear_refs":
            path = tmp_path / "clear_refs"
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", fake_open)
    assert not runtime.reset_peak_host_memory()
    stages = StageMemory()
    stages.metrics["peak_mem_gen_gb"] = 9.0  # a previous call's value must not survive
    with stages.stage("gen"):
        pass
    assert "peak_mem_gen_gb" not in stages.metrics and "time_gen_s" in stages.metrics
    sizes["VmHWM"] = sizes["VmRSS"] + 1024  # a reset that took: the peak is the current size
    assert runtime.reset_peak_host_memory()
    with stages.stage("gen"):
        pass
    assert stages.metrics["peak_mem_gen_gb"] == sizes["VmHWM"] * 1024 / 2**30


def test_peer_failures_are_told_from_a_ranks_own_errors():
    from megatron_rlhf import runtime

    assert runtime.is_peer_failure(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5"))
    assert runtime.is_peer_failure(RuntimeError("Connection reset by peer"))
    assert not runtime.is_peer_failure(RuntimeError("shape mismatch"))
    # one process: no peer to lose, whatever the error says
    assert runtime.lost_peers_message(RuntimeError("Connection reset by peer")) is None


def test_heartbeat_beats_until_stopped(world1):
    """The heartbeat adds to its counter in the rendezvous store until stop_heartbeat, which
    ends the thread (a daemon thread left inside a store call at exit aborts the process)."""
    import time

    import torch.distributed as dist

    from megatron_rlhf import runtime
    from megatron_rlhf.runtime import peers

    peers._start_heartbeat()
    try:
        thread, key = peers._heartbeat["thread"], f"{peers._BEAT_KEY}{dist.get_rank()}"
        store = peers._store()
        first = store.add(key, 0)
        time.sleep(2.5 * peers.HEARTBEAT_S)
        assert store.add(key, 0) > first
    finally:
        runtime.stop_heartbeat()
    assert not thread.is_alive() and not peers._heartbeat
    stopped = store.add(key, 0)
    time.sleep(1.5 * peers.HEARTBEAT_S)
    assert store.add(key, 0) == stopped
    runtime.stop_heartbeat()  # a second stop is a no-op


def test_a_process_with_a_busy_heartbeat_exits_cleanly():
    """A heartbeat that is always inside a store call when the interpreter exits: the exit
    handler stops it first (without that, 8 of 8 such exits aborted with "terminate called
    without an active exception", as a 2-node PPO job did in CI after finishing)."""
    script = textwrap.dedent("""
        from megatron_rlhf import runtime
        from megatron_rlhf.runtime import peers
        runtime.init_distributed()
        peers.HEARTBEAT_S = 0  # beat without pause: always inside store.add
        peers._start_heartbeat()
        import time; time.sleep(0.3)
        print("done", flush=True)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "done" in r.stdout, (r.returncode, r.stderr[-2000:])


def test_megatron_decorations_compile_on_their_first_call(monkeypatch):
    """compile_on_first_call: ``torch.compile`` inside the block defers the real one to the
    first call (the function form and the ``@torch.compile(...)`` form), compiles once, and
    is restored on exit."""
    import torch

    from megatron_rlhf import runtime

    compiled = []

    def fake_compile(fn, **kwargs):
        compiled.append((fn.__name__, kwargs))
        return lambda *a, **k: ("compiled", fn(*a, **k))

    monkeypatch.setattr(torch, "compile", fake_compile)
    with runtime.compile_on_first_call():
        def twice(x):
            return 2 * x

        @torch.compile(mode="max-autotune")
        def thrice(x):
            return 3 * x

        f = torch.compile(twice)
    assert torch.compile is fake_compile and compiled == []
    assert f(4) == ("compiled", 8) and f(5) == ("compiled", 10)
    assert thrice(1) == ("compiled", 3)
    assert compiled == [("twice", {}), ("thrice", {"mode": "max-autotune"})]


def test_a_fresh_process_starts_without_dynamo_and_saves_without_spawning():
    """Start-up on a CPU: after init_distributed and a model build, dynamo is not imported
    (megatron-core's decorations deferred) and torch.compile is torch's own; a checkpoint
    save leaves no child process behind (megatron's writer's results queue in process, not a
    spawned Manager's) and loads back."""
    script = textwrap.dedent("""
        import json, multiprocessing, sys, tempfile, torch
        from megatron_rlhf import runtime
        runtime.quiet_third_party_warnings()
        real = torch.compile
        runtime.init_distributed()
        from megatron_rlhf.parallel.groups import build_process_groups
        from megatron_rlhf.parallel.layout import Layout
        from megatron_rlhf.config import preset
        from megatron_rlhf.models.builder import build_model
        from megatron_rlhf.models import checkpoint as ckpt
        pg = build_process_groups(Layout())
        model = build_model(preset("tiny"), "actor", pg, dtype=torch.float32, seed=3)
        dynamo = "torch._dynamo" in sys.modules
        d = tempfile.mkdtemp()
        ckpt.save_checkpoint(d, 1, model, pg)
        again = build_model(preset("tiny"), "actor", pg, dtype=torch.float32, seed=4)
        ckpt.load_checkpoint(again, pg, d)
        same = all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
        print(json.dumps({"dynamo": dynamo, "compile_restored": torch.compile is real,
                          "children": [p.name for p in multiprocessing.active_children()],
                          "loaded": same}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r == {"dynamo": False, "compile_restored": True, "children": [], "loaded": True}, r
