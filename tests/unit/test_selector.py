"""The drafting selector (cost model, acceptance, choice), the migration plan and the
per-sample random numbers: pure functions, and the selector inside the engine."""

import itertools
import random

import pytest
import torch

from gen_fixtures import PROMPTS, actor_and_draft, feature_draft_for
from megatron_rlhf.config import GenerationConfig, SpecConfig
from megatron_rlhf.generation import rng
from megatron_rlhf.generation.engine import Generator
from megatron_rlhf.generation.migration import plan_transfers
from megatron_rlhf.generation.strategy import (
    Acceptance, CostTable, OnlineCosts, Selector, best_draft_length, expected_tokens_mixed, load_or_profile,
    profile,
)


def table(actor_per_token: float, actor_base: float, draft: float, batches=(1, 8, 64), widths=5):
    """Latencies ``actor(b, t) = (base + per_token * t) * (1 + b / 64)``, draft flat."""
    scale = [1 + b / 64 for b in batches]
    return CostTable(batches=list(batches),
                     actor={t: [(actor_base + actor_per_token * t) * s for s in scale]
                            for t in range(1, widths + 1)},
                     draft={t: [draft * s for s in scale] for t in (1, 2)})


# ---------------------------------------------------------------- pure choices
def test_best_draft_length_is_the_argmax_of_tokens_per_second():
    g = random.Random(0)
    for _ in range(200):
        k = g.randint(1, 6)
        times = [g.uniform(0.01, 1.0) for _ in range(k + 1)]
        tokens = [1.0] + [1.0 + g.uniform(0, n) for n in range(1, k + 1)]
        rates = [t / s for t, s in zip(tokens, times)]
        assert best_draft_length(times, tokens) == max(range(k + 1), key=lambda n: rates[n])


def test_selector_picks_the_argmax_of_a_synthetic_table(monkeypatch):
    from megatron_rlhf.generation import strategy

    monkeypatch.setattr(strategy, "EXPLORATION", 0.0)
    acc = Acceptance(4, decay=1.0, prior=0.7, prior_weight=10.0)
    assert acc.rates() == pytest.approx([0.7] * 4)
    expected = [1 + sum(0.7 ** j for j in range(1, n + 1)) for n in range(5)]
    for per_token, draft in ((0.0, 0.001), (0.01, 0.001), (0.05, 0.02), (0.2, 0.001), (0.0, 0.5)):
        costs = table(per_token, 0.05, draft)
        sel = Selector(costs, 4, acc)
        for b in (1, 5, 8, 30, 64, 200):
            rates = [expected[n] / costs.round_s(b, n) for n in range(5)]
            assert sel.choose(b) == max(range(5), key=lambda n: (rates[n], -n)), (per_token, draft, b)


def test_acceptance_estimate_follows_observations_and_decays():
    acc = Acceptance(3, decay=0.5)
    for _ in range(20):  # position 0 always accepted, position 1 never
        acc.observe(torch.tensor([1, 1, 1, 1]), 3)
    rates = acc.rates(explore=False)
    assert rates[0] == pytest.approx(1.0, abs=1e-3) and rates[1] == pytest.approx(0.0, abs=1e-3)
    assert acc.expected_tokens(3, explore=False) == pytest.approx(2.0, abs=1e-3)
    for _ in range(20):  # the actor changed: now nothing is accepted
        acc.observe(torch.tensor([0, 0, 0, 0]), 3)
    assert acc.rates(explore=False)[0] < 0.01
    # rounds without drafting let the evidence fade: the exploration bonus grows back
    before = acc.rates()[2]
    for _ in range(10):
        acc.observe(None, 0)
    assert acc.rates()[2] > before


