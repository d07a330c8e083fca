"""Routing replay (--routing-replay): the rollout records every fed token's experts per layer,
speculative rounds included; the actor's whole-sequence forwards take exactly those experts
(padded and packed micro-batches, and in the recompute of a checkpointed backward), or report
how often their own routers disagree. Tiny Mixtral, fp32, one process."""

import pytest
import torch

from megatron_rlhf.config import GenerationConfig, SpecConfig, preset
from megatron_rlhf.generation.engine import Generator
from megatron_rlhf.generation.history import HistoryDrafter
from megatron_rlhf.models import routing
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.models.forward import masked_forward
from megatron_rlhf.models.moe import routers
from megatron_rlhf.models.pipeline import forward_backward, map_micro_batches
from megatron_rlhf.rlhf.batch import Experience, model_micro_batches, pack, route_columns

from gen_fixtures import PROMPTS, actor_and_draft

SAMPLED = GenerationConfig(max_new_tokens=12, temperature=1.0, stop_on_eos=False)
PROMPTS3 = [p for p in PROMPTS for _ in range(3)]


@pytest.fixture(scope="module")
def models(world1):
    return actor_and_draft(world1, "tiny-mixtral", sharpness=20.0, noise=0.5)


class Observed:
    """The routing maps ``[tokens, experts]`` each router returns while attached, per layer."""

    def __init__(self, model):
        self.model, self.maps, self.handles = model, {}, []

    def __enter__(self):
        for r in routers(self.model):
            self.handles.append(r.register_forward_hook(
                lambda router, _in, out: self.maps.setdefault(router.layer_number - 1, []).append(out[1].clone())))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def _as_maps(records: torch.Tensor, experts: int) -> torch.Tensor:
    """``[tokens, k]`` expert indices -> ``[tokens, experts]`` bool."""
    return torch.zeros(records.shape[0], experts, dtype=torch.bool).scatter_(1, records.long().clamp(min=0), True)


def test_the_rollout_records_every_fed_token(models):
    """A sample's records cover its prompt and its response but the last token, and are the
    experts a whole-sequence forward over them takes in every layer."""
    actor = models[0]
    r = Generator(actor).generate(PROMPTS, SAMPLED, seed=5)
    experts = actor.mrlhf_config.num_experts
    for i, prompt in enumerate(PROMPTS):
        response = r.response_ids[i, : int(r.lengths[i])].tolist()
        records = r.routes[i]
        assert records.dtype == routing.RECORD_DTYPE
        assert records.shape == (len(prompt) + len(response) - 1, actor.mrlhf_config.num_layers, 2)
        with Observed(actor) as seen, torch.no_grad():
            masked_forward(actor, torch.tensor([prompt + response[:-1]]), None)
        for layer, maps in seen.maps.items():
            assert torch.equal(maps[0], _as_maps(records[:, layer], experts))


@pytest.mark.parametrize("source", ["history", "model"])
def test_speculation_records_what_plain_decoding_records(models, source):
    """Only accepted tokens keep their records: speculative rounds leave the routes of plain
    decoding, bit for bit (fp32), a sample's last token unrecorded even where a verification
    fed it."""
    actor, draft = models
    plain = Generator(actor).generate(PROMPTS3, SAMPLED, seed=7)
    spec = Generator(actor, draft if source == "model" else None,
                     history=HistoryDrafter() if source == "history" else None)
    r = spec.generate(PROMPTS3, SAMPLED, SpecConfig(4, draft_source=source), seed=7)
    assert torch.equal(r.response_ids, plain.response_ids)
    assert sum(r.stats.accepted_per_position) > 0  # drafts were accepted, rejected ones rolled back
    for mine, theirs in zip(r.routes, plain.routes):
        assert torch.equal(mine, theirs)


def _batch(actor, seed: int = 0):
    """An experience of PROMPTS3's samples whose routes are random top-2 sets (a generator
    that routes otherwise than the trainer), and the records at each known token."""
    r = Generator(actor).generate(PROMPTS3, SAMPLED, seed=3)
    g = torch.Generator().manual_seed(seed)
    layers, experts = actor.mrlhf_config.num_layers, actor.mrlhf_config.num_experts
    fake = [torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(n * layers)])
            .view(n, layers, 2).to(routing.RECORD_DTYPE) for n in (x.shape[0] for x in r.routes)]
    ids, att, mask = pack(PROMPTS3, r.responses(), 0)
    zeros = torch.zeros_like(mask)
    exp = Experience(input_ids=ids, attention_mask=att, response_mask=mask, old_logprobs=zeros,
                     ref_logprobs=zeros, scores=torch.zeros(len(PROMPTS3)), kl=zeros, advantages=zeros)
    exp.routes = route_columns(PROMPTS3, r.responses(), fake, ids.shape[1])
    return exp


