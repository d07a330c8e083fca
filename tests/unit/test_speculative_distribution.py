"""Speculative sampling draws from exactly the actor's distribution (a statistical test).

A tiny-vocabulary actor (V = 5) and two drafts that really differ from it and are not
one-hot (checked: first-token total variation > 0.3, the draft's largest probability <
0.9): a standalone draft and a feature (EAGLE) draft that reads the actor's hidden
states, both made more confident than the actor. ``T = 4`` new tokens after one prompt,
so all ``V**T`` continuations have exact probabilities under the actor, and bonus tokens
land inside the responses often (the first round starts after the prefill's token: with
``n = 1`` its bonus is token 3, with ``n = 2`` token 4; the test counts them).

- Plain and speculative sampling (``n`` = 1, 2, and ``auto`` driven by a seeded selector
  that picks plain or 1..3 drafts at random every round) fit the exact probabilities
  (chi-square p > 1e-3), at temperature 1 and at 0.7 with top-k and top-p.
- Four broken acceptance rules (wrappers below) must not (p < 1e-6, or a sequence the
  actor cannot produce) with either draft at ``n`` = 1, 2 and ``auto``: (a) the bonus
  token drawn from the draft, (b) the bonus token drawn from the actor one position too
  early, (c) the acceptance test against the untempered draft distribution (no bias at
  temperature 1: run at 0.7 only), (d) accepting every draft token. (a) and (b) change
  nothing but bonus tokens, so their detection also shows the bonus tokens are tested.

Every configuration is sampled once, ``N`` samples per configuration (``auto``: in
several calls, see :func:`sample`). (c) is the subtlest bias: at ``N`` its detection
depended on the draws (p from 1e-2 to 1e-8 for the standalone draft), so it and the
correct rule at its setting use ``SUBTLE_N = 3 N`` samples (p < 1e-11 seen over reruns).
The drafts' sharpness was chosen for (c): an acceptance test against a flatter ``q``
over-accepts the draft's favourite tokens, which matters most where the draft is more
confident than the actor. Every sabotage is detected in every configuration it runs in.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from gen_fixtures import RandomSelector, actor_and_draft, feature_draft_for
from megatron_rlhf.config import GenerationConfig, SpecConfig
from megatron_rlhf.generation.engine import Generator
from megatron_rlhf.generation.sampling import draw, probs_for_sampling
from megatron_rlhf.generation.speculative import Verdict, accept_sampling, residual_distribution
from megatron_rlhf.models.forward import lm_logits

V, T, N = 5, 4, 6000
SUBTLE_N = 3 * N
"""Samples for the untempered acceptance test (c), a smaller bias than the others (and for
the correct rule at the same setting, so both are judged at the same sample count)."""
PROMPT = [1, 2, 3]
MAX_N = 3
"""Largest draft length the random ``auto`` selector picks."""
AUTO_CALLS = 10
"""``auto`` configurations are sampled in this many calls (each its own selector)."""
SAMPLING = {"t1": dict(temperature=1.0), "t07": dict(temperature=0.7, top_k=3, top_p=0.9)}
KINDS = ["standalone", "feature"]
DRAFT_LENGTHS = [1, 2, "auto"]
PASS_P, FAIL_P = 1e-3, 1e-6


# ------------------------------------------------------------------------ broken rules
def bonus_from_draft(draft_tokens, q_probs, p_probs, u_accept, u_next) -> Verdict:
    """(a) After all ``n`` accepted, the bonus token is drawn from the draft's last
    distribution (``q[:, n-1]``) instead of the actor's ``p[:, n]``."""
    n = draft_tokens.shape[1]
    v = accept_sampling(draft_tokens, q_probs, p_probs, u_accept, u_next)
    wrong = draw(q_probs[:, n - 1], u_next[:, n])
    return Verdict(v.accepted, torch.where(v.accepted == n, wrong, v.next_token))


