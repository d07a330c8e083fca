"""Speculative sampling draws from exactly the actor's distribution (a statistical test).

A tiny-vocabulary actor and a deliberately different draft (a standalone one, and a
feature draft that reads the actor's hidden states); 3-token continuations of one
prompt, so all 6^3 sequences have exact probabilities from the actor. Plain and
speculative sampling must both fit them (chi-square); a broken rule that accepts every
draft token must not.
"""

import itertools

import pytest
import torch

from gen_fixtures import actor_and_draft, feature_draft_for
from megatron_rlhf.config import GenerationConfig, SpecConfig
from megatron_rlhf.generation import speculative
from megatron_rlhf.generation.engine import Generator
from megatron_rlhf.generation.sampling import probs_for_sampling
from megatron_rlhf.models.forward import lm_logits

V, T, N = 6, 3, 6000
PROMPT = [1, 2, 3]


@pytest.fixture(scope="module", params=["standalone", "feature"])
def models(world1, request):
    actor, draft = actor_and_draft(world1, vocab_size=V, sharpness=25.0, noise=2.0, seed=3)
    if request.param == "feature":
        draft = feature_draft_for(actor, world1, noise=3.0)
    return actor, draft


def draft_logits(draft, actor, ids: torch.Tensor) -> torch.Tensor:
    """The draft's teacher-forced logits (a feature draft reads the actor's hidden states)."""
    from megatron_rlhf.generation.draft import head_logits, target_logits_and_features

    if not draft.mrlhf_config.feature_draft:
        return lm_logits(draft, ids)
    att = torch.ones_like(ids)
    return head_logits(draft, ids, att, features=target_logits_and_features(actor, ids, att)[1])


def exact_probs(actor, cfg) -> torch.Tensor:
    """``[V**T]`` probability of every continuation under the actor's sampling distribution."""
    seqs = torch.tensor(list(itertools.product(range(V), repeat=T)))
    ids = torch.cat([torch.tensor(PROMPT).expand(len(seqs), -1), seqs], 1)
    with torch.no_grad():
        logits = lm_logits(actor, ids)[:, len(PROMPT) - 1: -1]  # [S, T, V]
    p = probs_for_sampling(logits, cfg).gather(-1, seqs[..., None])[..., 0]
    return p.prod(-1).double()


def chi_square_pvalue(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson chi-square; cells expecting fewer than 5 samples are pooled into one."""
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.double), stat / 2))


def sample_counts(actor, draft, cfg, n, seed, rule=speculative.accept_sampling) -> torch.Tensor:
    r = Generator(actor, draft).generate([PROMPT] * N, cfg, SpecConfig(n), seed=seed, accept_rule=rule)
    assert (r.lengths == T).all()
    index = (r.response_ids[:, :T] * torch.tensor([V * V, V, 1])).sum(-1)
    return torch.bincount(index, minlength=V**T).double()


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.8, top_k=4, top_p=0.95)])
def test_speculative_sampling_is_the_actors_distribution(models, params):
    actor, draft = models
    cfg = GenerationConfig(max_new_tokens=T, stop_on_eos=False, **params)
    p = exact_probs(actor, cfg)
    with torch.no_grad():
        q_first = probs_for_sampling(draft_logits(draft, actor, torch.tensor([PROMPT]))[0, -1], cfg)
    p_first = probs_for_sampling(lm_logits(actor, torch.tensor([PROMPT]))[0, -1], cfg)
    assert (q_first - p_first).abs().sum() > 0.3  # the draft really differs from the actor

    plain = sample_counts(actor, draft, cfg, 0, seed=11)
    spec = sample_counts(actor, draft, cfg, 2, seed=12)
    assert chi_square_pvalue(plain, N * p) > 1e-3
    assert chi_square_pvalue(spec, N * p) > 1e-3
    # first-token frequencies also match the exact probabilities closely
    first = spec.reshape(V, V * V).sum(-1) / N
    assert (first - p_first.double()).abs().max() < 0.03

    broken = sample_counts(actor, draft, cfg, 2, seed=13, rule=speculative.accept_always)
    assert chi_square_pvalue(broken, N * p) < 1e-6
