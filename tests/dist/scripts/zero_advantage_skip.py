"""Under torchrun (2 ranks): the actor update's zero-advantage skip changes no weight, bit for bit.

- DP=2, overlapped gradient reduction, distributed optimizer: the ranks run different numbers
  of micro-batches, rank 1 only the one it keeps (all its advantages are 0: a backward must
  still reduce the gradients);
- PP=2 (1F1B): both stages leave out the same micro-batches."""

import contextlib

import torch

from megatron_rlhf import runtime
from megatron_rlhf.config import OptimConfig
from megatron_rlhf.parallel.groups import build_process_groups
from megatron_rlhf.parallel.layout import Layout
from megatron_rlhf.rlhf import update
from megatron_rlhf.rlhf.optim import build_trainee
from unit.test_zero_advantage_skip import HORIZON, SCORES, _actor, _cfg, _experience


def train(pg, skip: bool, scores) -> tuple[list, dict, list]:
    """(weights, metrics, micro-batches run per step) of one train_actor call."""
    actor = _actor(pg)
    exp = _experience(actor, scores, near_actor=pg.pp.size() == 1)
    t = build_trainee(actor, pg, OptimConfig(lr=1e-2, clip_grad=0.0, overlap_grad_reduce=True,
                                             use_distributed_optimizer=True), 1e-2)
    assert t.ddp.ddp_config.overlap_grad_reduce
    runs, forward_backward = [], update.forward_backward
    update.forward_backward = lambda model, mbs, *a: runs.append(len(mbs)) or forward_backward(model, mbs, *a)
    try:
        metrics = update.train_actor(t, exp, _cfg("token-mean", skip), horizon=HORIZON)
    finally:
        update.forward_backward = forward_backward
    t.gather_params()
    return [p.detach().clone() for p in actor.parameters()], metrics, runs


def main():
    runtime.quiet_third_party_warnings()
    rank, _ = runtime.init_distributed()
    pg = build_process_groups(Layout(dp=2))
    scores = SCORES if rank == 0 else [0.5] * len(SCORES)  # rank 1: one group reward, A = 0
    off, m_off, runs_off = train(pg, False, scores)
    on, m_on, runs_on = train(pg, True, scores)
    assert runs_off == [4, 4], runs_off  # two PPO epochs of 4 micro-batches of 2
    assert runs_on == ([2, 2] if rank == 0 else [1, 1]), runs_on
    for a, b in zip(off, on, strict=True):
        assert torch.equal(a, b), "the skip changed a weight"
    assert m_on["skipped_fraction"] == (4 + 6) / 16, m_on["skipped_fraction"]
    assert m_on["actor_grad_norm"] == m_off["actor_grad_norm"] > 0

    pg = build_process_groups(Layout(pp=2))
    off, m_off, runs_off = train(pg, False, SCORES)
    on, m_on, runs_on = train(pg, True, SCORES)
    assert (runs_off, runs_on) == ([4, 4], [2, 2]), (runs_off, runs_on)
    for a, b in zip(off, on, strict=True):
        assert torch.equal(a, b), f"stage {rank}: the skip changed a weight"
    assert m_on["skipped_fraction"] == 0.5 and m_on["policy_loss"] == m_off["policy_loss"]
    assert m_on["actor_grad_norm"] == m_off["actor_grad_norm"] > 0
    if rank == 0:
        print("OK")
    runtime.shutdown()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
