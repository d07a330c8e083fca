"""Under torchrun (2 ranks): greedy generation at TP=2 equals TP=1 (a second layout of the
same ranks), plain and speculative (standalone and feature drafts, history drafts in ragged
rounds, also sampled under auto), on tiny models with
EOS mid-batch, one prompt at a time as in a batch; the modules' own forward equals the
plain-layer path at both TP sizes; the decode attention (both backends, fp32 and bf16,
dynamic and static steps) equals the whole-sequence forward on padded GQA batches at TP=2,
and a control without the mask does not. A tiny Qwen3-MoE (q/k norms, experts split over TP)
decodes at TP=2 as at TP=1: the dynamic step, the graphs' static one (every expert over every
token, run eagerly) and the modules' forward, with the same routes."""

import torch

from gen_fixtures import PROMPTS, actor_and_draft, decode_attention_error, feature_draft_for, reference_flash_kvcache
from megatron_rlhf import runtime
from megatron_rlhf.config import GenerationConfig, SpecConfig, preset
from megatron_rlhf.generation.engine import Generator
from megatron_rlhf.generation.history import HistoryDrafter
from megatron_rlhf.generation import attention, kv_cache
from megatron_rlhf.generation.incremental import plain_layers
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.parallel.groups import build_process_groups
from megatron_rlhf.parallel.layout import Layout


def run(pg, eos):
    actor, draft = actor_and_draft(pg, eos=eos)
    cfg = GenerationConfig(max_new_tokens=20, temperature=0)
    out = {"plain": Generator(actor).generate(PROMPTS, cfg)}
    for n in (1, 3):
        out[n] = Generator(actor, draft).generate(PROMPTS, cfg, SpecConfig(n))
    feature = feature_draft_for(actor, pg)
    for n in (1, 3):
        out[f"feature{n}"] = Generator(actor, feature).generate(PROMPTS, cfg, SpecConfig(n))
    assert plain_layers(actor)
    actor._mrlhf_plain_layers = False  # the modules' own forward (any layer spec)
    out["modules"] = Generator(actor).generate(PROMPTS, cfg)
    actor._mrlhf_plain_layers = True
    # one prompt at a time: decode steps and n=1 verifications of <= SWAPPED_GEMM_MAX_ROWS
    # rows take the swapped fp32 GEMMs, whose row-parallel outputs are all-reduced
    out["single"] = [Generator(actor).generate([p], cfg).responses()[0] for p in PROMPTS]
    out["single1"] = [Generator(actor, draft).generate([p], cfg, SpecConfig(1)).responses()[0]
                      for p in PROMPTS]
    # auto: the TP ranks time their rounds differently; the choice is the first rank's
    out["auto"] = Generator(actor, feature).generate(PROMPTS, cfg, SpecConfig("auto", max_draft_tokens=3))
    sampled = GenerationConfig(max_new_tokens=12, temperature=1.0)
    out["sampled"] = Generator(actor, draft).generate(PROMPTS, sampled, SpecConfig(2), seed=3)
    out["sampled_auto"] = Generator(actor, draft).generate(PROMPTS, sampled, SpecConfig("auto"), seed=3)
    # history drafts: ragged rounds (each row its own width; under auto the widths are the
    # first TP rank's), the second call drafting from the first's answers
    out["sampled_plain"] = Generator(actor).generate(PROMPTS, sampled, seed=3)
    for name, spec, params in (("history", SpecConfig(3, draft_source="history"), cfg),
                               ("history_auto", SpecConfig("auto", draft_source="history"), sampled)):
        gen = Generator(actor, history=HistoryDrafter())
        gen.generate(PROMPTS, params, spec, seed=4)
        out[name] = gen.generate(PROMPTS, params, spec, seed=3)
    return out


def run_moe(pg, eos):
    actor, _ = actor_and_draft(pg, "tiny-qwen3-moe", eos=eos, sharpness=20.0)
    cfg = GenerationConfig(max_new_tokens=16, temperature=0)
    out = {"plain": Generator(actor, graphs="off").generate(PROMPTS, cfg),
           "graphed": Generator(actor, graphs="eager").generate(PROMPTS, cfg)}
    assert plain_layers(actor)
    actor._mrlhf_plain_layers = False  # the modules' own forward (megatron's MoE layer)
    out["modules"] = Generator(actor, graphs="off").generate(PROMPTS, cfg)
    actor._mrlhf_plain_layers = True
    return out