def test_measured_rounds_correct_the_table():
    sel = Selector(table(0.0, 0.1, 0.0), 2, Acceptance(2, decay=1.0))
    for _ in range(30):
        sel.observe(8, 0, 0.3 * sel.costs.round_s(8, 0), None)
    assert sel.round_s(8, 0) == pytest.approx(0.3 * sel.costs.round_s(8, 0), rel=1e-3)
    # another batch octave takes the factor of the same length at the nearest octave
    assert sel.round_s(64, 0) == pytest.approx(0.3 * sel.costs.round_s(64, 0), rel=1e-3)
    # drafting rounds have their own overheads: a plain step's factor does not stand in
    assert sel.round_s(8, 2) == sel.costs.round_s(8, 2)
    for _ in range(30):
        sel.observe(64, 1, 2.0 * sel.costs.round_s(64, 1), None)
    assert sel.round_s(64, 2) == pytest.approx(2.0 * sel.costs.round_s(64, 2), rel=1e-3)
    assert sel.round_s(8, 2) == sel.costs.round_s(8, 2)  # n=1 at 64 is another length
    assert sel.round_s(8, 1) == pytest.approx(2.0 * sel.costs.round_s(8, 1), rel=1e-3)


def test_a_length_whose_overhead_was_never_measured_gets_tried():
    # drafting rounds cost 1.5x their profile; the selector has only ever measured n=2, and
    # must not let n=2's factor make plain steps look as dear: it tries them, and keeps them
    # when the acceptance is too low to pay for drafting
    sel = Selector(table(0.0, 0.1, 0.0), 2, Acceptance(2, decay=1.0, prior=0.05))
    sel.observe(1, 2, 1.5 * sel.costs.round_s(1, 2), torch.tensor([0]))
    assert sel.choose(1) == 0


def test_each_source_counts_only_the_positions_it_drafted():
    """History rows drafted ``found`` tokens and the model the rest (or padding): a
    source's acceptance at position i counts only the rows whose position i it drafted."""
    accepted, found = torch.tensor([2, 0, 3, 1]), torch.tensor([2, 0, 1, 3])
    hist, model = Acceptance(3, decay=1.0, prior_weight=0.0), Acceptance(3, decay=1.0, prior_weight=0.0)
    hist.observe(accepted, 3, hi=found)
    model.observe(accepted, 3, lo=found)
    # position 0: history rows 0, 2, 3 (all passed); model row 1 (refused)
    # position 1: history rows 0 (passed) and 3 (refused); model row 2 (passed)
    # position 2: history row 3 never reached it; model rows 0 (refused) and 2 (passed)
    assert hist.tried == [3, 2, 0] and hist.passed == [3, 1, 0]
    assert model.tried == [1, 1, 2] and model.passed == [0, 1, 1]


def test_expected_tokens_mix_the_sources_row_by_row():
    h, m = [0.9, 0.8, 0.5], [0.4, 0.3, 0.2]
    # history only: a row with 2 found stops after them, a row with 0 emits one token
    assert expected_tokens_mixed(3, [2, 0], h, None) == pytest.approx(((1 + 0.9 + 0.72) + 1) / 2)
    # with the model: the row of 2 found continues with the model's position-2 rate;
    # the row of 0 found is the model's throughout
    row2 = 1 + 0.9 + 0.72 + 0.72 * 0.2
    row0 = 1 + 0.4 + 0.4 * 0.3 + 0.4 * 0.3 * 0.2
    assert expected_tokens_mixed(3, [2, 0], h, m) == pytest.approx((row2 + row0) / 2)
    assert expected_tokens_mixed(1, [2, 0], h, None) == pytest.approx((1.9 + 1) / 2)  # narrower
    assert expected_tokens_mixed(3, [], h, m) == 1.0


def test_the_selector_weighs_what_the_history_found(monkeypatch):
    """A verification of n tokens costs 1 + 0.3 n plain steps. History drafts are
    accepted at 0.9: when most samples' history found 3 tokens it drafts 3; when one
    sample in eight found any, drafting does not pay and it decodes plainly."""
    from megatron_rlhf.generation import strategy

    monkeypatch.setattr(strategy, "EXPLORATION", 0.0)
    costs = CostTable(batches=[1, 64], actor={t: [1.0 + 0.3 * (t - 1)] * 2 for t in range(1, 6)})
    sel = Selector(costs, 4, None, Acceptance(8, decay=1.0, prior=0.9, prior_weight=10.0))
    assert sel.choose(8, [3] * 7 + [0], widest=3) == 3
    assert sel.choose(8, [3] + [0] * 7, widest=3) == 0
    assert sel.choose(8, [0] * 8, widest=0) == 0
    with pytest.raises(ValueError, match="draft source"):
        Selector(costs, 4, None, None)


