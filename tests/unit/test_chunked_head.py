"""The chunked LM head (``rlhf.chunked_head``): the log-probs, the entropy and every gradient of
the PPO loss equal the unchunked head's, and no ``tokens x vocab`` tensor is made in a step.

A tiny random actor (vocabulary 2000, padded to 2048; hidden 64) scores 4 responses of 128
tokens in all, in chunks of 24 (the last one partial). Gradients are compared per tensor to within 1e-5 of the
tensor's largest element: the chunked head sums the weight's gradient over the chunks, the
unchunked one over all tokens at once, in fp32 (the bits may differ; the observed gap is ~1e-7).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron_rlhf.config import ConfigError, GenerationConfig, ParallelConfig, PPOConfig, preset
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.models.forward import head_chunk, set_head_chunk
from megatron_rlhf.rlhf import chunked_head
from megatron_rlhf.rlhf.batch import Experience, pack
from megatron_rlhf.rlhf.experience import response_logprobs
from megatron_rlhf.rlhf.update import _policy_micro, _Sums, policy_forward

VOCAB, CHUNK = 2000, 24
PROMPTS, RESPONSES = (3, 5, 2, 4), (37, 19, 45, 27)  # 128 response tokens: 6 chunks, the last of 8
TOKENS = sum(RESPONSES)
POLICIES = [None, GenerationConfig(temperature=0.7), GenerationConfig(temperature=0.7, top_k=20),
            GenerationConfig(temperature=1.3, top_p=0.6)]


def _name(policy) -> str:
    return "none" if policy is None else f"T{policy.temperature}-k{policy.top_k}-p{policy.top_p}"


@pytest.fixture(scope="module", params=["tiny", "tiny-untied"])
def actor(request, world1):
    """A tiny actor, tied embeddings or not, in training mode."""
    # (a vocabulary large enough that tokens x vocab exceeds every activation of the trunk)
    model = build_model(preset(request.param, vocab_size=VOCAB), "actor", world1, dtype=torch.float32, seed=3)
    model.train()
    return model


def _experience(policy, advantages: bool = True) -> Experience:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 250, (n,), generator=g).tolist() for n in PROMPTS]
    responses = [torch.randint(2, 250, (n,), generator=g).tolist() for n in RESPONSES]
    ids, att, mask = pack(prompts, responses, 0, torch.device("cpu"))
    zeros = torch.zeros_like(mask)
    adv = torch.randn(mask.shape, generator=g) * mask if advantages else zeros
    return Experience(input_ids=ids, attention_mask=att, response_mask=mask, old_logprobs=zeros,
                      ref_logprobs=zeros, scores=torch.zeros(len(prompts)), kl=zeros, advantages=adv,
                      policy=policy)


def _ppo(entropy_coef: float) -> PPOConfig:
    # grpo: ratio 1 (pi_old from the update itself), a KL loss to a reference of log-prob 0
    return PPOConfig(global_batch_size=4, micro_batch_size=4, entropy_coef=entropy_coef,
                     advantage_estimator="grpo", rollout_n=2, kl_coef=0.1)


def _step(actor, exp: Experience, chunk: int, cfg: PPOConfig):
    """One micro-batch's PPO loss through the actor's forward with its head chunked by
    ``chunk`` (0: not): ``(log-probs, entropy, {parameter: gradient})``."""
    set_head_chunk(actor, chunk)
    actor.zero_grad(set_to_none=True)
    try:
        (_policy_micro(actor, exp, cfg, _Sums()) * exp.response_mask).sum().backward()
        with torch.no_grad():
            logp, entropy = policy_forward(actor, exp)
    finally:
        set_head_chunk(actor, 0)
    grads = {n: p.grad.clone() for n, p in actor.named_parameters() if p.grad is not None}
    actor.zero_grad(set_to_none=True)
    mask = exp.response_mask
    return logp * mask, entropy * mask, grads


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal to within 1e-5 of ``want``'s largest magnitude (fp32 sums in another order)."""
    return bool((got - want).abs().max() <= 1e-5 * want.abs().max().clamp(min=1e-30))


