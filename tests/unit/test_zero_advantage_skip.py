"""The actor update's skip of responses whose advantages are all exactly 0
(``--skip-zero-advantage``, on by default where nothing else gives them a loss).

- one GRPO step (two PPO epochs, so the second has ratios != 1 and clipping) with half the
  groups at zero advantage gives bitwise the same weights with the skip on and off, for each
  loss aggregation; a sabotage that drops the skipped rows from the weights' normalisers
  changes them;
- a mini-batch of zero advantages only still runs one micro-batch (the DP gradient reduction
  happens in a backward) and changes nothing either;
- the skip applies only without an entropy bonus or a KL loss term;
- the experience's log pi_old forward leaves out the rows the update skips.

Each with padded micro-batches of 2 rows and packed ones (``max_tokens_per_micro_batch`` 0 and
unset). Tiny model (vocabulary 32) in one process.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rlhf.config import OptimConfig, PPOConfig, preset
from megatron_rlhf.rlhf import update
from megatron_rlhf.rlhf.advantages import grpo_advantages

VOCAB = 32
HORIZON = 7
# 4 groups of 2 with very uneven lengths, so that the zero-advantage rows (groups 1 and 3,
# equal rewards) interleave with the others in length order
PROMPT_LENS = [2, 1, 4, 3, 1, 2, 3, 4]
RESPONSE_LENS = [6, 5, 1, 7, 3, 1, 6, 2]
SCORES = [1.0, 0.0, 0.5, 0.5, 0.0, 1.0, 0.0, 0.0]
ZERO_ROWS = torch.tensor([False, False, True, True, False, False, True, True])


def _actor(pg):
    from megatron_rlhf.models.builder import build_model

    cfg = preset("tiny", vocab_size=VOCAB, max_position_embeddings=32)
    return build_model(cfg, "actor", pg, dtype=torch.float32, seed=3)


def _experience(actor, scores, near_actor: bool = True):
    """The 8 samples with GRPO's advantages of ``scores`` and old log-probs near the actor's
    (or, where a stage has no logits, near -2)."""
    from megatron_rlhf.rlhf.batch import Experience, pack

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
    responses = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in RESPONSE_LENS]
    ids, att, mask = pack(prompts, responses, pad_id=0, device="cpu")
    B, T = mask.shape
    z = torch.zeros(B, T)
    exp = Experience(input_ids=ids, attention_mask=att, response_mask=mask, old_logprobs=z, ref_logprobs=z,
                     scores=torch.tensor(scores), kl=z, advantages=z)
    logp = torch.full((B, T), -2.0)
    if near_actor:
        with torch.no_grad():
            logp, _ = update.policy_forward(actor, exp)
    exp.old_logprobs = (logp + 0.3 * torch.randn(B, T, generator=g)) * mask  # some ratios clipped
    exp.advantages = grpo_advantages(exp.scores, 2, mask)
    return exp


def _train(pg, cfg: PPOConfig, scores=SCORES) -> tuple[dict, dict]:
    """(the weights after :func:`update.train_actor`, its metrics) from the same start."""
    from megatron_rlhf.rlhf.optim import build_trainee

    actor = _actor(pg)
    exp = _experience(actor, scores)
    t = build_trainee(actor, pg, OptimConfig(lr=1e-2, clip_grad=0.0, use_distributed_optimizer=False), 1e-2)
    metrics = update.train_actor(t, exp, cfg, horizon=HORIZON)
    return {n: p.detach().clone() for n, p in actor.named_parameters()}, metrics


def _cfg(agg: str, skip: bool, budget: int | None = 0, **kw) -> PPOConfig:
    return PPOConfig(advantage_estimator="grpo", kl_coef=0.0, global_batch_size=4, rollout_n=2,
                     micro_batch_size=2, ppo_epochs=2, dual_clip=3.0, loss_agg=agg,
                     skip_zero_advantage=skip, max_tokens_per_micro_batch=budget, **kw)


def _differing(a: dict, b: dict) -> list[str]:
    return [n for n in a if not torch.equal(a[n], b[n])]


@pytest.mark.parametrize("budget", [0, None], ids=["padded", "packed"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_skipping_zero_advantage_groups_changes_no_weight(world1, agg, budget, monkeypatch):
    start = {n: p.detach().clone() for n, p in _actor(world1).named_parameters()}
    exp = _experience(_actor(world1), SCORES)
    zero = ((exp.advantages == 0) | (exp.response_mask == 0)).all(-1)
    assert zero.tolist() == ZERO_ROWS.tolist()  # GRPO gives the equal-reward groups exact zeros

    off, m_off = _train(world1, _cfg(agg, skip=False, budget=budget))
    on, m_on = _train(world1, _cfg(agg, skip=True, budget=budget))
    assert _differing(start, off), "the step must move the weights"
    assert not _differing(on, off), f"{agg}: skipping changed {_differing(on, off)}"
    # the 4 zero rows fill the last micro-batches (padded: two of 2 rows; packed: their own),
    # which are left out
    assert m_on["skipped_fraction"] == 0.5 and m_off["skipped_fraction"] == 0.0
    for name in ("policy_loss", "clip_frac", "actor_grad_norm"):  # (they count the skipped tokens)
        assert m_on[name] == m_off[name], name
    assert m_on["clip_frac"] > 0  # the second epoch clips

    # Sabotage: the normalisers of the weights count the rows that are run only.
    real = update.loss_weights

    def without_skipped(mask, agg, group, horizon=None):
        w = torch.zeros_like(mask, dtype=torch.float32)
        w[~ZERO_ROWS] = real(mask[~ZERO_ROWS], agg, group, horizon)
        return w

    monkeypatch.setattr(update, "loss_weights", without_skipped)
    wrong, m_wrong = _train(world1, _cfg(agg, skip=True, budget=budget))
    assert _differing(wrong, off), f"{agg}: dropping the skipped rows from the normaliser went unseen"
    assert m_wrong["actor_grad_norm"] > m_off["actor_grad_norm"] * 1.2


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_dropping_zero_advantage_rows_trains_as_the_batch_without_them(world1, agg):
    """--drop-zero-advantage: the normalisers count only the rows with an advantage, so the
    step is the one on those rows alone (fp32 reduction order: 1e-5 of the step), and not the
    step that keeps the others in the count."""
    from megatron_rlhf.rlhf.optim import build_trainee

    def step(cfg, rows):
        actor = _actor(world1)
        exp = _experience(actor, SCORES).select(rows)
        t = build_trainee(actor, world1, OptimConfig(lr=1e-2, clip_grad=0.0, use_distributed_optimizer=False), 1e-2)
        update.train_actor(t, exp, cfg, horizon=HORIZON)
        return {n: p.detach().clone() for n, p in actor.named_parameters()}

    start = {n: p.detach().clone() for n, p in _actor(world1).named_parameters()}
    every, informative = torch.arange(8), (~ZERO_ROWS).nonzero().flatten()
    dropped = step(_cfg(agg, skip=True, drop_zero_advantage=True), every)
    alone = step(_cfg(agg, skip=True), informative)
    kept = step(_cfg(agg, skip=True), every)
    for n, w in alone.items():
        size = (w - start[n]).abs().max()
        assert (dropped[n] - w).abs().max() <= 1e-5 * size + 1e-7, n
    assert _differing(dropped, kept)


@pytest.mark.parametrize("budget", [0, None], ids=["padded", "packed"])
def test_a_mini_batch_of_zero_advantages_only_runs_one_micro_batch(world1, budget, monkeypatch):
    from megatron_rlhf.rlhf.batch import model_micro_batches

    actor = _actor(world1)
    parts = model_micro_batches(actor, _experience(actor, [0.5] * 8), 2, budget)[0]
    assert len(parts) == 4 if budget == 0 else 1 < len(parts) < 4  # (packed: fewer, not one)
    runs = []
    forward_backward = update.forward_backward
    monkeypatch.setattr(update, "forward_backward",
                        lambda model, mbs, *a: runs.append(len(mbs)) or forward_backward(model, mbs, *a))
    off, _ = _train(world1, _cfg("token-mean", skip=False, budget=budget), scores=[0.5] * 8)
    on, m_on = _train(world1, _cfg("token-mean", skip=True, budget=budget), scores=[0.5] * 8)
    assert runs == [len(parts)] * 2 + [1, 1]  # two epochs, skip off then on
    assert not _differing(on, off)
    assert m_on["skipped_fraction"] == 1 - parts[-1].batch_size / 8  # the shortest runs


def test_micro_batches_put_the_rows_flagged_last_each_longest_first(world1):
    exp = _experience(_actor(world1), SCORES)
    parts, order = exp.micro_batches(2, last=ZERO_ROWS)
    lengths = torch.tensor(RESPONSE_LENS)
    assert ZERO_ROWS[order].tolist() == [False] * 4 + [True] * 4
    for flag in (False, True):
        of_kind = lengths[order][ZERO_ROWS[order] == flag].tolist()
        assert of_kind == sorted(of_kind, reverse=True)
    assert [p.response_mask.shape[1] for p in parts] == [6, 3, 7, 2]  # each cut to its rows
    assert exp.micro_batches(2)[1].tolist() == exp.micro_batches(2, last=torch.zeros(8, dtype=torch.bool))[1].tolist()


@pytest.mark.parametrize("score", [0.1, 0.3, 0.7, 1 / 3, 2.2])
def test_groups_of_equal_rewards_get_exactly_zero_advantages(score):
    """The skip's trigger: a float mean of 7 equal scores can be an ulp off, which GRPO's
    division by std + eps (= eps) made an advantage of ~1e-2."""
    from megatron_rlhf.rlhf.advantages import rloo_advantages

    n, mixed = 7, [0.0, 1.0, 0.5, 0.25, 1.0, 0.0, 0.75]
    scores = torch.tensor([score] * n + mixed)
    mask, kl = torch.ones(2 * n, 3), torch.randn(2 * n, 3, generator=torch.Generator().manual_seed(0))
    m = torch.tensor(mixed, dtype=torch.float64)
    for adv, want in [(grpo_advantages(scores, n, mask), (m - m.mean()) / (m.std() + 1e-6)),
                      (grpo_advantages(scores, n, mask, scale_by_std=False), m - m.mean()),
                      (rloo_advantages(scores, kl, mask, n, kl_coef=0.0)[:, 0], m - (m.sum() - m) / (n - 1))]:
        assert (adv[:n] == 0).all(), adv[:n]
        assert torch.allclose(adv[n:].reshape(n, -1)[:, 0].double(), want, rtol=1e-5, atol=1e-6)


def test_the_skip_applies_only_where_nothing_else_is_in_the_loss():
    skip = update.zero_advantage_skip
    assert skip(PPOConfig(advantage_estimator="grpo", kl_coef=0.0)) is True
    assert skip(PPOConfig(advantage_estimator="grpo", kl_coef=0.0, skip_zero_advantage=False)) is False
    assert skip(PPOConfig(advantage_estimator="grpo", kl_coef=0.05)) is None  # a KL loss term
    assert skip(PPOConfig(advantage_estimator="grpo", kl_coef=0.0, entropy_coef=0.01)) is None
    for estimator in ("rloo", "reinforce++", "gae"):  # the KL is in the reward, so in the advantages
        assert skip(PPOConfig(advantage_estimator=estimator, kl_coef=0.05)) is True


@pytest.mark.parametrize("skip", [True, False])
def test_old_logprobs_are_computed_only_for_the_rows_the_update_runs(world1, skip, monkeypatch):
    """GRPO without KL: the experience's actor forward for log pi_old leaves out the
    zero-advantage rows (which the update leaves out too); the rows it runs get the log-probs
    of the whole batch's forward, within fp32 reduction order (rtol 1e-5, atol 1e-6)."""
    from megatron_rlhf.rlhf import experience
    from megatron_rlhf.rlhf.experience import ExperienceMaker

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
    responses = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in RESPONSE_LENS]
    width = max(RESPONSE_LENS)

    class Rollout:
        def responses(self):
            return responses
        response_logprobs = sampling_logprobs = torch.full((8, width), -7.0)

    actor = _actor(world1)
    rows_run = []
    real = experience.response_logprobs
    monkeypatch.setattr(experience, "response_logprobs", lambda model, exp, *a: rows_run.append(exp.batch_size)
                        or real(model, exp, *a))
    cfg = _cfg("token-mean", skip=skip, budget=None, recompute_logprobs=True)
    maker = ExperienceMaker(cfg, None, reward_fn="concise", actor=actor)
    exp = maker.make(prompts, [""] * 8, Rollout(), scores=torch.tensor(SCORES))
    mask = exp.response_mask.bool()
    full = real(actor, exp, 2)  # every row's log pi_old, one forward
    assert rows_run == ([4] if skip else [8])
    torch.testing.assert_close(exp.old_logprobs[~ZERO_ROWS], full[~ZERO_ROWS], rtol=1e-5, atol=1e-6)
    # the skipped rows keep the rollout's log-probs (read by nothing)
    assert bool((exp.old_logprobs[ZERO_ROWS][mask[ZERO_ROWS]] == -7.0).all()) == skip
    # with an entropy bonus the update runs every row, and so does the forward
    rows_run.clear()
    ExperienceMaker(_cfg("token-mean", skip=skip, budget=None, recompute_logprobs=True, entropy_coef=0.01),
                    None, reward_fn="concise", actor=actor).make(prompts, [""] * 8, Rollout(),
                                                                 scores=torch.tensor(SCORES))
    assert rows_run == [8]