def bonus_one_position_early(draft_tokens, q_probs, p_probs, u_accept, u_next) -> Verdict:
    """(b) The bonus token is drawn from ``p[:, n-1]`` (the last draft's position)."""
    n = draft_tokens.shape[1]
    v = accept_sampling(draft_tokens, q_probs, p_probs, u_accept, u_next)
    wrong = draw(p_probs[:, n - 1], u_next[:, n])
    return Verdict(v.accepted, torch.where(v.accepted == n, wrong, v.next_token))


def untempered_acceptance(temperature: float):
    """(c) The acceptance test compares ``p`` with the draft's untempered distribution
    (``q ** temperature`` renormalised on ``q``'s support) while the drafts were drawn
    from the tempered ``q``; the residual after a rejection is the correct one."""

    def rule(draft_tokens, q_probs, p_probs, u_accept, u_next) -> Verdict:
        q_raw = q_probs ** temperature  # zero outside the top-k/top-p support stays zero
        q_raw = q_raw / q_raw.sum(-1, keepdim=True)
        accepted = accept_sampling(draft_tokens, q_raw, p_probs, u_accept, u_next).accepted
        rows = torch.arange(len(accepted))
        q_row = torch.cat([q_probs, torch.zeros_like(q_probs[:, :1])], 1)[rows, accepted]
        residual = residual_distribution(p_probs[rows, accepted], q_row)
        return Verdict(accepted, draw(residual, u_next[rows, accepted]))

    return rule


def accept_always(draft_tokens, q_probs, p_probs, u_accept, u_next) -> Verdict:
    """(d) Every draft token is accepted; the bonus token comes from ``p[:, n]``."""
    n = draft_tokens.shape[1]
    accepted = torch.full((len(draft_tokens),), n, dtype=torch.long)
    return Verdict(accepted, draw(p_probs[:, n], u_next[:, n]))


SABOTAGES = {"bonus_from_draft": ("t1", "t07"), "bonus_one_position_early": ("t1", "t07"),
             "untempered_acceptance": ("t07",), "accept_always": ("t1", "t07")}
"""Each broken rule and the sampling settings where it is a real bias."""


def samples_for(setting: str, rule_name: str) -> int:
    """``N``, or ``SUBTLE_N`` for the subtlest sabotage (c) and the correct rule at its setting."""
    subtle = setting in SABOTAGES["untempered_acceptance"]
    return SUBTLE_N if subtle and rule_name in ("correct", "untempered_acceptance") else N


def rule_for(name: str, cfg: GenerationConfig):
    return {"correct": accept_sampling, "bonus_from_draft": bonus_from_draft,
            "bonus_one_position_early": bonus_one_position_early,
            "untempered_acceptance": untempered_acceptance(cfg.temperature),
            "accept_always": accept_always}[name]


# ------------------------------------------------------------------------ sampling
class RecordingRule:
    """An accept rule that remembers each call's draft length and per-row verdict."""

    def __init__(self, rule):
        self.rule, self.calls = rule, []

    def __call__(self, draft_tokens, q_probs, p_probs, u_accept, u_next) -> Verdict:
        v = self.rule(draft_tokens, q_probs, p_probs, u_accept, u_next)
        self.calls.append((draft_tokens.shape[1], v.accepted.clone()))
        return v


def bonus_tokens_in_responses(rule: RecordingRule, plain_steps_before: int) -> int:
    """Bonus tokens of the first speculative round that lie inside the responses. Until
    that round every row has emitted the same number of tokens (the prefill's and one per
    plain step), so its bonus token is response token ``emitted + n`` (0-based)."""
    if not rule.calls:
        return 0
    n, accepted = rule.calls[0]
    emitted = 1 + plain_steps_before
    return int((accepted == n).sum()) if emitted + n < T else 0


