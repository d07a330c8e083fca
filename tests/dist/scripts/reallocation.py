"""Under torchrun (2 ranks): parameter reallocation between a train layout (TP=2) and a
generation layout (TP=1 x DP=2) with megatron-core's resharding.

- train -> gen -> a second train copy leaves every weight bit-identical (tied and untied
  embeddings, a critic's value head, a feature draft's fusion and subset head);
- greedy generation on the generation copy (each DP rank half the prompts, a feature
  draft at n=2) equals generation on the train copy (TP=2, all prompts), token for token;
- the gen copy starts from other weights, so nothing passes without the copy."""

import torch
import torch.distributed as dist

from gen_fixtures import PROMPTS, actor_and_draft, feature_draft_for
from megatron_rlhf import runtime
from megatron_rlhf.config import GenerationConfig, SpecConfig, preset
from megatron_rlhf.generation.engine import Generator
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.parallel.groups import build_process_groups
from megatron_rlhf.parallel.layout import Layout
from megatron_rlhf.parallel.reshard import Reallocator


def round_trip(train, gen, name, role, make):
    """train -> gen -> another train-layout copy: every weight equal, bit for bit."""
    g, back = make(gen, 11), make(train["pg"], 12)
    assert any(not torch.equal(a, b) for a, b in zip(train["model"].parameters(), back.parameters()))
    stats = Reallocator()(train["model"], g)
    Reallocator()(g, back)
    for (n, a), b in zip(train["model"].named_parameters(), back.parameters()):
        assert torch.equal(a, b), f"{name} {role}: {n} changed in the round trip"
    moved = torch.tensor([stats.bytes_received + stats.bytes_local], dtype=torch.float64)
    dist.all_reduce(moved)
    total = sum(p.numel() * p.element_size() for p in g.parameters()) * dist.get_world_size()
    assert moved.item() == total, (name, role, moved.item(), total)  # every gen shard, once


def critic(pg, seed):
    """A critic whose value head is not zero (a seeded random one, as after training)."""
    model = build_model(preset("tiny"), "critic", pg, dtype=torch.float32, seed=seed)
    with torch.no_grad():
        model.output_layer.weight.copy_(torch.randn(model.output_layer.weight.shape,
                                                    generator=torch.Generator().manual_seed(seed)))
    return model


def main():
    runtime.quiet_third_party_warnings()
    rank, world = runtime.init_distributed()
    tp2 = build_process_groups(Layout(tp=2))
    gen = build_process_groups(Layout(tp=1, dp=2))
    for name in ("tiny", "tiny-untied"):
        model = build_model(preset(name), "actor", tp2, dtype=torch.float32, seed=3)
        round_trip({"model": model, "pg": tp2}, gen, name, "actor",
                   lambda pg, seed, name=name: build_model(preset(name), "actor", pg,
                                                           dtype=torch.float32, seed=seed))
    round_trip({"model": critic(tp2, 5), "pg": tp2}, gen, "tiny", "critic", critic)
    actor, _ = actor_and_draft(tp2, eos=None)
    feature = feature_draft_for(actor, tp2)
    round_trip({"model": feature, "pg": tp2}, gen, "feature draft", "draft",
               lambda pg, seed: feature_draft_for(actor_and_draft(pg, eos=None, seed=seed)[0], pg, seed=seed))

    # generation after reallocation equals generation on the train layout
    cfg = GenerationConfig(max_new_tokens=16, temperature=0)
    whole = Generator(actor, feature).generate(PROMPTS, cfg, SpecConfig(2)).responses()
    actor_gen, _ = actor_and_draft(gen, eos=None, seed=21)
    feature_gen = feature_draft_for(actor_gen, gen, seed=22)
    Reallocator()(actor, actor_gen)
    Reallocator()(feature, feature_gen)
    half = len(PROMPTS) // 2
    mine = PROMPTS[:half] if gen.dp.rank() == 0 else PROMPTS[half:]
    out = Generator(actor_gen, feature_gen).generate(mine, cfg, SpecConfig(2)).responses()
    gathered = [None] * world
    dist.all_gather_object(gathered, out)
    assert gathered[0] + gathered[1] == whole, "generation after reallocation differs"
    if rank == 0:
        print("OK")
    runtime.shutdown()


if __name__ == "__main__":
    main()
