"""benchmarks.peer without TRL, installs or processes: its flags (the task x precision matrix
included), the command lines and TRL settings it builds, the summaries of both sides' logs, the
compare lines and the result table."""

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
    assert [t.name for t in args.tasks] == ["arithmetic", "boxed2"] and args.precisions == ["fp32", "bf16"]
    arithmetic, boxed2 = args.tasks
    assert arithmetic.train.name == "math_train.jsonl" and arithmetic.train.is_file() and not arithmetic.make
    assert boxed2.train.parent == args.work / "tasks" / "boxed2" and args.work.is_absolute()
    assert args.peers == ["megatron_rlhf", "trl"]
    smoke = bench.parse_args(["--smoke", "--dry-run", "--iters", "5"])
    assert (smoke.iters, smoke.prompts_per_iter, smoke.max_new_tokens, smoke.heldout_limit) == (1, 2, 16, 4)


@pytest.mark.parametrize("argv", [["--iters", "0"], ["--prompts-per-iter", "3"],  # 3 prompts over 2 ranks
                                  ["--group", "3", "--micro-batch-size", "5"],  # 24 samples, batches of 5
                                  ["--heldout-limit", "-1"], ["--peers", "trl", "trl"], ["--peers", "vllm"],
                                  ["--precisions", "fp16"], ["--precisions", "bf16", "bf16"], ["--precisions"],
                                  ["--tasks"], ["--tasks", "arithmetic", "arithmetic"]])
def test_bad_flags_fail(bench, argv):
    with pytest.raises(SystemExit):
        bench.parse_args([*argv, "--dry-run"])


def test_tasks_and_precisions_parse(bench, tmp_path):
    train, heldout = tmp_path / "my_train.jsonl", tmp_path / "my_heldout.jsonl"
    for f in (train, heldout):
        f.write_text('{"prompt": "1 + 1?", "answer": "2"}\n')
    args = bench.parse_args(["--dry-run", "--tasks", "boxed2", f"file:{train},{heldout}", "--precisions", "bf16",
                             "--work", str(tmp_path / "w")])
    assert [t.name for t in args.tasks] == ["boxed2", "file:my_train"] and args.precisions == ["bf16"]
    boxed2, mine = args.tasks
    assert (mine.train, mine.heldout, mine.make) == (train, heldout, ())
    assert boxed2.train == tmp_path / "w" / "tasks" / "boxed2" / "math_train.jsonl"
    assert boxed2.heldout.name == "math_heldout.jsonl" and boxed2.slug == "boxed2" and mine.slug == "file-my_train"
    for flag_, value in (("--min-steps", "2"), ("--max-steps", "2"), ("--instruction", "boxed")):
        assert flag(list(boxed2.make), flag_) == value
    assert bench.parse_args(["--dry-run", "--precisions", "fp32"]).precisions == ["fp32"]


@pytest.mark.parametrize("spec, says", [
    ("gsm8k", "unknown task 'gsm8k': choose from arithmetic, boxed2"),
    ("file:only_one.jsonl", "file:TRAIN.jsonl,HELDOUT.jsonl"),
    ("file:a.jsonl,b.jsonl,c.jsonl", "two paths, one comma"),
    ("file:{tmp}/nope.jsonl,{tmp}/held.jsonl", "the train file {tmp}/nope.jsonl does not exist"),
    ("file:{tmp}/held.jsonl,{tmp}/nope.jsonl", "the held-out file {tmp}/nope.jsonl does not exist"),
])
def test_bad_tasks_fail_with_a_clear_message(bench, tmp_path, capsys, spec, says):
    (tmp_path / "held.jsonl").write_text('{"prompt": "1 + 1?", "answer": "2"}\n')
    with pytest.raises(SystemExit):  # with and without --dry-run: the files are checked either way
        bench.parse_args(["--tasks", "arithmetic", spec.format(tmp=tmp_path)])
    err = capsys.readouterr().err
    assert "--tasks:" in err and says.format(tmp=tmp_path) in err
    if "does not exist" in says:
        assert "make_math_task.py" in err


def test_two_user_tasks_of_one_name_fail(bench, tmp_path, capsys):
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        for name in ("train.jsonl", "held.jsonl"):
            (tmp_path / d / name).write_text("{}\n")
    specs = [f"file:{tmp_path / d / 'train.jsonl'},{tmp_path / d / 'held.jsonl'}" for d in ("a", "b")]
    with pytest.raises(SystemExit):
        bench.parse_args(["--dry-run", "--tasks", *specs])
    assert "file:train" in capsys.readouterr().err