def draft_logits(draft, actor, ids: torch.Tensor) -> torch.Tensor:
    """The draft's teacher-forced logits (a feature draft reads the actor's hidden states)."""
    from megatron_rlhf.generation.draft import head_logits, target_logits_and_features

    if not draft.mrlhf_config.feature_draft:
        return lm_logits(draft, ids)
    att = torch.ones_like(ids)
    return head_logits(draft, ids, att, features=target_logits_and_features(actor, ids, att)[1])


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """``(p-value, impossible)``: Pearson chi-square of ``counts [S]`` against exact ``probs
    [S]`` over the sequences the actor can produce (cells expecting fewer than 5 samples
    pooled into one), and how many samples are sequences it cannot produce (probability 0
    after top-k/top-p: any such sample alone refutes the sampler)."""
    possible = probs > 0
    impossible = int(counts[~possible].sum())
    expected = (counts.sum() - impossible) * probs
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small & possible].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = int(keep.sum()) - 1
    pvalue = torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.double), stat / 2)
    return float(pvalue), impossible


def build_models(pg, sharpness=6.0, noise=0.3, standalone_head=4.0, feature_noise=0.01,
                 feature_head=5.0, seed=3):
    """The actor and its two drafts, both made sharper than the actor (heads scaled): a
    draft more confident than the actor is where an acceptance test against the wrong
    ``q`` errs most, and it still accepts often enough for frequent bonus tokens."""
    actor, standalone = actor_and_draft(pg, vocab_size=V, sharpness=sharpness, noise=noise,
                                        seed=seed)
    feature = feature_draft_for(actor, pg, noise=feature_noise)
    with torch.no_grad():
        standalone.output_layer.weight.mul_(standalone_head)
        feature.output_layer.weight.mul_(feature_head)
    return actor, {"standalone": standalone, "feature": feature}


def exact_probs(actor) -> dict[str, torch.Tensor]:
    """Sampling setting -> ``[V**T]`` probability of every continuation under the actor."""
    seqs = torch.tensor(list(itertools.product(range(V), repeat=T)))
    ids = torch.cat([torch.tensor(PROMPT).expand(len(seqs), -1), seqs], 1)
    with torch.no_grad():
        logits = lm_logits(actor, ids)[:, len(PROMPT) - 1: -1]  # [S, T, V]
    out = {}
    for name, params in SAMPLING.items():
        p = probs_for_sampling(logits, GenerationConfig(**params))
        out[name] = p.gather(-1, seqs[..., None])[..., 0].prod(-1).double()
    return out


