"""Generation of mixture-of-experts models (Mixtral, Qwen3-MoE): the cached forward routes each
fed token as a whole-sequence forward does, and speculation changes no sample (exact
verification, fp32), as for dense models (tests/unit/test_exact_verification.py)."""

import pytest
import torch

from megatron_rlhf.config import GenerationConfig, SpecConfig
from megatron_rlhf.generation.engine import Generator
from megatron_rlhf.generation.history import HistoryDrafter
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
