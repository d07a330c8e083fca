"""GRPO as DAPO / Dr. GRPO users run it: the KL loss's estimator, ratio safety (clamp,
dual clip, clip-higher), loss aggregation, overlong penalty, mini-batch reshuffling,
dynamic sampling's group filter, and the held-out metrics."""

import math

import pytest
import torch

from megatron_rlhf.config import EvalConfig, PPOConfig
from megatron_rlhf.generation.rollout import GenerationStats, Rollout
from megatron_rlhf.rlhf.batch import Experience
from megatron_rlhf.rlhf.dynamic_sampling import GroupFilter, informative_groups
from megatron_rlhf.rlhf.evaluation import eval_metrics
from megatron_rlhf.rlhf.experience import overlong_penalty
from megatron_rlhf.rlhf.kl import RATIO_LOG_CLAMP
from megatron_rlhf.rlhf.losses import policy_loss
from megatron_rlhf.rlhf.update import _mini_batches, loss_weights


# ------------------------------------------------------------------------- KL as a loss
def test_kl_loss_defaults_to_k3_and_refuses_k1_and_abs():
    assert PPOConfig(advantage_estimator="grpo").kl_estimator == "k3"
    assert PPOConfig(advantage_estimator="gae").kl_estimator == "k1"  # in the reward: unbiased
    assert PPOConfig(advantage_estimator="rloo").kl_estimator == "k1"
    with pytest.raises(ValueError, match="k1 cannot be the KL loss of grpo: its expected gradient is zero"):
        PPOConfig(advantage_estimator="grpo", kl_estimator="k1")
    with pytest.raises(ValueError, match="abs cannot be the KL loss of grpo"):
        PPOConfig(advantage_estimator="grpo", kl_estimator="abs")
    PPOConfig(advantage_estimator="grpo", kl_estimator="k1", kl_coef=0.0)  # no KL term: fine
    PPOConfig(advantage_estimator="grpo", kl_estimator="k2")


def test_bad_options_are_refused():
    import re

    from megatron_rlhf.flags import cli_message

    for kw, msg in [(dict(dual_clip=1.0), "--dual-clip 1.0 must be > 1"),
                    (dict(clip_eps_low=1.0), "lower ratio clip 1.0 must be < 1"),
                    (dict(clip_eps_high=0.0), "--clip-eps-high must be > 0"),
                    (dict(loss_agg="sum"), "unknown --loss-agg 'sum'"),
                    (dict(filter_groups=True, rollout_n=1), "--filter-groups .* --rollout-n >= 2"),
                    (dict(overlong_buffer=-1), "--overlong-buffer -1"),
                    (dict(grpo_std_norm=False), "--no-grpo-std-norm changes grpo's advantages; the "
                     "advantage estimator is gae: drop the flag or use --advantage-estimator grpo")]:
        with pytest.raises(ValueError) as e:  # the message names fields; the CLI's, flags
            PPOConfig(**kw)
        assert re.search(msg, cli_message(e.value)), cli_message(e.value)
    with pytest.raises(ValueError, match="greedy responses would all be the same"):
        EvalConfig(eval_samples=4)


def test_an_overlong_buffer_past_the_length_limit_is_refused():
    """A buffer longer than --max-new-tokens starts the penalty before the first token: every
    response would be punished. Refused by the config check the plan runs, and by the
    experience maker; a buffer of the whole limit is allowed (verl's bound)."""
    from megatron_rlhf.config import GenerationConfig, RewardConfig
    from megatron_rlhf.flags import cli_message
    from megatron_rlhf.rlhf.experience import ExperienceMaker

    cfg = PPOConfig(overlong_buffer=40)
    with pytest.raises(ValueError) as e:
        cfg.check_generation(32)
    assert cli_message(e.value).startswith(
        "--overlong-buffer 40 exceeds --max-new-tokens 32: the penalty would start before the first token")
    cfg.check_generation(40)
    reward = RewardConfig(reward_workers=0)
    with pytest.raises(ValueError, match="overlong_buffer 40 exceeds max_new_tokens 32"):
        ExperienceMaker(cfg, None, reward_fn="token_parity", reward=reward,
                        gen=GenerationConfig(max_new_tokens=32))
    with pytest.raises(ValueError, match="give the generation settings"):
        ExperienceMaker(cfg, None, reward_fn="token_parity", reward=reward)
    ExperienceMaker(cfg, None, reward_fn="token_parity", reward=reward, gen=GenerationConfig(max_new_tokens=40))


