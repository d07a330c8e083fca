"""The graphed decode step (:mod:`megatron_rlhf.generation.graphs`), run eagerly on CPU.

On a GPU the generator replays CUDA graphs of ``forward_cached(static=True)`` over a KV
store at fixed addresses, with live rows padded to a power-of-two bucket. The CPU cannot
capture, but it runs the same object without capture (``capture=False`` /
``Generator(graphs="eager")``): buffers, buckets, padding rows, the store's in-place
compaction and the whole-cache attention are all exercised here, against the dynamic step.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest
import torch

from gen_fixtures import PROMPTS, RandomSelector, actor_and_draft, feature_draft_for
from megatron_rlhf.config import GenerationConfig, SpecConfig
from megatron_rlhf.generation import graphs
from megatron_rlhf.generation.engine import Generator
from megatron_rlhf.generation.history import HistoryDrafter
from megatron_rlhf.generation.incremental import RopeTable, forward_cached, prefill
from megatron_rlhf.generation.kv_cache import KVCache


@pytest.fixture(scope="module")
def pair(world1):
    actor, draft = actor_and_draft(world1)
    plain = Generator(actor, graphs="off").generate(PROMPTS, GenerationConfig(max_new_tokens=14, temperature=0))
    # EOS: the token in most responses' first 10, so samples finish at different steps and
    # the batch shrinks through several buckets
    common = Counter(t for r in plain.responses() for t in set(r[:10])).most_common(1)[0][0]
    actor.mrlhf_config.eos_token_id = common
    return actor, draft


@pytest.mark.parametrize("n", [1, 5])
@pytest.mark.parametrize("rows", [3, 4])
def test_static_step_equals_dynamic_step(world1, pair, n, rows):
    actor, _ = pair
    prompts = [p for p in PROMPTS][:rows]
    max_len = 24
    rope = RopeTable(actor, max_len)
    dynamic = KVCache.for_model(actor, rows, max_len)
    runner = graphs.StepGraphs(actor, rows, max_len, capture=False)
    static = runner.new_cache(rows)
    assert runner.capacity == graphs.bucket(rows) and static.batch == rows
    with torch.inference_mode():
        prefill(actor, dynamic, prompts, rope)
        prefill(actor, static, prompts, runner.rope)
        feed = torch.randint(0, actor.mrlhf_config.vocab_size, (rows, n), generator=torch.Generator().manual_seed(n))
        for _ in range(2):  # the second step reads what the first one wrote
            want, want_h = forward_cached(actor, dynamic, feed, rope, return_features=True)
            got, got_h = runner(feed, return_features=True)
            assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5, rtol=1e-5)
            assert torch.allclose(got_h, want_h, atol=1e-5, rtol=1e-5)
            assert torch.equal(static.lengths, dynamic.lengths)
    # rows past the live ones (bucket padding) are fed from position 0 at every step
    assert static.store_lengths[rows:].tolist() == [n] * (runner.capacity - rows)


GREEDY = GenerationConfig(max_new_tokens=14, temperature=0.0)
SAMPLED = GenerationConfig(max_new_tokens=14, temperature=1.0, top_k=20)


@pytest.mark.parametrize("spec", [SpecConfig(0), SpecConfig(2), SpecConfig("auto", max_draft_tokens=3),
                                  SpecConfig(2, verify="rejection")],
                         ids=["plain", "n2", "auto", "n2-rejection"])
@pytest.mark.parametrize("cfg", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_generation_with_the_graphed_step_equals_the_dynamic_one(pair, cfg, spec):
    """Samples finish at EOS mid-batch, so the batch is compacted in place and crosses
    buckets. The selector's choices may differ between the engines (timing); under exact
    verification (the default) that changes no token, so auto is compared like the rest.
    Rejection sampling (a fixed width: the same rounds in both engines) draws the same
    uniforms in both, so it too emits the same tokens."""
    actor, draft = pair
    prompts = PROMPTS * 4
    ref = Generator(actor, draft, graphs="off").generate(prompts, cfg, spec, seed=3)
    gen = Generator(actor, draft, graphs="eager")
    got = gen.generate(prompts, cfg, spec, seed=3)
    assert got.responses() == ref.responses()
    assert torch.allclose(got.response_logprobs, ref.response_logprobs, atol=1e-4)
    assert ref.finish_reasons.count("eos") > 0
    runner = gen._steps["actor"]
    buckets = {key[0] for key in [*runner.graphs, *runner.draft_graphs]}
    assert len(buckets) > 1, "compaction should have moved the batch to a smaller bucket"
    if spec.num_draft_tokens == 2:  # every round is a draft round: exact (greedy is) one graph each,
        assert got.stats.rounds_by_draft_len[0] == 0  # rejection sampling's around graphed forwards
        assert bool(runner.draft_graphs) == (spec.verify == "exact" or cfg.greedy)


@pytest.mark.parametrize("random", [False, True], ids=["n3", "random-n"])
@pytest.mark.parametrize("cfg", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_history_rounds_as_one_graph_emit_plain_decodings_tokens(pair, cfg, random):
    """A round of history drafts runs as one graph (verification, acceptance, log-probs,
    finished flags, the rows' advance) at bucketed widths. The same prompts twice (a second
    epoch): the history then proposes whole answers, samples finish inside a round (EOS
    and length), and every token and log-prob is plain decoding's. ``random-n``: every
    draft length 0..5 in one run (widths 2, 4, 8 serving them)."""
    actor, _ = pair
    prompts = [p for p in PROMPTS for _ in range(3)]
    plain = Generator(actor, graphs="off").generate(prompts, cfg, seed=3)
    spec = SpecConfig("auto", max_draft_tokens=5, draft_source="history") if random else \
        SpecConfig(3, draft_source="history")
    gen = Generator(actor, history=HistoryDrafter(), graphs="eager",
                    selector=RandomSelector(5, seed=1) if random else None)
    for _ in range(2):
        got = gen.generate(prompts, cfg, spec, seed=3)
        assert got.responses() == plain.responses()
        assert torch.allclose(got.response_logprobs, plain.response_logprobs, atol=1e-4)
        assert torch.allclose(got.sampling_logprobs, plain.sampling_logprobs, atol=1e-4)
    assert {"eos", "length"} <= set(got.finish_reasons)
    assert got.stats.history_accepted > got.stats.verifications  # the repeats were found
    widths = {key[1] for key in gen._steps["actor"].graphs if key[2] == "verify"}
    # a round is as wide as the longest proposal: n = 1..3 under n3 (widths 2 and 4)
    assert widths == {2, 4, 8} if random else 4 in widths and widths <= {2, 4}, widths


@pytest.mark.parametrize("feature", [False, True], ids=["draft", "feature-draft"])
@pytest.mark.parametrize("cfg", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_plain_rounds_of_a_drafting_run_are_graphed(world1, pair, cfg, feature):
    """Under ``auto`` with a draft model a round may be a plain step: it runs the sampled
    step's graph (for a feature draft also leaving the actor's hidden state), and the draft
    catches up with what it sampled afterwards. Plain rounds and every draft length mixed
    (a random selector): the tokens are the dynamic engine's, and plain decoding's."""
    actor, draft = pair
    if feature:
        draft = feature_draft_for(actor, world1)
    prompts = PROMPTS * 3
    spec = SpecConfig("auto", max_draft_tokens=3)
    plain = Generator(actor, graphs="off").generate(prompts, cfg, seed=4)
    ref = Generator(actor, draft, graphs="off", selector=RandomSelector(3, seed=5)).generate(prompts, cfg, spec, seed=4)
    gen = Generator(actor, draft, graphs="eager", selector=RandomSelector(3, seed=5))
    got = gen.generate(prompts, cfg, spec, seed=4)
    assert got.responses() == ref.responses() == plain.responses()
    assert torch.allclose(got.response_logprobs, ref.response_logprobs, atol=1e-4)
    # the same choices (the same random selector) and the same drafts: a draft that caught
    # up with the wrong tokens or hidden states would be accepted differently
    assert got.stats.accepted_per_position == ref.stats.accepted_per_position
    assert got.stats.rounds_by_draft_len[0] and sum(got.stats.rounds_by_draft_len[1:]) > 2
    sampled = [key for key in gen._steps["actor"].graphs if key[2] == "sample"]
    # with the hidden state for a feature draft (the key's return_features, before the attended length)
    assert sampled and all(key[-2] == feature for key in sampled)


def test_a_graphs_capture_is_not_a_rounds_cost(pair, monkeypatch):
    """The selector learns round costs from the rounds it times; the first round at a new
    bucket or width also captures a graph (seconds on a GPU, against a step's
    milliseconds). That time is not the round's: otherwise one capture would price a draft
    length out for good. Captures made slow here (0.6 s each: well above a loaded CPU's slowest
    round) never reach the selector."""
    actor, _ = pair
    real = graphs.StepGraphs._graph

    def slow(self, *a, **k):
        time.sleep(0.6)
        return real(self, *a, **k)

    class Timed(RandomSelector):
        def observe(self, batch, n, seconds, *rest, **kw):
            self.seen.append((n, seconds))

    monkeypatch.setattr(graphs.StepGraphs, "_graph", slow)
    sel = Timed(3, seed=2)
    sel.seen = []
    gen = Generator(actor, history=HistoryDrafter(), graphs="eager", selector=sel)
    prompts = [p for p in PROMPTS for _ in range(3)]
    captured = sum(gen.generate(prompts, SAMPLED, SpecConfig("auto", max_draft_tokens=3, draft_source="history"),
                                seed=3).stats.graph_capture_s for _ in range(2))
    assert captured >= 0.6 * len(gen._steps["actor"].graphs) >= 1.8
    assert {n for n, _ in sel.seen} >= {0, 1}
    assert max(seconds for _, seconds in sel.seen) < 0.6, sel.seen


@pytest.mark.parametrize("feature", [False, True], ids=["draft", "feature-draft"])
@pytest.mark.parametrize("cfg", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_draft_models_round_is_one_graph(world1, pair, cfg, feature):
    """A round of the draft model's drafts runs as one graph: the draft's catch-up (fed at
    a power-of-two width), its proposals, the exact verification. Same drafts as the
    dynamic engine (the acceptance per position is equal), the same tokens as plain
    decoding; catch-up widths above one (after a plain round under ``auto``, the buffer
    grows) are served too."""
    actor, draft = pair
    if feature:
        draft = feature_draft_for(actor, world1)
    prompts = PROMPTS * 2
    plain = Generator(actor, graphs="off").generate(prompts, cfg, seed=6)
    for spec, selector in ((SpecConfig(3), None), (SpecConfig("auto", max_draft_tokens=3), RandomSelector(3, seed=8))):
        ref = Generator(actor, draft, graphs="off", selector=selector and RandomSelector(3, seed=8))
        ref = ref.generate(prompts, cfg, spec, seed=6)
        gen = Generator(actor, draft, graphs="eager", selector=selector)
        got = gen.generate(prompts, cfg, spec, seed=6)
        assert got.responses() == ref.responses() == plain.responses()
        assert torch.allclose(got.response_logprobs, ref.response_logprobs, atol=1e-4)
        assert got.stats.accepted_per_position == ref.stats.accepted_per_position
        assert got.stats.draft_steps == ref.stats.draft_steps
        widths = {key[3] for key in gen._steps["actor"].draft_graphs}
        assert widths and (selector is None or max(widths) > 1), widths


@pytest.mark.parametrize("cfg", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_both_sources_round_is_one_graph(world1, pair, cfg):
    """``--draft-source both``: the history's tokens where it found some, the draft model's
    after them (conditioned on the history's), in the draft round's one graph: the same
    drafts as the dynamic engine (equal acceptance per position and from the history),
    plain decoding's tokens; the second epoch's history proposes whole answers."""
    actor, draft = pair
    prompts = [p for p in PROMPTS for _ in range(2)]
    plain = Generator(actor, graphs="off").generate(prompts, cfg, seed=4)
    spec = SpecConfig(3, draft_source="both")
    ref = Generator(actor, draft, history=HistoryDrafter(), graphs="off")
    gen = Generator(actor, draft, history=HistoryDrafter(), graphs="eager")
    from_history = from_model = 0
    for _ in range(2):
        want, got = ref.generate(prompts, cfg, spec, seed=4), gen.generate(prompts, cfg, spec, seed=4)
        assert got.responses() == want.responses() == plain.responses()
        assert torch.allclose(got.response_logprobs, want.response_logprobs, atol=1e-4)
        s, w = got.stats, want.stats
        assert s.accepted_per_position == w.accepted_per_position
        assert (s.history_verifications, s.history_drafted, s.history_accepted) == \
            (w.history_verifications, w.history_drafted, w.history_accepted)
        from_history += s.history_accepted
        from_model += s.accepted_tokens - s.history_accepted
    assert from_history > 0 and from_model > 0, (from_history, from_model)  # both sources accepted
    assert any(key[-2] for key in gen._steps["actor"].draft_graphs)  # the round with history ran graphed


def test_store_and_graphs_are_kept_and_rebuilt_when_needed(pair):
    actor, draft = pair
    gen = Generator(actor, None, graphs="eager")
    gen.generate(PROMPTS, GREEDY)
    runner = gen._steps["actor"]
    gen.generate(PROMPTS[:2], GREEDY)
    assert gen._steps["actor"] is runner, "a smaller request reuses the store and its graphs"
    gen.generate(PROMPTS * 3, GREEDY)
    assert gen._steps["actor"] is not runner and gen._steps["actor"].capacity == 16
    runner = gen._steps["actor"]
    with torch.no_grad():  # weights moved (offloaded and restored): graphs would read stale memory
        actor.output_layer.weight.data = actor.output_layer.weight.data.clone()
    ref = Generator(actor, None, graphs="off").generate(PROMPTS, GREEDY)
    assert gen.generate(PROMPTS, GREEDY).responses() == ref.responses()
    assert gen._steps["actor"] is not runner
    gen.release()
    assert not gen._steps


def test_time_step_runs_the_dynamic_step_on_cpu(pair):
    actor, _ = pair
    assert graphs.time_step(actor, 2, 3, context=8, repeats=2) > 0


def test_buckets():
    assert [graphs.bucket(r) for r in (1, 2, 3, 4, 5, 64, 65)] == [1, 2, 4, 4, 8, 64, 128]
    # draft widths: 1, 3, 7 where the cache has room (and a graph feeds at most 8 tokens)
    assert [graphs.width_bucket(n, room=9) for n in range(1, 8)] == [1, 3, 3, 7, 7, 7, 7]
    assert [graphs.width_bucket(n, room=4) for n in (2, 4, 5)] == [3, 4, 5]
    assert graphs.width_bucket(8, room=20) == 8  # past MAX_TOKENS: no graph serves it


class _FakeCapture:
    """A capture context whose exit fails like ``capture_end()`` after an op broke the capture."""

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if kind is not None or self.always:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        return False

    def __init__(self, always=False):
        self.always = always


def _host_sync_in_capture():
    x = torch.ones(2)
    return x.sum().item() + _raise_capture_forbidden()


def _raise_capture_forbidden():
    raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_names_the_op_that_broke_it_not_capture_end():
    from megatron_rlhf.generation.capture import CaptureError, record

    with pytest.raises(CaptureError) as e:
        record(_host_sync_in_capture, _FakeCapture())
    message = str(e.value)
    assert message.startswith("RuntimeError: operation not permitted when stream is capturing"), message
    assert "_raise_capture_forbidden" in message and "capture_end" not in message and "previous error" not in message
    assert "test_graphs.py" in message  # where the op ran
    # a capture whose only failure is the exit: that error is the one named
    with pytest.raises(CaptureError, match="previous error during capture"):
        record(lambda: 1, _FakeCapture(always=True))
    assert record(lambda: 7, _FakeCapture()) == 7


def test_graphs_survive_a_second_rollout(pair):
    """A generator keeps its graph store between calls: a second rollout of the same shapes
    makes no graph (its capture count is 0) and emits what the first did; after release()
    the next call makes them again."""
    actor, _ = pair
    cfg = GenerationConfig(max_new_tokens=10, temperature=0.8)
    gen = Generator(actor, graphs="eager")
    first = gen.generate(PROMPTS, cfg, seed=3)
    second = gen.generate(PROMPTS, cfg, seed=3)
    assert first.stats.graph_captures > 0 and second.stats.graph_captures == 0
    assert second.responses() == first.responses()
    gen.release()
    assert gen.generate(PROMPTS, cfg, seed=3).stats.graph_captures == first.stats.graph_captures
