"""Exact verification (``--spec-verify exact``): whatever is drafted (the history, a draft
model, both) and however many tokens a round verifies, the emitted tokens are those of
speculation off, token for token.

What makes these comparisons deterministic rather than lucky: the uniforms are keyed by
(seed, sample, position), so plain and speculative runs draw position ``m``'s token with
the same uniform; what could still differ is the actor's logits at a position (a
verification over ``n + 1`` tokens runs GEMMs of other shapes than a one-token step) when
the uniform falls within that rounding of a CDF boundary. Each comparison here is one
fixed computation (fixed seeds, fp32, a CPU's deterministic kernels): on a given machine
it matches or not every time. How likely a mismatch is elsewhere: ``python -m benchmarks.flips``
measured 600-1,900 flips per million tokens on SmolLM2 in fp32 and ~560 in bf16 on the CPU
(docs/benchmarks/flips_cpu.md); these tiny models sample a few hundred tokens per comparison from
sharpened distributions over 512 tokens, where near-ties are rarer still.
"""

import pytest
import torch

from megatron_rlhf.config import GenerationConfig, SpecConfig
from megatron_rlhf.generation import speculative
from megatron_rlhf.generation.engine import Generator, Lookup
from megatron_rlhf.generation.history import HistoryDrafter

from gen_fixtures import PROMPTS, RandomSelector, actor_and_draft

GROUP = 3
SETTINGS = {
    "T1": GenerationConfig(max_new_tokens=24, temperature=1.0, stop_on_eos=False),
    "T0.7-top-p": GenerationConfig(max_new_tokens=24, temperature=0.7, top_p=0.9, stop_on_eos=False),
    "greedy": GenerationConfig(max_new_tokens=24, temperature=0.0, stop_on_eos=False),
}
SEED = 11


@pytest.fixture(scope="module")
def models(world1):
    """A sharpened tiny actor (its samples repeat: the history has something to find) and a
    draft near it."""
    return actor_and_draft(world1, sharpness=20.0, noise=0.5)


def _prompts():
    return [p for p in PROMPTS for _ in range(GROUP)]


def _generate(actor, draft=None, history=None, spec=SpecConfig(0), cfg=SETTINGS["T1"], selector=None,
              seed=SEED):
    r = Generator(actor, draft, history=history, selector=selector).generate(_prompts(), cfg, spec, seed=seed)
    return r.response_ids, r.stats


@pytest.fixture(scope="module")
def plain(models):
    return {name: _generate(models[0], cfg=cfg)[0] for name, cfg in SETTINGS.items()}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("source", ["history", "history-padded", "model", "both"])
def test_drafts_change_no_sample(models, plain, setting, source):
    """``history``: ragged rounds (each row verifies its own proposal); ``history-padded``:
    every row the round's width (what a graphed round does)."""
    actor, draft = models
    history = HistoryDrafter() if source != "model" else None
    ragged, source = source == "history", source.removesuffix("-padded")
    r = Generator(actor, draft if source != "history" else None, history=history, ragged=ragged).generate(
        _prompts(), SETTINGS[setting], SpecConfig(4, draft_source=source), seed=SEED)
    ids, stats = r.response_ids, r.stats
    assert torch.equal(ids, plain[setting])
    accepted = sum(stats.accepted_per_position)
    assert stats.verifications and 0 < accepted < 4 * stats.verifications  # drafts accepted and refused
    if source != "model":
        assert 0 < stats.history_accepted < stats.history_drafted


@pytest.mark.parametrize("source", ["model", "history"])
def test_samples_do_not_depend_on_the_selectors_choices(models, plain, source):
    """Under ``auto`` the drafting choices depend on timings; under exact verification the
    samples do not depend on them. Under rejection sampling they do (the control)."""
    actor, draft = models
    model = draft if source == "model" else None
    runs = [_generate(actor, model, HistoryDrafter() if source == "history" else None,
                      SpecConfig("auto", draft_source=source), selector=RandomSelector(4, s))[0]
            for s in (1, 2)]
    assert torch.equal(runs[0], plain["T1"]) and torch.equal(runs[1], plain["T1"])
    if source == "model":
        rejected = [_generate(actor, draft, spec=SpecConfig("auto", verify="rejection"),
                              selector=RandomSelector(4, s))[0] for s in (1, 2)]
        assert not torch.equal(rejected[0], rejected[1])