def check_moe(tp2, tp1):
    eos = run_moe(tp1, None)["plain"].responses()[2][5]
    a, b = run_moe(tp2, eos), run_moe(tp1, eos)
    assert "eos" in a["plain"].finish_reasons and "eager graph code" in a["graphed"].stats.decode
    for key in ("plain", "graphed", "modules"):
        assert a[key].responses() == a["plain"].responses(), f"MoE TP=2 {key} != TP=2 plain"
        assert a[key].responses() == b[key].responses(), f"MoE TP=2 {key} != TP=1 {key}"
        for mine, theirs in zip(a[key].routes, b["plain"].routes):
            assert torch.equal(mine, theirs), f"MoE TP=2 {key}: other routes than TP=1"


def check_decode_attention(pg):
    """At TP=2 each rank holds one KV group of two query heads: still grouped. flash runs
    the reference of flash-attn's kernel (tests/gen_fixtures.py) on bf16 caches."""
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # as tests/unit/test_decode_attention.py
    saved = attention._flash_kvcache, kv_cache.CPU_HALF_CACHE_MIN_BATCH
    attention._flash_kvcache, kv_cache.CPU_HALF_CACHE_MIN_BATCH = reference_flash_kvcache, 1
    for dtype, tol in tolerance.items():
        model = build_model(preset("tiny"), "actor", pg, dtype=dtype, seed=2).eval()
        for backend in attention.BACKENDS:
            for static in (False, True):
                err = decode_attention_error(model, backend, static=static)
                assert err < tol, f"TP=2 {backend} {dtype} static={static}: {err}"
                control = decode_attention_error(model, backend, static=static, drop_mask=True)
                assert control > 5 * tol, f"TP=2 {backend} {dtype} static={static}: no mask, {control}"
    attention._flash_kvcache, kv_cache.CPU_HALF_CACHE_MIN_BATCH = saved


def main():
    runtime.quiet_third_party_warnings()
    rank, _ = runtime.init_distributed()
    tp2 = build_process_groups(Layout(tp=2))
    tp1 = build_process_groups(Layout(tp=1, dp=2))
    probe = run(tp1, eos=None)["plain"].responses()
    eos = probe[2][6]
    a, b = run(tp2, eos), run(tp1, eos)
    check_decode_attention(tp2)
    check_moe(tp2, tp1)
    assert "eos" in a["plain"].finish_reasons
    assert a["feature3"].stats.accepted_tokens > 0
    assert a["feature3"].stats.accepted_tokens == b["feature3"].stats.accepted_tokens
    assert a["history"].stats.history_accepted > 0
    assert a["history_auto"].responses() == a["sampled_plain"].responses()  # exact verification
    for key in ("plain", "modules", 1, 3, "feature1", "feature3", "auto", "history"):
        assert a[key].responses() == a["plain"].responses(), f"TP=2 {key} != TP=2 plain"
        assert a[key].responses() == b[key].responses(), f"TP=2 {key} != TP=1 {key}"
    for key in ("single", "single1"):
        assert a[key] == a["plain"].responses(), f"TP=2 {key} != TP=2 plain"
        assert a[key] == b[key], f"TP=2 {key} != TP=1 {key}"
    # every rank of the TP group drew the same sampled tokens (and made the same choices)
    for key in ("sampled", "sampled_auto", "history_auto"):
        mine = a[key].response_ids
        other = [torch.zeros_like(mine) for _ in range(2)]
        torch.distributed.all_gather(other, mine, group=tp2.tp)
        assert torch.equal(other[0], other[1])
    hist = torch.tensor(a["sampled_auto"].stats.rounds_by_draft_len)
    both = [torch.zeros_like(hist) for _ in range(2)]
    torch.distributed.all_gather(both, hist, group=tp2.tp)
    assert torch.equal(both[0], both[1])
    if rank == 0:
        print("OK", a[3].stats.mean_accepted_length)


if __name__ == "__main__":
    main()
