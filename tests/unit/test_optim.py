"""The optimizer of the RLHF trainer (megatron-core's DDP and optimizer, distributed or
not): fp32 masters for bf16 models, clipping, the warmup + cosine schedule."""

import math

import pytest
import torch

from megatron_rlhf.config import OptimConfig, preset
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.rlhf.optim import WarmupCosine, build_trainee


def test_warmup_then_cosine():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    s = WarmupCosine(opt, peak=1e-3, min_lr=1e-4, warmup=4, total=14)
    seen = []
    for _ in range(16):
        seen.append(s.current_lr)
        s.step()
    for step, lr in enumerate(seen):
        if step < 4:
            want = 1e-3 * (step + 1) / 4
        else:
            progress = min((step - 4) / 10, 1.0)
            want = 1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + math.cos(math.pi * progress))
        assert lr == pytest.approx(want, rel=1e-12), step
    assert seen[14] == seen[15] == pytest.approx(1e-4)
    fresh = WarmupCosine(opt, 1e-3, 1e-4, 4, 14)
    fresh.load_state_dict(s.state_dict())
    assert fresh.current_lr == s.current_lr


def _tiny(world1, dtype):
    return build_model(preset("tiny"), "actor", world1, dtype=dtype, seed=3)


def _reference_adamw(params, cfg, lr):
    """torch's AdamW on fp32 copies, no weight decay on 1-D tensors (norms)."""
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    groups = [{"params": [m for m in masters if m.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [m for m in masters if m.dim() < 2], "weight_decay": 0.0}]
    return masters, torch.optim.AdamW(groups, lr=lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                      eps=cfg.adam_eps)


@pytest.mark.parametrize("distributed", [True, False])
def test_megatron_optimizer_steps_fp32_masters_of_a_bf16_model(world1, distributed):
    """megatron's DDP + optimizer on a bf16 model equals AdamW on fp32 masters fed the same
    fp32 gradients, rounded to bf16 afterwards; with clipping active in one step."""
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.0, use_distributed_optimizer=distributed)
    model = _tiny(world1, torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    masters, ref = _reference_adamw(params, cfg, 1e-2)
    t = build_trainee(model, world1, cfg, 1e-2)
    for step in range(3):
        torch.manual_seed(step)
        grads = [torch.randn(p.shape) for p in params]
        clip = 2.0 if step == 1 else 0.0
        t.optimizer.config.clip_grad = clip
        for p, g in zip(params, grads):
            p.main_grad.copy_(g)  # DDP's fp32 gradient buffer
        norm = t.step()
        want = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
        assert norm == pytest.approx(want, rel=1e-5)
        scale = min(1.0, clip / (want + 1e-6)) if clip else 1.0
        for m, g in zip(masters, grads):
            m.grad = g * scale
        ref.step()
        for p, m in zip(params, masters):
            assert p.dtype == torch.bfloat16
            torch.testing.assert_close(p.float(), m.detach().to(torch.bfloat16).float(),
                                       rtol=0, atol=0)
        assert all(float(p.main_grad.abs().max()) == 0 for p in params)  # zeroed for the next
    # a bf16-only update would lose most of these small steps: the fp32 masters kept them
    assert any(not torch.equal(m.detach(), p.float()) for m, p in zip(masters, params))


@pytest.mark.parametrize("distributed", [True, False])
def test_a_bf16_model_is_the_bf16_copy_of_fp32_masters_after_a_step(world1, distributed):
    """With bf16 weights the optimizer holds an fp32 master of every trained weight and fp32
    Adam states; after a step each bf16 weight is its master rounded to bf16, and the masters
    hold more than bf16 does (they are not bf16 values widened)."""
    from megatron_rlhf.rlhf.optim import chained, inner_optimizers

    model = _tiny(world1, torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    t = build_trainee(model, world1, OptimConfig(lr=1e-3, use_distributed_optimizer=distributed), 1e-3)
    _random_step(t, params, 0)
    pairs = []
    for opt in chained(t.optimizer):
        if distributed:  # at DP=1 each shard is its whole (flattened) parameter
            groups = zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups)
        else:
            groups = zip(opt.float16_groups, opt.fp32_from_float16_groups)
        pairs += [(p, m) for model_group, masters in groups for p, m in zip(model_group, masters)]
    assert {id(p) for p, _ in pairs} == {id(p) for p in params}  # every trained weight has a master
    for p, m in pairs:
        assert p.dtype == torch.bfloat16 and m.dtype == torch.float32
        assert torch.equal(p.detach().reshape(-1), m.detach().reshape(-1).to(torch.bfloat16))
    assert any(not torch.equal(m.detach(), m.detach().to(torch.bfloat16).float()) for _, m in pairs)
    stepped = [q for inner in inner_optimizers(t.optimizer) for g in inner.param_groups for q in g["params"]]
    assert stepped and all(q.dtype == torch.float32 for q in stepped)  # Adam steps the masters
    states = [v for inner in inner_optimizers(t.optimizer) for st in inner.state.values()
              for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")]
    assert len(states) == 2 * len(params) and all(v.dtype == torch.float32 for v in states)


def test_learning_rate_follows_the_schedule(world1):
    cfg = OptimConfig(lr=1e-3)
    t = build_trainee(_tiny(world1, torch.float32), world1, cfg, 1e-3, (1e-4, 2, 6))
    seen = []
    for _ in range(8):
        seen.append([g["lr"] for g in t.optimizer.param_groups])
        t.step()
    for step, lrs in enumerate(seen):
        assert all(lr == pytest.approx(t.scheduler.lr(step)) for lr in lrs), step
    assert seen[0][0] == pytest.approx(5e-4) and seen[7][0] == pytest.approx(1e-4)


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_activation_recompute_keeps_the_gradients(world1, recompute):
    """megatron's activation recompute re-runs (parts of) layers in backward: the same loss
    and gradients as keeping every activation."""
    from megatron_rlhf.models.forward import lm_logits

    ids = torch.randint(2, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    att = torch.ones_like(ids)
    att[0, :4] = 0  # left padding
    grads = []
    for granularity in (None, recompute):
        model = build_model(preset("tiny"), "actor", world1, dtype=torch.float32, seed=3,
                            recompute=granularity)
        assert model.config.recompute_granularity == granularity
        model.train()
        calls = {"layer": 0, "core": 0}
        layer = model.decoder.layers[0]
        layer.register_forward_hook(lambda *a: calls.__setitem__("layer", calls["layer"] + 1))
        layer.self_attention.core_attention.register_forward_hook(
            lambda *a: calls.__setitem__("core", calls["core"] + 1))
        loss = lm_logits(model, ids, att).log_softmax(-1)[..., 5].mean()
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        # what ran again in backward: nothing, the whole layer, or the attention core
        want = {None: (1, 1), "full": (2, 2), "selective": (1, 2)}[granularity]
        assert (calls["layer"], calls["core"]) == want, (granularity, calls)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _random_step(t, params, seed: int) -> None:
    """One optimizer step of trainee ``t`` on random gradients."""
    torch.manual_seed(seed)
    for p in params:
        p.main_grad.copy_(torch.randn(p.shape))
    t.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_parking_the_optimizer_between_steps_changes_no_update(world1, dtype):
    """The trainer parks each optimizer in pinned host memory while other stages run
    (:func:`~megatron_rlhf.rlhf.offload.park_trainee`). The same bookkeeping with copies
    (CPU has no pinned memory): Adam states always move, fp32 masters move for a bf16
    model and stay for an fp32 one (there they are the weights), parking twice moves
    nothing more, and the updates equal those of an optimizer never parked."""
    from megatron_rlhf.rlhf.offload import optimizer_tensors, park_trainee

    moved = []

    def move(x, host):
        moved.append(host)
        return x.clone()

    finals = []
    for park in (False, True):
        model = _tiny(world1, dtype)
        params = [p for p in model.parameters() if p.requires_grad]
        t = build_trainee(model, world1, OptimConfig(lr=1e-2), 1e-2)
        weights = [p.data_ptr() for p in params]
        for step in range(3):
            _random_step(t, params, step)
            if park:
                held = optimizer_tensors(t)
                adam = [h for h, k in held if k is not None]
                masters = [h for h, k in held if k is None]
                assert len(adam) == 2 * len(params)  # exp_avg, exp_avg_sq
                assert len(masters) == (len(params) if dtype == torch.bfloat16 else 0)
                before = len(moved)
                park_trainee(t, True, move)
                park_trainee(t, True, move)  # already parked: nothing moves
                assert len(moved) - before == len(held)
                park_trainee(t, False, move)
                assert [p.data_ptr() for p in params] == weights  # the weights never moved
        finals.append([p.detach().float().clone() for p in params])
    for a, b in zip(*finals):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_releasing_the_weights_during_generation_changes_no_update(world1, dtype):
    """While the actor generates on a copy of its own, its training copy's weights wait in
    host memory (:func:`~megatron_rlhf.rlhf.offload.release_weights`, forced on CPU): every
    parameter's storage is emptied (its memory given back), released twice changes nothing,
    and the weights come back bit for bit into the same storages, so the optimizer (whose
    fp32 masters of an fp32 model are those storages) steps on as if never released."""
    from megatron_rlhf.rlhf.offload import release_weights

    finals = []
    for release in (False, True):
        model = _tiny(world1, dtype)
        params = [p for p in model.parameters() if p.requires_grad]
        t = build_trainee(model, world1, OptimConfig(lr=1e-2), 1e-2)
        for step in range(3):
            _random_step(t, params, step)
            if release:
                before = [p.detach().clone() for p in params]
                release_weights(t, True, force=True)
                assert all(p.untyped_storage().nbytes() == 0 for p in params)
                release_weights(t, True, force=True)  # already released
                release_weights(t, False, force=True)
                release_weights(t, False, force=True)  # already back
                for a, p in zip(before, params):
                    assert torch.equal(a, p)
        finals.append([p.detach().float().clone() for p in params])
    for a, b in zip(*finals):
        assert torch.equal(a, b)


def test_parking_is_decided_by_the_memory_estimate():
    """--park-optimizer auto: the states stay on the device when generation and inference
    fit beside them in the estimate, and are parked when they do not (or without an
    estimate); on and off force either way; on CPU nothing is parked."""
    from megatron_rlhf.parallel.layout import Layout
    from megatron_rlhf.plan import memory
    from megatron_rlhf.rlhf.offload import park_decision

    models = {"actor": preset("smollm2-135m"), "critic": preset("smollm2-135m")}
    lay = memory.StageLayouts(train=Layout.parse("1x1x2"), gen=Layout.parse("1x2", pipeline=False))

    def unparked(gb):
        return memory.estimate(models, memory.Cluster(nodes=1, gpus_per_node=2, gpu_memory_gb=gb), lay,
                               options=memory.MemoryOptions(park_on_host=False, reserve_gb=0.0))

    roomy = unparked(1000.0)
    gen = roomy.stage("generation")
    state = sum(v for k, v in gen.parts.items() if k.endswith(("_grads", "_optimizer")))
    # room for generation alone, not for the states beside it
    tight = unparked((max(s.total for s in roomy.stages if s.stage != "training") - state / 2) / memory.GB)
    assert tight.stage("generation").total - state <= tight.stage("generation").capacity
    park, why = park_decision("auto", True, roomy)
    assert not park and "fits them" in why
    park, why = park_decision("auto", True, tight)
    assert park and "does not fit" in why
    assert park_decision("auto", True, None)[0]
    for gpu in (roomy, tight, None):
        assert park_decision("on", True, gpu) == (True, "--park-optimizer on")
        assert park_decision("off", True, gpu) == (False, "--park-optimizer off")
        for mode in ("auto", "on", "off"):
            assert not park_decision(mode, False, gpu)[0]


def test_the_trainer_parks_only_where_decided(monkeypatch):
    """The rollout parks the trainees' optimizer states where ``park_optimizer`` says, and
    ``mem_optimizer_parked`` records it (0 on CPU, where nothing moves)."""
    from types import SimpleNamespace

    from megatron_rlhf.rlhf import offload
    from megatron_rlhf.rlhf.trainer import RLHFTrainer

    moves = []
    monkeypatch.setattr(offload, "park_trainee", lambda t, host: moves.append((t, host)))
    generator = SimpleNamespace(generate=lambda *a, **k: "samples", release=lambda: None)
    for park in (True, False):
        moves.clear()
        me = SimpleNamespace(m=SimpleNamespace(actor=None, critic="critic", draft_trainee=None),
                             park_optimizer=park, release_train_copy=False, generator=generator,
                             spec=None, migrator=None, keep_graphs=False)
        assert RLHFTrainer._generate(me, [[1]], [0], None, 0) == "samples"
        assert moves == ([("critic", True)] if park else [])
        me.m = SimpleNamespace(actor=None, critic=None, reference=None, reward_model=None, draft=None)
        assert RLHFTrainer._memory_components(me) == {"mem_optimizer_parked": 0}


def test_decode_graphs_are_kept_where_training_fits_beside_them():
    """The KV cache store and its graphs stay across rollouts when the estimate fits training
    with the generation stage's KV caches beside it; released otherwise, without an estimate,
    or without a GPU; the trainer releases them only where not kept."""
    from types import SimpleNamespace

    from megatron_rlhf.parallel.layout import Layout
    from megatron_rlhf.plan import memory
    from megatron_rlhf.rlhf.offload import keep_graphs_decision
    from megatron_rlhf.rlhf.trainer import RLHFTrainer

    models = {"actor": preset("smollm2-135m")}
    lay = memory.StageLayouts(train=Layout.parse("1x1x2"), gen=Layout.parse("1x2", pipeline=False))

    def estimate(gb):
        return memory.estimate(models, memory.Cluster(nodes=1, gpus_per_node=2, gpu_memory_gb=gb), lay,
                               options=memory.MemoryOptions(reserve_gb=0.0))

    roomy = estimate(1000.0)
    train, gen = roomy.stage("training"), roomy.stage("generation")
    store = gen.parts["kv_cache"]
    assert keep_graphs_decision(True, roomy)[0]
    # training fits alone, not with the store beside it
    tight = estimate(max(max(s.total for s in roomy.stages), train.total + store // 2) / memory.GB)
    assert tight.stage("training").fits and tight.stage("training").total + store > tight.stage("training").capacity
    keep, why = keep_graphs_decision(True, tight)
    assert not keep and "does not fit" in why, why
    assert not keep_graphs_decision(True, None)[0] and not keep_graphs_decision(False, roomy)[0]

    released = []
    generator = SimpleNamespace(generate=lambda *a, **k: "samples", release=lambda: released.append(1))
    for keep in (True, False):
        released.clear()
        me = SimpleNamespace(m=SimpleNamespace(actor=None, critic=None, draft_trainee=None), park_optimizer=False,
                             release_train_copy=False, generator=generator, spec=None, migrator=None,
                             keep_graphs=keep)
        RLHFTrainer._generate(me, [[1]], [0], None, 0)
        assert released == ([] if keep else [1])