def _trainer_routes(actor, exp: Experience, packed: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per micro-batch and layer: (the routing map the forward took at the real tokens, the
    records there), real tokens row after row."""
    parts, _ = model_micro_batches(actor, exp, 4, max_tokens=None if packed else 0)
    assert all((mb.packed is not None) == packed for mb in parts)
    out = []
    with Observed(actor) as seen:
        map_micro_batches(actor, parts, lambda output, mb: None)
    for i, mb in enumerate(parts):
        real = mb.attention_mask.bool()
        b, s = real.shape
        for layer, maps in seen.maps.items():
            took = maps[i]
            took = took[: real.sum()] if packed else took.view(s, b, -1).transpose(0, 1)[real]
            out.append((took, mb.routes[real][:, layer]))
    return out


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_replay_takes_the_rollouts_routes(models, packed, monkeypatch):
    """With replay every recorded token takes its recorded experts in every layer; without,
    the trainer's routers choose (and disagree with the records); a replay that gives one
    layer's records to another is caught."""
    actor = models[0]
    experts = actor.mrlhf_config.num_experts
    exp = _batch(actor)

    def agree(pairs):
        return all(torch.equal(took[rec[:, 0] >= 0], _as_maps(rec, experts)[rec[:, 0] >= 0])
                   for took, rec in pairs)

    routing.set_replay(actor, False)
    assert not agree(_trainer_routes(actor, exp, packed))
    routing.set_replay(actor, True)
    try:
        pairs = _trainer_routes(actor, exp, packed)
        assert agree(pairs)
        known = sum(int((rec[:, 0] >= 0).sum()) for _, rec in pairs)
        fed = sum(len(p) + int(n) - 1 for p, n in zip(PROMPTS3, exp.response_mask.sum(1)))
        assert known == fed * actor.mrlhf_config.num_layers  # every fed token, every layer
        layers = actor.mrlhf_config.num_layers
        monkeypatch.setattr(routing, "layer_records", lambda records, r: records[:, (r.layer + 1) % layers])
        assert not agree(_trainer_routes(actor, exp, packed))
    finally:
        routing.set_replay(actor, False)


def test_the_metrics_count_disagreeing_routes(models):
    """routing_disagreement: the share of (token, layer) routes the trainer's routers choose
    otherwise, with or without replay; routing_mismatch: those the forward took otherwise,
    0 with replay. Measured once per arming."""
    actor = models[0]
    exp = _batch(actor, seed=1)
    parts, _ = model_micro_batches(actor, exp, 4)
    found = {}
    for replay in (False, True):
        routing.set_replay(actor, replay)
        routing.arm(actor)
        with routing.measuring(actor):
            map_micro_batches(actor, parts, lambda output, mb: None)
        with routing.measuring(actor):  # disarmed: counts nothing
            map_micro_batches(actor, parts[:1], lambda output, mb: None)
        found[replay] = routing.take_metrics(actor)
    routing.set_replay(actor, False)
    # random top-2 of 4 experts: a route equals the router's own with probability 1/6
    assert 0.6 < found[False]["routing_disagreement"] < 1.0
    assert found[False]["routing_mismatch"] == found[False]["routing_disagreement"]
    assert found[True]["routing_disagreement"] == found[False]["routing_disagreement"]
    assert found[True]["routing_mismatch"] == 0.0
    # in some layer of 2: 1 - (1/6)^2 of the tokens
    assert found[False]["routing_disagreement"] < found[False]["routing_tokens_disagreeing"] < 1.0
    assert found[True]["routing_tokens_disagreeing"] == found[False]["routing_tokens_disagreeing"]
    assert routing.take_metrics(actor) == {}


def test_a_checkpointed_backward_replays_what_its_forward_took(world1, models):
    """Recomputing each layer in the backward (--recompute-granularity full) takes the
    replayed routes again: the gradients equal those without recomputation, and differ from
    a replay that the recompute would not see."""
    exp = _batch(models[0], seed=2)

    def grads(recompute, replay=True):
        model = build_model(preset("tiny-mixtral"), "actor", world1, dtype=torch.float32, seed=4,
                            recompute=recompute)
        routing.set_replay(model, replay)
        model.train()
        parts, _ = model_micro_batches(model, exp, 6, max_tokens=0)
        forward_backward(model, parts, lambda out, mb: out.float().logsumexp(-1).mean())
        assert all(not r.backward for r in routing.routes(model))  # forgotten after the step
        return [p.main_grad.clone() if hasattr(p, "main_grad") else p.grad.clone()
                for p in model.parameters() if p.requires_grad]

    plain, checkpointed = grads(None), grads("full")
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(plain, checkpointed))
    own = grads(None, replay=False)
    assert not all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(plain, own))
