"""Review of the RL math: tests that fail when the reduction, signs or masks are sabotaged.

- the PPO update's gradient is the token mean of the per-token loss over the mini-batch
  (padding masked, one denominator for every micro-batch), against a hand-written loss of
  each sample alone;
- the entropy bonus raises the entropy, the KL loss term lowers the KL to the reference;
- DPO's sequence log-probabilities count response tokens only;
- SFT packing keeps the examples after an empty-prompt example intact;
- the expected gradients of the KL estimators (exact, over a small support): k2's is the
  gradient of KL(pi || ref), k3's that of KL(ref || pi), k1's zero.

Tiny models (vocabulary 32) in one process; fp64 where no model is involved.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rlhf.config import OptimConfig, PPOConfig, preset
from megatron_rlhf.finetune import data as D
from megatron_rlhf.finetune import losses as FL
from megatron_rlhf.rlhf.kl import kl_estimate

VOCAB = 32
SEED = 3


# ---------------------------------------------------------------------------- PPO helpers
def _model_cfg():
    return preset("tiny", vocab_size=VOCAB, max_position_embeddings=32)


def _actor(pg, seed: int = SEED):
    """A tiny actor whose (tied) embedding is scaled up so its distributions are peaked,
    not near uniform (the entropy and KL then move measurably in one step)."""
    from megatron_rlhf.models.builder import build_model

    model = build_model(_model_cfg(), "actor", pg, dtype=torch.float32, seed=seed)
    with torch.no_grad():
        model.embedding.word_embeddings.weight.mul_(3.0)
    return model


def _trainee(model, pg, lr: float = 1e-3):
    from megatron_rlhf.rlhf.optim import build_trainee

    return build_trainee(model, pg, OptimConfig(lr=lr, clip_grad=0.0, use_distributed_optimizer=False), lr)


# 8 samples: prompts of 1-4 tokens, responses of very uneven lengths, so that the 2
# micro-batches of each 4-sample mini-batch hold 11 + 3 and 4 + 9 response tokens.
PROMPT_LENS = [2, 1, 4, 3, 1, 2, 3, 4]
RESPONSE_LENS = [6, 5, 1, 2, 3, 1, 6, 3]


def _samples(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
    responses = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in RESPONSE_LENS]
    return prompts, responses


def _alone_logits(model, prompt, response):
    """``[n, V]`` logits that predict ``response`` from the sample run alone (no padding)."""
    from megatron_rlhf.models.forward import lm_logits

    seq = torch.tensor([prompt + response])
    p, n = len(prompt), len(response)
    return lm_logits(model, seq)[0, p - 1:p + n - 1]


def _experience(model, prompts, responses, advantages: bool, ref_model=None, seed: int = 1):
    """An Experience as the loop builds it (0 at padding): old log-probs near the model's
    (so some ratios are clipped), advantages random or 0, reference log-probs from
    ``ref_model`` (or near the model's)."""
    from megatron_rlhf.rlhf.batch import Experience, pack

    g = torch.Generator().manual_seed(seed)
    ids, att, mask = pack(prompts, responses, pad_id=0, device="cpu")
    B, T = mask.shape
    old, ref, adv = torch.zeros(B, T), torch.zeros(B, T), torch.zeros(B, T)
    with torch.no_grad():
        for i, (p, r) in enumerate(zip(prompts, responses)):
            n = len(r)
            lp = torch.log_softmax(_alone_logits(model, p, r).double(), -1)[torch.arange(n), r]
            old[i, :n] = (lp + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)).float()
            if ref_model is None:
                ref[i, :n] = (lp + 0.5 * torch.randn(n, generator=g, dtype=torch.float64)).float()
            else:
                rl = torch.log_softmax(_alone_logits(ref_model, p, r).double(), -1)
                ref[i, :n] = rl[torch.arange(n), r].float()
            if advantages:
                adv[i, :n] = torch.randn(n, generator=g)
    return Experience(input_ids=ids, attention_mask=att, response_mask=mask, old_logprobs=old,
                      ref_logprobs=ref, scores=torch.zeros(B), kl=torch.zeros(B, T), advantages=adv)


