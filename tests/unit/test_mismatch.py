"""The train-inference mismatch: the generator's log-probs of the sampled tokens against the
training forward's log pi_old (metrics per iteration), and truncated importance sampling
(``--rollout-is-cap``) that weighs the policy loss by their ratio."""

import math

import pytest
import torch

from megatron_rlhf.models.pipeline import model_output
from megatron_rlhf.rlhf import experience, update
from megatron_rlhf.rlhf.experience import ExperienceMaker
from megatron_rlhf.rlhf.update import _Sums

from unit.test_zero_advantage_skip import PROMPT_LENS, RESPONSE_LENS, SCORES, VOCAB, _actor, _cfg


def _samples():
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
    responses = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in RESPONSE_LENS]
    return prompts, responses


def _make(actor, generator_logprobs, responses, prompts, **kw):
    class Rollout:
        def responses(self):
            return responses
        response_logprobs = sampling_logprobs = generator_logprobs

    cfg = _cfg("token-mean", skip=False, budget=None, recompute_logprobs=True, **kw)
    maker = ExperienceMaker(cfg, None, reward_fn="concise", actor=actor)
    return maker, maker.make(prompts, [""] * 8, Rollout(), scores=torch.tensor(SCORES))


@pytest.fixture(scope="module")
def setup(world1):
    """The actor, the samples and the trainer's own log-probs of them (the maker's forward:
    every row, micro-batches of 2)."""
    actor = _actor(world1)
    prompts, responses = _samples()
    width = max(RESPONSE_LENS)
    _, exp = _make(actor, torch.zeros(8, width), responses, prompts)
    return actor, prompts, responses, experience.response_logprobs(actor, exp, 2)


def test_a_generator_that_is_the_trainer_has_no_mismatch(setup):
    """fp32, the same batch shape: the generator's log-probs are the trainer's, bit for bit,
    and every metric is exactly 0."""
    actor, prompts, responses, trainer = setup
    maker, exp = _make(actor, trainer, responses, prompts)
    assert torch.equal(exp.old_logprobs, trainer) and torch.equal(exp.rollout_logprobs, trainer)
    assert maker.take_mismatch() == {"mismatch_logprob_abs_mean": 0.0, "mismatch_logprob_abs_max": 0.0,
                                     "mismatch_k3": 0.0}
    assert maker.take_mismatch() == {}  # once


def test_a_perturbed_generator_shows_its_perturbation(setup):
    """The generator off by +0.1 on every sampled token (and by 0.5 on one): the mean and max
    gaps, and the k3 estimate exp(r) - 1 - r of r = trainer - generator."""
    actor, prompts, responses, trainer = setup
    mask = torch.zeros_like(trainer)
    for i, n in enumerate(RESPONSE_LENS):
        mask[i, :n] = 1
    shifted = (trainer + 0.1) * mask
    shifted[3, 2] += 0.4
    maker, _ = _make(actor, shifted, responses, prompts)
    m = maker.take_mismatch()
    tokens = sum(RESPONSE_LENS)
    assert m["mismatch_logprob_abs_mean"] == pytest.approx((0.1 * (tokens - 1) + 0.5) / tokens, rel=1e-5)
    assert m["mismatch_logprob_abs_max"] == pytest.approx(0.5, rel=1e-5)
    k3 = lambda r: math.exp(r) - 1 - r  # noqa: E731
    assert m["mismatch_k3"] == pytest.approx((k3(-0.1) * (tokens - 1) + k3(-0.5)) / tokens, rel=1e-4)


def test_truncated_importance_sampling_weighs_each_tokens_loss(setup):
    """With --rollout-is-cap C each token's policy loss is the plain one times
    min(pi_old / pi_generator, C); the weights are logged."""
    actor, prompts, responses, trainer = setup
    g = torch.Generator().manual_seed(2)
    generated = trainer + 0.5 * torch.randn(trainer.shape, generator=g)
    _, exp = _make(actor, generated, responses, prompts, rollout_is_cap=1.5)
    exp.advantages = torch.randn(exp.advantages.shape, generator=g) * exp.response_mask
    weight = torch.exp(exp.old_logprobs - exp.rollout_logprobs).clamp(max=1.5)
    assert 0 < int((weight == 1.5).sum()) < int(exp.response_mask.sum())  # the cap bites, not everywhere
    with torch.no_grad():
        output = model_output(actor, exp)
        plain = update._policy_loss(actor, output, exp, _cfg("token-mean", skip=False, budget=None), _Sums())
        sums = _Sums()
        capped = update._policy_loss(actor, output, exp, _cfg("token-mean", skip=False, budget=None,
                                                               rollout_is_cap=1.5), sums)
    torch.testing.assert_close(capped, plain * weight, rtol=1e-6, atol=1e-7)
    assert "rollout_is_weight" in sums.values