def test_both_sides_get_the_same_settings(bench, tmp_path):
    args = bench.parse_args(["--dry-run", "--iters", "3", "--lr", "2e-6", "--kl-coef", "0.01"])
    p = bench.paths(tmp_path)
    task = args.tasks[0]
    cmd = bench.ours_command(args, task, "fp32", p["mcore"], tmp_path / "log")
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"] and "--nproc_per_node=2" in cmd
    assert flag(cmd, "-m") == "torch.distributed.run" and "megatron_rlhf.train" in cmd
    assert flag(cmd, "--reward-fn") == "math" and flag(cmd, "--advantage-estimator") == "grpo"
    assert (flag(cmd, "--global-batch-size"), flag(cmd, "--rollout-n")) == ("8", "4")
    assert flag(cmd, "--micro-batch-size") == "8"  # 32 samples over 2 ranks: 2 micro-batches of 8 each
    assert (flag(cmd, "--max-new-tokens"), flag(cmd, "--lr"), flag(cmd, "--kl-coef")) == ("128", "2e-06", "0.01")
    assert (flag(cmd, "--train-iters"), flag(cmd, "--eval-limit"), flag(cmd, "--eval-interval")) == ("3", "0", "0")
    assert flag(cmd, "--prompts") == str(task.train) and flag(cmd, "--eval-prompts") == str(task.heldout)
    assert "--fp32" in cmd and "--bf16" not in cmd
    conf = bench.trl_config(args, task, "fp32", p["hf"], tmp_path / "trl")
    assert conf["per_device_train_batch_size"] * conf["gradient_accumulation_steps"] == 32
    assert (conf["iters"], conf["group"], conf["max_new_tokens"]) == (3, 4, 128)
    assert (conf["lr"], conf["kl_coef"], conf["seed"]) == (2e-6, 0.01, 1234)
    assert conf["verifiers"].endswith("megatron_rlhf/rlhf/rewards/math_answer.py") and Path(conf["verifiers"]).is_file()
    json.dumps(conf)  # the worker reads it as JSON
    assert bench.trl_command(p["venv"], tmp_path / "c.json")[0] == str(p["venv"] / "bin" / "python")
    smoke = bench.parse_args(["--smoke", "--dry-run"])  # 8 samples: 4 per rank, one TRL batch of 8
    assert flag(bench.ours_command(smoke, task, "fp32", p["mcore"], tmp_path), "--micro-batch-size") == "4"
    assert bench.micro_batches(smoke)[1:] == (8, 1)