def test_online_costs_learn_the_fixed_and_per_token_parts(monkeypatch):
    """Rounds cost 50 ms + 5 ms per token (a CPU-like line). Before anything is measured a
    plain step is the choice; while the batch has stayed at 32, a verification is priced in
    proportion to its tokens (4 drafts: 5 plain steps); once plain steps at shrinking
    batches are measured, the fixed part is known, and with drafts accepted at 0.6 the
    selector drafts at small batches and decodes plainly at large ones."""
    from megatron_rlhf.generation import strategy

    monkeypatch.setattr(strategy, "EXPLORATION", 0.0)
    costs = OnlineCosts()

    def cost(b, n):
        return 0.05 + 0.005 * b * (n + 1)

    sel = Selector(costs, 4, Acceptance(4, decay=1.0, prior=0.6, prior_weight=10.0))
    assert sel.choose(32) == 0 and costs.round_s(32, 0) == 0 and costs.round_s(32, 2) == float("inf")
    for _ in range(5):
        sel.observe(32, 0, cost(32, 0), None)
    assert costs.round_s(32, 4) == pytest.approx(5 * cost(32, 0))
    for b in range(32, 26, -1):  # batches within 20% of each other: still read in proportion
        sel.observe(b, 0, cost(b, 0), None)
    assert costs.round_s(29, 4) > 4 * cost(29, 0)
    for b in range(32, 0, -1):
        sel.observe(b, 0, cost(b, 0), None)
    for b in (1, 2, 8, 32):
        for n in (0, 1, 4):
            assert costs.round_s(b, n) == pytest.approx(cost(b, n), rel=1e-6), (b, n)
    tokens = [sel.acceptance.expected_tokens(n) for n in range(5)]
    for b in (1, 32):  # the choice the true costs make
        assert sel.choose(b) == best_draft_length([cost(b, n) for n in range(5)], tokens)
    assert sel.choose(1) == 3 and sel.choose(32) == 0
    sel.observe(2, 3, 2 * cost(2, 3), torch.tensor([3, 3]))  # measured dearer than the prior
    assert costs.round_s(2, 3) == pytest.approx(2 * cost(2, 3))
    assert costs.to_dict()["by_n"]["3"]["w"] == 1


@pytest.mark.parametrize("device", ["gpu", "cpu"])
def test_the_first_drafting_round_is_tried_at_a_fixed_batch(monkeypatch, device):
    """At a batch that never changes, the prior prices a verification in proportion to its
    tokens. On a GPU-like line (a round costs about a plain step) the selector would then
    never draft; instead it tries the length that would pay at a plain step's cost once,
    and keeps drafting because that round measured cheap. On a CPU-like line the one try
    measures dear and the selector goes back to plain steps."""
    from megatron_rlhf.generation import strategy

    monkeypatch.setattr(strategy, "EXPLORATION", 0.0)
    per_token = 0.0001 if device == "gpu" else 0.005

    def cost(n):
        return 0.05 + per_token * 32 * (n + 1)

    costs = OnlineCosts()
    sel = Selector(costs, 4, Acceptance(4, decay=1.0, prior=0.6, prior_weight=10.0))
    assert sel.choose(32) == 0  # nothing measured: plain
    sel.observe(32, 0, cost(0), None)
    assert costs.guessing() and costs.round_s(32, 4) == pytest.approx(5 * cost(0))
    n = sel.choose(32)
    assert n == 4  # 2.31 tokens a round at a plain step's cost: the most
    sel.observe(32, n, cost(n), torch.tensor([2] * 32))
    assert not costs.guessing()
    # (2 of 4 accepted in every sample: the third and fourth drafts are not worth it)
    assert [sel.choose(32) for _ in range(3)] == ([2] * 3 if device == "gpu" else [0] * 3)
    # the prior alone (no try) would never have drafted on the GPU-like line
    monkeypatch.setattr(OnlineCosts, "guessing", lambda self: False)
    fresh = Selector(OnlineCosts(), 4, Acceptance(4, decay=1.0, prior=0.6, prior_weight=10.0))
    fresh.observe(32, 0, cost(0), None)
    assert fresh.choose(32) == 0