def _reference_loss(model, exp, rows, cfg: PPOConfig):
    """The token-mean PPO loss of samples ``rows``, by hand, each sample run alone:
    ``sum over their response tokens of (clipped surrogate - entropy_coef * entropy +
    kl_coef * k3) / their number of response tokens``."""
    total, tokens = 0.0, 0
    for i in rows:
        n = int(exp.response_mask[i].sum())
        p = int(exp.attention_mask[i, :exp.prompt_len].sum())
        prompt = exp.input_ids[i, exp.prompt_len - p:exp.prompt_len].tolist()
        response = exp.input_ids[i, exp.prompt_len:exp.prompt_len + n].tolist()
        logp_all = torch.log_softmax(_alone_logits(model, prompt, response).double(), -1)  # [n, V]
        logp = logp_all[torch.arange(n), response]
        old, ref, adv = (x[i, :n].double() for x in (exp.old_logprobs, exp.ref_logprobs, exp.advantages))
        ratio = torch.exp(logp - old)
        pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps))
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        k3 = torch.exp(ref - logp) - (ref - logp) - 1
        total = total + (pg - cfg.entropy_coef * entropy + cfg.kl_coef * k3).sum()
        tokens += n
    return total / tokens


def _record_steps(t):
    """Wrap ``t.step`` to record, at every optimizer step, the accumulated gradient (DDP's
    ``main_grad``) and the parameters it was computed at."""
    steps, step = [], t.step

    def recording():
        steps.append({n: (p.detach().clone(), p.main_grad.detach().clone())
                      for n, p in t.model.named_parameters()})
        return step()

    t.step = recording
    return steps


def _rel_err(got: dict, want: dict) -> float:
    g = torch.cat([got[n].flatten().double() for n in sorted(want)])
    w = torch.cat([want[n].flatten().double() for n in sorted(want)])
    return float((g - w).norm() / w.norm())


# ---------------------------------------------------------------------------- 1. PPO reduction
def test_ppo_step_gradient_is_the_token_mean_over_each_mini_batch(world1):
    """Each optimizer step's gradient is that of the per-token loss summed over the
    mini-batch's response tokens (padding out) and divided by their number, whatever the
    micro-batches hold: 2 mini-batches of 4 samples, each 2 micro-batches with very
    different token counts (11 + 3, 4 + 9), entropy and KL-loss terms on (they are non-zero
    at padding too), against each sample's loss computed alone by hand."""
    from megatron_rlhf.rlhf.update import train_actor

    pg = world1
    actor = _actor(pg)
    prompts, responses = _samples()
    exp = _experience(actor, prompts, responses, advantages=True)
    cfg = PPOConfig(advantage_estimator="grpo", global_batch_size=4, rollout_n=2, micro_batch_size=2,
                    num_mini_batches=2, ppo_epochs=1, clip_eps=0.2, kl_coef=0.1, kl_estimator="k3",
                    entropy_coef=0.05)
    t = _trainee(actor, pg)
    steps = _record_steps(t)
    train_actor(t, exp, cfg)
    assert len(steps) == 2

    reference = _actor(pg)
    names = dict(reference.named_parameters())
    for k, rows in enumerate((range(0, 4), range(4, 8))):
        with torch.no_grad():
            for n, (w, _) in steps[k].items():
                names[n].copy_(w)
        reference.zero_grad(set_to_none=True)
        _reference_loss(reference, exp, rows, cfg).backward()
        want = {n: p.grad for n, p in names.items()}
        got = {n: g for n, (_, g) in steps[k].items()}
        err = _rel_err(got, want)
        assert err < 1e-4, \
            f"mini-batch {k}: PPO gradient differs from the token-mean loss's by {err:.3g} (relative)"


# ---------------------------------------------------------------------------- 2. signs
def _masked_mean(x, mask):
    return float((x * mask).sum() / mask.sum())


def _policy_stats(model, exp, estimator: str):
    """Token means over the responses of the policy's entropy and of the KL estimate
    ``estimator`` against ``exp.ref_logprobs`` at the sampled tokens."""
    from megatron_rlhf.models.forward import lm_logits
    from megatron_rlhf.rlhf.batch import response_slice

    with torch.no_grad():
        logits = response_slice(lm_logits(model, exp.input_ids, exp.attention_mask), exp).double()
        logp_all = torch.log_softmax(logits, -1)
        logp = logp_all.gather(-1, exp.response_ids[..., None]).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        kl = kl_estimate(logp, exp.ref_logprobs.double(), estimator)
    return _masked_mean(entropy, exp.response_mask), _masked_mean(kl, exp.response_mask)