def test_precision_reaches_both_sides(bench, tmp_path):
    """Ours gets --bf16 or --fp32 (never both), which our trainer's parser reads; TRL's config
    says bf16, which the worker turns into bf16 weights and GRPOConfig(bf16=True)."""
    from megatron_rlhf import train

    args = bench.parse_args(["--dry-run"])
    p = bench.paths(tmp_path)
    for task in args.tasks:
        for dtype, other in (("bf16", "--fp32"), ("fp32", "--bf16")):
            cmd = bench.ours_command(args, task, dtype, p["mcore"], tmp_path / "log")
            assert f"--{dtype}" in cmd and other not in cmd
            ours = train.parse_args(cmd[cmd.index("megatron_rlhf.train") + 1:])  # our trainer's own parser
            assert ours.bf16 is (dtype == "bf16") and (ours.prompts, ours.eval_prompts) == (str(task.train),
                                                                                           str(task.heldout))
            conf = bench.trl_config(args, task, dtype, p["hf"], tmp_path / "trl")
            assert conf["bf16"] is (dtype == "bf16")
            assert (conf["train_file"], conf["heldout_file"]) == (str(task.train), str(task.heldout))
            kwargs = bench.grpo_config_kwargs(conf)
            assert (kwargs["bf16"], kwargs["fp16"], kwargs["use_cpu"]) == (dtype == "bf16", False, True)
            assert bench.model_dtype(conf) == {"bf16": "bfloat16", "fp32": "float32"}[dtype]
            assert (kwargs["num_generations"], kwargs["max_completion_length"], kwargs["max_steps"]) == (4, 128, 8)


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
             "time_rollout_s": 5.0, "time_train_s": 4.0, "samples": 8},
            {"iteration": 2, "time_iteration_s": 4.0, "reward_mean": 0.2, "response_length": 22.0,
             "time_rollout_s": 3.0, "time_train_s": 1.0, "samples": 8},
            {"iteration": 3, "time_iteration_s": 6.0, "reward_mean": 0.3, "response_length": 24.0,
             "time_rollout_s": 4.0, "time_train_s": 2.0, "samples": 8,
             "eval/accuracy": 0.5, "eval/responses": 4, "eval/time_s": 3.0}]
    ours = {**bench.summarise_ours(rows), "wall_s": 60.0, "process": "torchrun 2 ranks x 1 thread (gloo)"}
    assert ours["s_per_iter"] == 5.0 and ours["s_first_iter"] == 9.0 and ours["iters"] == 3
    assert ours["stage_s"] == {"time_rollout_s": 3.5, "time_train_s": 1.5}  # medians after the first
    assert (ours["heldout_accuracy_before"], ours["heldout_accuracy_after"], ours["heldout_records"]) == (0.25, 0.5, 4)
    fake = {"step_s": [20.0, 10.0, 12.0], "reward_by_iter": [0.0, 0.25, 0.5], "length_by_iter": [30.0, 31.0, 32.0],
            "samples": 8,
            "before": {"accuracy": 0.25, "records": 4, "time_s": 5.0, "response_length": 30.0},
            "after": {"accuracy": 0.75, "records": 4, "time_s": 5.0, "response_length": 30.0}}
    trl = {**bench.summarise_trl(fake), "wall_s": 90.0, "process": "1 process x 2 threads"}
    assert trl["s_per_iter"] == 11.0 and trl["response_length"] == 31.0
    assert bench.summarise_ours(rows[1:2] + rows[3:])["s_per_iter"] == 6.0  # first is dropped
    assert bench.steady([7.0]) == 7.0  # one iteration: itself
    # after the first iteration: ours 4 + 6 s over 8 x (22 + 24) tokens, TRL 10 + 12 s over 8 x (31 + 32)
    assert ours["ms_per_response_token"] == pytest.approx(1000 * 10 / (8 * 46))
    assert trl["ms_per_response_token"] == pytest.approx(1000 * 22 / (8 * 63))
    results = {"megatron_rlhf": ours, "trl": trl}
    args = bench.parse_args(["--dry-run"])
    conf = bench.settings(args)
    where = bench.cell_settings(args.tasks[1], "bf16")
    cmp = bench.compare(results, where, conf)
    assert cmp["per_token_ratio"] == pytest.approx((22 / 63) / (10 / 46))  # 1.61: TRL's ms per token over ours
    assert cmp["per_iter_ratio"] == pytest.approx(11.0 / 5.0)
    assert list(cmp)[:5] == ["kind", "task", "dtype", "per_token_ratio", "per_iter_ratio"]
    assert (cmp["task"], cmp["dtype"], cmp["train_file"]) == ("boxed2", "bf16", str(args.tasks[1].train))
    assert cmp["heldout_accuracy_after"] == {"megatron_rlhf": 0.5, "trl": 0.75}
    assert cmp["lr"] == conf["lr"] and cmp["model"] == conf["model"]  # the settings ride along
    json.dumps(cmp)
    other = bench.cell_settings(args.tasks[0], "fp32")
    text = bench.table([(other, results, bench.compare(results, other, conf)), (where, results, cmp)], conf)
    lines = text.splitlines()
    assert lines[0].startswith("| task | dtype | peer | ms / response token | TRL/ours per token | TRL/ours per iter |")
    assert lines[1].startswith("|---")
    ours_row = "| megatron_rlhf | 27.2 | 1.61x | 2.20x | 5.00 | 9.00 | 3 | 0.250 | 0.500 | 4 | 0.200 |"
    trl_row = "| trl | 43.7 |  |  | 11.00 | 20.00 | 3 | 0.250 | 0.750 | 4 | 0.250 |"
    assert lines[2].startswith("| arithmetic | fp32 " + ours_row) and lines[3].startswith("| arithmetic | fp32 " + trl_row)
    assert lines[4].startswith("| boxed2 | bf16 " + ours_row) and lines[5].startswith("| boxed2 | bf16 " + trl_row)
    assert ("boxed2 bf16: megatron_rlhf is 1.61x as fast per response token as TRL GRPOTrainer (2.20x per "
            "iteration)") in text
    assert "8 prompts x 4 responses" in text and "128 new tokens" in text
    alone = bench.table([(where, {"trl": {**trl, "response_length": None}}, None)], conf)
    assert "| boxed2 | bf16 | trl | 43.7 |  |  |" in alone and "as fast" not in alone


def test_compare_ratios_from_known_numbers(bench):
    """TRL over ours: 75 ms against 30 ms per token is 2.5x, 12 s against 8 s per iteration 1.5x."""
    def side(ms, s):
        return {"ms_per_response_token": ms, "s_per_iter": s, "response_length": 40.0, "wall_s": 1.0,
                "heldout_accuracy_before": 0.1, "heldout_accuracy_after": 0.2}

    where = {"task": "arithmetic", "dtype": "fp32"}
    cmp = bench.compare({"megatron_rlhf": side(30.0, 8.0), "trl": side(75.0, 12.0)}, where, {})
    assert (cmp["per_token_ratio"], cmp["per_iter_ratio"]) == (2.5, 1.5)
    assert cmp["ms_per_response_token"] == {"megatron_rlhf": 30.0, "trl": 75.0}
    slower = bench.compare({"megatron_rlhf": side(60.0, 20.0), "trl": side(30.0, 10.0)}, where, {})
    assert (slower["per_token_ratio"], slower["per_iter_ratio"]) == (0.5, 0.5)  # < 1: ours slower
    missing = bench.compare({"megatron_rlhf": side(None, 8.0), "trl": side(75.0, 12.0)}, where, {})
    assert missing["per_token_ratio"] is None and missing["per_iter_ratio"] == 1.5


