"""benchmarks.peer without TRL, installs or processes: its flags, the command lines and
TRL settings it builds, the summaries of both sides' logs and the result table."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("benchmarks.peer")


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_defaults_and_smoke(bench):
    args = bench.parse_args(["--dry-run"])
    assert (args.iters, args.prompts_per_iter, args.group, args.max_new_tokens) == (8, 8, 4, 128)
    assert (args.lr, args.temperature, args.kl_coef, args.heldout_limit) == (1e-5, 1.0, 0.0, 0)
    assert args.train_file.name == "math_train.jsonl" and args.train_file.is_absolute()
    assert args.peers == ["megatron_rlhf", "trl"]
    smoke = bench.parse_args(["--smoke", "--dry-run", "--iters", "5"])
    assert (smoke.iters, smoke.prompts_per_iter, smoke.max_new_tokens, smoke.heldout_limit) == (1, 2, 16, 4)


@pytest.mark.parametrize("argv", [["--iters", "0"], ["--prompts-per-iter", "3"],  # 3 prompts over 2 ranks
                                  ["--group", "3", "--micro-batch-size", "5"],  # 24 samples, batches of 5
                                  ["--heldout-limit", "-1"], ["--peers", "trl", "trl"], ["--peers", "vllm"]])
def test_bad_flags_fail(bench, argv):
    with pytest.raises(SystemExit):
        bench.parse_args([*argv, "--dry-run"])


def test_missing_task_file_fails_with_a_hint(bench, tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--train-file", str(tmp_path / "nope.jsonl")])
    assert "make_math_task.py" in capsys.readouterr().err


def test_both_sides_get_the_same_settings(bench, tmp_path):
    args = bench.parse_args(["--dry-run", "--iters", "3", "--lr", "2e-6", "--kl-coef", "0.01"])
    p = bench.paths(tmp_path)
    cmd = bench.ours_command(args, p["mcore"], tmp_path / "log")
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"] and "--nproc_per_node=2" in cmd
    assert flag(cmd, "-m") == "torch.distributed.run" and "megatron_rlhf.train" in cmd
    assert flag(cmd, "--reward-fn") == "math" and flag(cmd, "--advantage-estimator") == "grpo"
    assert (flag(cmd, "--global-batch-size"), flag(cmd, "--rollout-n")) == ("8", "4")
    assert flag(cmd, "--micro-batch-size") == "8"  # 32 samples over 2 ranks: 2 micro-batches of 8 each
    assert (flag(cmd, "--max-new-tokens"), flag(cmd, "--lr"), flag(cmd, "--kl-coef")) == ("128", "2e-06", "0.01")
    assert (flag(cmd, "--train-iters"), flag(cmd, "--eval-limit"), flag(cmd, "--eval-interval")) == ("3", "0", "0")
    assert flag(cmd, "--eval-prompts") == str(args.heldout_file) and "--fp32" in cmd
    conf = bench.trl_config(args, p["hf"], tmp_path / "trl")
    assert conf["per_device_train_batch_size"] * conf["gradient_accumulation_steps"] == 32
    assert (conf["iters"], conf["group"], conf["max_new_tokens"]) == (3, 4, 128)
    assert (conf["lr"], conf["kl_coef"], conf["seed"]) == (2e-6, 0.01, 1234)
    assert conf["verifiers"].endswith("megatron_rlhf/rlhf/rewards/math_answer.py") and Path(conf["verifiers"]).is_file()
    json.dumps(conf)  # the worker reads it as JSON
    assert bench.trl_command(p["venv"], tmp_path / "c.json")[0] == str(p["venv"] / "bin" / "python")
    smoke = bench.parse_args(["--smoke", "--dry-run"])  # 8 samples: 4 per rank, one TRL batch of 8
    assert flag(bench.ours_command(smoke, p["mcore"], tmp_path), "--micro-batch-size") == "4"
    assert bench.micro_batches(smoke)[1:] == (8, 1)


def test_install_pins_torch_before_trl(bench, tmp_path):
    pins = {"torch": "2.13.0", "transformers": "5.24.0"}
    venv, constraints = tmp_path / "venv", tmp_path / "c.txt"
    make, torch_cmd, trl_cmd = bench.install_commands(venv, constraints, pins)
    assert make == [sys.executable, "-m", "venv", str(venv)]
    assert torch_cmd[-1] == "torch==2.13.0" and "trl==1.16.0" in trl_cmd and "math-verify==0.9.0" in trl_cmd
    for cmd in (torch_cmd, trl_cmd):
        assert cmd[0] == str(venv / "bin" / "python") and flag(cmd, "-c") == str(constraints)
    assert set(bench.pinned_versions()) == {"torch", "transformers"}
    assert "+" not in bench.pinned_versions()["torch"]


def test_summaries_compare_and_table(bench):
    rows = [{"iteration": 0, "eval/accuracy": 0.25, "eval/responses": 4, "eval/time_s": 3.0},
            {"iteration": 1, "time_iteration_s": 9.0, "reward_mean": 0.1, "response_length": 20.0,
             "time_rollout_s": 5.0, "time_train_s": 4.0},
            {"iteration": 2, "time_iteration_s": 4.0, "reward_mean": 0.2, "response_length": 22.0,
             "time_rollout_s": 3.0, "time_train_s": 1.0},
            {"iteration": 3, "time_iteration_s": 6.0, "reward_mean": 0.3, "response_length": 24.0,
             "time_rollout_s": 4.0, "time_train_s": 2.0,
             "eval/accuracy": 0.5, "eval/responses": 4, "eval/time_s": 3.0}]
    ours = {**bench.summarise_ours(rows), "wall_s": 60.0, "process": "torchrun 2 ranks x 1 thread (gloo)"}
    assert ours["s_per_iter"] == 5.0 and ours["s_first_iter"] == 9.0 and ours["iters"] == 3
    assert ours["stage_s"] == {"time_rollout_s": 3.5, "time_train_s": 1.5}  # medians after the first
    assert (ours["heldout_accuracy_before"], ours["heldout_accuracy_after"], ours["heldout_records"]) == (0.25, 0.5, 4)
    fake = {"step_s": [20.0, 10.0, 12.0], "reward_by_iter": [0.0, 0.25, 0.5], "length_by_iter": [30.0, 31.0, 32.0],
            "before": {"accuracy": 0.25, "records": 4, "time_s": 5.0, "response_length": 30.0},
            "after": {"accuracy": 0.75, "records": 4, "time_s": 5.0, "response_length": 30.0}}
    trl = {**bench.summarise_trl(fake), "wall_s": 90.0, "process": "1 process x 2 threads"}
    assert trl["s_per_iter"] == 11.0 and trl["response_length"] == 31.0
    assert bench.summarise_ours(rows[1:2] + rows[3:])["s_per_iter"] == 6.0  # first is dropped
    assert bench.steady([7.0]) == 7.0  # one iteration: itself
    results = {"megatron_rlhf": ours, "trl": trl}
    cmp = bench.compare(results)
    assert cmp["ours_faster_by"] == pytest.approx(2.2)
    assert cmp["heldout_accuracy_after"] == {"megatron_rlhf": 0.5, "trl": 0.75}
    json.dumps(cmp)
    conf = bench.settings(bench.parse_args(["--dry-run"]))
    text = bench.table(results, cmp, conf)
    lines = text.splitlines()
    assert lines[0].startswith("| peer |") and lines[1].startswith("|---")
    assert lines[2].startswith("| megatron_rlhf | 5.00 | 9.00 | 3 | 0.250 | 0.500 | 4 | 0.200 |")
    assert lines[3].startswith("| trl | 11.00 | 20.00 | 3 | 0.250 | 0.750 | 4 | 0.250 |")
    assert "2.20x" in text and "8 prompts x 4 responses" in text and "128 new tokens" in text
    assert "-" in bench.table({"trl": {**trl, "response_length": None}}, None, conf)


def test_summaries_need_the_rows(bench):
    with pytest.raises(ValueError, match="evaluation rows"):
        bench.summarise_ours([{"iteration": 1, "time_iteration_s": 1.0}])


def test_dry_run_prints_json_lines(bench, capsys):
    assert bench.main(["--smoke", "--dry-run"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["kind"] for x in lines] == ["header", "command", "command"]
    assert lines[0]["iters"] == 1 and lines[0]["smoke"] is True
    assert {x["peer"] for x in lines[1:]} == {"megatron_rlhf", "trl"}


def test_per_token_time_counts_each_sides_own_lengths(bench):
    """After the first iteration: 4 s + 6 s over 2 samples x (20 + 30) tokens = 100 ms per token."""
    assert bench.ms_per_response_token([10.0, 4.0, 6.0], [50.0, 20.0, 30.0], 2) == 100.0
    assert bench.ms_per_response_token([3.0], [10.0], 3) == 100.0  # one iteration: itself
    assert bench.ms_per_response_token([1.0, 2.0], [5.0, 0.0], 4) is None  # no tokens to divide by
