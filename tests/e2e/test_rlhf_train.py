"""``python -m megatron_rlhf.train`` end to end on a tiny random model, one process:
it learns a rule reward (GAE and GRPO), resumes exactly (also after a kill mid-save), and
stops with exit code 3 when the reward function fails."""

import signal
from types import SimpleNamespace

import pytest

import rlhf_fixtures as F
from megatron_rlhf.data.sampler import batch_indices


@pytest.fixture(scope="module")
def tiny(world1, tmp_path_factory):
    d = tmp_path_factory.mktemp("rlhf")
    return SimpleNamespace(dir=d, actor=F.make_actor_checkpoint(d / "actor", world1),
                           prompts=F.write_prompts(d / "prompts.jsonl"))


# ---------------------------------------------------------------------------- learning
# token_parity (fraction of even token ids) starts near 0.5 for a random model. Observed
# with these settings (mean reward of the last 3 minus the first 3 of 12 iterations), seeds
# 1-5: gae 0.43 0.43 0.38 0.26 0.37, grpo 0.38 0.38 0.39 0.35 0.43 (last-3 mean >= 0.83).
LEARN = dict(reward_fn="token_parity", global_batch_size=8, rollout_n=4, micro_batch_size=8,
             max_new_tokens=8, lr=1e-2, critic_lr=1e-2, kl_coef=0.01, train_iters=12, seed=1)


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_learns_rule_reward(tiny, tmp_path, estimator):
    F.check_ok(F.run_train(F.train_args(tiny.actor, tiny.prompts, tmp_path, save=None,
                                        advantage_estimator=estimator, **LEARN)))
    rows = F.read_metrics(tmp_path / "log")
    assert [m["iteration"] for m in rows] == list(range(1, 13))
    rewards = [m["reward_mean"] for m in rows]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.15 and last > 0.7, f"{estimator} did not learn: {rewards}"
    if estimator == "gae":
        assert all("value_loss" in m for m in rows)
    else:
        assert not any("value_loss" in m for m in rows)


# ---------------------------------------------------------------------------- resume
# Sampling at temperature 1, a fixed LR schedule (--lr-decay-iters, so a run cut short at
# --train-iters 2 follows the same schedule), GAE so the critic's state is resumed too.
RESUME = dict(temperature=1.0, lr_decay_iters=4, advantage_estimator="gae", seed=7)


@pytest.fixture(scope="module")
def uninterrupted(tiny):
    """Run A: 4 iterations in one go; its metrics by iteration."""
    out = tiny.dir / "run_a"
    F.check_ok(F.run_train(F.train_args(tiny.actor, tiny.prompts, out, save=None,
                                        train_iters=4, **RESUME)))
    rows = F.read_metrics(out / "log")
    assert [m["iteration"] for m in rows] == [1, 2, 3, 4]
    return {m["iteration"]: m for m in rows}


def _iterations(rows):
    return [m["iteration"] for m in rows]


def test_resume_repeats_the_uninterrupted_run(tiny, tmp_path, uninterrupted):
    args = F.train_args(tiny.actor, tiny.prompts, tmp_path, train_iters=None, **RESUME)
    assert "precision: fp32 (--fp32)" in F.check_ok(F.run_train(args + ["--train-iters", "2"])).stderr
    save = tmp_path / "save"
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    for part in ("actor", "critic", "trainer"):
        assert (save / "iter_0000002" / part).is_dir(), part

    # a checkpoint is resumed only forwards, and one of the hand-written optimizer's days
    # (no LR schedules in its state.json, optim_tp000.pt) is refused with the way forward
    legacy = _as_legacy_checkpoint(save / "iter_0000002", tmp_path / "legacy")
    bad = F.run_validation([(args + ["--train-iters", "2", "--load", str(save)], 1),
                            (args + ["--train-iters", "4", "--load", str(legacy)], 1)])
    assert bad[0]["code"] == 2, bad[0]
    assert "is at iteration 2: raise --train-iters" in bad[0]["output"], bad[0]
    assert bad[1]["code"] == 2 and "before training moved to megatron's optimizer" in bad[1]["output"]
    assert f"--actor-load {legacy / 'actor'}" in bad[1]["output"], bad[1]

    # megatron's optimizer states (dist_checkpointing, any layout), RNG states per rank
    trainer = save / "iter_0000002" / "trainer"
    assert sorted(p.name for p in trainer.iterdir()) == [
        "optim_actor", "optim_critic", "rng_00000.pt", "state.json"]
    assert (trainer / "optim_actor" / "metadata.json").is_file()

    # resumed without --fp32: the run's own precision (fp32), whatever this CPU would choose
    resume = [a for a in args if a != "--fp32"] + ["--train-iters", "4", "--load", str(save)]
    r = F.check_ok(F.run_train(resume))
    assert f"precision: fp32 (the resumed run's, as its checkpoint {save / 'iter_0000002' / 'actor'} holds)" in r.stderr
    rows = F.read_metrics(tmp_path / "log")
    assert _iterations(rows) == [1, 2, 3, 4]
    for m in rows:
        F.assert_metrics_equal(m, uninterrupted[m["iteration"]])
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "4"


