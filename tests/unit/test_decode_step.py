"""The decode step without the waste a review found (issue 40), on the CPU twin of the graphed
engine (``Generator(graphs="eager")``: the code a CUDA graph captures, run eagerly):

* a layer of a one-token step is at most :data:`MAX_OPS_PER_LAYER` aten ops on the GPU's
  attention without flash-attn (sdpa): the mask's bias is built once per forward, RoPE of q
  and k is one expression;
* a step attends over its length bucket, not the whole cache, with the same tokens;
* finished rows are dropped only when the batch bucket shrinks, copying the filled prefix;
* plain decoding launches step t+1 before it reads step t's result.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.decode_step import ops_per_layer
from gen_fixtures import PROMPTS, actor_and_draft, eos_mid_batch
from megatron_rlhf.config import GenerationConfig
from megatron_rlhf.generation import engine, graphs, incremental
from megatron_rlhf.generation.engine import Generator
from megatron_rlhf.generation.kv_cache import KVCache

# 4 linears, 2 RMSNorms, RoPE (a flip, two products, a sum), 2 cache writes, the attention,
# 2 residual sums, SwiGLU's silu and product. Before: 24, with a mask repeated per layer and
# a 5-op RoPE for q and for k.
MAX_OPS_PER_LAYER = 17
SAMPLED = GenerationConfig(max_new_tokens=24, temperature=0.8, top_k=40)
GREEDY = GenerationConfig(max_new_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def actor(world1):
    actor, _ = actor_and_draft(world1)
    eos_mid_batch(actor, GREEDY)
    return actor


@pytest.mark.parametrize("n", [1, 4])
def test_a_layer_of_the_static_step_is_a_few_ops(actor, n):
    # counted by the benchmark's dispatch mode (views excluded), tokens fed per row n
    assert ops_per_layer(actor, "sdpa", n) <= MAX_OPS_PER_LAYER


def _forwards(monkeypatch) -> list[tuple[bool, int, int, int]]:
    """Records per cached forward ``(static, tokens the rows need, attended length, cache length)``."""
    seen, real = [], incremental._forward_cached

    def forward(model, cache, tokens, rope, *a, **kw):
        needed = int(cache.lengths.max()) + tokens.shape[1]
        static = kw.get("static", False)
        seen.append((static, needed, (kw.get("attend") or cache.max_len) if static else None, cache.max_len))
        return real(model, cache, tokens, rope, *a, **kw)

    monkeypatch.setattr(incremental, "_forward_cached", forward)
    return seen


def test_a_step_attends_over_its_length_bucket_with_the_same_tokens(actor, monkeypatch):
    cfg = GenerationConfig(max_new_tokens=100, temperature=0.8, top_k=40, stop_on_eos=False)
    seen = _forwards(monkeypatch)
    out = Generator(actor, graphs="eager").generate(PROMPTS, cfg, seed=5)
    steps = [(needed, attend, max_len) for static, needed, attend, max_len in seen if static]
    max_len = steps[0][2]
    # 99 steps after the prefill's token, and the one launched before the last was read
    # (every row finished: lengths zeroed)
    assert len(steps) == 100 and max_len >= 100 and steps[-1][0] == 1
    steps = steps[:-1]
    # every row's keys are read, and no more than the bucket of the longest (no row
    # finishes early here, so the host's bound is the longest row exactly)
    assert all(needed <= attend == graphs.length_bucket(needed, max_len) for needed, attend, _ in steps)
    assert [a for _, a, _ in steps].count(graphs.MIN_LENGTH_BUCKET) > 10
    assert {a for _, a, _ in steps} == {32, 48, 64, 80, 96, 112} and max_len == 112
    # the same tokens as steps over the whole cache
    monkeypatch.setattr(graphs, "length_bucket", lambda needed, max_len: max_len)
    whole = Generator(actor, graphs="eager").generate(PROMPTS, cfg, seed=5)
    assert out.responses() == whole.responses()
    assert torch.allclose(out.response_logprobs, whole.response_logprobs, atol=1e-5, rtol=0)


def test_finished_rows_are_dropped_only_when_the_batch_bucket_shrinks(actor, monkeypatch):
    decisions, copies = [], []
    real_compacts, real_select = engine._compacts, KVCache.select

    def compacts(rows, live, graphed):
        decisions.append((rows, live, real_compacts(rows, live, graphed)))
        return decisions[-1][-1]

    def select(self, rows, filled=None):
        copies.append((len(rows), filled, self.max_len))
        return real_select(self, rows, filled)

    monkeypatch.setattr(engine, "_compacts", compacts)
    monkeypatch.setattr(KVCache, "select", select)
    prompts = PROMPTS * 6  # 30 rows, a bucket of 32
    out = Generator(actor, graphs="eager").generate(prompts, GREEDY, seed=5)
    assert "eos" in out.finish_reasons and "length" in out.finish_reasons
    kept = [(rows, live) for rows, live, dropped in decisions if live < rows and not dropped]
    dropped = [(rows, live) for rows, live, d in decisions if d]
    assert kept and dropped  # finished rows stayed masked in their bucket, and were dropped
    assert all(graphs.bucket(live) == graphs.bucket(rows) for rows, live in kept)
    assert all(graphs.bucket(live) < graphs.bucket(rows) for rows, live in dropped)
    # one copy of the actor's cache per compaction, of the filled prefix only
    assert len(copies) == len(dropped) and all(filled is not None and filled < max_len
                                               for _, filled, max_len in copies), copies
    ref = Generator(actor, graphs="off").generate(prompts, GREEDY, seed=5)
    assert out.responses() == ref.responses()


def test_plain_decoding_launches_a_step_before_reading_the_last(actor, monkeypatch):
    events, real_run, real_result = [], graphs.Eager.run, graphs.Fetch.result

    def run(self):
        events.append("run")
        return real_run(self)

    def result(self):
        events.append("read")
        return real_result(self)

    monkeypatch.setattr(graphs.Eager, "run", run)
    monkeypatch.setattr(graphs.Fetch, "result", result)
    out = Generator(actor, graphs="eager").generate(PROMPTS * 3, SAMPLED, seed=5)
    reads = [i for i, e in enumerate(events) if e == "read"]
    assert len(reads) == events.count("run") > 5  # every launched step is read
    # step k + 1 was launched before step k's result was read (the last has none after it)
    assert all(events[:i].count("run") >= k + 2 for k, i in enumerate(reads[:-1])), events
    ref = Generator(actor, graphs="off").generate(PROMPTS * 3, SAMPLED, seed=5)
    assert out.responses() == ref.responses() and out.finish_reasons == ref.finish_reasons
    assert torch.allclose(out.response_logprobs, ref.response_logprobs, atol=1e-4)
    assert out.stats.actor_steps == ref.stats.actor_steps  # the idle step after the last is not counted


def test_a_gpu_without_graphs_runs_the_graph_code_eagerly(actor):
    gen, gpu = Generator(actor), torch.device("cuda")
    assert gen._graph_mode(GenerationConfig(cuda_graphs=False), gpu) == "eager"  # one host read per step
    assert gen._graph_mode(GenerationConfig(), gpu) == "cuda"
    assert gen._graph_mode(GenerationConfig(), torch.device("cpu")) is None
    assert Generator(actor, graphs="off")._graph_mode(GenerationConfig(), gpu) is None
