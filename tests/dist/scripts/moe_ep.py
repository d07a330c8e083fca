"""Under torchrun (2 ranks): expert parallelism on a tiny Mixtral (4 experts, top-2), fp32.

- One GRPO step at EP=2 (each rank holds 2 experts; tokens exchanged over the EP group) equals
  the step at EP=1 x DP=2 (every rank all 4): the loss, the gradient norm and every updated
  weight, within fp32 reduction order (1e-5 relative to the step). The ranks hold different
  numbers of rows (rank 0: 4, rank 1: 1), so their token counts and micro-batch counts differ:
  padded and packed micro-batches, the distributed optimizer (experts sharded over their own
  data-parallel group) and not.
- A checkpoint saved at EP=2 loads at EP=1 and one saved at EP=1 loads at EP=2, weight for weight.
- The experience's log pi_old forward of the rows the update trains, at EP=2 where one rank
  trains none of its rows: both ranks join the forward (it hung).
- PP=2 (a layer per stage): each stage's router replays its own layer's records (random
  ones), and both layers' expert loads reach both stages.
- Reallocation from the EP=2 training copy to generation at TP=2 and at EP=1 x DP=2, and back to
  a second EP=2 copy, leaves every weight bit-identical; every generation shard moves once; and
  greedy generation (history drafts, exact verification) on the TP=2 copy equals that on the
  DP=2 copy, token for token.
"""

import contextlib
import sys
import tempfile

import torch

from megatron_rlhf import runtime
from gen_fixtures import PROMPTS
from megatron_rlhf.config import GenerationConfig, OptimConfig, PPOConfig, SpecConfig, preset
from megatron_rlhf.generation.engine import Generator
from megatron_rlhf.generation.history import HistoryDrafter
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.models.checkpoint import load_checkpoint, save_checkpoint
from megatron_rlhf.parallel.groups import build_process_groups
from megatron_rlhf.parallel.layout import Layout
from megatron_rlhf.parallel.reshard import Reallocator
from megatron_rlhf.rlhf import update
from megatron_rlhf.rlhf.optim import build_trainee
from unit.test_packed_batches import _experience

TOLERANCE = 1e-5
MODEL = preset("tiny-mixtral")


def global_names(model) -> dict:
    """``{name: tensor}`` with each local expert under its global index."""
    from megatron_rlhf.models.moe import global_expert_name

    return {global_expert_name(n, model): p.detach().clone() for n, p in model.named_parameters()}


def actor(pg, full: dict | None = None):
    """The tiny Mixtral at ``pg``'s layout, its weights ``full``'s (global names) when given."""
    model = build_model(MODEL, "actor", pg, dtype=torch.float32, seed=3)
    if full is not None:
        from megatron_rlhf.models.moe import global_expert_name

        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(full[global_expert_name(n, model)])
    return model


def step(pg, exp, full, budget, distributed):
    model = actor(pg, full)
    start = global_names(model)
    optim = OptimConfig(lr=1.0, clip_grad=0.0, adam_eps=1.0, use_distributed_optimizer=distributed,
                        overlap_grad_reduce=distributed)
    t = build_trainee(model, pg, optim, 1.0)
    cfg = PPOConfig(advantage_estimator="grpo", kl_coef=0.0, global_batch_size=4, rollout_n=2,
                    micro_batch_size=2, max_tokens_per_micro_batch=budget, recompute_logprobs=True)
    metrics = update.train_actor(t, exp, cfg)
    t.gather_params()
    return start, global_names(model), metrics, t


def same_step(want, got, what):
    (start, a, ma, _), (_, b, mb, _) = want, got
    for key in ("policy_loss", "actor_grad_norm"):
        assert abs(ma[key] - mb[key]) <= TOLERANCE * abs(ma[key]) + 1e-7, (what, key, ma[key], mb[key])
    for n, w in b.items():
        size = (a[n] - start[n]).abs().max()
        assert size > 0, (what, n)
        assert (w - a[n]).abs().max() <= TOLERANCE * size + 2 * torch.finfo(torch.float32).eps * w.abs().max(), \
            (what, n, (w - a[n]).abs().max().item(), size.item())