# ------------------------------------------------------------------------- ratio safety
def test_clip_higher_bounds_the_ratio_asymmetrically():
    cfg = PPOConfig(clip_eps=0.2, clip_eps_high=0.28)
    assert (cfg.clip_low, cfg.clip_high) == (0.2, 0.28)
    logp = torch.log(torch.tensor([[1.5, 1.25, 0.5]]))
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    loss, clipped = policy_loss(logp, old, adv, cfg.clip_low, cfg.clip_high)
    # A > 0: the ratio 1.5 is capped at 1.28 (not 1.2), 1.25 is inside; A < 0: 0.5 -> 0.8
    assert torch.allclose(loss, torch.tensor([[-1.28, -1.25, 0.8]]))
    assert clipped.tolist() == [[True, False, True]]


def test_dual_clip_caps_negative_advantages():
    logp = torch.log(torch.tensor([[10.0, 10.0, 2.0, 10.0]]))
    old = torch.zeros(1, 4)
    adv = torch.tensor([[-2.0, 1.5, -0.5, -0.5]])
    loss, clipped = policy_loss(logp, old, adv, 0.2, dual_clip=3.0)
    # ratio 10 with A = -2: max(20, 2.4) = 20, capped at -A C = 6 (not C = 3); with A > 0
    # untouched (-1.5 x 1.2); ratio 2 < C: 1.0 stays; ratio 10 with A = -0.5: 5 capped at 1.5
    assert torch.allclose(loss, torch.tensor([[6.0, -1.8, 1.0, 1.5]]))
    assert clipped.tolist() == [[True, True, False, True]]
    plain, _ = policy_loss(logp, old, adv, 0.2)
    assert plain[0, 0] == 20.0 and plain[0, 3] == 5.0  # the cap is what changed them


def test_log_ratio_is_clamped_before_exp():
    logp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-1000.0, 1000.0]])
    loss, _ = policy_loss(logp, old, torch.tensor([[-1.0, 1.0]]), 0.2)
    assert torch.isfinite(loss).all()
    assert float(loss[0, 0].detach()) == pytest.approx(math.exp(RATIO_LOG_CLAMP))
    loss.sum().backward()
    assert torch.isfinite(logp.grad).all()


# ------------------------------------------------------------------------- aggregation
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.float32)


def _aggregate(per_token, agg, horizon=None):
    return float((per_token * loss_weights(MASK, agg, None, horizon)).sum())


def test_loss_aggregations_match_their_definitions():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 7.0, 99.0, 99.0], [6.0, 99.0, 99.0, 99.0]])
    assert _aggregate(x, "token-mean") == pytest.approx((1 + 2 + 3 + 4 + 5 + 7 + 6) / 7)
    assert _aggregate(x, "seq-mean-token-mean") == pytest.approx((2.5 + 6.0 + 6.0) / 3)
    assert _aggregate(x, "seq-mean-token-sum") == pytest.approx((10 + 12 + 6) / 3)
    assert _aggregate(x, "seq-mean-token-sum-norm", horizon=8) == pytest.approx((10 + 12 + 6) / 8 / 3)
    with pytest.raises(ValueError, match="horizon"):
        loss_weights(MASK, "seq-mean-token-sum-norm", None)


def test_seq_mean_weights_short_responses_more_per_token():
    tm = loss_weights(MASK, "token-mean", None)
    sm = loss_weights(MASK, "seq-mean-token-mean", None)
    assert torch.allclose(tm[MASK.bool()], torch.full((7,), 1 / 7))
    assert sm[2, 0] == pytest.approx(1 / 3) and sm[0, 0] == pytest.approx(1 / 12)
    assert (sm[~MASK.bool()] == 0).all()


# ------------------------------------------------------------------------- overlong
def test_overlong_penalty_is_soft_and_linear():
    lengths = torch.tensor([10, 24, 28, 32])
    p = overlong_penalty(lengths, limit=32, buffer=8, penalty=0.5)
    assert p.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5])


