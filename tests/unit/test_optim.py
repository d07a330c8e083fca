"""The optimizer pieces of the RLHF trainer: LR schedule, fp32 masters for bf16 models,
gradient norm and clipping."""

import math

import pytest
import torch

from megatron_rlhf.config import OptimConfig
from megatron_rlhf.rlhf.optim import (
    MixedPrecisionAdamW,
    WarmupCosine,
    build_optimizer,
    clip_gradients,
    grad_norm,
)


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                               torch.nn.Linear(16, 4)).to(dtype)


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


def test_bf16_model_steps_on_fp32_masters():
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    low, ref = _model(torch.bfloat16), _model(torch.float32)
    with torch.no_grad():  # the fp32 twin starts from the bf16 values
        for a, b in zip(ref.parameters(), low.parameters()):
            a.copy_(b.float())
    opt_low, opt_ref = build_optimizer(low, cfg, 1e-2), build_optimizer(ref, cfg, 1e-2)
    assert isinstance(opt_low, MixedPrecisionAdamW) and not isinstance(opt_ref, MixedPrecisionAdamW)
    for step in range(3):
        torch.manual_seed(step)
        grads = [torch.randn_like(p, dtype=torch.float32) for p in ref.parameters()]
        for p, g in zip(low.parameters(), grads):
            p.grad = g.to(torch.bfloat16)
        for p, g in zip(ref.parameters(), grads):
            p.grad = g.to(torch.bfloat16).float()  # the same (rounded) gradient
        opt_low.step(), opt_ref.step()
        opt_low.zero_grad(), opt_ref.zero_grad()
    for m, p, r in zip(opt_low.masters, low.parameters(), ref.parameters()):
        torch.testing.assert_close(m, r, rtol=0, atol=0)  # fp32 step, not a bf16 one
        assert p.dtype == torch.bfloat16 and torch.equal(p, m.to(torch.bfloat16))
    # a bf16-only update would lose most of these small steps: the masters kept them
    assert any(not torch.equal(m, p.float()) for m, p in zip(opt_low.masters, low.parameters()))
    # resume: masters come back exactly, the model weights follow
    state = opt_low.state_dict()
    other = _model(torch.bfloat16)
    opt_other = build_optimizer(other, cfg, 1e-2)
    opt_other.load_state_dict(state)
    for a, b in zip(opt_other.masters, opt_low.masters):
        assert torch.equal(a, b)
    for a, b in zip(other.parameters(), low.parameters()):
        assert torch.equal(a, b)


def test_grad_norm_and_clipping_single_rank():
    m = _model(torch.float32)
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    want = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in m.parameters())).item()
    assert grad_norm(m, None) == pytest.approx(want, rel=1e-12)
    before = clip_gradients(m, want / 4, None)
    assert before == pytest.approx(want, rel=1e-12)
    assert grad_norm(m, None) == pytest.approx(want / 4, rel=1e-5)
    assert clip_gradients(m, 0.0, None) == pytest.approx(want / 4, rel=1e-5)  # 0: no clip