def _one_step(pg, exp, cfg, actor):
    from megatron_rlhf.rlhf.update import train_actor

    t = _trainee(actor, pg, lr=1e-3)
    train_actor(t, exp, cfg)
    return actor


def test_entropy_bonus_raises_the_entropy(world1):
    """With zero advantages and an entropy coefficient, one PPO step raises the policy's
    entropy at the response positions (``loss - entropy_coef * entropy``)."""
    actor = _actor(world1)
    exp = _experience(actor, *_samples(), advantages=False)
    before, _ = _policy_stats(actor, exp, "k3")
    cfg = PPOConfig(advantage_estimator="gae", micro_batch_size=4, kl_coef=0.0, kl_estimator="k1",
                    entropy_coef=0.1)
    after, _ = _policy_stats(_one_step(world1, exp, cfg, actor), exp, "k3")
    assert after > before + 1e-3, \
        f"entropy went from {before:.5f} to {after:.5f}, not up: the bonus has the wrong sign (or no gradient)"


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_kl_loss_lowers_the_kl_to_the_reference(world1, estimator):
    """With zero advantages and a KL loss (grpo), one PPO step lowers the KL estimate to a
    different reference model at the sampled tokens (``loss + kl_coef * kl``)."""
    actor = _actor(world1)
    exp = _experience(actor, *_samples(), advantages=False, ref_model=_actor(world1, seed=SEED + 1))
    _, before = _policy_stats(actor, exp, estimator)
    cfg = PPOConfig(advantage_estimator="grpo", rollout_n=2, global_batch_size=4, micro_batch_size=4,
                    kl_coef=0.1, kl_estimator=estimator, entropy_coef=0.0)
    _, after = _policy_stats(_one_step(world1, exp, cfg, actor), exp, estimator)
    assert after < before - 1e-3, (f"{estimator} went from {before:.5f} to {after:.5f}, not down: "
                                   "the KL term has the wrong sign (or no gradient)")


# ---------------------------------------------------------------------------- 3. DPO masks
def test_dpo_sequence_logprobs_count_response_tokens_only():
    """``sequence_logprobs`` sums log p(token t | logits at t-1) over response tokens only:
    equal to a loop over them, and its gradient is 0 at every position that predicts a
    prompt or padding token (or nothing: the last column)."""
    g = torch.Generator().manual_seed(5)
    B, T, V = 3, 9, 11
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 0, 0, 0],   # prompt, response, padding
                         [0, 1, 1, 1, 1, 1, 1, 1, 1],   # a 1-token prompt, response to the end
                         [0, 0, 0, 0, 0, 0, 1, 0, 0]])  # a long prompt, a 1-token response
    got = FL.sequence_logprobs(logits, ids, mask)
    for b in range(B):
        want = sum(float(torch.log_softmax(logits.detach()[b, t - 1], -1)[ids[b, t]])
                   for t in range(1, T) if mask[b, t])
        assert float(got[b].detach()) == pytest.approx(want, rel=1e-6), f"row {b}"
    got.sum().backward()
    predicts_target = torch.zeros(B, T, dtype=torch.bool)
    predicts_target[:, :-1] = mask[:, 1:].bool()
    grad_norm = logits.grad.norm(dim=-1)  # [B, T]
    assert (grad_norm[~predicts_target] == 0).all(), "prompt or padding positions enter the sum"
    assert (grad_norm[predicts_target] > 0).all()


def test_dpo_loop_scores_each_row_like_the_example_alone(world1):
    """The DPO loop's per-row sequence log-probs (rows of a padded batch of different prompt
    and response lengths) equal the sum of the response tokens' log-probs of each example
    run alone: prompt and padding tokens do not count."""
    from megatron_rlhf.finetune.loop import FinetuneTrainer, forward
    from megatron_rlhf.models.builder import build_model

    model = build_model(_model_cfg(), "actor", world1, dtype=torch.float32, seed=7).eval()
    g = torch.Generator().manual_seed(6)
    exs = [D.Example(torch.randint(2, VOCAB, (p,), generator=g).tolist(),
                     torch.randint(2, VOCAB, (r,), generator=g).tolist())
           for p, r in ((3, 2), (1, 6), (5, 1), (2, 3))]
    batch = D.token_batch([[e] for e in exs], pad_id=0, device="cpu")
    with torch.no_grad():
        got = FinetuneTrainer._sequence_logprobs(model, forward(model, batch), batch)
        for i, e in enumerate(exs):
            logp = torch.log_softmax(_alone_logits(model, e.prompt, e.response).double(), -1)
            want = float(logp[torch.arange(len(e.response)), e.response].sum())
            assert float(got[i]) == pytest.approx(want, rel=1e-4, abs=1e-4), f"row {i}"