def main():
    runtime.quiet_third_party_warnings()
    rank, _ = runtime.init_distributed()
    exp = _experience(advantages=True)
    mine = exp.select([0, 1, 2, 3] if rank == 0 else [4])
    ep1 = build_process_groups(Layout(dp=2))
    ep2 = build_process_groups(Layout(dp=2, ep=2))
    full = global_names(actor(ep1))
    split = actor(ep2, full)
    assert len([n for n in global_names(split) if "local_experts" in n]) == 2 * 2 * MODEL.num_layers
    from megatron_rlhf.models.moe import RaggedAllGatherDispatcher

    dispatcher = split.decoder.layers[0].mlp.token_dispatcher
    assert type(dispatcher) is RaggedAllGatherDispatcher and dispatcher.ep_size == 2

    for budget in (0, 12):
        for distributed in (False, True):
            what = f"budget {budget} distributed {distributed} rank {rank}"
            want = step(ep1, mine, full, budget, distributed)
            got = step(ep2, mine, full, budget, distributed)
            same_step(want, got, what)
            if distributed:  # experts sharded over their data-parallel group (size 1 at EP=2 x DP=2)
                groups = sorted(o.data_parallel_group.size() for o in got[3].optimizer.chained_optimizers)
                assert groups == [1, 2], (what, groups)

    # checkpoints across EP sizes, both ways
    root = [tempfile.mkdtemp() if rank == 0 else None]
    torch.distributed.broadcast_object_list(root, src=0)
    trained = step(ep1, mine, full, 0, False)[1]  # every expert, on every rank
    save_checkpoint(root[0] + "/ep2", 1, actor(ep2, trained), ep2)
    loaded = build_model(MODEL, "actor", ep1, dtype=torch.float32, seed=9)
    load_checkpoint(loaded, ep1, root[0] + "/ep2")
    assert all(torch.equal(t, trained[n]) for n, t in global_names(loaded).items()), "ep2 -> ep1"
    save_checkpoint(root[0] + "/ep1", 1, actor(ep1, trained), ep1)
    loaded = build_model(MODEL, "actor", ep2, dtype=torch.float32, seed=9)
    load_checkpoint(loaded, ep2, root[0] + "/ep1")
    assert all(torch.equal(t, trained[n]) for n, t in global_names(loaded).items()), "ep1 -> ep2"

    # reallocation: EP=2 training -> TP=2 / EP=1 x DP=2 generation -> EP=2 again
    train = actor(ep2, trained)
    copies = {}
    for name, layout in (("tp2", Layout(tp=2)), ("dp2", Layout(dp=2))):
        pg = build_process_groups(layout)
        gen = build_model(MODEL, "actor", pg, dtype=torch.float32, seed=11)
        stats = Reallocator()(train, gen)
        moved = torch.tensor([float(stats.bytes_received + stats.bytes_local)], dtype=torch.float64)
        torch.distributed.all_reduce(moved)
        assert moved.item() == sum(p.numel() * p.element_size() for p in gen.parameters()) * 2, name
        back = build_model(MODEL, "actor", ep2, dtype=torch.float32, seed=12)
        Reallocator()(gen, back)
        assert all(torch.equal(t, trained[n]) for n, t in global_names(back).items()), name
        if layout.tp == 1:  # (at TP=2 the copy holds shards: the round trip checks them)
            assert all(torch.equal(t, trained[n]) for n, t in global_names(gen).items()), name
        copies[name] = gen
    cfg = GenerationConfig(max_new_tokens=16, temperature=0, stop_on_eos=False)
    spec = SpecConfig(3, draft_source="history")
    whole = Generator(copies["tp2"], history=HistoryDrafter()).generate(PROMPTS, cfg, spec).responses()
    half = len(PROMPTS) // 2
    mine = PROMPTS[:half] if rank == 0 else PROMPTS[half:]
    out = Generator(copies["dp2"], history=HistoryDrafter()).generate(mine, cfg, spec).responses()
    gathered = [None, None]
    torch.distributed.all_gather_object(gathered, out)
    assert gathered[0] + gathered[1] == whole, "generation at TP=2 and at DP=2 differ"
    old_logprobs_where_one_rank_trains_nothing(ep2, exp.select([0, 1, 2, 3] if rank == 0 else [4]), trained)
    pipelined_routes(exp.select(slice(0, 4)))
    if rank == 0:
        print("OK")
    runtime.shutdown()


def old_logprobs_where_one_rank_trains_nothing(pg, mine, full):
    from megatron_rlhf.rlhf.experience import ExperienceMaker

    model = actor(pg, full)
    maker = ExperienceMaker(PPOConfig(advantage_estimator="grpo", kl_coef=0.0, global_batch_size=4, rollout_n=2,
                                      micro_batch_size=2), reference=None, reward_fn="token_parity",
                            actor=model, recompute=True, dp_group=pg.dp, mp_group=pg.mp)
    if pg.dp.rank() == 0:
        mine.advantages = torch.zeros_like(mine.advantages)
    trained = maker._old_logprobs_where_trained(mine)
    assert bool(trained.any()) and (pg.dp.rank() == 1 or int(trained.sum()) == 1), trained


def pipelined_routes(exp):
    from megatron_rlhf.models import routing
    from megatron_rlhf.models.moe import RouterStats, routers
    from megatron_rlhf.models.pipeline import map_micro_batches
    from megatron_rlhf.rlhf.batch import model_micro_batches

    staged = actor(build_process_groups(Layout(pp=2)))
    routing.set_replay(staged, True)
    b, s = exp.input_ids.shape
    g = torch.Generator().manual_seed(0)
    records = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(b * s * 2)]).view(b, s, 2, 2)
    exp.routes = records.masked_fill(~exp.attention_mask.bool()[:, :, None, None], -1).to(routing.RECORD_DTYPE)
    parts, _ = model_micro_batches(staged, exp, 2, max_tokens=0)
    taken = []
    hooks = [r.register_forward_hook(lambda router, _in, out: taken.append((router.layer_number - 1, out[1])))
             for r in routers(staged)]
    with RouterStats(staged) as stats:
        map_micro_batches(staged, parts, lambda output, mb: None)
    for h in hooks:
        h.remove()
    assert len(taken) == len(parts)  # one layer on this stage
    for mb, (layer, took) in zip(parts, taken):
        real = mb.attention_mask.bool()
        rec = mb.routes[real][:, layer].long()
        took = took.view(real.shape[1], real.shape[0], -1).transpose(0, 1)[real]
        assert torch.equal(took, torch.zeros_like(took).scatter_(1, rec, True)), f"layer {layer}"
    loads = stats.metrics("actor_moe")
    assert {k for k in loads if k.endswith("_load_max")} == {"actor_moe_layer1_load_max", "actor_moe_layer2_load_max"}


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