def _accepts_one_mismatch(draft_tokens, drawn, widths=None):
    ok = draft_tokens == drawn[:, :-1]
    ok[:, 0] = True  # sabotage: the first draft token is always taken
    if widths is not None:
        ok &= torch.arange(ok.shape[1]) < widths[:, None]
    return speculative.verdict_from_matches(ok, drawn)


_EXACT = speculative.accept_drawn


def _emits_the_draft(draft_tokens, drawn, widths=None):
    v = _EXACT(draft_tokens, drawn, widths)
    n = draft_tokens.shape[1]
    rejected = v.accepted < (n if widths is None else widths)
    own = draft_tokens.gather(1, v.accepted.clamp(max=n - 1)[:, None])[:, 0]
    return speculative.Verdict(v.accepted, torch.where(rejected, own, v.next_token))


@pytest.mark.parametrize("ragged", [True, False])
@pytest.mark.parametrize("saboteur", [_accepts_one_mismatch, _emits_the_draft])
def test_a_sabotaged_exact_rule_changes_samples(models, plain, monkeypatch, saboteur, ragged):
    """The rule every exact verification goes through (:func:`speculative.accept_drawn`:
    the padded rounds' :func:`speculative.accept_exact` and the ragged rounds), sabotaged."""
    monkeypatch.setattr(speculative, "accept_drawn", saboteur)
    r = Generator(models[0], history=HistoryDrafter(), ragged=ragged).generate(
        _prompts(), SETTINGS["T1"], SpecConfig(4, draft_source="history"), seed=SEED)
    assert not torch.equal(r.response_ids, plain["T1"])


def test_the_token_after_j_accepted_drafts_uses_position_m_plus_j_uniform():
    """White box: one row, a uniform distribution over 4 tokens, uniforms that draw 0, 1, 2,
    3 at positions m..m+3. Drafts [0, 1, 3] accept two; the emitted token is position
    m+2's draw (2), not position m's (0) or the draft's (3)."""
    p = torch.full((1, 4, 4), 0.25)
    u = torch.tensor([[0.1, 0.3, 0.6, 0.9]])
    v = speculative.accept_exact(torch.tensor([[0, 1, 3]]), p, u)
    assert v.accepted.tolist() == [2] and v.next_token.tolist() == [2]
    v = speculative.accept_exact(torch.tensor([[0, 1, 2]]), p, u)  # all accepted: the bonus is m+3's
    assert v.accepted.tolist() == [3] and v.next_token.tolist() == [3]


def test_rejection_is_refused_for_history_drafts():
    from megatron_rlhf.flags import cli_message

    with pytest.raises(ValueError, match="draft_source history .*: use verify exact") as e:
        SpecConfig(4, draft_source="history", verify="rejection")
    assert "--draft-source history" in cli_message(e.value) and "use --spec-verify exact" in cli_message(e.value)


def test_repeats_are_found(models):
    """The same prompts a second time (the next epoch of an RL run, another seed): greedy
    answers repeat the first epoch's, and the history's drafts are accepted for more than 4
    of the 5 tokens a verification of 4 drafts can emit (measured 4.74); the first epoch,
    with only the prompts and the siblings to draft from, gets far less (1.40)."""
    cfg = GenerationConfig(max_new_tokens=32, temperature=0.0, stop_on_eos=False)
    generator = Generator(models[0], history=HistoryDrafter())
    lengths = []
    for epoch in range(2):
        r = generator.generate(_prompts(), cfg, SpecConfig(4, draft_source="history"), seed=SEED + epoch)
        lengths.append(1 + r.stats.history_accepted / r.stats.verifications)
    assert lengths[1] > 4.0 and lengths[0] < lengths[1], lengths