# ------------------------------------------------------------------------- reshuffle
def _exp(n):
    ids = torch.arange(n)[:, None].repeat(1, 3)
    mask = torch.ones(n, 2)
    z = torch.zeros(n, 2)
    return Experience(input_ids=ids, attention_mask=torch.ones(n, 3), response_mask=mask, old_logprobs=z,
                      ref_logprobs=z, scores=torch.zeros(n), kl=z, advantages=z)


def test_mini_batches_reshuffled_per_epoch_seeded():
    cfg = PPOConfig(num_mini_batches=2, ppo_epochs=2)
    exp = _exp(8)

    def order(epoch, seed):
        return [mb.input_ids[:, 0].tolist() for mb in _mini_batches(exp, cfg, epoch, seed)]

    assert order(0, 5) == order(0, 5)  # seeded
    assert order(0, 5) != order(1, 5)  # a new order each epoch
    assert sorted(sum(order(1, 5), [])) == list(range(8))  # every sample once
    assert order(0, None) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    one = PPOConfig(num_mini_batches=1)
    assert [mb.batch_size for mb in _mini_batches(exp, one, 1, 5)] == [8]


# ------------------------------------------------------------------------- dynamic sampling
def _rollout(lengths, fill):
    t = max(lengths)
    resp = torch.stack([torch.tensor([fill + i] * n + [0] * (t - n)) for i, n in enumerate(lengths)])
    lp = -torch.ones(len(lengths), t) * (resp != 0)
    return Rollout(prompt_ids=[[fill + i] for i in range(len(lengths))], response_ids=resp,
                   response_logprobs=lp, sampling_logprobs=lp, lengths=torch.tensor(lengths),
                   finish_reasons=["eos"] * len(lengths),
                   stats=GenerationStats(new_tokens=sum(lengths), elapsed_s=1.0))


def test_informative_groups():
    assert informative_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), 2) == [False, True, False]


def test_group_filter_keeps_informative_groups_and_fills_a_full_batch():
    f = GroupFilter(need=2, n=2)
    r1 = _rollout([2, 3, 1, 4], fill=10)  # groups: (10, 11) equal rewards, (12, 13) informative
    f.add(r1, torch.tensor([1.0, 1.0, 0.0, 1.0]), ([[10]] * 4, list("abcd"), [0, 1, 2, 3], [{}] * 4))
    assert f.short == 1
    r2 = _rollout([5, 2, 3, 3], fill=20)  # (20, 21) informative, (22, 23) equal
    f.add(r2, torch.tensor([0.0, 0.5, 0.0, 0.0]), ([[20]] * 4, list("efgh"), [8, 9, 10, 11], [{}] * 4))
    assert f.short == 0
    rollout, scores, (ids, texts, sids, metas), counts = f.batch(pad_id=0)
    assert sids == [2, 3, 8, 9] and texts == list("cdef")
    assert scores.tolist() == [0.0, 1.0, 0.0, 0.5]
    assert rollout.lengths.tolist() == [1, 4, 5, 2]
    assert rollout.response_ids[0].tolist() == [12, 0, 0, 0, 0] and rollout.response_ids[2].tolist() == [20] * 5
    assert rollout.stats.new_tokens == 10 + 13  # both rounds were generated
    assert counts == {"filter_kept_groups": 2.0, "filter_dropped_groups": 2.0, "filter_filled_groups": 0.0}

    short = GroupFilter(need=2, n=2)
    short.add(r1, torch.tensor([1.0, 1.0, 0.0, 1.0]), ([[10]] * 4, list("abcd"), [0, 1, 2, 3], [{}] * 4))
    rollout, scores, cols, counts = short.batch(pad_id=0)
    assert cols[2] == [2, 3, 0, 1] and len(rollout.finish_reasons) == 4  # topped up: still full
    assert scores.tolist() == [0.0, 1.0, 1.0, 1.0] and counts["filter_filled_groups"] == 1.0


# ------------------------------------------------------------------------- eval metrics
def test_eval_metrics_accuracy_and_pass_at_k():
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])  # 3 records x K=2
    lengths = torch.tensor([4, 6, 8, 2, 3, 1])
    out = eval_metrics(scores, lengths, 2, 1.0, None)
    assert out["eval/accuracy"] == pytest.approx(3 / 6)
    assert out["eval/pass@2"] == pytest.approx(2 / 3)
    assert out["eval/reward_mean"] == pytest.approx(0.5)
    assert out["eval/response_length"] == pytest.approx(4.0)
    assert "eval/pass@1" not in eval_metrics(scores, lengths, 1, 0.5, None)


