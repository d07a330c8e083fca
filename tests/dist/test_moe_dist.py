"""Mixture-of-experts models over several ranks (tests/dist/scripts/moe_ep.py)."""

import shutil

import pytest

import rlhf_fixtures as F
from launch import torchrun

pytestmark = pytest.mark.dist


@pytest.mark.shared_launch(2, "moe_ep.py", timeout=300)  # in the launch shared with other scripts
def test_expert_parallel_step_and_checkpoints_equal_ep1(shared_launch):
    r = shared_launch()
    assert "OK" in r.stdout


@pytest.mark.shared_launch(2, "migration.py", "moe", timeout=600)
def test_moe_speculation_with_migration_changes_no_sample(shared_launch):
    """DP=2, samples migrating mid-generation, plain / history / model drafts: the tokens of
    plain decoding on one rank (fp32)."""
    r = shared_launch()
    assert "MIGRATION OK" in r.stdout


@pytest.mark.slow
def test_grpo_at_ep2_trains_as_at_ep1(world1, tmp_path):
    """``megatron_rlhf.train`` on a tiny Mixtral, greedy GRPO with the routers' losses on: the
    training layout 1x1x2:ep2 (experts split, generation on a copy of its own, weights
    reallocated every iteration) gives the metrics of 1x1x2 (every expert on both ranks, the
    rollout's routes replayed), logs each layer's expert load and how often the trainer's
    routers disagree with the rollout's, and its checkpoint resumes at EP=1."""
    actor = F.make_actor_checkpoint(tmp_path / "actor", world1, name="tiny-mixtral")
    prompts = F.write_prompts(tmp_path / "prompts.jsonl")
    runs = {}

    def train(layout, out, **kw):
        torchrun(2, ["-m", "megatron_rlhf.train", *F.train_args(
            actor, prompts, out, advantage_estimator="grpo", kl_coef=0.0, temperature=0,
            micro_batch_size=2, train_layout=layout, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001,
            adam_eps=1e-5, **kw)], timeout=400)
        return F.read_metrics(out / "log")

    runs["1x1x2"] = train("1x1x2", tmp_path / "1x1x2", routing_replay="rollout")
    runs["1x1x2:ep2"] = train("1x1x2:ep2", tmp_path / "1x1x2_ep2", save_interval=1)
    dense, split = runs["1x1x2"], runs["1x1x2:ep2"]
    assert len(dense) == len(split) == 2
    # the EP=2 run's first checkpoint (weights and Adam states) resumed at EP=1: its second
    # iteration is the uninterrupted EP=1 run's
    first = tmp_path / "first" / "save"
    shutil.copytree(tmp_path / "1x1x2_ep2" / "save" / "iter_0000001", first / "iter_0000001")
    (first / "latest_checkpointed_iteration.txt").write_text("1")
    resumed = train("1x1x2", tmp_path / "resumed", train_iters=2, load=first,
                    routing_replay="rollout")[-1]
    assert resumed["iteration"] == 2
    for key in ("reward_mean", "policy_loss", "actor_grad_norm"):
        assert resumed[key] == pytest.approx(dense[1][key], rel=1e-4, abs=1e-6), key
    for a, b in zip(dense, split):
        for key in ("reward_mean", "response_length", "policy_loss", "actor_grad_norm",
                    "actor_moe_layer1_load_max", "actor_moe_layer2_load_min"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["iteration"], key)
        assert b["actor_moe_layer1_dropped"] == 0.0 and b["actor_moe_layer1_load_max"] >= 1.0
        # fp32, the generator's weights: its routes are the trainer's but for rounding
        assert a["routing_mismatch"] == 0.0 and a["routing_disagreement"] < 0.01
        assert b["routing_mismatch"] == b["routing_disagreement"] < 0.01
    assert "realloc_mb" in split[0] and split[0]["realloc_mb"] > 0  # the generation copy
