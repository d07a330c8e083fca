"""``train_sft`` and ``train_rm`` end to end on a tiny model (char tokenizer, 2 gloo ranks)
with the shipped sets: the reward model beats chance on held-out pairs and feeds PPO
through --reward-load; SFT lowers the held-out loss and resumes exactly; DPO raises the
implicit reward margin of the training pairs."""

from pathlib import Path
from types import SimpleNamespace

import pytest

import rlhf_fixtures as F
from launch import ROOT, torchrun

DATA = ROOT / "megatron_rlhf" / "data"
COMMON = ["--no-chat", "--fp32", "--seq-length", "600", "--global-batch-size", "16",
          "--micro-batch-size", "4", "--held-out-fraction", "0.1", "--seed", "3"]


@pytest.fixture(scope="module")
def tiny(world1, tmp_path_factory):
    d = tmp_path_factory.mktemp("finetune")
    return SimpleNamespace(dir=d, actor=F.make_actor_checkpoint(d / "actor", world1, positions=640))


def _run(module: str, args: list[str], out: Path) -> list[dict]:
    torchrun(2, ["-m", module, *args, *COMMON, "--log-dir", str(out), "--save", str(out)])
    return F.read_metrics(out)


def test_reward_model_beats_chance_and_feeds_ppo(tiny, tmp_path):
    rows = _run("megatron_rlhf.train_rm", ["--load-model", str(tiny.actor), "--data", str(DATA / "preferences.jsonl"),
                                           "--lr", "2e-3", "--train-iters", "20", "--eval-interval", "10"],
                tmp_path / "rm")
    evals = [r for r in rows if "eval_accuracy" in r]
    assert evals[-1]["eval_accuracy"] >= 0.8, evals  # 54 held-out pairs; chance is 0.5
    rm = tmp_path / "rm" / "iter_0000020" / "reward"
    ppo = F.run_train(F.train_args(tiny.actor, F.write_prompts(tmp_path / "p.jsonl"), tmp_path / "ppo",
                                   reward_fn=None, reward_load=str(rm), train_iters=1, save=None))
    F.check_ok(ppo)
    assert F.read_metrics(tmp_path / "ppo" / "log")[0]["reward_mean"] != 0.0


def test_sft_lowers_held_out_loss_and_resumes_exactly(tiny, tmp_path):
    args = ["--load-model", str(tiny.actor), "--data", str(DATA / "sft.jsonl"), "--pack",
            "--lr", "1e-2", "--lr-decay-iters", "6", "--eval-interval", "2", "--save-interval", "2"]
    full = _run("megatron_rlhf.train_sft", args + ["--train-iters", "6"], tmp_path / "full")
    evals = [full[0]["initial_eval_loss"]] + [r["eval_loss"] for r in full if "eval_loss" in r]
    assert evals[-1] < evals[0] - 0.3, evals  # nats per response token
    half = tmp_path / "half"
    _run("megatron_rlhf.train_sft", args + ["--train-iters", "2"], half)
    resumed = _run("megatron_rlhf.train_sft", args + ["--train-iters", "6", "--load", str(half)], half)
    for a, b in zip(full[2:], resumed[-4:]):
        F.assert_metrics_equal(a, b)


def test_dpo_raises_the_margin_of_the_training_pairs(tiny, tmp_path):
    rows = _run("megatron_rlhf.train_rm", ["--loss", "dpo", "--load-model", str(tiny.actor),
                                           "--data", str(DATA / "preferences.jsonl"), "--beta", "0.1",
                                           "--lr", "1e-3", "--train-iters", "8"], tmp_path / "dpo")
    assert rows[0]["margin"] == pytest.approx(0.0, abs=1e-3)  # the policy starts as its reference
    assert rows[-1]["margin"] > 1.0 and rows[-1]["accuracy"] > 0.9, rows[-1]
    assert (tmp_path / "dpo" / "iter_0000008" / "actor").is_dir()
