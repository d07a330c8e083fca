"""The GRPO options on the paths a run takes, against numbers computed by hand:

- one ``train_actor`` step with clip-higher and dual clip on gives the logged policy loss and
  clip fraction, and the gradient, of the clipped surrogate written out here;
- each ``--loss-agg`` gives the gradient of its aggregation of that surrogate;
- the experience maker adds the overlong penalty to the scores (the rewards, and GRPO's
  advantages of them, by hand), Dr. GRPO's advantages skip the std, and the group filter
  judges the scores before the penalty.

A tiny actor (vocabulary 32) in a one-rank gloo world; the old log-probs are set so that
each token's ratio is a chosen number, away from every clip bound.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rlhf.config import GenerationConfig, OptimConfig, PPOConfig, RewardConfig, preset
from megatron_rlhf.generation.rollout import GenerationStats, Rollout
from megatron_rlhf.rlhf.dynamic_sampling import informative_groups
from megatron_rlhf.rlhf.experience import ExperienceMaker

VOCAB = 32
SEED = 5
HORIZON = 8  # the response-length limit seq-mean-token-sum-norm divides by

# 4 samples (2 groups of 2) of uneven response lengths, so that the aggregations differ.
# Per sample: the advantage and each response token's ratio pi / pi_old. Every ratio lies
# away from the bounds 0.8, 1.2, 1.28 and the dual clip 3, so rounding cannot move it across.
PROMPTS = [[5, 9], [7], [3, 11, 4], [8, 2]]
RESPONSES = [[12, 6, 30, 7, 19, 4], [21], [9, 9, 14], [25, 3, 17, 10, 28]]
ADVANTAGES = [1.5, -2.0, -0.5, 0.8]
RATIOS = [[0.5, 0.9, 1.1, 1.24, 1.5, 3.5],  # A > 0: 1.24 inside clip-higher only, 1.5 and 3.5 capped
          [10.0],  # A < 0, far off-policy: dual clip caps -A r = 20 at -A C = 6
          [0.5, 1.1, 5.0],  # A < 0: 0.5 clipped up to 0.8; 5: 2.5 capped at 1.5
          [1.0, 1.25, 0.7, 1.3, 1.1]]


def _actor(pg):
    from megatron_rlhf.models.builder import build_model

    return build_model(preset("tiny", vocab_size=VOCAB, max_position_embeddings=32), "actor", pg,
                       dtype=torch.float32, seed=SEED)


def _logprobs_alone(model, prompt, response):
    """``[n]`` float64 log pi of ``response``'s tokens, the sample run alone (no padding)."""
    from megatron_rlhf.models.forward import lm_logits

    seq = torch.tensor([prompt + response])
    p, n = len(prompt), len(response)
    logits = lm_logits(model, seq)[0, p - 1:p + n - 1].double()
    return torch.log_softmax(logits, -1)[torch.arange(n), response]


def _experience(model):
    """An Experience of the samples above: advantages per sample, and old log-probs that
    make each token's ratio under ``model`` the one in :data:`RATIOS`."""
    from megatron_rlhf.rlhf.batch import Experience, pack

    ids, att, mask = pack(PROMPTS, RESPONSES, pad_id=0, device="cpu")
    B, T = mask.shape
    old, adv = torch.zeros(B, T), torch.zeros(B, T)
    with torch.no_grad():
        for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
            n = len(r)
            old[i, :n] = (_logprobs_alone(model, p, r) - torch.tensor(RATIOS[i]).double().log()).float()
            adv[i, :n] = ADVANTAGES[i]
    return Experience(input_ids=ids, attention_mask=att, response_mask=mask, old_logprobs=old,
                      ref_logprobs=torch.zeros(B, T), scores=torch.zeros(B), kl=torch.zeros(B, T),
                      advantages=adv)


def _cfg(**kw):
    # recompute_logprobs set: with one step per iteration and no flag, the update would take
    # pi_old from its own forward (ratio 1), not from the experience
    return PPOConfig(advantage_estimator="grpo", global_batch_size=2, rollout_n=2, micro_batch_size=2,
                     kl_coef=0.0, recompute_logprobs=True, **kw)


def _surrogate(ratio, adv, low, high, dual):
    """The per-token PPO loss, written out: ``max(-A r, -A clip(r, 1 - low, 1 + high))``, and
    for A < 0 at most ``-A dual``; returns ``(loss, clipped)``."""
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - low, 1 + high)
    loss = torch.maximum(unclipped, clipped)
    active = clipped > unclipped
    if dual is not None:
        cap = torch.full_like(loss, -adv * dual)
        capped = (adv < 0) & (loss > cap)
        loss, active = torch.where(capped, cap, loss), active | capped
    return loss, active