def _grads_equal(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(_close(got[n], want[n]) for n in want)


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
@pytest.mark.parametrize("policy", POLICIES, ids=_name)
def test_gradients_equal_the_unchunked_heads(actor, policy, entropy_coef):
    """The PPO loss (clipped ratio, KL term, entropy bonus when its coefficient is set) over a
    tempered and/or truncated policy: values and every parameter's gradient."""
    exp, cfg = _experience(policy), _ppo(entropy_coef)
    lp, ent, grads = _step(actor, exp, CHUNK, cfg)
    lp0, ent0, grads0 = _step(actor, exp, 0, cfg)
    assert len(grads0) == len(list(actor.parameters()))
    assert (lp - lp0).abs().max() <= 1e-5 and (ent - ent0).abs().max() <= 1e-5
    assert _grads_equal(grads, grads0)


def test_the_entropys_own_gradient_is_the_unchunked_heads(actor):
    """The entropy alone as the loss (its gradient through the chunks' recomputed logits)."""
    exp = _experience(GenerationConfig(temperature=0.7, top_k=20), advantages=False)
    cfg = PPOConfig(global_batch_size=4, micro_batch_size=4, entropy_coef=1.0, advantage_estimator="grpo",
                    rollout_n=2, kl_coef=0.0)
    _, _, grads = _step(actor, exp, CHUNK, cfg)
    _, _, grads0 = _step(actor, exp, 0, cfg)
    assert all(g.abs().max() > 0 for g in grads0.values())  # advantages 0: the entropy's alone
    assert _grads_equal(grads, grads0)


def test_the_comparison_sees_a_wrong_temperature_or_a_lost_chunk(actor, monkeypatch):
    """Controls: the tolerance above is tight enough to see a temperature off by 0.05, or
    the gradient of one chunk of six missing."""
    cfg = _ppo(0.01)
    _, _, want = _step(actor, _experience(GenerationConfig(temperature=0.7)), 0, cfg)
    _, _, off = _step(actor, _experience(GenerationConfig(temperature=0.75)), CHUNK, cfg)
    assert not _grads_equal(off, want)
    real, calls = chunked_head._chunk, []

    def lose_the_second(*args):
        calls.append(1)
        out = real(*args)
        return tuple(t.detach() for t in out) if len(calls) == 2 else out

    monkeypatch.setattr(chunked_head, "_chunk", lose_the_second)
    _, _, lost = _step(actor, _experience(GenerationConfig(temperature=0.7)), CHUNK, cfg)
    assert not _grads_equal(lost, want)


def test_experience_logprobs_equal_the_unchunked_heads(actor):
    exp = _experience(GenerationConfig(temperature=0.7, top_p=0.6))
    set_head_chunk(actor, CHUNK)
    try:
        got = response_logprobs(actor, exp, micro_batch_size=2)
    finally:
        set_head_chunk(actor, 0)
    want = response_logprobs(actor, exp, micro_batch_size=2)
    assert got.shape == want.shape and (got - want).abs().max() <= 1e-5
    assert torch.equal(got == 0, exp.response_mask == 0)


class _Tensors(TorchDispatchMode):
    """Every op's output tensors while active (forward, and the backward run on this thread)."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.seen += [(str(func), tuple(t.shape)) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out

    def largest(self, vocab: int, weight: tuple[int, int]) -> int:
        """The most elements of a tensor with a vocabulary-sized dim (the head's weight and
        its gradient aside)."""
        return max(torch.Size(s).numel() for _, s in self.seen
                   if vocab in s and s not in (weight, weight[::-1]))


def test_no_tokens_by_vocab_tensor_in_a_training_step(actor):
    """A PPO step (forward and backward, entropy bonus on, a truncated tempered policy) and
    the experience's log-prob forward make no tensor of ``tokens x vocab`` elements: the
    largest vocabulary-wide one is a chunk's. Control: the unchunked head's step does, in its
    forward and in its backward, which the recording sees."""
    vocab = actor.mrlhf_config.padded_vocab_size
    weight = (vocab, actor.config.hidden_size)
    assert TOKENS * vocab > weight[0] * weight[1]  # (the head's gradient is no tokens x vocab tensor)
    exp, cfg = _experience(GenerationConfig(temperature=0.7, top_k=20)), _ppo(0.01)
    with _Tensors() as chunked:
        _step(actor, exp, CHUNK, cfg)
        set_head_chunk(actor, CHUNK)
        try:
            response_logprobs(actor, exp, micro_batch_size=4)
        finally:
            set_head_chunk(actor, 0)
    assert max(torch.Size(s).numel() for _, s in chunked.seen) < TOKENS * vocab
    assert chunked.largest(vocab, weight) == CHUNK * vocab
    assert ("aten._log_softmax_backward_data.default", (CHUNK, VOCAB)) in chunked.seen  # (the backward seen)
    with _Tensors() as whole:
        _step(actor, exp, 0, cfg)
    big = {f for f, s in whole.seen if torch.Size(s).numel() >= TOKENS * vocab}
    assert "aten._log_softmax.default" in big and "aten._log_softmax_backward_data.default" in big


def test_a_chunk_size_is_a_number_of_tokens_and_a_value_head_is_refused(world1):
    with pytest.raises(ConfigError, match="head_chunk_tokens"):
        ParallelConfig(head_chunk_tokens=-1)
    assert ParallelConfig().head_chunk_tokens > 0  # on by default
    critic = build_model(preset("tiny"), "critic", world1, dtype=torch.float32, seed=3)
    with pytest.raises(ValueError, match="--head-chunk-tokens 0"):
        set_head_chunk(critic, CHUNK)
    set_head_chunk(critic, 0)
    assert head_chunk(critic) == 0