def test_history_drafts_change_no_sample_and_need_no_restoring(tiny, tmp_path, uninterrupted):
    """Rollouts drafted from the rollout history (3 drafts every round, verified exactly)
    give the run without drafts its metrics: rewards, KL, losses and gradient norms, so the
    samples and the updates are the same. Stopped after 2 iterations and resumed, the run's
    history starts empty (it is not checkpointed): only the drafting statistics differ."""
    args = F.train_args(tiny.actor, tiny.prompts, tmp_path, train_iters=None, **RESUME,
                        draft_source="history", num_draft_tokens=3)
    F.check_ok(F.run_train(args + ["--train-iters", "2"]))
    F.check_ok(F.run_train(args + ["--train-iters", "4", "--load", str(tmp_path / "save")]))
    rows = F.read_metrics(tmp_path / "log")
    assert _iterations(rows) == [1, 2, 3, 4]
    drafting = ("gen_", "accepted_length")
    assert sum(m["gen_history_accepted_length"] > 1.0 for m in rows) >= 3, rows  # drafts were taken
    for m in rows:
        F.assert_metrics_equal({k: v for k, v in m.items() if not k.startswith(drafting)},
                               {k: v for k, v in uninterrupted[m["iteration"]].items() if not k.startswith(drafting)})


def _as_legacy_checkpoint(src, dst):
    """A copy of ``src`` as the hand-written optimizer wrote it: optim_tp000.pt, and a
    state.json without LR schedules."""
    import json
    import shutil

    shutil.copytree(src, dst)
    trainer = dst / "trainer"
    for d in ("optim_actor", "optim_critic"):
        shutil.rmtree(trainer / d)
    (trainer / "optim_tp000.pt").write_bytes(b"old")
    meta = json.loads((trainer / "state.json").read_text())
    del meta["schedulers"]
    meta["files"] = {p.name: p.stat().st_size for p in trainer.iterdir() if p.name != "state.json"}
    (trainer / "state.json").write_text(json.dumps(meta))
    return dst


def test_killed_mid_save_resumes_from_the_last_complete_checkpoint(tiny, tmp_path, uninterrupted):
    args = F.train_args(tiny.actor, tiny.prompts, tmp_path, train_iters=3, save_interval=1,
                        **RESUME)
    r = F.run_train(args, MEGATRON_RLHF_TEST_KILL_IN_SAVE="2")
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr[-3000:])
    save = tmp_path / "save"
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert (save / "iter_0000001" / "trainer" / "state.json").is_file()
    assert not (save / "iter_0000002").exists() and (save / "iter_0000002.tmp").is_dir()
    assert _iterations(F.read_metrics(tmp_path / "log")) == [1, 2]  # 2 was logged, not saved

    F.check_ok(F.run_train(args + ["--load", str(save), "--keep-last-checkpoints", "2"]))
    rows = F.read_metrics(tmp_path / "log")
    assert _iterations(rows) == [1, 2, 3]
    for m in rows:
        F.assert_metrics_equal(m, uninterrupted[m["iteration"]])
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert (save / "iter_0000002" / "trainer" / "state.json").is_file()
    assert not (save / "iter_0000002.tmp").exists()  # the torn save was redone
    # --keep-last-checkpoints 2: iteration 1 went once 3 was committed
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000002", "iter_0000003"]


# ---------------------------------------------------------------------------- reward errors
@pytest.mark.parametrize("fn,message", [
    ("nan_reward", "returned nan for sample {i}; rewards must be finite numbers"),
    ("raise_on_boom", "raised on sample {i}: ValueError: boom prompt seen"),
], ids=["nan", "raises"])
def test_failing_reward_stops_a_strict_run(tiny, tmp_path, fn, message):
    prompts = ["ab", "cde", "boom", "fghi"]
    seed, n = 7, 2
    order = batch_indices(len(prompts), 4, 1, seed)  # iteration 1 takes all four
    i = order.index(prompts.index("boom")) * n  # the first sample of "boom" in the batch
    args = F.train_args(tiny.actor, F.write_prompts(tmp_path / "p.jsonl", prompts), tmp_path,
                        reward_fn=f"rlhf_fixtures:{fn}", global_batch_size=4, rollout_n=n,
                        seed=seed, save_interval=1, strict_rewards=True)
    r = F.run_train(args)
    assert r.returncode == 3, (r.returncode, r.stderr[-3000:])
    assert f"error: rank 0: reward function 'rlhf_fixtures:{fn}' " + message.format(i=i) in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "save" / "latest_checkpointed_iteration.txt").exists()


