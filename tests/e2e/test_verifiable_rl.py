"""Verifiable-reward training end to end on a tiny random model, one process: records with
fields reach the reward function (parquet for training, json for evaluation), --filter-groups
keeps a full batch of groups whose rewards differ, and the held-out evaluation runs before
iteration 1, at the interval and after the last iteration. A user's reward composing the math
verifier reads the --answer-key field; a reward raising on every sample stops the run, loudly,
unless --tolerate-reward-errors."""

from types import SimpleNamespace

import pytest

import rlhf_fixtures as F


@pytest.fixture(scope="module")
def actor(world1, tmp_path_factory):
    return F.make_actor_checkpoint(tmp_path_factory.mktemp("actor") / "actor", world1)


@pytest.fixture(scope="module")
def run(actor, tmp_path_factory):
    d = tmp_path_factory.mktemp("verifiable")
    train = F.write_records(d / "train.parquet")
    heldout = F.write_records(d / "heldout.json", F.PROMPTS[:5])
    args = F.train_args(actor, train, d, save=None, prompt_key="text",
                        reward_fn="rlhf_fixtures:record_fields", strict_rewards=True,
                        advantage_estimator="grpo", global_batch_size=4, rollout_n=2,
                        filter_groups=True, filter_max_tries=4, train_iters=3,
                        eval_prompts=str(heldout), eval_interval=2, eval_samples=2,
                        eval_temperature=1.0, eval_threshold=0.5)
    F.check_ok(F.run_train(args))
    return SimpleNamespace(rows={m["iteration"]: m for m in F.read_metrics(d / "log")})


def test_eval_metrics_at_iteration_0_the_interval_and_the_end(run):
    assert sorted(run.rows) == [0, 1, 2, 3]
    evaluated = [it for it, m in sorted(run.rows.items()) if "eval/accuracy" in m]
    assert evaluated == [0, 2, 3]
    for it in evaluated:
        m = run.rows[it]
        assert m["eval/responses"] == 10  # 5 records x 2 samples
        assert 0 <= m["eval/accuracy"] <= m["eval/pass@2"] <= 1
        assert 0 < m["eval/response_length"] <= 6 and m["eval/reward_errors"] == 0
    assert set(run.rows[0]) == {"iteration"} | {k for k in run.rows[2] if k.startswith("eval/")}


def test_filter_groups_trains_on_a_full_batch_of_informative_groups(run):
    for it in (1, 2, 3):
        m = run.rows[it]
        assert m["filter_kept_groups"] == 4 and m["filter_filled_groups"] == 0, m
        assert m["filter_dropped_groups"] >= 1 and m["filter_rounds"] >= 2  # 5 of 16 prompts are flat
        assert m["samples"] == 8 and m["reward_errors"] == 0 and "actor_grad_norm" in m
        assert m["reward_std"] > 0


def test_a_users_reward_composing_math_reads_the_answer_key(actor, tmp_path):
    """``--prompt-key question --answer-key solution --reward-fn reward_fixtures:math_and_short``
    on a parquet task: the user's function calls the math verifier, which reads the field."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": p, "solution": str(len(p))} for p in F.PROMPTS]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "task.parquet")
    args = F.train_args(actor, tmp_path / "task.parquet", tmp_path, save=None, prompt_key="question",
                        answer_key="solution", reward_fn="reward_fixtures:math_and_short",
                        strict_rewards=True, train_iters=1)
    F.check_ok(F.run_train(args))
    assert F.read_metrics(tmp_path / "log")[0]["reward_errors"] == 0


def test_a_reward_raising_on_every_sample_stops_the_run_loudly(actor, tmp_path):
    args = F.train_args(actor, F.write_prompts(tmp_path / "p.jsonl"), tmp_path, save=None,
                        reward_fn="reward_fixtures:always_keyerror")
    r = F.run_train(args)
    assert r.returncode == 3, (r.returncode, r.stderr[-3000:])
    assert ("reward function 'reward_fixtures:always_keyerror' failed on every one of the 8 samples"
            in r.stderr)
    # the first KeyError, printed once, with its sample, prompt and traceback
    assert r.stderr.count("warning: reward function") == 1 and r.stderr.count("Traceback") == 1
    assert "raised on sample 0: KeyError: 'score'" in r.stderr and "prompt: '" in r.stderr
    assert not (tmp_path / "log").exists() or not F.read_metrics(tmp_path / "log")

    F.check_ok(F.run_train(args + ["--tolerate-reward-errors"]))
    rows = F.read_metrics(tmp_path / "log")
    assert [(m["iteration"], m["reward_errors"], m["reward_mean"]) for m in rows] == [(1, 8, 0.0), (2, 8, 0.0)]