def test_summaries_need_the_rows(bench):
    with pytest.raises(ValueError, match="evaluation rows"):
        bench.summarise_ours([{"iteration": 1, "time_iteration_s": 1.0}])


def test_dry_run_prints_every_command_of_the_matrix(bench, capsys, tmp_path):
    assert bench.main(["--smoke", "--dry-run", "--work", str(tmp_path)]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["kind"] for x in lines] == ["header"] + ["command"] * 9  # made task, 2 tasks x 2 precisions x 2 peers
    head, make, runs = lines[0], lines[1], lines[2:]
    assert head["iters"] == 1 and head["smoke"] is True
    assert (head["tasks"], head["precisions"]) == (["arithmetic", "boxed2"], ["fp32", "bf16"])
    assert make["task"] == "boxed2" and make["command"][1].endswith("tools/make_math_task.py")
    assert flag(make["command"], "--out-dir") == str(tmp_path / "tasks" / "boxed2")
    assert not (tmp_path / "tasks").exists()  # a dry run makes nothing
    assert [(x["task"], x["dtype"], x["peer"]) for x in runs] == [
        (t, d, peer) for t in ("arithmetic", "boxed2") for d in ("fp32", "bf16") for peer in ("megatron_rlhf", "trl")]
    for x in runs:
        if x["peer"] == "megatron_rlhf":
            assert f"--{x['dtype']}" in x["command"] and flag(x["command"], "--max-new-tokens") == "16"
            assert flag(x["command"], "--log-dir").endswith(f"smoke-{x['task']}-{x['dtype']}-megatron_rlhf")
        else:
            assert x["config"]["bf16"] is (x["dtype"] == "bf16")
            assert x["command"][-1] == str(Path(x["config"]["out_dir"]) / "config.json")
    assert {x["command"][x["command"].index("--prompts") + 1] for x in runs if x["peer"] == "megatron_rlhf"} == {
        str(bench.DATA / "math_train.jsonl"), str(tmp_path / "tasks" / "boxed2" / "math_train.jsonl")}


def test_dry_run_honours_peers(bench, capsys):
    assert bench.main(["--dry-run", "--peers", "trl", "--tasks", "arithmetic", "--precisions", "bf16"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(x["kind"], x.get("peer"), x.get("dtype")) for x in lines] == [("header", None, None),
                                                                          ("command", "trl", "bf16")]


def test_made_task_is_made_once_and_reused(bench, tmp_path, monkeypatch):
    """boxed2's files come from tools/make_math_task.py (two-step, \\boxed{} instruction) and are reused."""
    task = bench.parse_args(["--dry-run", "--tasks", "boxed2", "--work", str(tmp_path)]).tasks[0]
    bench.ensure_task(task)
    train = [json.loads(x) for x in task.train.read_text().splitlines()]
    heldout = [json.loads(x) for x in task.heldout.read_text().splitlines()]
    assert (len(train), len(heldout)) == (1500, 200)
    assert all(r["steps"] == 2 and r["prompt"].endswith("put your final answer within \\boxed{}.") for r in train)
    assert not task.train.parent.with_name("boxed2.tmp").exists()
    verifiers = bench.load_verifiers(str(bench.VERIFIERS))  # as the TRL worker loads it; ours registers it as math
    gold = heldout[0]["answer"]
    assert verifiers.math_answer_correct(f"First 3 + 4 = 7, then 7 + 1 = 8. So $\\boxed{{{gold}}}$ in all, not 99.", gold)
    assert not verifiers.math_answer_correct(f"So \\boxed{{{int(gold) + 1}}}, not {gold}.", gold)
    stamp = task.train.stat().st_mtime_ns
    monkeypatch.setattr(bench, "run_checked", lambda *a, **k: pytest.fail("remade an existing task"))
    bench.ensure_task(task)
    assert task.train.stat().st_mtime_ns == stamp


def test_per_token_time_counts_each_sides_own_lengths(bench):
    """After the first iteration: 4 s + 6 s over 2 samples x (20 + 30) tokens = 100 ms per token."""
    assert bench.ms_per_response_token([10.0, 4.0, 6.0], [50.0, 20.0, 30.0], 2) == 100.0
    assert bench.ms_per_response_token([3.0], [10.0], 3) == 100.0  # one iteration: itself
    assert bench.ms_per_response_token([1.0, 2.0], [5.0, 0.0], 4) is None  # no tokens to divide by