def _hand_loss(model, cfg: PPOConfig, agg: str):
    """``(aggregated loss, token-mean surrogate, clip fraction)`` by hand, each sample alone."""
    per_seq, all_tokens, clipped = [], [], []
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        logp = _logprobs_alone(model, p, r)
        old = (logp.detach() - torch.tensor(RATIOS[i]).double().log())  # as _experience sets it
        loss, active = _surrogate(torch.exp(logp - old), ADVANTAGES[i], cfg.clip_low, cfg.clip_high,
                                  cfg.dual_clip)
        per_seq.append(loss)
        all_tokens.append(loss)
        clipped.append(active)
    tokens = torch.cat(all_tokens)
    n_seqs = len(per_seq)
    total = {"token-mean": tokens.sum() / tokens.numel(),
             "seq-mean-token-mean": sum(x.mean() for x in per_seq) / n_seqs,
             "seq-mean-token-sum": sum(x.sum() for x in per_seq) / n_seqs,
             "seq-mean-token-sum-norm": sum(x.sum() for x in per_seq) / HORIZON / n_seqs}[agg]
    return total, float(tokens.detach().mean()), float(torch.cat(clipped).double().mean())


def _step(pg, cfg: PPOConfig):
    """One train_actor step on the samples: ``(metrics, gradient by name, weights before)``."""
    from megatron_rlhf.rlhf.optim import build_trainee
    from megatron_rlhf.rlhf.update import train_actor

    actor = _actor(pg)
    exp = _experience(actor)
    before = {n: p.detach().clone() for n, p in actor.named_parameters()}
    t = build_trainee(actor, pg, OptimConfig(lr=1e-3, clip_grad=0.0, use_distributed_optimizer=False), 1e-3)
    grads, step = [], t.step

    def recording():  # the accumulated gradient (DDP's main_grad) at the optimizer step
        grads.append({n: p.main_grad.detach().clone() for n, p in t.model.named_parameters()})
        return step()

    t.step = recording
    metrics = train_actor(t, exp, cfg, horizon=HORIZON)
    assert len(grads) == 1
    return metrics, grads[0], before


def _hand_grad(pg, before, cfg: PPOConfig, agg: str):
    """``(gradient by name, token-mean surrogate, clip fraction)`` of the hand loss at ``before``."""
    model = _actor(pg)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, w in before.items():
            params[n].copy_(w)
    model.zero_grad(set_to_none=True)
    loss, surrogate, clip_frac = _hand_loss(model, cfg, agg)
    loss.backward()
    return {n: p.grad for n, p in params.items()}, surrogate, clip_frac


def _rel_err(got: dict, want: dict) -> float:
    g = torch.cat([got[n].flatten().double() for n in sorted(want)])
    w = torch.cat([want[n].flatten().double() for n in sorted(want)])
    return float((g - w).norm() / w.norm())


# ---------------------------------------------------------------------------- ratio clips
@pytest.mark.parametrize("high,dual", [(None, None), (0.28, None), (None, 3.0), (0.28, 3.0)])
def test_a_step_with_clip_higher_and_dual_clip_is_the_hand_loss(world1, high, dual):
    """The logged policy loss and clip fraction are the token means of the surrogate above,
    and the gradient is its token mean's: clip-higher lets the ratio 1.24 (A > 0) through and
    caps 1.5 at 1.28, the dual clip caps the loss of A = -2, ratio 10 at -A C = 6 (not C)."""
    cfg = _cfg(clip_eps=0.2, clip_eps_high=high, dual_clip=dual)
    metrics, grad, before = _step(world1, cfg)
    want_grad, surrogate, clip_frac = _hand_grad(world1, before, cfg, "token-mean")
    assert metrics["policy_loss"] == pytest.approx(surrogate, rel=1e-5, abs=1e-6)
    assert metrics["clip_frac"] == pytest.approx(clip_frac, abs=1e-9)
    err = _rel_err(grad, want_grad)
    assert err < 1e-4, f"the step's gradient differs from the hand loss's by {err:.3g} (relative)"


# ---------------------------------------------------------------------------- aggregation
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                 "seq-mean-token-sum-norm"])
def test_a_step_aggregates_by_loss_agg(world1, agg):
    """The step's gradient is that of the hand surrogate aggregated as ``--loss-agg`` says:
    over all tokens, each sequence's token mean, its token sum, or its sum over the limit
    (8), averaged over the sequences."""
    cfg = _cfg(clip_eps_high=0.28, loss_agg=agg)
    _, grad, before = _step(world1, cfg)
    want, _, _ = _hand_grad(world1, before, cfg, agg)
    err = _rel_err(grad, want)
    assert err < 1e-4, f"{agg}: the step's gradient differs from the hand loss's by {err:.3g} (relative)"
    if agg != "token-mean":  # the aggregations are told apart here
        other, _, _ = _hand_grad(world1, before, cfg, "token-mean")
        assert _rel_err(other, want) > 0.05


# ---------------------------------------------------------------------------- rewards
LIMIT, BUFFER, PENALTY = 8, 4, 0.5


def _rollout(lengths):
    t = max(lengths)
    resp = torch.tensor([[3 + i] * n + [0] * (t - n) for i, n in enumerate(lengths)])
    lp = -0.5 * (resp != 0).float()
    return Rollout(prompt_ids=[[1, 2]] * len(lengths), response_ids=resp, response_logprobs=lp,
                   sampling_logprobs=lp, lengths=torch.tensor(lengths),
                   finish_reasons=["eos"] * len(lengths), stats=GenerationStats(new_tokens=sum(lengths)))