def test_failing_reward_scores_zero_and_is_counted(tiny, tmp_path):
    """Without --strict-rewards a crash costs its sample (reward 0), not the run."""
    prompts = ["ab", "cde", "boom", "fghi"]
    args = F.train_args(tiny.actor, F.write_prompts(tmp_path / "p.jsonl", prompts), tmp_path,
                        reward_fn="rlhf_fixtures:raise_on_boom", global_batch_size=4, rollout_n=2,
                        save=None)
    F.check_ok(F.run_train(args))
    rows = F.read_metrics(tmp_path / "log")
    assert [(m["reward_errors"], m["reward_timeouts"]) for m in rows] == [(2, 0), (2, 0)]


# ---------------------------------------------------------------------------- reward model
def test_reward_model_scores_the_rollouts(world1, tiny, tmp_path):
    import torch

    from megatron_rlhf.config import preset
    from megatron_rlhf.models.builder import build_model
    from megatron_rlhf.models.checkpoint import save_checkpoint

    cfg = preset("tiny", vocab_size=F.VOCAB, max_position_embeddings=F.POSITIONS)
    rm = build_model(cfg, "reward", world1, dtype=torch.float32, seed=5)
    torch.nn.init.normal_(rm.output_layer.weight)  # zero-initialised otherwise
    save_checkpoint(tmp_path / "rm", 0, rm, world1)
    args = F.train_args(tiny.actor, tiny.prompts, tmp_path, reward_fn=None,
                        reward_load=str(tmp_path / "rm"), train_iters=2)
    F.check_ok(F.run_train(args))
    rows = F.read_metrics(tmp_path / "log")
    assert [m["iteration"] for m in rows] == [1, 2]
    assert all(m["reward_std"] > 0 for m in rows), rows  # scores vary with the samples

    # an LM checkpoint is not a reward model
    bad = F.run_validation([(F.train_args(tiny.actor, tiny.prompts, tmp_path, reward_fn=None,
                                          reward_load=str(tiny.actor)), 1)])
    assert bad[0]["code"] == 2 and "holds a model of role 'actor'; a reward model has a scalar head" in bad[0]["output"], bad[0]


# ---------------------------------------------------------------------------- old log-probs
def test_recomputed_old_logprobs_match_generation(tiny, tmp_path):
    """In fp32 the generator's log-probs equal a training forward's (within 1e-4, tested in
    the generation tests), so recomputing pi_old must not change the run; the recomputing run
    logs that train-inference mismatch, near 0."""
    runs = {}
    for flag in ("--recompute-logprobs", "--no-recompute-logprobs"):
        out = tmp_path / flag.strip("-")
        args = F.train_args(tiny.actor, tiny.prompts, out, save=None, advantage_estimator="gae",
                            train_iters=2, seed=11)
        F.check_ok(F.run_train(args + [flag]))
        runs[flag] = F.read_metrics(out / "log")
    for a, b in zip(runs["--recompute-logprobs"], runs["--no-recompute-logprobs"]):
        mismatch = {k: a.pop(k) for k in list(a) if k.startswith("mismatch_")}
        assert sorted(mismatch) == ["mismatch_k3", "mismatch_logprob_abs_max", "mismatch_logprob_abs_mean"]
        assert mismatch["mismatch_logprob_abs_max"] < 1e-4 and mismatch["mismatch_k3"] < 1e-8, mismatch
        F.assert_metrics_equal(a, b, tol=1e-4)


# ---------------------------------------------------------------------------- draft in the loop
@pytest.mark.parametrize("feature", [False, True])
def test_draft_distilled_in_the_loop(world1, tiny, tmp_path, feature):
    """Speculative rollouts with a draft (standalone, or a feature draft reading the actor's
    hidden states) that is distilled every iteration: the draft's distillation loss is
    logged and the saved draft differs from the initial one."""
    import torch

    from megatron_rlhf.config import preset
    from megatron_rlhf.models.builder import build_model
    from megatron_rlhf.models.checkpoint import load_checkpoint, save_checkpoint

    cfg = preset("tiny", vocab_size=F.VOCAB, max_position_embeddings=F.POSITIONS,
                 num_layers=1, feature_draft=feature)
    draft = build_model(cfg, "draft", world1, dtype=torch.float32, seed=3)
    save_checkpoint(tmp_path / "draft", 0, draft, world1)
    args = F.train_args(tiny.actor, tiny.prompts, tmp_path, draft_load=str(tmp_path / "draft"),
                        num_draft_tokens=2, draft_distill=True, draft_lr=1e-2, train_iters=2)
    F.check_ok(F.run_train(args))
    rows = F.read_metrics(tmp_path / "log")
    assert all(m["draft_kl"] > 0 and "time_draft_s" in m for m in rows), rows
    assert all(("draft_feature_loss" in m) == feature for m in rows)
    assert all(m["accepted_length"] >= 1.0 for m in rows)
    trained = build_model(cfg, "draft", world1, dtype=torch.float32, seed=4)
    load_checkpoint(trained, world1, tmp_path / "save" / "iter_0000002" / "draft")
    moved = max((a - b).abs().max().item()
                for a, b in zip(trained.parameters(), draft.parameters()))
    assert moved > 1e-4, moved