# ---------------------------------------------------------------------------- 4. SFT packing
def _placed_logits(batch, exs_in_row, logits_alone):
    """``[1, W, V]`` logits of a packed row holding, at each example's columns, the logits
    of that example alone (what a model honouring the segments computes)."""
    out = torch.zeros(1, batch.input_ids.shape[1], logits_alone[0].shape[-1], dtype=torch.float64)
    col = 0
    for e, z in zip(exs_in_row, logits_alone):
        out[0, col:col + e.length] = z
        col += e.length
    return out


def test_sft_packing_after_an_empty_prompt(world1):
    """An example with an empty prompt (``--no-chat`` with a tokenizer that adds no BOS)
    packed first in a row, then two more: the later examples keep their tokens, their own
    segment (positions restarting at 0), a loss mask of 0 on the prompt and 1 on the
    response; the packed SFT loss (sum and target count) equals the sum over the examples
    alone; the model's logits of each example equal those of the example alone."""
    from megatron_rlhf.finetune.loop import forward
    from megatron_rlhf.models.builder import build_model

    g = torch.Generator().manual_seed(8)
    rand = lambda n: torch.randint(2, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    empty, b, c = D.Example([], rand(6)), D.Example(rand(3), rand(2)), D.Example(rand(1), rand(3))
    rows = D.pack([b, empty, c], width=20)
    assert [[e is x for x in (empty, b, c)].index(True) for e in rows[0]] == [0, 1, 2] and len(rows) == 1
    packed = D.token_batch(rows, pad_id=0, device="cpu")
    positions, _ = D.segment_inputs(packed.segments)
    col = 0
    for k, e in enumerate((empty, b, c), 1):
        cols = slice(col, col + e.length)
        assert packed.input_ids[0, cols].tolist() == e.prompt + e.response, f"example {k}: tokens"
        assert packed.segments[0, cols].tolist() == [k] * e.length, f"example {k}: segment"
        assert positions[0, cols].tolist() == list(range(e.length)), f"example {k}: positions"
        if e.prompt:
            assert packed.loss_mask[0, cols].tolist() == [0] * len(e.prompt) + [1] * len(e.response), \
                f"example {k} (after the empty prompt): loss mask"
        col += e.length
    assert packed.last.tolist() == [5, 10, 14]
    assert (packed.segments[0, col:] == 0).all() and (packed.loss_mask[0, col:] == 0).all()

    # the loss of the packed row (logits of each example alone placed at its columns)
    alone = [D.token_batch([[e]], pad_id=0, device="cpu") for e in (empty, b, c)]
    z = [torch.randn(1, e.length, 13, generator=g, dtype=torch.float64) for e in (empty, b, c)]
    ids13 = lambda x: x % 13  # noqa: E731  (a small vocabulary for random logits)
    loss, count = FL.sft_loss(_placed_logits(packed, (empty, b, c), [x[0] for x in z]),
                              ids13(packed.input_ids), packed.loss_mask)
    parts = [FL.sft_loss(zz, ids13(a.input_ids), a.loss_mask) for zz, a in zip(z, alone)]
    assert float(count) == sum(float(n) for _, n in parts)
    assert float(loss) == pytest.approx(sum(float(s) for s, _ in parts), rel=1e-6)

    # the model sees each example as alone
    model = build_model(_model_cfg(), "actor", world1, dtype=torch.float32, seed=9).eval()
    from megatron_rlhf.models.forward import logits_of

    with torch.no_grad():
        lp = logits_of(model, forward(model, packed))[0]
        col = 0
        for e, a in zip((empty, b, c), alone):
            la = logits_of(model, forward(model, a))[0, :e.length]
            torch.testing.assert_close(lp[col:col + e.length], la, rtol=1e-4, atol=1e-4)
            col += e.length


def test_sft_packing_an_empty_prompt_example_after_another():
    """No target is predicted across examples: every target column's predecessor lies in
    the same example, so the packed SFT target count equals the examples' alone."""
    g = torch.Generator().manual_seed(10)
    rand = lambda n: torch.randint(2, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    first, empty = D.Example(rand(3), rand(4)), D.Example([], rand(3))
    packed = D.token_batch(D.pack([first, empty], width=20), pad_id=0, device="cpu")
    assert packed.input_ids[0, :7].tolist() == first.prompt + first.response
    target = packed.loss_mask[0, 1:].bool()
    same = packed.segments[0, 1:] == packed.segments[0, :-1]
    crossing = (target & ~same).nonzero().flatten() + 1
    alone = sum(float(FL.sft_loss(torch.zeros(1, e.length, 4), torch.tensor([e.prompt + e.response]) % 4,
                                  D.token_batch([[e]], 0, "cpu").loss_mask)[1]) for e in (first, empty))
    packed_count = float(FL.sft_loss(torch.zeros(1, packed.input_ids.shape[1], 4), packed.input_ids % 4,
                                     packed.loss_mask)[1])
    assert crossing.tolist() == [] and packed_count == alone, (
        f"targets predicted across examples at columns {crossing.tolist()}; "
        f"{packed_count} targets packed, {alone} alone")


# ---------------------------------------------------------------------------- 5. KL estimators
def _expected_grad(theta, ref_logp, estimator: str):
    """``E_{a ~ pi}[grad_theta k(a)]`` exactly: each token of the support weighted by
    ``pi(a)`` (a constant), the gradient flowing through ``log pi(a)`` in the estimator
    only, as when the estimate is a loss term on sampled tokens."""
    theta = theta.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, -1)  # [V]
    weights = logp.detach().exp()
    est = kl_estimate(logp[None], ref_logp[None], estimator)[0]  # [V]
    (weights * est).sum().backward()
    return theta.grad


def _grad_of(fn, theta):
    theta = theta.clone().requires_grad_(True)
    fn(torch.log_softmax(theta, -1)).backward()
    return theta.grad


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kl_estimators_expected_gradients(seed, monkeypatch):
    """On pi = softmax(theta) over 5 tokens and a fixed ref: the expected gradient of k2
    equals the gradient of KL(pi || ref); that of k3 is the gradient of KL(ref || pi)
    (E_pi[(1 - ref/pi) grad log pi] = -sum ref grad log pi), not zero and not KL(pi||ref)'s;
    that of k1 is zero (E_pi[grad log pi] = 0: as a loss it does nothing). k1 and k3 are
    unbiased estimates of KL(pi || ref), k2 is not. These are the estimators' own identities:
    k3's clamp at 10 (kl.K3_CLAMP, verl's) is lifted, since it drops the tokens with
    ref/pi > 13.6 from the expectation (seed 0 has one)."""
    from megatron_rlhf.rlhf import kl as K

    monkeypatch.setattr(K, "K3_CLAMP", math.inf)
    g = torch.Generator().manual_seed(seed)
    theta = 1.5 * torch.randn(5, generator=g, dtype=torch.float64)
    ref_logp = torch.log_softmax(1.5 * torch.randn(5, generator=g, dtype=torch.float64), -1)
    ref = ref_logp.exp()
    kl_pi_ref = _grad_of(lambda lp: (lp.exp() * (lp - ref_logp)).sum(), theta)
    kl_ref_pi = _grad_of(lambda lp: (ref * (ref_logp - lp)).sum(), theta)
    assert kl_pi_ref.norm() > 1e-2 and (kl_pi_ref - kl_ref_pi).norm() > 1e-3  # a case that tells them apart

    torch.testing.assert_close(_expected_grad(theta, ref_logp, "k2"), kl_pi_ref, rtol=1e-10, atol=1e-12)
    k3 = _expected_grad(theta, ref_logp, "k3")
    torch.testing.assert_close(k3, kl_ref_pi, rtol=1e-10, atol=1e-12)
    assert k3.norm() > 1e-2 and (k3 - kl_pi_ref).norm() > 1e-3
    torch.testing.assert_close(_expected_grad(theta, ref_logp, "k1"), torch.zeros(5, dtype=torch.float64),
                               rtol=0, atol=1e-12)

    pi, logp = torch.softmax(theta, -1), torch.log_softmax(theta, -1)
    kl = float((pi * (logp - ref_logp)).sum())
    mean = {k: float((pi * kl_estimate(logp[None], ref_logp[None], k)[0]).sum())
            for k in ("k1", "k2", "k3")}
    assert mean["k1"] == pytest.approx(kl, rel=1e-10) and mean["k3"] == pytest.approx(kl, rel=1e-10)
    assert not math.isclose(mean["k2"], kl, rel_tol=1e-3)
