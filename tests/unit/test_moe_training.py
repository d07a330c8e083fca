"""Training mixture-of-experts models: the routers' auxiliary losses (load balancing, z-loss)
and their weighting, the expert-load metrics, and the zero-advantage skip they turn off."""

from types import SimpleNamespace

import pytest
import torch

from megatron_rlhf.config import PPOConfig, preset
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.models.moe import RouterStats, routers
from megatron_rlhf.models.pipeline import forward_backward
from megatron_rlhf.rlhf.update import zero_advantage_skip


def _micro_batch(seed: int, rows: int = 2, length: int = 9):
    ids = torch.randint(2, 256, (rows, length), generator=torch.Generator().manual_seed(seed))
    return SimpleNamespace(input_ids=ids, attention_mask=torch.ones_like(ids), prompt_len=1, packed=None)


def _router_grads(world1, micro_batches, **coeffs):
    """The routers' weight gradients of a backward of the auxiliary losses alone."""
    model = build_model(preset("tiny-mixtral", **coeffs), "actor", world1, dtype=torch.float32, seed=3)
    model.train()
    forward_backward(model, micro_batches, lambda out, mb: out.sum() * 0)
    return [r.weight.grad.clone() if r.weight.grad is not None else torch.zeros_like(r.weight)
            for r in routers(model)]


@pytest.mark.parametrize("coeff", ["moe_aux_loss_coeff", "moe_z_loss_coeff"])
def test_router_losses_are_a_mean_over_micro_batches(world1, coeff):
    """A micro-batch given twice weighs what it weighs once (the losses are means over the
    micro-batches, as megatron's schedules make them); without the coefficient no gradient
    reaches the routers through a loss that ignores the outputs."""
    a, b = _micro_batch(1), _micro_batch(2)
    once = _router_grads(world1, [a], **{coeff: 0.1})
    twice = _router_grads(world1, [a, a], **{coeff: 0.1})
    pair = _router_grads(world1, [a, b], **{coeff: 0.1})
    other = _router_grads(world1, [b], **{coeff: 0.1})
    for g1, g2, gp, gb in zip(once, twice, pair, other):
        assert g1.abs().max() > 0
        assert torch.allclose(g1, g2, rtol=1e-5, atol=1e-9)
        assert torch.allclose(gp, (g1 + gb) / 2, rtol=1e-5, atol=1e-9)
    assert all(g.abs().max() == 0 for g in _router_grads(world1, [a]))


def test_a_frozen_router_stays_as_loaded(world1):
    """--moe-freeze-router: a step changes the experts, not the routers (they get no gradient
    and no optimizer state); without it the routers move too."""
    from megatron_rlhf.config import OptimConfig
    from megatron_rlhf.models.moe import freeze_routers
    from megatron_rlhf.rlhf.optim import build_trainee

    def step(frozen):
        model = build_model(preset("tiny-mixtral"), "actor", world1, dtype=torch.float32, seed=3)
        if frozen:
            freeze_routers(model)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        t = build_trainee(model, world1, OptimConfig(lr=1e-2, clip_grad=0.0), 1e-2)
        model.train()
        forward_backward(model, [_micro_batch(5)], lambda out, mb: out.float().logsumexp(-1).mean(), t.accumulating)
        t.step()
        t.gather_params()
        return {n: not torch.equal(p, before[n]) for n, p in model.named_parameters()}

    for frozen in (True, False):
        moved = step(frozen)
        assert all(moved[n] != frozen for n in moved if n.endswith("router.weight")), moved
        assert all(moved[n] for n in moved if ".experts." in n)


def test_expert_loads_count_every_route(world1):
    model = build_model(preset("tiny-mixtral"), "actor", world1, dtype=torch.float32, seed=3)
    mb = _micro_batch(3, rows=3, length=7)
    with RouterStats(model) as stats, torch.no_grad():  # the hooks count what the routers return
        model(mb.input_ids, torch.arange(7).expand(3, 7), None)
    assert sorted(stats.loads) == [1, 2]
    for layer, load in stats.loads.items():
        assert int(load.sum()) == 3 * 7 * 2 == stats.routed[layer]  # dropless: every top-2 route
    m = stats.metrics("actor_moe")
    assert m["actor_moe_layer1_dropped"] == 0.0
    assert m["actor_moe_layer1_load_max"] >= 1.0 >= m["actor_moe_layer1_load_min"]


def test_router_losses_turn_off_the_zero_advantage_skip():
    """A zero-advantage row still has a router loss: it is not skipped."""
    base = dict(advantage_estimator="grpo", kl_coef=0.0)
    assert zero_advantage_skip(PPOConfig(**base)) is True
    assert zero_advantage_skip(PPOConfig(**base, moe_aux_loss_coeff=0.01)) is None
    assert zero_advantage_skip(PPOConfig(**base, moe_z_loss_coeff=0.001)) is None
    with pytest.raises(ValueError, match="moe_aux_loss_coeff must be >= 0"):
        PPOConfig(**base, moe_aux_loss_coeff=-1.0)