def _history_selector(draft_cost: float, per_token: float = 0.005, fixed: float = 0.04,
                      acceptance: float = 0.8):
    """A history-only selector whose costs were learned from plain steps at batches 1..16
    (``fixed + per_token * batch``) and from ragged rounds whose drafts cost ``draft_cost``
    each beyond a plain step (drafts accepted at ``acceptance``, no exploration bonus)."""
    sel = Selector(OnlineCosts(), 8, None, Acceptance(8, decay=1.0, prior=acceptance, prior_weight=10.0))
    for b in range(16, 0, -1):
        sel.observe(b, 0, fixed + per_token * b, None)
    for drafts in (4, 16, 8):
        sel.observe(8, 2, fixed + per_token * 8 + draft_cost * drafts, None, drafts=drafts)
    return sel


@pytest.mark.parametrize("draft_cost, widths", [
    (0.0005, [8, 0, 3, 1]),  # drafts nearly free (a GPU, or a CPU's long tail): every one
    (0.05, [0, 0, 0, 0]),  # drafts dear: plain
])
def test_ragged_widths_take_the_drafts_worth_their_cost(monkeypatch, draft_cost, widths):
    """A ragged round (each sample its own width) costs a plain step plus what its drafts
    cost beyond one (learned from the ragged rounds measured), and draft ``i`` of a sample
    adds the expected tokens 0.8 ** (i + 1); a sample with no proposal costs nothing.
    Batch 4 (plain step 60 ms); the proposals are 8, 0, 3 and 1 long."""
    from megatron_rlhf.generation import strategy

    monkeypatch.setattr(strategy, "EXPLORATION", 0.0)
    sel = _history_selector(draft_cost)
    assert sel.costs.ragged_s(4, 12) == pytest.approx(0.06 + 12 * draft_cost)
    assert sel.choose_widths([8, 0, 3, 1]) == widths


def test_ragged_widths_go_to_the_samples_expected_to_finish_last(monkeypatch):
    """At batch 16 (plain step 120 ms, 5 ms a draft, acceptance 0.8) drafts pay too little
    when every sample weighs the same (at most 8% more tokens per second: within the
    margin), so a flat choice is a plain step. A rollout ends with its longest sample:
    when one sample is expected to emit 100 more tokens and the rest 5, a token gained
    there is worth 20 gained elsewhere, and that sample (or the two long ones) verify their
    whole proposals while the others take a plain step. Equal predictions are the flat choice."""
    from megatron_rlhf.generation import strategy

    monkeypatch.setattr(strategy, "EXPLORATION", 0.0)
    sel = _history_selector(0.005)
    found = [6] * 16
    assert sel.choose_widths(found) == [0] * 16
    assert sel.choose_widths(found, [5.0] * 15 + [100.0]) == [0] * 15 + [6]
    assert sel.choose_widths(found, [100.0, 100.0] + [5.0] * 14) == [6, 6] + [0] * 14
    assert sel.choose_widths(found, [50.0] * 16) == [0] * 16


def test_large_ragged_rounds_do_not_price_small_ones_out():
    """What drafts cost beyond a plain step is a line through the origin. The first ragged
    rounds of a run may be a held-out evaluation's, 90-100 rows verifying 384-450 drafts
    (about 5 ms each; a round with few drafts among 90 rows costs much beyond a plain step
    too, what grows with the batch, not the drafts); a free
    intercept fitted to them priced any later round of a few rows at a second beyond a
    plain step, so nothing drafted again and nothing corrected it. Through the origin the
    same rounds price a draft at about 5 ms, and a round of 3 rows with two 4-draft
    proposals (acceptance 0.8) drafts them."""
    from megatron_rlhf.generation import costs

    sel = Selector(OnlineCosts(), 4, None, Acceptance(4, decay=1.0, prior=0.8, prior_weight=10.0))
    for b in range(100, 0, -3):
        sel.observe(b, 0, 0.05 + 0.003 * b, None)
    rounds = ((384, 1.98), (450, 2.10), (420, 2.05), (60, 1.20))  # (drafts, seconds beyond a plain step)
    for drafts, extra in rounds:
        sel.observe(95, 4, 0.05 + 0.003 * 95 + extra, None, drafts=drafts)
    assert 0.004 < sel.costs.drafted.predict(1) < 0.006
    assert sel.costs.ragged_s(3, 8) < 0.059 + 8 * 0.006
    assert sel.choose_widths([4, 4, 0]) == [4, 4, 0]
    free = costs._Fit(1.0)  # the free line over the same rounds: the intercept
    for drafts, extra in rounds:
        free.add(drafts, extra)
    assert free.predict(8) > 1.0


