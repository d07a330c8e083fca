"""PPO trains the policy that generation samples from: ``logits / temperature`` within the
top-k/top-p set of the current logits, the sampled token always kept (``policy.policy_logits``).

Numerics against ``probs_for_sampling``; then a tiny random actor sampled at temperature
0.7 with top-k and top-p: its old log-probs are the log-probs it was sampled with, and the
first mini-batch's importance ratio in the training forward is exactly 1.
"""

import pytest
import torch

from megatron_rlhf.config import GenerationConfig, PPOConfig, SpecConfig, preset
from megatron_rlhf.generation.engine import Generator
from megatron_rlhf.generation.sampling import probs_for_sampling
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.rlhf import policy as P
from megatron_rlhf.rlhf.batch import model_micro_batches
from megatron_rlhf.rlhf.experience import ExperienceMaker
from megatron_rlhf.rlhf.update import _policy_micro, _Sums, policy_forward
from rlhf_fixtures import POSITIONS, PROMPTS, VOCAB

TEMPERED = GenerationConfig(max_new_tokens=6, temperature=0.7, top_k=8, top_p=0.8)
POLICIES = [TEMPERED, GenerationConfig(temperature=1.3, top_p=0.6),
            GenerationConfig(temperature=0.5), GenerationConfig(top_k=3)]


def _name(policy) -> str:
    return "none" if policy is None else f"T{policy.temperature}-k{policy.top_k}-p{policy.top_p}"


def _logits_and_tokens(policy: GenerationConfig, seed: int = 0):
    """Random ``[4, 5, 40]`` logits; tokens drawn from the sampling distribution in rows
    0-1 and uniformly (mostly outside the top-k/top-p set) in rows 2-3."""
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(4, 5, 40, generator=g)
    probs = probs_for_sampling(logits, policy)
    tokens = torch.multinomial(probs.view(-1, 40), 1, generator=g).view(4, 5)
    tokens[2:] = torch.randint(0, 40, (2, 5), generator=g)
    return logits, tokens, probs.gather(-1, tokens[..., None])[..., 0]


@pytest.mark.parametrize("policy", POLICIES, ids=_name)
def test_logprob_is_log_of_the_sampling_probability(policy):
    logits, tokens, p = _logits_and_tokens(policy)
    lp = P.policy_logprobs(logits, tokens, policy)
    inside = p > 0
    assert inside[:2].all()
    assert (~inside[2:]).any() == (policy.top_k > 0 or policy.top_p < 1)  # both cases seen
    assert (lp[inside] - p[inside].log()).abs().max() <= 1e-6
    assert torch.isfinite(lp).all()
    # a token outside the set is kept in it: the policy's set plus that one token
    z = P.policy_logits(logits, tokens, policy)
    assert torch.isfinite(z.gather(-1, tokens[..., None])).all()
    assert torch.equal(torch.isfinite(z), (probs_for_sampling(logits, policy) > 0)
                       | torch.nn.functional.one_hot(tokens, 40).bool())


def test_temperature_and_truncation_are_not_ignored():
    logits, tokens, _ = _logits_and_tokens(TEMPERED)
    untempered = P.logprobs_from_logits(logits, tokens)
    assert (P.policy_logprobs(logits, tokens, TEMPERED) - untempered).abs().min() > 1e-3


@pytest.mark.parametrize("policy", [None, GenerationConfig(temperature=0.0),
                                    GenerationConfig(temperature=1.0, top_k=40)], ids=_name)
def test_greedy_and_untempered_train_the_actor_itself(policy):
    logits, tokens = 3 * torch.randn(4, 5, 40), torch.randint(0, 40, (4, 5))
    lp, ent = P.policy_logprobs_and_entropy(logits, tokens, policy)
    assert torch.equal(lp, P.logprobs_from_logits(logits, tokens))
    assert torch.equal(ent, P.entropy_from_logits(logits))


