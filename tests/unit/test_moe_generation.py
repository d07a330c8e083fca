"""Generation of mixture-of-experts models (Mixtral, Qwen3-MoE): the cached forward routes each
fed token as a whole-sequence forward does, speculation changes no sample (exact
verification, fp32), as for dense models (tests/unit/test_exact_verification.py), and the
graphs' static step (every expert over every token; run eagerly here) decodes as the dynamic
one, routes included."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron_rlhf.config import GenerationConfig, SpecConfig
from megatron_rlhf.generation import graphs
from megatron_rlhf.generation.engine import Generator
from megatron_rlhf.generation.history import HistoryDrafter
from megatron_rlhf.generation.incremental import _plain_experts, plain_layers
from megatron_rlhf.models import routing
from megatron_rlhf.models.forward import lm_logits

from gen_fixtures import PROMPTS, actor_and_draft

MOE = ["tiny-mixtral", "tiny-qwen3-moe"]
SAMPLED = GenerationConfig(max_new_tokens=20, temperature=1.0, stop_on_eos=False)
GREEDY = GenerationConfig(max_new_tokens=20, temperature=0.0, stop_on_eos=False)
PROMPTS3 = [p for p in PROMPTS for _ in range(3)]


@pytest.fixture(scope="module", params=MOE)
def models(request, world1):
    """A sharpened MoE actor (its samples repeat: the history has drafts to offer) and an MoE
    draft near it."""
    return actor_and_draft(world1, request.param, sharpness=20.0, noise=0.5)


def test_generated_logprobs_equal_a_whole_sequence_forward(models):
    """The log-probs the generator reports for its samples are those of one forward over the
    prompt and response (fp32, 1e-4: the two run the experts over other token sets)."""
    actor = models[0]
    r = Generator(actor).generate(PROMPTS, SAMPLED, seed=5)
    for i, prompt in enumerate(PROMPTS):
        response = r.response_ids[i].tolist()
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logp = torch.log_softmax(lm_logits(actor, ids)[0, len(prompt) - 1:-1].float(), -1)
        want = logp.gather(-1, torch.tensor(response)[:, None])[:, 0]
        assert (r.response_logprobs[i, :len(response)] - want).abs().max() < 1e-4


@pytest.mark.parametrize("cfg", [SAMPLED, GREEDY], ids=["T1", "greedy"])
@pytest.mark.parametrize("source", ["history", "model"])
def test_speculation_changes_no_sample(models, cfg, source):
    actor, draft = models
    plain = Generator(actor).generate(PROMPTS3, cfg, seed=7).response_ids
    spec = Generator(actor, draft if source == "model" else None,
                     history=HistoryDrafter() if source == "history" else None)
    r = spec.generate(PROMPTS3, cfg, SpecConfig(4, draft_source=source), seed=7)
    assert torch.equal(r.response_ids, plain)
    accepted = sum(r.stats.accepted_per_position)
    assert r.stats.verifications and 0 < accepted  # drafts were verified and some accepted


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_the_plain_moe_layer_is_megatrons(models, static):
    """The decode step's MoE layer gives megatron's MoE layer's output (fp32, 1e-5) and
    records its router's top-k; the static one runs every expert over every token."""
    actor = models[0]
    cfg = actor.mrlhf_config
    assert plain_layers(actor) and graphs.graphable(actor)
    h = torch.randn(3, 4, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    records = torch.full((12, cfg.num_layers, cfg.moe_router_topk), -1, dtype=routing.RECORD_DTYPE)
    for idx in range(cfg.num_layers):
        moe = actor.decoder.layers[idx].mlp
        with torch.no_grad():
            want, _ = moe(h)
            _, chosen = moe.router(h.reshape(12, -1))
            step = SimpleNamespace(linear=F.linear, static=static, routes=(records, torch.arange(12), None))
            got = _plain_experts(moe, idx, h, step)
        assert (got - want).abs().max() < 1e-5
        took = torch.zeros_like(chosen).scatter_(1, records[:, idx].long(), True)
        assert torch.equal(took, chosen.bool())


def test_a_layer_the_step_cannot_reproduce_is_not_plain(models):
    """A capacity (token dropping) takes the MoE layer off the plain path and off the graphs."""
    actor = models[0]
    cfg = actor.decoder.layers[0].mlp.config
    try:
        cfg.moe_expert_capacity_factor, actor._mrlhf_plain_layers = 1.0, None
        assert not plain_layers(actor) and not graphs.graphable(actor)
    finally:
        cfg.moe_expert_capacity_factor, actor._mrlhf_plain_layers = None, None
    assert plain_layers(actor)


@pytest.mark.parametrize("source", [None, "history", "model"])
def test_the_graphed_step_decodes_as_the_dynamic_one(models, source):
    """Generation from the graphs' code (run eagerly) equals the dynamic engine's: the samples,
    and the routes of every fed token, with samples finishing at different steps (a graph's
    step keeps feeding finished rows at length 0: their records must stay)."""
    actor, draft = models
    cfg = GenerationConfig(max_new_tokens=20, temperature=1.0, stop_on_eos=True)
    eos = actor.mrlhf_config.eos_token_id
    # EOS: a token half the samples draw in their first 8 (samples finish at different steps)
    early = Generator(actor, graphs="off").generate(PROMPTS3, SAMPLED, seed=9).response_ids[:, 1:8]
    counts = torch.stack([(early == t).any(1).sum() for t in range(actor.mrlhf_config.vocab_size)])
    actor.mrlhf_config.eos_token_id = int((counts - len(PROMPTS3) // 2).abs().argmin())
    spec = SpecConfig(4, draft_source=source) if source else None

    def generator(mode):
        return Generator(actor, draft if source == "model" else None, graphs=mode,
                         history=HistoryDrafter() if source == "history" else None)

    try:
        ref = generator("off").generate(PROMPTS3, cfg, spec, seed=9)
        r = generator("eager").generate(PROMPTS3, cfg, spec, seed=9)
    finally:
        actor.mrlhf_config.eos_token_id = eos
    assert "eager graph code" in r.stats.decode and "dynamic" in ref.stats.decode
    assert {"eos", "length"} <= set(ref.finish_reasons)
    assert torch.equal(r.response_ids, ref.response_ids)
    for i, (mine, theirs) in enumerate(zip(r.routes, ref.routes)):
        assert mine.shape[0] == len(PROMPTS3[i]) + int(ref.lengths[i]) - 1
        assert torch.equal(mine, theirs)