def test_ragged_widths_are_prefixes_chosen_by_gain(monkeypatch):
    """Gains fall along a sample's proposal, so the chosen drafts are each sample's first
    ones: with acceptance 1 at the first two positions and 0.2 after, at batch 16 (plain
    step 120 ms, 3 ms a draft) exactly those two (and the third sample's one) pay; at 5 ms
    a draft the gain, 4% more tokens per second, is within the margin of a plain step."""
    from megatron_rlhf.generation import strategy

    monkeypatch.setattr(strategy, "EXPLORATION", 0.0)
    for cost, widths in ((0.003, [2, 2, 1]), (0.005, [0, 0, 0])):
        sel = _history_selector(cost)
        sel.history.passed = [10.0, 10.0] + [2.0] * 6
        assert sel.history.rates()[:3] == [1.0, 1.0, 0.2]
        assert sel.choose_widths([5, 5, 1] + [0] * 13) == widths + [0] * 13, cost


def test_ragged_widths_measure_a_plain_step_first_and_try_once():
    """Nothing measured: plain. Plain steps measured but no ragged round: one is tried as
    if it cost a plain step (every draft); once measured dear, plain again."""
    sel = Selector(OnlineCosts(), 4, None, Acceptance(4, decay=1.0, prior=0.8, prior_weight=10.0))
    assert sel.choose_widths([4, 2]) == [0, 0]
    sel.observe(2, 0, 0.1, None)
    assert sel.costs.ragged_s(2, 6) is None and sel.choose_widths([4, 2]) == [4, 2]
    sel.observe(2, 4, 0.1 + 6 * 0.05, torch.tensor([1, 1]), torch.tensor([4, 2]), drafts=6)
    assert 4 not in sel.costs.by_n and sel.costs.ragged_s(2, 6) == pytest.approx(0.4)
    assert sel.choose_widths([4, 2]) == [0, 0]  # a draft costs half a plain step: none pays


def test_drafting_must_beat_a_plain_step_by_the_margin(monkeypatch):
    """Drafts accepted at 0.5: one draft emits 1.5 tokens. A verification that costs 1.4
    plain steps promises 7% more tokens per second (within DRAFT_MARGIN: plain); one that
    costs 1.2 steps promises 25% more (drafted)."""
    from megatron_rlhf.generation import strategy

    monkeypatch.setattr(strategy, "EXPLORATION", 0.0)
    assert strategy.DRAFT_MARGIN == 0.1
    acc = Acceptance(1, decay=1.0, prior=0.5, prior_weight=10.0)
    for ratio, chosen in ((1.4, 0), (1.2, 1)):
        costs = CostTable(batches=[1, 64], actor={1: [1.0, 1.0], 2: [ratio, ratio]})
        assert Selector(costs, 1, acc).choose(8) == chosen, ratio


def test_cost_table_interpolates_and_round_trips(tmp_path):
    t = table(0.01, 0.05, 0.002)
    assert t.actor_s(8, 2) == pytest.approx((0.05 + 0.02) * (1 + 8 / 64))
    assert t.actor_s(4, 1) == pytest.approx(t.actor_s(1, 1) + (t.actor_s(8, 1) - t.actor_s(1, 1)) * 3 / 7)
    lo, hi = t.actor_s(1, 3), t.actor_s(8, 3)
    assert lo < t.actor_s(4, 3) < hi
    assert t.actor_s(128, 1) > t.actor_s(64, 1)  # extrapolated with the last slope
    assert t.actor_s(8, 7) > t.actor_s(8, 5)  # wider than profiled
    t.save(tmp_path / "p.json")
    back = CostTable.load(tmp_path / "p.json")
    assert back.to_dict() == t.to_dict()
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="delete it to re-profile"):
        CostTable.load(tmp_path / "bad.json")