def test_eval_schedule():
    cfg = EvalConfig(eval_interval=3)
    assert [it for it in range(0, 11) if cfg.due(it, 10)] == [0, 3, 6, 9, 10]
    assert [it for it in range(0, 5) if EvalConfig().due(it, 4)] == [0, 4]


# ------------------------------------------------------------------------- records -> reward
@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_record_fields_reach_a_users_reward_function_unchanged(tmp_path, suffix):
    """Every field of a record but the prompt arrives as ``RewardInput.meta``, equal to what
    the file holds (``rlhf_fixtures:record_fields`` raises otherwise: strict, so it fails)."""
    import rlhf_fixtures as F
    from megatron_rlhf.config import RewardConfig
    from megatron_rlhf.data.prompts import load_prompts
    from megatron_rlhf.rlhf.experience import ExperienceMaker

    records = load_prompts(F.write_records(tmp_path / f"r{suffix}", F.PROMPTS[:4]), key="text")
    cfg = PPOConfig(global_batch_size=4, rollout_n=1)
    maker = ExperienceMaker(cfg, None, reward_fn="rlhf_fixtures:record_fields",
                            reward=RewardConfig(strict_rewards=True, reward_workers=0))
    rollout = _rollout([3, 2, 4, 1], fill=4)  # even ids 4, 6: parity 1 or 0 per row
    scores = maker.score([[1]] * 4, [r.prompt for r in records], rollout, 0, [r.meta for r in records])
    flat = [r.meta["flat"] for r in records]
    assert flat == [True, True, False, False]
    assert scores.tolist() == [0.5, 0.5, 1.0, 0.0]
    assert maker.take_reward_stats() == {"reward_errors": 0, "reward_timeouts": 0}
    wrong = [dict(r.meta, info={"p": "?", "n": [1, 2]}) for r in records]
    from megatron_rlhf.rlhf.rewards import RewardError
    with pytest.raises(RewardError, match="record fields"):
        maker.score([[1]] * 4, [r.prompt for r in records], rollout, 0, wrong)


# ------------------------------------------------------------------------- W&B logging
class _FakeWandb:
    """Stands in for the optional ``wandb`` package: records init kwargs and logged rows."""

    def __init__(self, fail_online=False):
        self.inits, self.rows, self.finished, self.fail_online = [], [], 0, fail_online

    def init(self, **kw):
        if kw["mode"] == "online" and self.fail_online:
            raise OSError("no network")
        self.inits.append(kw)
        return self

    def log(self, row, step):
        self.rows.append((step, row))

    def finish(self):
        self.finished += 1


def test_wandb_gets_every_numeric_metric_offline_without_credentials(tmp_path, monkeypatch):
    import sys

    from megatron_rlhf.rlhf.metrics import MetricsLog, wandb_mode

    fake = _FakeWandb(fail_online=True)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login
    assert wandb_mode() == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x")
    assert wandb_mode() == "online"
    log = MetricsLog(str(tmp_path / "log"), True, wandb_project="p", config={"seed": 1})
    assert [i["mode"] for i in fake.inits] == ["offline"]  # online failed: offline instead
    assert fake.inits[0]["project"] == "p" and fake.inits[0]["config"] == {"seed": 1}
    log.write(0, {"eval/accuracy": 0.25, "gen_rounds_by_draft_len": [1, 2]})
    log.write(1, {"reward_mean": 0.5, "samples": 8})
    log.close()
    assert fake.rows == [(0, {"eval/accuracy": 0.25}), (1, {"reward_mean": 0.5, "samples": 8})]
    assert fake.finished == 1
    assert len(_lines(tmp_path / "log" / "metrics.jsonl")) == 2
    other = MetricsLog(str(tmp_path / "log2"), False, wandb_project="p")  # not rank 0: no run
    assert other.wandb is None and len(fake.inits) == 1


def _lines(path):
    return [line for line in path.read_text().splitlines() if line.strip()]