def _maker(**kw):
    cfg = PPOConfig(advantage_estimator="grpo", global_batch_size=2, rollout_n=2, kl_coef=0.0,
                    overlong_buffer=BUFFER, overlong_penalty=PENALTY, **kw)
    # reward_fixtures:keyed scores a sample by its record's "answer" field
    return ExperienceMaker(cfg, None, reward_fn="reward_fixtures:keyed",
                           reward=RewardConfig(reward_workers=0), gen=GenerationConfig(max_new_tokens=LIMIT))


def _make(maker, lengths, answers):
    rollout = _rollout(lengths)
    metas = [{"answer": a} for a in answers]
    prompts = [[1, 2]] * len(lengths)
    scores = maker.score(prompts, ["q"] * len(lengths), rollout, 0, metas)
    return scores, maker.make(prompts, ["q"] * len(lengths), rollout, metas=metas)


def _hand_penalty(n):
    # 0 up to LIMIT - BUFFER = 4 tokens, then down by PENALTY / BUFFER a token: -0.5 at 8
    return -PENALTY * min(max(n - (LIMIT - BUFFER), 0) / BUFFER, 1.0)


def test_the_overlong_penalty_is_added_to_the_scores_and_reaches_grpo():
    """The experience's rewards are the reward function's scores plus the penalty (lengths 3
    and 5, 6 and 8 against a limit of 8 and a buffer of 4: 0, -0.125, -0.25, -0.5), and
    GRPO's advantages are those rewards' (unbiased std, eps 1e-6)."""
    lengths, answers = [3, 5, 6, 8], [1.0, 1.0, 0.0, 1.0]
    scores, exp = _make(_maker(), lengths, answers)
    assert scores.tolist() == answers  # score(): the reward function's, unshaped
    rewards = [a + _hand_penalty(n) for a, n in zip(answers, lengths)]
    assert rewards == [1.0, 0.875, -0.25, 0.5]
    assert exp.scores.tolist() == pytest.approx(rewards, abs=1e-6)
    for g in (0, 2):  # per group of 2: (r - mean) / (unbiased std + 1e-6)
        a, b = rewards[g:g + 2]
        std = abs(a - b) / math.sqrt(2)
        want = [(a - b) / 2 / (std + 1e-6), (b - a) / 2 / (std + 1e-6)]
        for row, w in zip((g, g + 1), want):
            n = lengths[row]
            assert exp.advantages[row, :n].tolist() == pytest.approx([w] * n, rel=1e-5)
            assert exp.advantages[row, n:].abs().sum() == 0


def test_dr_grpo_advantages_are_not_divided_by_the_std():
    """--no-grpo-std-norm: the advantage is the reward minus its group's mean."""
    lengths, answers = [3, 5, 6, 8], [1.0, 1.0, 0.0, 1.0]
    _, exp = _make(_maker(grpo_std_norm=False), lengths, answers)
    rewards = [a + _hand_penalty(n) for a, n in zip(answers, lengths)]
    want = [rewards[0] - 0.9375, rewards[1] - 0.9375, rewards[2] - 0.125, rewards[3] - 0.125]
    assert want == [0.0625, -0.0625, -0.375, 0.375]
    assert exp.advantages[:, 0].tolist() == pytest.approx(want, abs=1e-6)


def test_the_group_filter_judges_scores_before_the_overlong_penalty():
    """Two wrong answers of 6 and 8 tokens (inside the buffer) have equal scores: the group
    carries no signal of correctness and is dropped, though its rewards differ by length
    (their GRPO advantages would be +-0.71 from length alone). A group with a right and a
    wrong answer is kept."""
    maker = _maker()
    lengths, answers = [6, 8, 2, 3], [0.0, 0.0, 0.0, 1.0]
    scores, exp = _make(maker, lengths, answers)
    assert informative_groups(scores, 2) == [False, True]  # what the trainer's GroupFilter sees
    assert informative_groups(exp.scores, 2) == [True, True]  # the shaped rewards would keep it
    assert exp.advantages[0, 0].item() == pytest.approx(1 / math.sqrt(2), rel=1e-4)


def test_the_cli_reaches_the_new_options():
    """``--no-grpo-std-norm`` and ``--loss-agg seq-mean-token-sum`` set their fields."""
    import argparse

    from megatron_rlhf.config import dataclass_from_namespace
    from megatron_rlhf.flags import add_fields

    p = argparse.ArgumentParser()
    add_fields(p, PPOConfig)
    args = p.parse_args(["--advantage-estimator", "grpo", "--no-grpo-std-norm",
                         "--loss-agg", "seq-mean-token-sum"])
    cfg = dataclass_from_namespace(PPOConfig, args)
    assert (cfg.grpo_std_norm, cfg.loss_agg) == (False, "seq-mean-token-sum")
    assert dataclass_from_namespace(PPOConfig, p.parse_args([])).grpo_std_norm is True
    with pytest.raises(SystemExit):
        p.parse_args(["--loss-agg", "seq-sum"])