# ---------------------------------------------------------------- in the engine
@pytest.fixture(scope="module")
def same_pair(world1):
    return actor_and_draft(world1, noise=0.0)  # the draft is the actor: everything accepted


def test_free_verification_makes_the_engine_draft_the_most(same_pair):
    actor, draft = same_pair
    sel = Selector(table(0.0, 0.05, 1e-4), 4, Acceptance(4, decay=0.98))
    sel.observe = lambda *a, **k: Acceptance.observe(sel.acceptance, a[3], a[1])  # keep the table
    cfg = GenerationConfig(max_new_tokens=24, temperature=1.0)
    r = Generator(actor, draft, selector=sel).generate(PROMPTS, cfg, SpecConfig("auto"), seed=1)
    hist = r.stats.rounds_by_draft_len
    assert r.stats.mode == "auto" and sum(hist) > 0 and hist[4] == sum(hist), hist
    assert r.stats.accepted_tokens == r.stats.verifications * 4  # p == q: every draft accepted


def test_costly_verification_makes_the_engine_decode_plainly(same_pair):
    actor, draft = same_pair
    sel = Selector(table(0.05, 0.0, 0.01), 4, Acceptance(4, decay=0.98))
    sel.observe = lambda *a, **k: Acceptance.observe(sel.acceptance, a[3], a[1])
    cfg = GenerationConfig(max_new_tokens=24, temperature=1.0)
    r = Generator(actor, draft, selector=sel).generate(PROMPTS, cfg, SpecConfig("auto"), seed=1)
    hist = r.stats.rounds_by_draft_len
    assert hist[0] == sum(hist) > 0 and r.stats.verifications == 0, hist


@pytest.mark.parametrize("kind", ["standalone", "feature"])
def test_auto_with_a_profiled_table_keeps_greedy_tokens(world1, kind, tmp_path):
    """The real path: profile at the first call (written to the profile file, reused by
    the next generator), choices that mix plain steps and drafts; greedy tokens equal
    plain decoding."""
    actor, draft = actor_and_draft(world1, noise=0.5)
    if kind == "feature":
        draft = feature_draft_for(actor, world1, noise=0.5)
    cfg = GenerationConfig(max_new_tokens=20, temperature=0)
    plain = Generator(actor).generate(PROMPTS, cfg).responses()
    spec = SpecConfig("auto", max_draft_tokens=3, cost_profile=str(tmp_path / "costs.json"))
    gen = Generator(actor, draft)
    assert gen.generate(PROMPTS, cfg, spec).responses() == plain
    assert (tmp_path / "costs.json").exists()
    again = Generator(actor, draft)
    again.generate(PROMPTS, cfg, spec)
    assert again.selector.costs.to_dict() == CostTable.load(tmp_path / "costs.json").to_dict()
    # alternate plain and drafting rounds: the draft's catch-up buffer spans several steps
    sel = gen.selector
    turn = itertools.cycle([0, 0, 3, 1, 0, 2, 0, 0, 0, 3])
    sel.choose = lambda batch, *_: next(turn)
    r = gen.generate(PROMPTS, cfg, spec)
    assert r.responses() == plain and r.stats.rounds_by_draft_len[0] > 0 and r.stats.verifications > 0


def test_profile_measures_every_width(world1):
    actor, draft = actor_and_draft(world1)
    t = profile(actor, draft, 2, 9, context=8, repeats=1)
    assert t.batches == [1, 4, 9] and sorted(t.actor) == [1, 2, 3] and sorted(t.draft) == [1, 2]
    assert all(x > 0 for v in list(t.actor.values()) + list(t.draft.values()) for x in v)
    other = load_or_profile(actor, None, SpecConfig("auto", max_draft_tokens=1), 2, 64)
    assert other.draft == {} and other.models != t.models