@pytest.mark.parametrize("policy", [None, *POLICIES], ids=_name)
def test_an_entropy_kept_as_a_metric_is_the_same_entropy(policy):
    """``entropy_grad=False`` (the entropy only logged) shares the log-softmax of the
    log-probs; values and log-prob gradients equal the differentiable path's."""
    logits, tokens, _ = _logits_and_tokens(policy or TEMPERED, seed=2)
    a, b = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    lp, ent = P.policy_logprobs_and_entropy(a, tokens, policy)
    lp2, ent2 = P.policy_logprobs_and_entropy(b, tokens, policy, entropy_grad=False)
    assert not ent2.requires_grad and torch.isfinite(ent2).all()
    assert torch.allclose(lp, lp2, atol=1e-6) and torch.allclose(ent.detach(), ent2, atol=1e-5)
    lp.sum().backward()
    lp2.sum().backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-6)


@pytest.mark.parametrize("policy", POLICIES, ids=_name)
def test_entropy_and_gradients_of_the_truncated_policy(policy):
    logits, tokens, _ = _logits_and_tokens(policy, seed=1)
    logits.requires_grad_(True)
    lp, ent = P.policy_logprobs_and_entropy(logits, tokens, policy)
    z = P.policy_logits(logits.detach(), tokens, policy)
    q = z.softmax(-1)
    want = -(q * torch.where(q > 0, q.log(), 0.0)).sum(-1)
    assert (ent.detach() - want).abs().max() <= 1e-5
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(logits.grad).all()
    assert (logits.grad[~torch.isfinite(z)] == 0).all()  # outside the set: no gradient
    assert (logits.grad[torch.isfinite(z)] != 0).any()


# ------------------------------------------------------------- experience and training
def _tiny(world1, seed):
    cfg = preset("tiny", vocab_size=VOCAB, max_position_embeddings=POSITIONS)
    return build_model(cfg, "actor", world1, dtype=torch.float32, seed=seed)


@pytest.fixture(scope="module")
def sampled(world1):
    """A tiny actor, a different reference and 8 responses sampled at :data:`TEMPERED`."""
    actor, reference = _tiny(world1, seed=3), _tiny(world1, seed=4)
    prompts = [[2 + ord(c) - ord("a") for c in p] for p in PROMPTS[:4] for _ in range(2)]
    rollout = Generator(actor, pad_id=0).generate(prompts, TEMPERED, SpecConfig(num_draft_tokens=0),
                                                 seed=5)
    assert (rollout.sampling_logprobs != rollout.response_logprobs).any()
    return actor, reference, prompts, rollout


def _make(sampled, gen, **ppo):
    actor, reference, prompts, rollout = sampled
    cfg = PPOConfig(global_batch_size=4, rollout_n=2, micro_batch_size=4,
                    advantage_estimator="grpo", **ppo)
    maker = ExperienceMaker(cfg, reference, reward_fn="token_parity", actor=actor, gen=gen)
    texts = [p for p in PROMPTS[:4] for _ in range(2)]
    return maker, maker.make(prompts, texts, rollout), cfg


def test_first_ratio_is_exactly_one(sampled):
    actor = sampled[0]
    maker, exp, cfg = _make(sampled, TEMPERED, ppo_epochs=2)  # two updates: pi_old needs its own forward
    assert maker.recompute and exp.policy is TEMPERED  # recomputed by default when tempered
    mask = exp.response_mask.bool()
    # the old log-probs are those of the distribution actually sampled
    slp = sampled[3].sampling_logprobs[:, :mask.shape[1]]
    assert (exp.old_logprobs - slp)[mask].abs().max() < 1e-4
    actor.train()
    # the first mini-batch's, packed as training packs them
    for mb in model_micro_batches(actor, exp, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch)[0]:
        logp, _ = policy_forward(actor, mb)
        ratio = torch.exp(logp - mb.old_logprobs)
        assert torch.equal(ratio[mb.response_mask.bool()], torch.ones(int(mb.response_mask.sum())))
        sums = _Sums()
        _policy_micro(actor, mb, cfg, sums)
        assert sums.values["clip_frac"] == 0 and sums.values["approx_kl"] == 0
    # the reference is scored under the same tempered, truncated policy
    ref = torch.cat([policy_forward(sampled[1], mb)[0] for mb in exp.split(4)])
    assert (exp.ref_logprobs - ref * exp.response_mask).abs().max() < 1e-5


