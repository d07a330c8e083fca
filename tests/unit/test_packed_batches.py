"""Packed micro-batches (``models.packed``, ``--max-tokens-per-micro-batch``): rows concatenated
without padding, each attending within itself, give the padded forward's log-probs, values,
reward scores and one optimizer step's weights.

Tolerance (fp32): outputs within 1e-5 absolute (the attention and the matmuls run over other
shapes, so the bits may differ; the observed gap is ~3e-7), each tensor's optimizer step within
1e-5 of its largest element (plus two fp32 roundings of the weights). Budgets of 12 tokens make micro-batches where a 2-token row (a 1-token
prompt and a 1-token response) shares a pack and a 12-token row fills one alone.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rlhf.config import ConfigError, OptimConfig, PPOConfig, preset
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.models.packed import pack_rows, packed_forward, supports_packing
from megatron_rlhf.rlhf import update
from megatron_rlhf.rlhf.batch import Experience, model_micro_batches, pack
from megatron_rlhf.rlhf.experience import response_logprobs, response_values, reward_model_scores

PROMPTS = [[3, 4, 5], [6], [7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18, 19]]
RESPONSES = [[20, 21], [22], [23, 24, 25, 26, 27, 28, 29], [30, 31, 32, 33, 34], [35, 36, 37, 38, 39, 40]]
TOLERANCE = 1e-5
BUDGETS = [None, 12, 30]  # None: 2 rows of the longest; 12: the longest row (5 + 7) fills one


def _experience(advantages: bool = False) -> Experience:
    ids, att, mask = pack(PROMPTS, RESPONSES, pad_id=0, device="cpu")
    z = torch.zeros_like(mask)
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(mask.shape, generator=g) * mask if advantages else z
    old = (-2.0 + 0.3 * torch.randn(mask.shape, generator=g)) * mask
    return Experience(input_ids=ids, attention_mask=att, response_mask=mask, old_logprobs=old,
                      ref_logprobs=z, scores=torch.zeros(len(PROMPTS)), kl=z, advantages=adv)


@pytest.fixture(scope="module")
def models(world1):
    actor = build_model(preset("tiny"), "actor", world1, dtype=torch.float32, seed=3)  # GQA, 4 heads in 2 groups
    reward = build_model(preset("tiny-mha"), "reward", world1, dtype=torch.float32, seed=4)
    torch.nn.init.normal_(reward.output_layer.weight)  # a non-trivial value head
    return actor, reward


def test_pack_rows_layout():
    exp = _experience()
    lengths = exp.attention_mask.sum(1).tolist()
    p = pack_rows(exp.input_ids, exp.attention_mask, lengths, length=40, multiple=4)
    assert p.tokens == 40 and p.params.lengths == (5, 2, 12, 7, 12, 2)  # the rows, then padding
    assert p.params.cu_seqlens_q.tolist() == [0, 5, 7, 19, 26, 38, 40] and p.params.max_seqlen_q == 12
    want = [t for row in (a + b for a, b in zip(PROMPTS, RESPONSES)) for t in row]
    assert p.input_ids[0, :38].tolist() == want and p.input_ids[0, 38:].tolist() == [0, 0]
    real = exp.attention_mask.bool()
    assert torch.equal(p.input_ids[0][p.index][real], exp.input_ids[real])  # index: padded -> packed
    assert (p.index[~real] == 0).all()
    assert pack_rows(exp.input_ids, exp.attention_mask, lengths, multiple=4).tokens == 40  # 38 rounded up
    with pytest.raises(ValueError, match="do not fit"):
        pack_rows(exp.input_ids, exp.attention_mask, lengths, length=37)


def test_micro_batches_fill_the_budget_and_refuse_a_longer_row():
    exp = _experience()
    parts, order = exp.micro_batches(2, packed=True, max_tokens=12)
    # longest responses first: rows 2 (12 tokens), 4 (12), 3 (7) and 0 (5) together, 1 (2)
    assert [p.packed.params.lengths for p in parts] == [(12,), (12,), (7, 5), (2,)]
    assert order.tolist() == [2, 4, 3, 0, 1]
    one = exp.micro_batches(2, one_width=True, packed=True, max_tokens=16, multiple=4)[0]
    assert {p.packed.tokens for p in one} == {16}  # pipeline schedules: one shape
    with pytest.raises(ValueError, match="--max-tokens-per-micro-batch"):
        exp.micro_batches(2, packed=True, max_tokens=11)
    assert exp.micro_batches(2)[0][0].packed is None and exp.select([0]).packed is None


@pytest.mark.parametrize("budget", BUDGETS)
def test_packed_experience_equals_padded(models, budget):
    actor, reward = models
    assert supports_packing(actor) and supports_packing(reward)
    exp = _experience()
    for fn, model in ((response_logprobs, actor), (response_values, reward), (reward_model_scores, reward)):
        padded = fn(model, exp, 2, max_tokens=0)
        packed = fn(model, exp, 2, max_tokens=budget)
        assert padded.abs().max() > 0.1
        assert (packed - padded).abs().max() <= TOLERANCE, fn.__name__
        if padded.dim() == 2:
            assert (packed[exp.response_mask == 0] == 0).all()


def test_a_packed_row_attends_within_itself(models):
    """Each row's outputs, packed behind others, equal its forward alone: no attention across
    rows (a leak would change them by far more than the tolerance), positions restarting."""
    actor, _ = models
    exp = _experience()
    lengths = exp.attention_mask.sum(1).tolist()
    with torch.no_grad():
        out = packed_forward(actor, pack_rows(exp.input_ids, exp.attention_mask, lengths))
        for i in range(len(PROMPTS)):
            row = exp.select([i])
            alone = packed_forward(actor, pack_rows(row.input_ids, row.attention_mask, lengths[i:i + 1]))
            real = exp.attention_mask[i].bool()
            assert (out[i][real] - alone[0][real]).abs().max() <= TOLERANCE, i


def _step(world1, budget, head_chunk: int = 0) -> dict:
    """The actor's weights after one PPO step over the 5 rows (Adam with an epsilon of 1 and a
    learning rate of 1: the step is about the gradient, where a first Adam step is about
    lr x its sign, which rounding can flip for a gradient near 0)."""
    from megatron_rlhf.models.forward import set_head_chunk
    from megatron_rlhf.rlhf.optim import build_trainee

    actor = build_model(preset("tiny"), "actor", world1, dtype=torch.float32, seed=3)
    set_head_chunk(actor, head_chunk)
    optim = OptimConfig(lr=1.0, clip_grad=0.0, adam_eps=1.0, use_distributed_optimizer=False)
    t = build_trainee(actor, world1, optim, 1.0)
    cfg = PPOConfig(advantage_estimator="grpo", kl_coef=0.0, global_batch_size=4, rollout_n=2,
                    micro_batch_size=2, max_tokens_per_micro_batch=budget, recompute_logprobs=True)
    update.train_actor(t, _experience(advantages=True), cfg)
    return {n: p.detach().clone() for n, p in actor.named_parameters()}


@pytest.mark.parametrize("head_chunk", [0, 8], ids=["logits", "chunked-head"])
def test_one_optimizer_step_packed_equals_padded(world1, head_chunk):
    start = {n: p.detach().clone() for n, p in
             build_model(preset("tiny"), "actor", world1, dtype=torch.float32, seed=3).named_parameters()}
    padded = _step(world1, 0, head_chunk)
    for budget in (None, 12):
        packed = _step(world1, budget, head_chunk)
        for n, w in padded.items():
            step = (w - start[n]).abs().max()
            assert step > 0, f"the step must move {n}"
            # the steps' gap within the tolerance, and the rounding of the weights they land on
            ulp = torch.finfo(torch.float32).eps * w.abs().max()
            assert (packed[n] - w).abs().max() <= TOLERANCE * step + 2 * ulp, (budget, n)


def test_a_budget_below_the_longest_sequence_is_refused():
    cfg = PPOConfig(max_tokens_per_micro_batch=100)
    cfg.check_generation(max_new_tokens=36, max_prompt_length=64)
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch 100 is less than the longest"):
        cfg.check_generation(max_new_tokens=37, max_prompt_length=64)
    with pytest.raises(ConfigError, match=">= 0"):
        PPOConfig(max_tokens_per_micro_batch=-1)


def test_models_that_cannot_pack_run_padded(models, monkeypatch):
    actor, _ = models
    from megatron_rlhf.models import packed

    monkeypatch.setattr(packed, "supports_packing", lambda model: False)
    assert all(p.packed is None for p in model_micro_batches(actor, _experience(), 2)[0])