# ---------------------------------------------------------------- migration plan
@pytest.mark.parametrize("counts", [[5, 0], [8, 4], [12, 0, 0, 0], [3, 9, 1, 7], [0, 0, 7],
                                    [4, 4], [2, 1], [6, 5, 6, 5], [1, 0, 0, 0]])
def test_migration_plan_balances_within_one(counts):
    moves = plan_transfers(counts, threshold=0.0)
    after = list(counts)
    for src, dst, n in moves:
        assert n > 0
        after[src] -= n
        after[dst] += n
    senders, receivers = {m[0] for m in moves}, {m[1] for m in moves}
    assert not senders & receivers
    if max(counts) - min(counts) >= 2:
        assert max(after) - min(after) <= 1 and sum(after) == sum(counts)
    else:
        assert moves == []


def test_migration_plan_respects_the_threshold():
    assert plan_transfers([6, 4], threshold=0.25) == []  # 6 <= 1.25 * 5
    assert plan_transfers([7, 3], threshold=0.25) == [(0, 1, 2)]
    assert plan_transfers([0, 0], threshold=0.0) == []


# ---------------------------------------------------------------- keyed random numbers
def test_keyed_uniforms_do_not_depend_on_the_batch():
    key = rng.seed_key(7)
    sid = torch.arange(1000)
    pos = torch.randint(0, 50, (1000,), generator=torch.Generator().manual_seed(0))
    u = rng.uniform(key, sid, pos, rng.NEXT)
    perm = torch.randperm(1000, generator=torch.Generator().manual_seed(1))
    assert torch.equal(rng.uniform(key, sid[perm], pos[perm], rng.NEXT), u[perm])
    assert torch.equal(rng.uniform(key, sid[:3], pos[:3], rng.NEXT), u[:3])
    for other in (rng.uniform(key, sid, pos, rng.DRAFT), rng.uniform(rng.seed_key(8), sid, pos, rng.NEXT),
                  rng.uniform(key, sid, pos + 1, rng.NEXT)):
        assert (other != u).float().mean() > 0.99


def test_keyed_uniforms_are_uniform_and_independent():
    key = rng.seed_key(3)
    sid, pos = torch.meshgrid(torch.arange(400), torch.arange(250), indexing="ij")
    u = rng.uniform(key, sid, pos, rng.ACCEPT).double().flatten()
    assert float(u.min()) >= 0 and float(u.max()) < 1
    n = u.numel()
    # Kolmogorov-Smirnov against U(0, 1); p ~ 1e-6 at D = 2.7 / sqrt(n)
    d = (torch.arange(1, n + 1, dtype=torch.double) / n - u.sort().values).abs().max()
    assert float(d) < 2.7 / n ** 0.5
    # neighbouring positions and samples are uncorrelated
    grid = u.view(400, 250)
    for a, b in ((grid[:, 1:], grid[:, :-1]), (grid[1:], grid[:-1])):
        c = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]
        assert abs(float(c)) < 0.01


def test_auto_without_a_profile_learns_costs_as_it_runs(world1, monkeypatch):
    """No --cost-profile: no profiling at the first call (it would raise here); the costs
    are the rounds' own, and greedy tokens equal plain decoding."""
    from megatron_rlhf.generation import costs

    def no_profile(*a, **k):
        raise AssertionError("profiled")

    monkeypatch.setattr(costs, "profile", no_profile)
    actor, draft = actor_and_draft(world1, noise=0.0)
    cfg = GenerationConfig(max_new_tokens=20, temperature=0)
    plain = Generator(actor).generate(PROMPTS, cfg).responses()
    gen = Generator(actor, draft)
    r = gen.generate(PROMPTS, cfg, SpecConfig("auto", max_draft_tokens=3))
    assert r.responses() == plain
    costs = gen.selector.costs
    assert isinstance(costs, OnlineCosts) and costs.by_n[0].w > 0
    assert r.stats.rounds_by_draft_len[0] >= 1  # the first round is plain: nothing was measured