def test_old_logprobs_at_temperature_1_would_not_match_the_trained_policy(sampled):
    """Had old log-probs been taken at temperature 1 without truncation (the sampler's
    settings ignored), the first ratio of the training forward would be far from 1."""
    _, untempered, _ = _make(sampled, None)
    _, exp, _ = _make(sampled, TEMPERED)
    logp, _ = policy_forward(sampled[0], exp)
    ratio = torch.exp(logp - untempered.old_logprobs)[exp.response_mask.bool()]
    assert (ratio - 1).abs().max() > 0.5, ratio


def test_without_recompute_old_logprobs_are_the_sampling_logprobs(sampled):
    maker, exp, _ = _make(sampled, TEMPERED, recompute_logprobs=False)
    assert not maker.recompute
    t = exp.response_mask.shape[1]
    slp = sampled[3].sampling_logprobs[:, :t] * exp.response_mask
    assert torch.equal(exp.old_logprobs, slp)


def _policy_grads(actor, exp, cfg):
    """The actor's gradients of the masked sum of the PPO loss over ``exp``'s micro-batches
    (packed as training packs them)."""
    actor.zero_grad(set_to_none=True)
    for mb in model_micro_batches(actor, exp, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch)[0]:
        (_policy_micro(actor, mb, cfg, _Sums()) * mb.response_mask).sum().backward()
    grads = [p.grad.clone() for p in actor.parameters() if p.grad is not None]
    actor.zero_grad(set_to_none=True)
    return grads


def test_one_update_per_iteration_takes_old_logprobs_from_its_own_forward(sampled):
    """With one optimizer step per iteration no forward recomputes log pi_old: the update's
    own log-probs, detached, are it. The gradient equals the recomputing run's, whatever
    ``exp.old_logprobs`` holds (here the sampling log-probs shifted by 1, which would put
    every ratio at e^1, outside the clip, if they were read)."""
    actor = sampled[0]
    maker, exp, cfg = _make(sampled, TEMPERED)
    assert cfg.old_from_update and not maker.recompute
    recomputing_maker, recomputed, recomputing = _make(sampled, TEMPERED, recompute_logprobs=True)
    assert recomputing_maker.recompute and not recomputing.old_from_update
    advantages = torch.linspace(-1, 1, exp.response_mask.numel()).view_as(exp.response_mask) * exp.response_mask
    exp.advantages, recomputed.advantages = advantages, advantages.clone()
    exp.old_logprobs = exp.old_logprobs - 1.0
    actor.train()
    sums = _Sums()
    _policy_micro(actor, exp, cfg, sums)
    assert sums.values["clip_frac"] == 0 and sums.values["approx_kl"] == 0
    got, want = _policy_grads(actor, exp, cfg), _policy_grads(actor, recomputed, recomputing)
    assert len(got) == len(want) > 0
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # the control: the same shifted old log-probs, read as pi_old, change the gradient
    shifted = _make(sampled, TEMPERED, recompute_logprobs=False)[1]
    shifted.advantages, shifted.old_logprobs = advantages, exp.old_logprobs
    assert not all(torch.equal(a, b) for a, b in zip(_policy_grads(actor, shifted, PPOConfig(
        global_batch_size=4, rollout_n=2, micro_batch_size=4, advantage_estimator="grpo",
        recompute_logprobs=False)), want))