def test_a_history_round_is_as_wide_as_the_longest_proposal(models):
    """Without a draft model a round verifies no more than the longest proposal among the
    live samples (none: a plain step); with a model the model fills the width."""
    history, actor, draft = HistoryDrafter(), *models
    looked_up = Lookup(None, [0, 2, 1, 3], [True, True, True, False], room=4)  # a finished row's 3: not live
    assert Generator(actor, history=history)._choose(None, 3, 4, looked_up) == 2
    assert Generator(actor, history=history)._choose(None, 3, 4, Lookup(None, [0] * 3, [True] * 3, 4)) == 0
    assert Generator(actor, draft, history=history)._choose(None, 3, 4, looked_up) == 4


def test_long_running_samples_draft_further_and_change_nothing(models, plain):
    """DAS: samples past ``long_after`` tokens draft up to twice ``n``. With a history of
    the same answers (a second epoch, greedy) rounds wider than n=2 happen, and the tokens
    are still plain decoding's."""
    cfg = SETTINGS["greedy"]
    generator = Generator(models[0], history=HistoryDrafter(long_after=6))
    spec = SpecConfig(2, draft_source="history")
    generator.generate(_prompts(), cfg, spec, seed=SEED + 1)
    r = generator.generate(_prompts(), cfg, spec, seed=SEED)
    assert torch.equal(r.response_ids, plain["greedy"])
    assert spec.max_tokens(False) == 4 and sum(r.stats.rounds_by_draft_len[3:]) > 0, r.stats.rounds_by_draft_len


def test_a_global_index_changes_no_sample(models, plain):
    """Drafts from other prompts' answers (``--history-global``) are verified like any:
    over two epochs the tokens are plain decoding's; the global index holds both epochs' answers."""
    drafter = HistoryDrafter(global_responses=64, global_min_match=2)
    generator = Generator(models[0], history=drafter)
    spec = SpecConfig(3, draft_source="history", history_global=64)
    for seed in (SEED + 1, SEED):
        r = generator.generate(_prompts(), SETTINGS["T1"], spec, seed=seed)
    assert torch.equal(r.response_ids, plain["T1"]) and drafter.stats()["global_responses"] == 2 * len(_prompts())
    assert r.stats.history_accepted > 0


def test_a_ragged_round_verifies_each_rows_own_proposal(models, plain, monkeypatch):
    """Without a draft model each row of a round verifies its own proposal's length (none:
    the row takes a plain step), and only those tokens reach the LM head: the forward's
    packed logits hold ``sum(valid)`` rows. Under ``auto`` with random per-sample widths,
    the tokens are still plain decoding's."""
    from megatron_rlhf.generation import rounds

    seen = []

    def recording(model, cache, tokens, rope, *args, **kw):
        out = forward_cached(model, cache, tokens, rope, *args, **kw)
        if kw.get("packed_logits"):
            seen.append((kw["valid"].tolist(), out.shape[0], tokens.shape[1]))
        return out

    forward_cached = rounds.forward_cached
    monkeypatch.setattr(rounds, "forward_cached", recording)
    generator = Generator(models[0], history=HistoryDrafter())
    for seed in (SEED + 1, SEED):  # a first epoch fills the history
        r = generator.generate(_prompts(), SETTINGS["T1"], SpecConfig(4, draft_source="history"), seed=seed)
    assert torch.equal(r.response_ids, plain["T1"])
    assert seen and all(rows == sum(valid) for valid, rows, _ in seen)
    assert any(min(valid) == 1 and max(valid) > 2 for valid, _, _ in seen), seen  # plain rows beside drafting ones
    assert any(sum(valid) < len(valid) * width for valid, _, width in seen)  # fewer tokens than padded

    seen.clear()
    r = Generator(models[0], history=HistoryDrafter(), selector=RandomSelector(4, 3)).generate(
        _prompts(), SETTINGS["T1"], SpecConfig("auto", draft_source="history"), seed=SEED)
    assert torch.equal(r.response_ids, plain["T1"]) and len({tuple(v) for v, _, _ in seen}) > 3