def sample(actor, draft, setting: str, n, rule_name: str, seed: int, samples: int = N):
    """``(counts [V**T], stats, bonus tokens in responses)`` of ``samples`` continuations.
    ``auto`` runs as :data:`AUTO_CALLS` calls, each with its own random selector: one
    call's batch takes only about ``T - 1`` rounds, all with the same ``n``."""
    cfg = GenerationConfig(max_new_tokens=T, stop_on_eos=False, **SAMPLING[setting])
    calls = AUTO_CALLS if n == "auto" else 1
    counts = torch.zeros(V**T, dtype=torch.double)
    stats, bonus = None, 0
    for c in range(calls):
        rule = RecordingRule(rule_for(rule_name, cfg))
        selector = RandomSelector(MAX_N, seed + c) if n == "auto" else None
        ids = list(range(c * samples // calls, (c + 1) * samples // calls))
        r = Generator(actor, draft if n else None, selector=selector).generate(
            [PROMPT] * len(ids), cfg, SpecConfig(n, max_draft_tokens=MAX_N, verify="rejection"), seed=seed,
            sample_ids=ids, accept_rule=rule)
        assert (r.lengths == T).all()
        index = (r.response_ids[:, :T] * V ** torch.arange(T - 1, -1, -1)).sum(-1)
        counts += torch.bincount(index, minlength=V**T)
        plain_first = 0
        if selector is not None:
            plain_first = next((i for i, m in enumerate(selector.choices) if m), 0)
        bonus += bonus_tokens_in_responses(rule, plain_first)
        stats = r.stats if stats is None else add_stats(stats, r.stats)
    return counts, stats, bonus


def add_stats(a, b):
    """``a`` with ``b``'s per-position and per-length counts added."""
    for name in ("accepted_per_position", "drafted_per_position", "rounds_by_draft_len"):
        setattr(a, name, [x + y for x, y in zip(getattr(a, name), getattr(b, name))])
    return a


@pytest.fixture(scope="module")
def models(world1):
    return build_models(world1)


@pytest.fixture(scope="module")
def exact(models):
    return exact_probs(models[0])


@pytest.fixture(scope="module")
def sampled(models):
    """``sample`` of one configuration ``(kind, setting, n, rule)``, each drawn once (with
    its own seed) and kept for the module."""
    actor, drafts = models
    cache = {}

    def get(kind, setting, n, rule_name):
        key = (kind, setting, n, rule_name)
        if key not in cache:
            cache[key] = sample(actor, drafts[kind], setting, n, rule_name,
                                zlib.crc32(repr(key).encode()), samples_for(setting, rule_name))
        return cache[key]

    return get


# ------------------------------------------------------------------------ tests
@pytest.mark.parametrize("setting", list(SAMPLING))
@pytest.mark.parametrize("kind", KINDS)
def test_draft_differs_from_the_actor_and_is_not_one_hot(models, kind, setting):
    actor, drafts = models
    cfg = GenerationConfig(**SAMPLING[setting])
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        q = probs_for_sampling(draft_logits(drafts[kind], actor, ids)[0, -1], cfg)
        p = probs_for_sampling(lm_logits(actor, ids)[0, -1], cfg)
    tv = 0.5 * float((q - p).abs().sum())
    print(f"\n{kind} {setting}: TV(q, p) of the first token {tv:.3f}, max q {float(q.max()):.3f}")
    assert tv > 0.3
    assert q.max() < 0.9


@pytest.mark.parametrize("setting", list(SAMPLING))
def test_plain_sampling_is_the_actors_distribution(sampled, exact, setting):
    counts = sampled("standalone", setting, 0, "correct")[0]
    pv, impossible = chi_square(counts, exact[setting])
    print(f"\nplain {setting} ({int(counts.sum())} samples): p = {pv:.3g}")
    assert impossible == 0 and pv > PASS_P


@pytest.mark.parametrize("n", DRAFT_LENGTHS)
@pytest.mark.parametrize("setting", list(SAMPLING))
@pytest.mark.parametrize("kind", KINDS)
def test_speculative_sampling_is_the_actors_distribution(sampled, exact, kind, setting, n):
    counts, stats, bonus = sampled(kind, setting, n, "correct")
    pv, impossible = chi_square(counts, exact[setting])
    print(f"\n{kind} {setting} n={n} ({int(counts.sum())} samples): p = {pv:.3g}; bonus tokens "
          f"in responses (first rounds) {bonus}; accepted per position "
          f"{stats.accepted_per_position}; rounds by draft length {stats.rounds_by_draft_len}")
    assert impossible == 0 and pv > PASS_P
    assert bonus > N // 20  # bonus tokens really are part of what was tested
    if n == "auto":
        assert all(stats.rounds_by_draft_len), "plain steps and every draft length ran"


@pytest.mark.parametrize("n", DRAFT_LENGTHS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sabotage,setting", [(s, t) for s, ts in SABOTAGES.items() for t in ts])
def test_broken_rule_is_detected(sampled, exact, sabotage, setting, kind, n):
    counts = sampled(kind, setting, n, sabotage)[0]
    pv, impossible = chi_square(counts, exact[setting])
    print(f"\n{sabotage} {kind} {setting} n={n} ({int(counts.sum())} samples): p = {pv:.3g} "
          f"over possible sequences, {impossible} impossible ones")
    assert impossible > 0 or pv < FAIL_P
