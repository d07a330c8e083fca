"""The plain decode step as one graph (issue 28), traced on the CPU twin of the graphed
engine (``Generator(graphs="eager")``: the same code a CUDA graph captures, run eagerly)
with a dispatch mode that records every aten op:

* inside the captured step, no op reads the host (``item``/``_local_scalar_dense``,
  ``nonzero``, ``masked_select``, boolean-mask indexing, ``is_nonzero``/``equal``);
* outside it, a steady-state step (no rebinding, no compaction) runs at most 10 eager
  ops, of which at most one copies from the device to the host;
* a round with history drafts (a verification graph, or a plain step where nothing was
  found) adds the lookup's one read of the rows' state, and nothing else;
* sabotage: an ``.item()`` put back in the step, or a host read put back in the loop, fails;
* a capture that fails falls back to eager steps with the same samples.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gen_fixtures import PROMPTS, RandomSelector, actor_and_draft, eos_mid_batch
from megatron_rlhf.config import GenerationConfig, SpecConfig
from megatron_rlhf.generation import graphs, lookup, rounds, sampling
from megatron_rlhf.generation.engine import Generator
from megatron_rlhf.generation.history import HistoryDrafter
from megatron_rlhf.generation.state import Rows

HOST_READS = {"_local_scalar_dense", "item", "nonzero", "masked_select", "is_nonzero", "equal"}
MAX_EAGER_OPS, MAX_HOST_COPIES = 10, 1
CFGS = {"greedy": GenerationConfig(max_new_tokens=24, temperature=0.0),
        "sampled": GenerationConfig(max_new_tokens=24, temperature=0.8, top_k=40)}


def _name(func) -> str:
    return func._schema.name.split("::")[-1]


def _reads_host(func, args) -> bool:
    name = _name(func)
    if name in HOST_READS:
        return True
    if name in ("index", "index_put", "index_put_"):  # a boolean mask index is a nonzero
        return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool
                   for t in (args[1] if len(args) > 1 else ()) if t is not None)
    return False


class Trace(TorchDispatchMode):
    """Records (phase, step, op name, host read?, copy into the host buffer?) per aten op,
    and ``tolist`` of any tensor but the host buffer as a host read (on the CPU twin it is
    no op; on a GPU it is a device-to-host copy). Phases: ``setup`` (prefill), ``graph``
    (inside a step graph), ``loop`` (the engine between and around graphs), ``end`` (the
    rollout's assembly)."""

    def __init__(self):
        super().__init__()
        self.ops, self.phase, self.step, self.rebuilt = [], "setup", -1, set()
        self.compactions: list[tuple[int, int, int]] = []  # (step, rows before, rows kept)
        self.host_buffers: list[torch.Tensor] = []

    def tolist(self, tensor: torch.Tensor) -> None:
        if not any(tensor.data_ptr() == h.data_ptr() for h in self.host_buffers):
            self.ops.append((self.phase, self.step, "tolist", True, False))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:  # views launch nothing
            to_host = (_name(func) == "copy_" and
                       any(args[0].data_ptr() == h.data_ptr() for h in self.host_buffers))
            self.ops.append((self.phase, self.step, _name(func), _reads_host(func, args), to_host))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def actor(world1):
    actor, _ = actor_and_draft(world1)
    eos_mid_batch(actor, CFGS["greedy"])  # samples finish at different steps: the batch is compacted
    return actor


@pytest.fixture(scope="module")
def draft(world1):
    return actor_and_draft(world1)[1]


class AlwaysPlain(RandomSelector):
    """An ``auto`` selector that never drafts: every round of a drafting run is plain."""

    def choose(self, batch: int, found=None, widest: int | None = None) -> int:
        return 0


def trace(actor, cfg, monkeypatch, prompts=PROMPTS * 3, history=False, draft=None, plain_rounds=False):
    """Generate under :class:`Trace`; returns the trace and the rollout. ``history``: with
    history drafts (``SpecConfig(3, draft_source="history")``), after a first run of the
    same prompts has filled the history; a round then starts with the lookup. ``draft``: 3
    drafts a round from that draft model (with ``history``: ``--draft-source both``;
    with ``plain_rounds``: ``auto``, every round plain, the draft's buffer kept)."""
    rec = Trace()
    source = ("both" if draft is not None else "history") if history else None
    spec = SpecConfig(3, draft_source=source) if history or draft is not None else None
    if plain_rounds:
        spec = SpecConfig("auto", max_draft_tokens=3)
    gen = Generator(actor, draft, graphs="eager", history=HistoryDrafter() if history else None,
                    selector=AlwaysPlain(3, seed=0) if plain_rounds else None)
    gen.generate(prompts, cfg, spec, seed=5)  # build the store once: its buffers are known below
    rec.host_buffers.extend(gen._steps["actor"].hosts)
    if history:  # drafts from the prompts and the siblings only: rounds of every kind
        gen.history = HistoryDrafter()
    real_run, real_rollout, real_select = graphs.Eager.run, Generator._rollout, Rows.select
    real_tolist = torch.Tensor.tolist

    def tolist(self):
        rec.tolist(self)
        return real_tolist(self)
    # what each round calls first (plain decoding launches step t+1 before reading step t)
    first = (lookup, "look_up") if history else (
        (rounds, "spec_round") if draft is not None and not plain_rounds else
        (rounds, "plain_step") if draft is not None else (rounds, "launch_sampled"))
    real_step = getattr(*first)

    def run(self):
        before, rec.phase = rec.phase, "graph"
        try:
            return real_run(self)
        finally:
            rec.phase = before

    def step(*a, **k):
        rec.phase, rec.step = "loop", rec.step + 1
        return real_step(*a, **k)

    def rollout(self, *a, **k):
        rec.phase = "end"
        return real_rollout(self, *a, **k)

    def select(self, keep, filled=None):  # compaction: this step's rows are rebuilt (and rebound next)
        rec.rebuilt.update((rec.step, rec.step + 1))
        rec.compactions.append((rec.step, len(self), len(keep)))
        return real_select(self, keep, filled)

    monkeypatch.setattr(graphs.Eager, "run", run)
    monkeypatch.setattr(*first, step)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    monkeypatch.setattr(Generator, "_rollout", rollout)
    monkeypatch.setattr(Rows, "select", select)
    with rec:
        out = gen.generate(prompts, cfg, spec, seed=5)
    return rec, out


def per_step(rec):
    """{step: (eager ops outside the graph, host copies and reads outside it)} for steady
    steps: not the first (it binds the rows to the store) and not around a compaction."""
    ops, host = Counter(), Counter()
    for phase, step, _, reads, to_host in rec.ops:
        if phase == "loop":
            ops[step] += 1
            host[step] += reads or to_host
    steady = [s for s in range(1, rec.step + 1) if s not in rec.rebuilt]
    return {s: (ops[s], host[s]) for s in steady}


@pytest.mark.parametrize("name", list(CFGS))
def test_step_graph_reads_no_host_and_little_runs_outside(actor, monkeypatch, name):
    rec, out = trace(actor, CFGS[name], monkeypatch)
    inside = [op for phase, _, op, reads, _ in rec.ops if phase == "graph" and reads]
    assert not inside, f"host reads inside the step graph: {Counter(inside)}"
    assert "eos" in out.finish_reasons and "length" in out.finish_reasons
    steps = per_step(rec)
    assert len(steps) >= rec.step // 2, steps
    assert all(n <= MAX_EAGER_OPS and h <= MAX_HOST_COPIES for n, h in steps.values()), steps
    assert all(h == 1 for _, h in steps.values()), "each step's result reaches the host once"
    # the steps that rebind rows (the first, and those around a compaction) are few
    assert len(rec.rebuilt) <= 2 * math.ceil(math.log(len(PROMPTS) * 3, 4 / 3))
    ref = Generator(actor, graphs="off").generate(PROMPTS * 3, CFGS[name], seed=5)
    assert out.responses() == ref.responses()
    assert torch.allclose(out.response_logprobs, ref.response_logprobs, atol=1e-4)  # static attention: summation order


@pytest.mark.parametrize("name", list(CFGS))
def test_a_history_round_is_one_graph_and_two_host_reads(actor, monkeypatch, name):
    """A round with history drafts: the lookup reads the rows' state once (alive, sample,
    cache length: one packed copy), the round's graph (a verification, or a plain step
    where nothing was found) is read once; nothing inside the graph reads the host. The
    tokens are plain decoding's."""
    rec, out = trace(actor, CFGS[name], monkeypatch, history=True)
    inside = [op for phase, _, op, reads, _ in rec.ops if phase == "graph" and reads]
    assert not inside, f"host reads inside the verification graph: {Counter(inside)}"
    assert out.stats.history_accepted > 0 and out.stats.verifications > 0
    steps = per_step(rec)
    assert len(steps) >= rec.step // 2, steps
    # measured: 4 ops outside a plain step's graph, 9 outside a verification's
    assert all(n <= MAX_EAGER_OPS and h == MAX_HOST_COPIES + 1 for n, h in steps.values()), steps
    assert out.stats.rounds_by_draft_len[0] and sum(out.stats.rounds_by_draft_len[1:]), "both kinds of round"
    ref = Generator(actor, graphs="off").generate(PROMPTS * 3, CFGS[name], seed=5)
    assert out.responses() == ref.responses()


def test_a_draft_models_round_is_one_graph_and_one_host_read(draft, actor, monkeypatch, name="sampled"):
    """A round of a draft model's 3 drafts: catch-up, proposals and verification in one
    graph that reads nothing from the host, one packed result read, and a few eager ops
    around it (the catch-up buffer copied in and out). The tokens are plain decoding's.
    Sampled only: greedy differs inside the graph alone (an argmax for the draw)."""
    rec, out = trace(actor, CFGS[name], monkeypatch, draft=draft)
    inside = [op for phase, _, op, reads, _ in rec.ops if phase == "graph" and reads]
    assert not inside, f"host reads inside the draft round's graph: {Counter(inside)}"
    steps = per_step(rec)  # measured: 10 ops a round (the catch-up buffer in, the next one out)
    assert len(steps) >= rec.step // 2, steps
    assert all(n <= MAX_EAGER_OPS and h == MAX_HOST_COPIES for n, h in steps.values()), steps
    ref = Generator(actor, graphs="off").generate(PROMPTS * 3, CFGS[name], seed=5)
    assert out.responses() == ref.responses()


def test_a_both_sources_round_is_one_graph_and_two_host_reads(draft, actor, monkeypatch, name="sampled"):
    """``--draft-source both``: the lookup's one packed read, then the draft model's round
    graph with the history's tokens (copied in beside the catch-up buffer), nothing inside
    reading the host. The tokens are plain decoding's."""
    rec, out = trace(actor, CFGS[name], monkeypatch, history=True, draft=draft)
    inside = [op for phase, _, op, reads, _ in rec.ops if phase == "graph" and reads]
    assert not inside, f"host reads inside the round's graph: {Counter(inside)}"
    assert out.stats.history_accepted > 0 and out.stats.accepted_tokens > out.stats.history_accepted
    # measured: 16-17 ops a round: the lookup's packed read (2), the history's tokens and
    # counts made and copied in (4), the draft round's 10 (11 after a compaction)
    steps = per_step(rec)
    assert len(steps) >= rec.step // 3, steps  # rounds around a compaction are not counted
    assert all(n <= MAX_EAGER_OPS + 7 and h == MAX_HOST_COPIES + 1 for n, h in steps.values()), steps
    ref = Generator(actor, graphs="off").generate(PROMPTS * 3, CFGS[name], seed=5)
    assert out.responses() == ref.responses()


def test_a_plain_round_of_a_drafting_run_is_one_graph_and_one_host_read(draft, actor, monkeypatch, name="sampled"):
    """Under ``auto`` with a draft model a plain round also appends its token to the
    draft's catch-up buffer: without reading the buffer's counts on the host (the buffer
    grows by one column whatever they are)."""
    rec, out = trace(actor, CFGS[name], monkeypatch, draft=draft, plain_rounds=True)
    assert out.stats.rounds_by_draft_len[0] and not sum(out.stats.rounds_by_draft_len[1:])
    steps = per_step(rec)  # measured: 6 ops a step (the buffer grown by a column, the token put in)
    assert len(steps) >= rec.step // 2, steps
    assert all(n <= MAX_EAGER_OPS and h == MAX_HOST_COPIES for n, h in steps.values()), steps
    ref = Generator(actor, graphs="off").generate(PROMPTS * 3, CFGS[name], seed=5)
    assert out.responses() == ref.responses()


def test_an_item_in_the_step_fails(actor, monkeypatch):
    real = sampling.step_outputs

    def sabotaged(logits, *a, **k):
        if logits.max().item() > 1e30:  # a host read inside the captured step
            raise AssertionError("unreachable")
        return real(logits, *a, **k)

    monkeypatch.setattr(graphs, "step_outputs", sabotaged)
    rec, _ = trace(actor, CFGS["sampled"], monkeypatch)
    inside = {op for phase, _, op, reads, _ in rec.ops if phase == "graph" and reads}
    assert "item" in inside


def test_a_host_read_in_the_loop_fails(actor, monkeypatch):
    real = rounds.launch_sampled

    def sabotaged(call, runner, rows, *a, **k):
        int(rows["alive"].sum())  # the per-step live count the engine used to read
        return real(call, runner, rows, *a, **k)

    monkeypatch.setattr(rounds, "launch_sampled", sabotaged)
    rec, _ = trace(actor, CFGS["greedy"], monkeypatch)
    assert any(h > MAX_HOST_COPIES for _, h in per_step(rec).values())


def test_a_failed_capture_decodes_eagerly(actor, monkeypatch, caplog):
    """``capture=True`` on the CPU: the capture raises (no CUDA), the store logs why and
    runs the same steps eagerly; the samples are the uncaptured engine's."""
    ref = Generator(actor, graphs="eager").generate(PROMPTS, CFGS["sampled"], seed=2)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    real_init = graphs.StepGraphs.__init__

    def init(self, model, capacity, max_len, capture, backend=None, routes=False):
        real_init(self, model, capacity, max_len, capture=False, backend=backend, routes=routes)
        self.capture = True  # what a GPU would do: try to capture each new graph

    monkeypatch.setattr(graphs.StepGraphs, "__init__", init)
    gen = Generator(actor, graphs="eager")
    gen._graph_mode = lambda cfg, dev: "cuda"
    with caplog.at_level("WARNING", logger=graphs.__name__):
        got = gen.generate(PROMPTS, CFGS["sampled"], seed=2)
    runner = gen._steps["actor"]
    assert runner.failed and not runner.capture
    assert "CUDA graph capture failed" in caplog.text
    assert got.responses() == ref.responses()
