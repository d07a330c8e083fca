"""Under torchrun (2 ranks): packed micro-batches equal padded ones at every layout that splits a
sequence's work (tolerances as in tests/unit/test_packed_batches.py).

- TP=2 with sequence parallelism (packs rounded up to a multiple of 2 by a padding segment):
  log-probs and values;
- PP=2 (1F1B, every pack one shape): log-probs, and one PPO step's weights on each stage;
- DP=2 with overlapped gradient reduction and the distributed optimizer, the ranks holding
  different rows (so different numbers of packs): one PPO step's weights.
"""

import contextlib

import torch

from megatron_rlhf import runtime
from megatron_rlhf.config import OptimConfig, PPOConfig, preset
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.parallel.groups import build_process_groups
from megatron_rlhf.parallel.layout import Layout
from megatron_rlhf.rlhf import update
from megatron_rlhf.rlhf.batch import model_micro_batches
from megatron_rlhf.rlhf.experience import response_logprobs, response_values
from megatron_rlhf.rlhf.optim import build_trainee
from unit.test_packed_batches import TOLERANCE, _experience


def close(a, b, what):
    assert (a - b).abs().max() <= TOLERANCE, (what, (a - b).abs().max())


def step(pg, budget, exp, sp=False, overlap=False):
    """(start, after) weights of one PPO step over ``exp`` (Adam eps 1, lr 1: see the unit test)."""
    actor = build_model(preset("tiny"), "actor", pg, dtype=torch.float32, seed=3, sequence_parallel=sp)
    start = {n: p.detach().clone() for n, p in actor.named_parameters()}
    optim = OptimConfig(lr=1.0, clip_grad=0.0, adam_eps=1.0, use_distributed_optimizer=overlap,
                        overlap_grad_reduce=overlap)
    t = build_trainee(actor, pg, optim, 1.0)
    cfg = PPOConfig(advantage_estimator="grpo", kl_coef=0.0, global_batch_size=4, rollout_n=2,
                    micro_batch_size=2, max_tokens_per_micro_batch=budget, recompute_logprobs=True)
    update.train_actor(t, exp, cfg)
    t.gather_params()
    return start, {n: p.detach().clone() for n, p in actor.named_parameters()}


def same_step(padded, packed, what):
    (start, want), (_, got) = padded, packed
    for n, w in want.items():
        size = (w - start[n]).abs().max()
        assert size > 0, (what, n)
        ulp = torch.finfo(torch.float32).eps * w.abs().max()
        assert (got[n] - w).abs().max() <= TOLERANCE * size + 2 * ulp, (what, n)


def main():
    runtime.quiet_third_party_warnings()
    rank, _ = runtime.init_distributed()
    exp = _experience(advantages=True)

    pg = build_process_groups(Layout(tp=2))
    actor = build_model(preset("tiny"), "actor", pg, dtype=torch.float32, seed=3, sequence_parallel=True)
    critic = build_model(preset("tiny"), "critic", pg, dtype=torch.float32, seed=3, sequence_parallel=True)
    with torch.no_grad():
        critic.output_layer.weight.copy_(torch.linspace(-1, 1, critic.output_layer.weight.numel()).view(1, -1))
    packs = model_micro_batches(actor, exp, 2, 19)[0]
    assert all(p.packed.tokens % 2 == 0 for p in packs) and any(p.packed.params.lengths[-1] == 1 for p in packs)
    close(response_logprobs(actor, exp, 2, 19), response_logprobs(actor, exp, 2, 0), "tp2 sp log-probs")
    close(response_values(critic, exp, 2, 19), response_values(critic, exp, 2, 0), "tp2 sp values")

    pg = build_process_groups(Layout(pp=2))
    actor = build_model(preset("tiny"), "actor", pg, dtype=torch.float32, seed=3)
    four = exp.select([0, 1, 2, 3])  # (padded micro-batches under PP: whole ones of 2 rows)
    packs = model_micro_batches(actor, four, 2, 14)[0]
    assert [p.packed.params.lengths for p in packs] == [(12, 2), (7, 5, 2)]  # each padded to 14
    close(response_logprobs(actor, four, 2, 14), response_logprobs(actor, four, 2, 0), "pp2 log-probs")
    same_step(step(pg, 0, four), step(pg, 14, four), f"pp2 stage {rank}")

    pg = build_process_groups(Layout(dp=2))
    mine = exp.select([0, 1, 2, 3] if rank == 0 else [4])  # rank 0: three packs of 12, rank 1: one
    same_step(step(pg, 0, mine, overlap=True), step(pg, 12, mine, overlap=True), f"dp2 rank {rank}")
    if rank == 0:
        print("OK")
    runtime.shutdown()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
