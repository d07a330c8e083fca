"""Advantage estimators and PPO losses against explicit per-sample, per-token loops."""

from __future__ import annotations

import math
import socket

import pytest
import torch
import torch.distributed as dist

from megatron_rlhf.rlhf import advantages as adv
from megatron_rlhf.rlhf import kl as K
from megatron_rlhf.rlhf import losses, policy

SEEDS = (0, 1, 2)
TOL = dict(rtol=1e-10, atol=1e-10)


def _lengths(seed: int, B: int, T: int) -> list[int]:
    """Mixed response lengths: one empty row, one full row, the rest random."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g).tolist()
    lengths[seed % B] = 0
    lengths[(seed + 1) % B] = T
    return lengths


def _batch(seed: int, B: int = 8, T: int = 7):
    """Random float64 ``(x, y, z, mask, lengths)`` with garbage (large values) at padding."""
    g = torch.Generator().manual_seed(seed)
    lengths = _lengths(seed, B, T)
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(T)] for n in lengths],
                        dtype=torch.float64)
    x, y, z = (torch.randn(B, T, generator=g, dtype=torch.float64) for _ in range(3))
    pad = mask == 0
    x[pad], y[pad], z[pad] = 1e6, -1e6, 1e6
    return x, y, z, mask, lengths


def _assert_rows(out: torch.Tensor, ref: list[list[float]]) -> None:
    torch.testing.assert_close(out, torch.tensor(ref, dtype=torch.float64), **TOL)


# ---------------------------------------------------------------------- masked statistics

@pytest.mark.parametrize("seed", SEEDS)
def test_masked_sum_and_mean(seed):
    x, _, _, mask, lengths = _batch(seed)
    vals = [x[b, t].item() for b, n in enumerate(lengths) for t in range(n)]
    torch.testing.assert_close(adv.masked_sum(x, mask).item(), math.fsum(vals), **TOL)
    torch.testing.assert_close(adv.masked_mean(x, mask).item(), math.fsum(vals) / len(vals), **TOL)
    row_means = [math.fsum(x[b, t].item() for t in range(n)) / n if n else 0.0
                 for b, n in enumerate(lengths)]
    torch.testing.assert_close(adv.masked_mean(x, mask, dim=1),
                               torch.tensor(row_means, dtype=torch.float64), **TOL)


def _whiten_ref(x, lengths, shift_mean, eps):
    vals = [x[b, t].item() for b, n in enumerate(lengths) for t in range(n)]
    mean = math.fsum(vals) / len(vals)
    var = math.fsum((v - mean) ** 2 for v in vals) / len(vals)
    out = []
    for b, n in enumerate(lengths):
        row = []
        for t in range(x.shape[1]):
            if t < n:
                w = (x[b, t].item() - mean) / math.sqrt(var + eps)
                row.append(w if shift_mean else w + mean)
            else:
                row.append(0.0)
        out.append(row)
    return out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten(seed, shift_mean):
    x, _, _, mask, lengths = _batch(seed)
    x = 3.0 * x + 2.0  # a non-trivial mean and scale
    out = adv.masked_whiten(x, mask, shift_mean=shift_mean, eps=1e-8)
    _assert_rows(out, _whiten_ref(x, lengths, shift_mean, 1e-8))
    out_bool = adv.masked_whiten(x, mask.bool(), shift_mean=shift_mean, eps=1e-8)
    torch.testing.assert_close(out_bool, out, rtol=0, atol=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_masked_whiten_over_group_equals_local():
    created = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                                rank=0, world_size=1)
        created = True
    try:
        if dist.get_world_size() != 1:
            pytest.skip("needs a one-process world")
        group = dist.new_group([0])
        for seed in SEEDS:
            x, _, _, mask, _ = _batch(seed)
            for shift_mean in (True, False):
                torch.testing.assert_close(
                    adv.masked_whiten(x, mask, group=group, shift_mean=shift_mean),
                    adv.masked_whiten(x, mask, shift_mean=shift_mean), rtol=0, atol=1e-12)
    finally:
        if created:
            dist.destroy_process_group()


# ----------------------------------------------------------------------------- advantages

def _gae_ref(r, v, lengths, gamma, lam):
    A, R = [], []
    for b, n in enumerate(lengths):
        a_row, last = [0.0] * r.shape[1], 0.0
        for t in reversed(range(n)):
            v_next = v[b, t + 1].item() if t + 1 < n else 0.0
            delta = r[b, t].item() + gamma * v_next - v[b, t].item()
            last = delta + gamma * lam * last
            a_row[t] = last
        A.append(a_row)
        R.append([a_row[t] + v[b, t].item() if t < n else 0.0 for t in range(r.shape[1])])
    return A, R


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (1.0, 0.95), (0.9, 0.0)])
def test_gae(seed, gamma, lam):
    r, v, _, mask, lengths = _batch(seed)
    A, R = adv.gae(r, v, mask, gamma, lam)
    A_ref, R_ref = _gae_ref(r, v, lengths, gamma, lam)
    _assert_rows(A, A_ref)
    _assert_rows(R, R_ref)


def test_gae_one_one_returns_are_reward_to_go():
    r, v, _, mask, lengths = _batch(5)
    _, R = adv.gae(r, v, mask, 1.0, 1.0)
    ref = [[math.fsum(r[b, s].item() for s in range(t, n)) if t < n else 0.0
            for t in range(r.shape[1])] for b, n in enumerate(lengths)]
    _assert_rows(R, ref)


def _grpo_ref(scores, group_size, lengths, T, eps, scale):
    out = []
    for b, n in enumerate(lengths):
        start = b // group_size * group_size
        grp = [scores[i].item() for i in range(start, start + group_size)]
        mean = math.fsum(grp) / group_size
        if group_size == 1:
            a = 0.0
        elif scale:
            std = math.sqrt(math.fsum((s - mean) ** 2 for s in grp) / (group_size - 1))
            a = (scores[b].item() - mean) / (std + eps)
        else:
            a = scores[b].item() - mean
        out.append([a if t < n else 0.0 for t in range(T)])
    return out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("group_size", [1, 4])
@pytest.mark.parametrize("scale", [True, False])
def test_grpo_advantages(seed, group_size, scale):
    _, _, _, mask, lengths = _batch(seed)
    scores = torch.randn(8, generator=torch.Generator().manual_seed(seed + 100),
                         dtype=torch.float64)
    out = adv.grpo_advantages(scores, group_size, mask, eps=1e-6, scale_by_std=scale)
    _assert_rows(out, _grpo_ref(scores, group_size, lengths, mask.shape[1], 1e-6, scale))


def test_grpo_rejects_batch_not_divisible():
    with pytest.raises(ValueError, match="multiple of the group size 4"):
        adv.grpo_advantages(torch.zeros(6), 4, torch.ones(6, 3))


def _shaped_returns_ref(scores, kl, lengths, T, kl_coef, gamma):
    """Per row, in plain Python: reward -kl_coef*kl_t at each token plus the score at the
    last; the return G_t = r_t + gamma * G_{t+1}; 0 at padding."""
    out = []
    for i, n in enumerate(lengths):
        r = [-kl_coef * float(kl[i, t]) for t in range(n)]
        if n:
            r[-1] += float(scores[i])
        g, row = 0.0, [0.0] * T
        for t in reversed(range(n)):
            g = r[t] + gamma * g
            row[t] = g
        out.append(row)
    return out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("group_size", [2, 4])
def test_rloo_advantages(seed, group_size):
    """Each score minus the mean of the other scores of its group, then KL-shaped
    undiscounted returns."""
    kl, _, _, mask, lengths = _batch(seed)
    scores = torch.randn(8, generator=torch.Generator().manual_seed(seed + 7), dtype=torch.float64)
    baselined = []
    for i in range(8):
        start = i - i % group_size
        others = [float(scores[j]) for j in range(start, start + group_size) if j != i]
        baselined.append(float(scores[i]) - sum(others) / len(others))
    out = adv.rloo_advantages(scores, kl, mask, group_size, kl_coef=0.1)
    _assert_rows(out, _shaped_returns_ref(baselined, kl, lengths, mask.shape[1], 0.1, 1.0))
    with pytest.raises(ValueError, match="groups of >= 2 samples"):
        adv.rloo_advantages(scores, kl, mask, 1, kl_coef=0.1)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_advantages(seed, gamma):
    """KL-shaped discounted returns, whitened over every response token of the batch."""
    kl, _, _, mask, lengths = _batch(seed)
    scores = torch.randn(8, generator=torch.Generator().manual_seed(seed + 11), dtype=torch.float64)
    returns = _shaped_returns_ref(scores, kl, lengths, mask.shape[1], 0.05, gamma)
    flat = [returns[i][t] for i, n in enumerate(lengths) for t in range(n)]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((x - mean) ** 2 for x in flat) / len(flat) + 1e-8)
    want = [[(returns[i][t] - mean) / std if t < n else 0.0 for t in range(mask.shape[1])]
            for i, n in enumerate(lengths)]
    _assert_rows(adv.reinforce_pp_advantages(scores, kl, mask, kl_coef=0.05, gamma=gamma), want)


def test_advantage_estimator_names():
    for name in adv.ADVANTAGE_ESTIMATORS:
        adv.check_advantage_estimator(name)
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'x'; valid: gae, grpo, rloo, reinforce\+\+"):
        adv.check_advantage_estimator("x")


@pytest.mark.parametrize("name", ["gae", "grpo", "rloo", "reinforce++"])
def test_estimate_by_name(name):
    """:func:`adv.estimate` dispatches every registered name to its estimator, bit for bit."""
    from megatron_rlhf.config import PPOConfig
    from megatron_rlhf.rlhf.batch import Experience

    assert tuple(adv.ESTIMATORS) == adv.ADVANTAGE_ESTIMATORS
    g = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float64)
    scores, kl = torch.randn(4, generator=g, dtype=torch.float64), torch.randn(4, 4, generator=g, dtype=torch.float64)
    values = torch.randn(4, 4, generator=g, dtype=torch.float64) * mask
    zeros = torch.zeros_like(mask)
    exp = Experience(input_ids=torch.zeros(4, 6, dtype=torch.long), attention_mask=torch.ones(4, 6),
                     response_mask=mask, old_logprobs=zeros, ref_logprobs=zeros, scores=scores, kl=kl,
                     advantages=zeros, values=values)
    cfg = PPOConfig(advantage_estimator=name, rollout_n=2, gamma=0.9, lam=0.8)
    adv.estimate(exp, cfg)
    if name == "gae":
        a, r = adv.gae(adv.token_rewards(scores, kl, mask, cfg.kl_coef), values, mask, 0.9, 0.8)
        assert torch.equal(exp.advantages, adv.masked_whiten(a, mask)) and torch.equal(exp.returns, r)
        return
    want = {"grpo": lambda: adv.grpo_advantages(scores, 2, mask),
            "rloo": lambda: adv.rloo_advantages(scores, kl, mask, 2, cfg.kl_coef),
            "reinforce++": lambda: adv.reinforce_pp_advantages(scores, kl, mask, cfg.kl_coef, 0.9)}[name]()
    assert torch.equal(exp.advantages, want) and exp.returns is None


# --------------------------------------------------------------------------------- losses

def _kl_ref(lp: float, ref: float, estimator: str) -> float:
    d = lp - ref
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "abs":
        return abs(d)
    lr = min(max(ref - lp, -20.0), 20.0)
    return min(math.exp(lr) - lr - 1.0, 10.0)  # k3 clamped to 10, as verl


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("estimator", K.KL_ESTIMATORS)
def test_kl_estimate(seed, estimator):
    lp, ref, _, _, _ = _batch(seed)
    lp, ref = lp.clamp(-5, 5), ref.clamp(-5, 5)
    out = K.kl_estimate(lp, ref, estimator)
    B, T = lp.shape
    _assert_rows(out, [[_kl_ref(lp[b, t].item(), ref[b, t].item(), estimator)
                        for t in range(T)] for b in range(B)])
    if estimator in ("k2", "k3", "abs"):
        assert (out >= 0).all()


def test_k3_clamps_log_ratio_and_value():
    """The log-ratio is clamped to +-20 before exp, and k3 to at most 10 (verl's bounds): one
    token at log(pi_ref/pi) = 30 would otherwise add e^20 - 21 = 4.85e8 to the loss."""
    lp = torch.tensor([[-1000.0, 0.0, -30.0, -2.0, 0.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[0.0, -1000.0, 0.0, 0.0, -9.0]], dtype=torch.float64)
    out = K.kl_estimate(lp, ref, "k3")
    assert K.K3_CLAMP == 10.0
    # log(ref/pi) = 1000, -1000, 30: past the bound; 2: exp(2) - 3 = 4.39 inside; -9: 9 - 1 + e^-9
    torch.testing.assert_close(out[0].tolist(), [10.0, 10.0, 10.0, math.exp(2.0) - 3.0,
                                                 math.exp(-9.0) + 8.0], **TOL)
    out.sum().backward()
    assert lp.grad[0, :3].tolist() == [0.0, 0.0, 0.0]  # clamped: a constant
    torch.testing.assert_close(lp.grad[0, 3].item(), 1.0 - math.exp(2.0), **TOL)  # d/dlp of e^(ref-lp) + lp - ref - 1


def test_kl_estimator_names():
    for name in K.KL_ESTIMATORS:
        K.check_kl_estimator(name)
    with pytest.raises(ValueError, match=r"unknown KL estimator 'k4'; valid: k1, k2, k3, abs"):
        K.check_kl_estimator("k4")
    with pytest.raises(ValueError, match="k4"):
        K.kl_estimate(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


@pytest.mark.parametrize("seed", SEEDS)
def test_token_rewards(seed):
    kl, _, _, mask, lengths = _batch(seed)
    scores = torch.randn(8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    out = adv.token_rewards(scores, kl, mask, kl_coef=0.05)
    ref = []
    for b, n in enumerate(lengths):
        row = [-0.05 * kl[b, t].item() if t < n else 0.0 for t in range(kl.shape[1])]
        if n:
            row[n - 1] += scores[b].item()
        ref.append(row)
    _assert_rows(out, ref)


def _logits(seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return 4.0 * torch.randn(3, 5, 11, generator=g, dtype=torch.float64).to(dtype), g


@pytest.mark.parametrize("seed", SEEDS)
def test_logprobs_from_logits(seed):
    logits, g = _logits(seed)
    tokens = torch.randint(0, 11, (3, 5), generator=g)
    out = policy.logprobs_from_logits(logits, tokens)
    ref = []
    for b in range(3):
        row = []
        for t in range(5):
            zs = [logits[b, t, v].item() for v in range(11)]
            top = max(zs)
            lse = top + math.log(math.fsum(math.exp(z - top) for z in zs))
            row.append(zs[tokens[b, t].item()] - lse)
        ref.append(row)
    _assert_rows(out, ref)


@pytest.mark.parametrize("seed", SEEDS)
def test_entropy_from_logits(seed):
    logits, _ = _logits(seed)
    out = policy.entropy_from_logits(logits)
    ref = []
    for b in range(3):
        row = []
        for t in range(5):
            zs = [logits[b, t, v].item() for v in range(11)]
            total = math.fsum(math.exp(z) for z in zs)
            row.append(-math.fsum(math.exp(z) / total * math.log(math.exp(z) / total) for z in zs))
        ref.append(row)
    _assert_rows(out, ref)


def test_bf16_logits_are_computed_in_float32():
    logits, g = _logits(0, torch.bfloat16)
    tokens = torch.randint(0, 11, (3, 5), generator=g)
    lp = policy.logprobs_from_logits(logits, tokens)
    ent = policy.entropy_from_logits(logits)
    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp, policy.logprobs_from_logits(logits.float(), tokens),
                               rtol=0, atol=0)
    torch.testing.assert_close(ent, policy.entropy_from_logits(logits.float()), rtol=0, atol=0)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("clip_eps,clip_high", [(0.2, None), (0.2, 0.28), (0.1, 0.3)])
def test_policy_loss(seed, clip_eps, clip_high):
    lp, old, a, _, _ = _batch(seed)
    old = lp + 0.3 * old.clamp(-3, 3)  # ratios spread around 1, many outside the clip range
    loss, clipped = losses.policy_loss(lp, old, a, clip_eps, clip_high)
    high = clip_eps if clip_high is None else clip_high
    ref_loss, ref_clip = [], []
    for b in range(lp.shape[0]):
        lrow, crow = [], []
        for t in range(lp.shape[1]):
            ratio = math.exp(lp[b, t].item() - old[b, t].item())
            A = a[b, t].item()
            u = -A * ratio
            c = -A * min(max(ratio, 1 - clip_eps), 1 + high)
            lrow.append(max(u, c))
            crow.append(c > u)
        ref_loss.append(lrow)
        ref_clip.append(crow)
    _assert_rows(loss, ref_loss)
    assert clipped.tolist() == ref_clip
    assert 0 < sum(map(sum, ref_clip)) < lp.numel()  # the test exercises both branches


def test_policy_loss_asymmetric_clip_bounds():
    ratio = torch.tensor([[1.25, 1.25, 0.75]], dtype=torch.float64)
    A = torch.tensor([[1.0, 1.0, -1.0]], dtype=torch.float64)
    lp = ratio.log()
    sym, sym_c = losses.policy_loss(lp, torch.zeros_like(lp), A, 0.2)
    asym, asym_c = losses.policy_loss(lp, torch.zeros_like(lp), A, 0.2, clip_eps_high=0.28)
    torch.testing.assert_close(sym, torch.tensor([[-1.2, -1.2, 0.8]], dtype=torch.float64), **TOL)
    torch.testing.assert_close(asym, torch.tensor([[-1.25, -1.25, 0.8]], dtype=torch.float64),
                               **TOL)
    assert sym_c.tolist() == [[True, True, True]]
    assert asym_c.tolist() == [[False, False, True]]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("clip_eps", [None, 0.2])
def test_value_loss(seed, clip_eps):
    v, old, R, _, _ = _batch(seed)
    old = v + 0.3 * old.clamp(-3, 3)
    loss, clipped = losses.value_loss(v, old, R, clip_eps)
    ref_loss, ref_clip = [], []
    for b in range(v.shape[0]):
        lrow, crow = [], []
        for t in range(v.shape[1]):
            vv, oo, rr = v[b, t].item(), old[b, t].item(), R[b, t].item()
            u = (vv - rr) ** 2
            if clip_eps is None:
                lrow.append(0.5 * u)
                crow.append(False)
            else:
                vc = oo + min(max(vv - oo, -clip_eps), clip_eps)
                c = (vc - rr) ** 2
                lrow.append(0.5 * max(u, c))
                crow.append(c > u)
        ref_loss.append(lrow)
        ref_clip.append(crow)
    _assert_rows(loss, ref_loss)
    assert clipped.tolist() == ref_clip
    if clip_eps is not None:
        assert 0 < sum(map(sum, ref_clip)) < v.numel()
