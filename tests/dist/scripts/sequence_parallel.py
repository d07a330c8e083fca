"""Under torchrun (2 ranks, TP=2): sequence parallelism changes no result.

Tiny fp32 models built with and without ``sequence_parallel`` from the same seed (the same
weights at every TP size on CPU):

- logits of a left-padded batch of odd length (padded to a multiple of TP inside) and a
  critic's values are equal;
- one optimizer step from the same loss gives the same weights (the norms' gradients,
  computed on sequence shards, summed over TP by ``finalize_model_grads``); control: with
  the norms' ``sequence_parallel`` marks removed, the weights differ;
- greedy generation with the sequence-parallel model (its modules run whole sequences
  while decoding) equals the plain model's, plain and through the modules' own forward.
"""

import torch

from megatron_rlhf import runtime
from megatron_rlhf.config import GenerationConfig, OptimConfig, preset
from megatron_rlhf.generation.engine import Generator
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.models.forward import lm_logits, token_values
from megatron_rlhf.parallel.groups import build_process_groups
from megatron_rlhf.parallel.layout import Layout
from megatron_rlhf.rlhf.optim import build_trainee

IDS = torch.tensor([[0, 0, 5, 17, 33, 2, 9], [4, 8, 15, 16, 23, 42, 7]])
MASK = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])


def model(pg, sp, role="actor"):
    return build_model(preset("tiny"), role, pg, dtype=torch.float32, seed=3, sequence_parallel=sp)


def step(pg, sp, marks=True):
    """The weights after one Adam step on a loss over IDS."""
    m = model(pg, sp)
    if not marks:
        for p in m.parameters():
            if getattr(p, "sequence_parallel", False):
                p.sequence_parallel = False
    t = build_trainee(m, pg, OptimConfig(lr=1e-2, adam_eps=1e-5), 1e-2)  # (see test_rlhf_dist FLAGS)
    with t.accumulating(True):
        logp = lm_logits(m, IDS, MASK).log_softmax(-1)
        (logp[..., 3] * MASK).sum().div(10).backward()
    t.step()
    return {k: v.detach().clone() for k, v in m.named_parameters()}


def main():
    runtime.quiet_third_party_warnings()
    rank, _ = runtime.init_distributed()
    pg = build_process_groups(Layout(tp=2))
    plain, sp = model(pg, False), model(pg, True)
    assert sp.config.sequence_parallel and not plain.config.sequence_parallel
    marked = [k for k, p in sp.named_parameters() if getattr(p, "sequence_parallel", False)]
    assert len(marked) == 2 * preset("tiny").num_layers + 1, marked  # every norm
    with torch.no_grad():
        a, b = lm_logits(plain, IDS, MASK), lm_logits(sp, IDS, MASK)
        assert a.shape == b.shape == (2, 7, preset("tiny").vocab_size)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        critics = model(pg, False, "critic"), model(pg, True, "critic")
        for c in critics:
            c.output_layer.weight.copy_(torch.linspace(-1, 1, c.output_layer.weight.numel()).view(1, -1))
        v1, v2 = (token_values(c, IDS, MASK) for c in critics)
        assert v1.shape == (2, 7) and v1.abs().max() > 1e-3
        torch.testing.assert_close(v2, v1, rtol=1e-5, atol=1e-6)

    w_plain, w_sp = step(pg, False), step(pg, True)
    for k in w_plain:
        torch.testing.assert_close(w_sp[k], w_plain[k], rtol=1e-5, atol=1e-6, msg=k)
    unsummed = step(pg, True, marks=False)
    off = [k for k in marked if not torch.allclose(unsummed[k], w_plain[k], rtol=1e-5, atol=1e-6)]
    assert off, "the norms' gradients needed no sum over TP: the test cannot see a missing one"

    cfg = GenerationConfig(max_new_tokens=12, temperature=0)
    prompts = [[5, 17, 33], [4, 8, 15, 16, 23], [9]]
    want = Generator(plain).generate(prompts, cfg).responses()
    assert Generator(sp).generate(prompts, cfg).responses() == want
    sp._mrlhf_plain_layers = False  # the modules' own forward, sequence parallelism off
    assert Generator(sp).generate(prompts, cfg).responses() == want
    assert sp.config.sequence_parallel  # restored after decoding
    if rank == 0:
        print("OK", len(off), "norms off without the TP sum")
    runtime.shutdown()


if __name__ == "__main__":
    main()
