"""The plan search (megatron_rlhf/plan): the dataflow graph, the cost estimator on
synthetic cost tables (every term computed by hand from the documented model), the
search (deterministic, annealing reaches the exhaustive optimum, infeasible requests name
their shortfall), plan files and what the trainer executes."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from megatron_rlhf.config import preset
from megatron_rlhf.parallel.layout import Layout
from megatron_rlhf.plan import memory as mem
from megatron_rlhf.plan import search as S
from megatron_rlhf.plan.cost import Estimator, Hardware, Options, Profile, shape_key
from megatron_rlhf.plan.graph import Call, rlhf_graph

TINY = preset("tiny")
HW = Hardware("synthetic", flops=1e12, mem_bw=1e11, intra_bw=1e9, inter_bw=1e8, latency_s=1e-3,
              gpus_per_node=8, gpu_memory_gb=80.0)
# per-layer seconds at TP=1: linear in tokens (1e-4 s per token forward, 3e-4 forward +
# backward, 2e-5 the head), decode 1e-3 s per token fed
PROFILE = Profile(shape=shape_key(TINY), tokens=[10, 1000], forward=[1e-3, 1e-1], train=[3e-3, 3e-1],
                  head=[2e-4, 2e-2], batches=[1, 100], decode=[1e-3, 1e-1], context=16)


def _est(**opt) -> Estimator:
    opts = dict(param_bytes=4, micro_batch_size=2)
    opts.update(opt)
    return Estimator({"actor": TINY, "critic": TINY, "reference": TINY}, HW,
                     {PROFILE.shape: PROFILE}, Options(**opts))


def _all_reduce(nbytes, group):
    return 0.0 if group == 1 else 1e-3 + 2 * (group - 1) / group * nbytes / 1e9


def test_the_graph_of_a_ppo_iteration():
    g = rlhf_graph(8, 6, 4, critic=True, reward_model=True, draft=True, draft_distill=True)
    assert [c.name for c in g.calls] == ["actor_gen", "ref_inf", "reward_inf", "critic_inf",
                                         "actor_train", "critic_train", "draft_train"]
    assert g.order()[0] == "actor_gen" and g.order().index("actor_train") > g.order().index("critic_inf")
    assert set(g.deps("actor_train")) == {"actor_gen", "ref_inf", "reward_inf", "critic_inf"}
    assert {(e.src, e.dst, e.what) for e in g.weight_edges()} == {
        ("actor_train", "actor_gen", "actor"), ("critic_train", "critic_inf", "critic"),
        ("draft_train", "actor_gen", "draft")}
    grpo = rlhf_graph(8, 6, 4, critic=False)
    assert [c.name for c in grpo.calls] == ["actor_gen", "ref_inf", "actor_train"]


def test_inference_time_by_hand():
    """8 samples of 10 tokens, TP=2 x DP=2, micro-batches of 2: per rank 2 micro-batches of
    20 tokens; per layer the forward (2e-3 s at TP 1, halved) and two all-reduces of
    20 x 64 x 4 bytes; the head once per micro-batch."""
    call = Call("ref_inf", "reference", "infer", samples=8, prompt_len=6, gen_len=4)
    got = _est().call_time(call, Layout(tp=2, pp=1, dp=2))
    layer = 2e-3 / 2 + 2 * _all_reduce(20 * 64 * 4, 2)
    want = 2 * (2 * layer + 4e-4 / 2)
    assert got["total"] == pytest.approx(want, rel=1e-9) and got["bubble"] == 0


def test_training_time_by_hand():
    """PP=2 x DP=2: 1F1B over 2 micro-batches takes 2 + (2 - 1) slots of one stage (one
    layer's forward+backward, half the head, a point-to-point send); the LM head trains the
    response's 4 positions per sample with its loss and the prompt's 6 with its matmul
    (three forwards each: no head_train table); the distributed optimizer's reduce-scatter
    (fp32 gradients) and all-gather (parameters) per step, and the tied embedding's
    gradient all-reduced between the two stages; the optimizer moves 96 bytes per
    parameter of its DP shard and zeroes 4 per parameter of the gradient buffer."""
    call = Call("actor_train", "actor", "train", samples=8, prompt_len=6, gen_len=4)
    got = _est().call_time(call, Layout(tp=1, pp=2, dp=2))
    head = 3 * 2e-4 * 8 / 10 + 3 * 2e-4 * 12 / 10
    stage = 6e-3 + head / 2 + (1e-3 + 20 * 64 * 4 / 1e9)
    assert got["compute"] + got["bubble"] == pytest.approx(3 * stage, rel=1e-9)
    assert got["bubble"] == pytest.approx(stage, rel=1e-9)
    params = mem.stage_params(TINY, "actor", 2, 0).per_gpu(1)
    rs = 1e-3 + 0.5 * params * 4 / 1e9
    assert TINY.tie_embeddings
    tied = _all_reduce(TINY.padded_vocab_size * TINY.hidden_size * 4, 2)
    assert got["grad_sync"] == pytest.approx(2 * rs + tied, rel=1e-9)
    assert got["optimizer"] == pytest.approx((params / 2 * 96 + params * 4) / 1e11, rel=1e-9)
    untied = _est().call_time(dataclasses.replace(call, model="critic"), Layout(tp=1, pp=2, dp=2))
    assert untied["grad_sync"] == pytest.approx(2 * (1e-3 + 0.5 * mem.stage_params(
        TINY, "critic", 2, 0).per_gpu(1) * 4 / 1e9), rel=1e-9)  # a value head: nothing tied


def _measured_est(hw=HW, **opt) -> Estimator:
    """The estimator on a profile that measured the head's backward and TP=2 tables."""
    prof = Profile(**dict(PROFILE.__dict__, head_train=[1e-3, 1e-1], tp_tables={"2": {
        "tokens": [20, 1000], "forward": [5e-3, 0.25], "train": [1.5e-2, 0.75],
        "head": [7e-4, 3.5e-2], "head_train": [3e-3, 0.15]}}))
    opts = dict(param_bytes=4, micro_batch_size=2)
    opts.update(opt)
    return Estimator({"actor": TINY, "critic": TINY, "reference": TINY}, hw, {prof.shape: prof},
                     Options(**opts))


def test_lm_training_pays_the_measured_head_backward_and_the_critic_does_not():
    """TP=1 x DP=4 (no pipeline, no bubble): per micro-batch of 2 samples, 2 layers of
    forward+backward over 20 tokens, and for the actor the head's measured forward+backward
    over the 8 response positions (1e-4 s per token) plus three head forwards over the 12
    prompt positions; the critic's value head costs nothing."""
    est = _measured_est()
    lay = Layout(tp=1, pp=1, dp=4)
    actor = est.call_time(Call("actor_train", "actor", "train", 8, 6, 4), lay)
    critic = est.call_time(Call("critic_train", "critic", "train", 8, 6, 4), lay)
    assert critic["compute"] == pytest.approx(2 * 6e-3, rel=1e-9)
    assert actor["compute"] - critic["compute"] == pytest.approx(8e-4 + 3 * 2e-4 * 12 / 10, rel=1e-9)
    assert est.head(TINY, 8, 1, train=True) == pytest.approx(8e-4, rel=1e-9)
    assert est.head(TINY, 8, 1, value=True, train=True) == 0.0
    # without a head_train table the backward is two more forwards
    assert _est().head(TINY, 8, 1, train=True) == pytest.approx(3 * 2e-4 * 8 / 10, rel=1e-9)


def test_tp_tables_replace_the_divided_tp1_costs_from_their_first_token_count():
    est = _measured_est()
    assert est.layer_forward(TINY, 2, 10, 2) == pytest.approx(5e-3, rel=1e-9)  # all-reduces included
    assert est.layer_train(TINY, 2, 10, 2) == pytest.approx(1.5e-2, rel=1e-9)
    assert est.head(TINY, 20, 2) == pytest.approx(7e-4, rel=1e-9)
    assert est.head(TINY, 20, 2, train=True) == pytest.approx(3e-3, rel=1e-9)
    # below the table's first token count, and at a TP size it lacks: TP=1 costs / TP + all-reduces
    assert est.layer_forward(TINY, 1, 10, 2) == pytest.approx(1e-3 / 2 + 2 * _all_reduce(10 * 64 * 4, 2), rel=1e-9)
    assert est.layer_forward(TINY, 2, 10, 4) == pytest.approx(2e-3 / 4 + 2 * _all_reduce(20 * 64 * 4, 4), rel=1e-9)


def test_a_tp_rank_pays_the_fixed_per_layer_overhead_whole():
    """Without a TP table, a TP rank's share of a TP=1 cost is the fixed overhead per layer
    (``layer_overhead_s``, ``decode_overhead_s``: launches, Python) plus the rest / TP, as
    in the roofline path; an overhead above the measured cost caps at it."""
    hw = dataclasses.replace(HW, layer_overhead_s=4e-4, decode_overhead_s=6e-4)
    est = _est()
    est.hw = hw
    dec = 1e-3 + (1e-1 - 1e-3) * 7 / 99  # 8 tokens fed, interpolated
    assert est.layer_decode(TINY, 8, 16, 1, 2) == pytest.approx(
        6e-4 + (dec - 6e-4) / 2 + 2 * _all_reduce(8 * 64 * 4, 2), rel=1e-9)
    assert est.layer_decode(TINY, 8, 16, 1, 1) == pytest.approx(dec, rel=1e-9)
    assert est.layer_forward(TINY, 2, 10, 4) == pytest.approx(
        4e-4 + (2e-3 - 4e-4) / 4 + 2 * _all_reduce(20 * 64 * 4, 4), rel=1e-9)
    est.hw = dataclasses.replace(hw, decode_overhead_s=1.0)
    assert est.layer_decode(TINY, 8, 16, 1, 2) == pytest.approx(dec + 2 * _all_reduce(8 * 64 * 4, 2), rel=1e-9)


def test_collectives_use_their_fitted_costs():
    """A reduce-scatter and an all-gather at their own fitted bandwidth and latency inside
    a node (the all-reduce's beyond it); an all-reduce pays its latency per ring step."""
    hw = dataclasses.replace(HW, reduce_scatter_bw=2e8, reduce_scatter_latency_s=2e-3,
                             all_gather_bw=4e8, all_gather_latency_s=3e-3, ring_latency_s=1e-4)
    est = _measured_est(hw)
    n = 1 << 20
    assert est.reduce_scatter(n, 4) == pytest.approx(2e-3 + 0.75 * n / 2e8, rel=1e-9)
    assert est.all_gather(n, 4) == pytest.approx(3e-3 + 0.75 * n / 4e8, rel=1e-9)
    assert est.reduce_scatter(n, 16) == pytest.approx(1e-3 + 15 / 16 * n / 1e8, rel=1e-9)  # across nodes
    assert est.all_reduce(n, 4) == pytest.approx(6 * (1e-4 + n / 4 / 1e9), rel=1e-9)
    assert est.all_reduce(n, 1) == est.reduce_scatter(n, 1) == 0.0
    assert _est().all_reduce(n, 4) == pytest.approx(_all_reduce(n, 4), rel=1e-9)  # one latency
    params = mem.stage_params(TINY, "critic").per_gpu(1)
    got = est.call_time(Call("critic_train", "critic", "train", 8, 6, 4), Layout(tp=1, pp=1, dp=4))
    assert got["grad_sync"] == pytest.approx(est.reduce_scatter(params * 4, 4) + est.all_gather(params * 4, 4),
                                             rel=1e-9)
    plain = _measured_est(hw, distributed_optimizer=False)
    got = plain.call_time(Call("critic_train", "critic", "train", 8, 6, 4), Layout(tp=1, pp=1, dp=4))
    assert got["grad_sync"] == pytest.approx(est.all_reduce(params * 4, 4), rel=1e-9)
    assert got["optimizer"] == pytest.approx(params * 100 / 1e11, rel=1e-9)  # no shard


def test_the_pipeline_bubble_is_free_only_on_oversubscribed_cores():
    call = Call("critic_train", "critic", "train", samples=8, prompt_len=6, gen_len=4)
    lay = Layout(tp=1, pp=2, dp=2)
    busy = _measured_est(dataclasses.replace(HW, cores=4)).call_time(call, lay)  # 8 ranks, 4 cores
    own = _measured_est(dataclasses.replace(HW, cores=8)).call_time(call, lay)
    gpus = _measured_est().call_time(call, lay)  # cores unknown: a device per rank
    stage = 6e-3 + 1e-3 + 20 * 64 * 4 / 1e9
    assert busy["bubble"] == 0.0 and busy["compute"] == pytest.approx(2 * stage, rel=1e-9)
    assert own["bubble"] == gpus["bubble"] == pytest.approx(stage, rel=1e-9)
    assert dataclasses.replace(HW, cores=4, gpus_per_node=2, threads_per_rank=4).oversubscribed
    from megatron_rlhf.plan.cost import HARDWARE

    assert not any(hw.oversubscribed for hw in HARDWARE.values())
    assert all(HARDWARE[g].optimizer_bytes_per_param == 32 for g in ("h100", "h200", "a100"))


def test_a_micro_batch_holds_at_most_a_ranks_samples():
    """--micro-batch-size 8 with 2 samples per rank runs micro-batches of 2, not 8."""
    call = Call("ref_inf", "reference", "infer", samples=8, prompt_len=6, gen_len=4)
    lay = Layout(tp=1, pp=1, dp=4)
    assert _est(micro_batch_size=8).micro_batches(call, lay) == (2, 1)
    assert _est(micro_batch_size=8).call_time(call, lay)["total"] == pytest.approx(
        _est(micro_batch_size=2).call_time(call, lay)["total"], rel=1e-12)
    assert _est(micro_batch_size=1).micro_batches(call, lay) == (1, 2)


def test_generation_time_follows_the_tail_by_hand():
    """Half the samples stop at half the length: 2 tokens at 4 live samples per rank, then
    2 tokens at 2; a step is 2 layers of decode (1e-3 s per token fed, interpolated) and the
    head; prefill is one forward over each rank's 4 prompts of 6 tokens."""
    call = Call("actor_gen", "actor", "generate", samples=8, prompt_len=6, gen_len=4)
    got = _est(response_fractions=(0.5, 1.0)).call_time(call, Layout(tp=1, pp=1, dp=2))

    def dec(tokens):
        return 1e-3 + (1e-1 - 1e-3) * (tokens - 1) / 99

    def per_token(live):
        return 2 * dec(live) + 2e-4 * live / 10

    assert got["decode"] == pytest.approx(2 * per_token(4) + 2 * per_token(2), rel=1e-9)
    assert got["prefill"] == pytest.approx(2 * (1e-3 + 0.099 * 14 / 990) + 2e-4 * 4 / 10, rel=1e-9)


def test_speculation_takes_the_best_draft_length():
    """With a draft that costs nothing and accepts everything, n = max_draft_tokens emits
    n + 1 tokens per verification, whose cost is the actor's step at n + 1 tokens."""
    from megatron_rlhf.plan.cost import Speculation

    free = TINY.replace(num_layers=1, hidden_size=8, ffn_hidden_size=8, num_attention_heads=1,
                        num_query_groups=1, vocab_size=8, kv_channels=8)
    est = _est(speculation=Speculation(free, acceptance=1.0, max_draft_tokens=3))
    # memory-bound decode: a step feeding 100 tokens costs twice one feeding 1
    est.profiles[PROFILE.shape] = Profile(**dict(PROFILE.__dict__, decode=[1e-3, 2e-3]))
    got = est._per_token(TINY, 1, 16, 1, est.opt.speculation)
    verify = 2 * (1e-3 + 1e-3 * 3 / 99) + 2e-4 * 4 / 10
    draft = 3 * est._per_token(free, 1, 16, 1, None)
    assert got == pytest.approx((draft + verify) / 4, rel=1e-9)


def test_reallocation_only_between_different_layouts():
    est = _est()
    assert est.realloc("actor", Layout(tp=2, dp=2), Layout(tp=2, dp=2)) == (0.0, 0)
    seconds, nbytes = est.realloc("actor", Layout(tp=2, dp=2), Layout(tp=1, dp=4))
    assert nbytes == mem.stage_params(TINY, "actor").total * 4 and seconds > nbytes / 1e9
    # TP and PP agreeing, a GPU holds its shard where the source has it at the same stage
    staged = Layout(tp=1, pp=2, dp=2)  # stage 0 on GPUs 0-1, stage 1 on 2-3
    assert est.realloc("actor", staged, Layout(tp=1, pp=2, dp=1, ranks=(0, 2))) == (0.0, 0)
    assert est.realloc("actor", staged, Layout(tp=1, pp=2, dp=1, ranks=(2, 3)))[1] == \
        mem.stage_params(TINY, "actor", 2, 0).per_gpu(1) * 4  # GPU 2 held stage 1, takes stage 0


# ---------------------------------------------------------------------------- search
def _llama_case(nodes=1, gb=80.0, critic=False):
    models = {"actor": preset("llama2-7b"), "reference": preset("llama2-7b")}
    if critic:
        models["critic"] = preset("llama2-7b")
    from megatron_rlhf.plan.cost import HARDWARE

    est = Estimator(models, HARDWARE["h100"], options=Options(response_fractions=(0.25, 0.5, 1.0)))
    graph = rlhf_graph(64, 512, 512, critic=critic)
    return graph, est, mem.Cluster(nodes=nodes, gpus_per_node=8, gpu_memory_gb=gb)


def test_inference_calls_on_disjoint_gpus_overlap():
    """The reference and a reward model on either half of 2x8 GPUs run at once: the
    iteration pays the busiest GPU's share of the inference calls, not their sum; on the
    same half, or on the whole cluster, they add up. The trainer takes such a plan."""
    models = {m: preset("llama2-7b") for m in ("actor", "reference", "reward")}
    from megatron_rlhf.plan.cost import HARDWARE

    est = Estimator(models, HARDWARE["h100"], options=Options(response_fractions=(0.25, 0.5, 1.0)))
    graph = rlhf_graph(64, 512, 512, critic=False, reward_model=True)
    cluster = mem.Cluster(nodes=2, gpus_per_node=8, gpu_memory_gb=80)
    half, second = Layout(tp=1, pp=1, dp=8), Layout(tp=1, pp=1, dp=8, ranks=tuple(range(8, 16)))
    assert half in S.halves(cluster) and second in S.halves(cluster)
    assert {lay.ranks for lay in S.halves(cluster)} == {half.ranks, second.ranks}
    whole = Layout(tp=2, pp=1, dp=8)
    base = {"actor_gen": Layout(tp=2, pp=1, dp=8), "actor_train": whole}
    apart = S.evaluate(graph, S.Plan(dict(base, ref_inf=half, reward_inf=second)), est, cluster)
    same = S.evaluate(graph, S.Plan(dict(base, ref_inf=half, reward_inf=half)), est, cluster)
    ref, rew = apart.calls["ref_inf"]["total"], apart.calls["reward_inf"]["total"]
    assert same.calls["reward_inf"]["total"] == rew  # where a call runs, not its cost, differs
    others = sum(p["total"] for c, p in apart.calls.items() if c not in ("ref_inf", "reward_inf"))
    reallocs = sum(t for t, _ in apart.reallocs.values())
    assert apart.time_s == pytest.approx(others + reallocs + max(ref, rew), rel=1e-12)
    assert apart.overlap_s == pytest.approx(min(ref, rew), rel=1e-12)
    assert same.time_s == pytest.approx(others + reallocs + ref + rew, rel=1e-12) and same.overlap_s == 0
    assert S.trainer_flags(apart.plan) == {"train_layout": "2x1x8", "gen_layout": "2x8",
                                           "ref_layout": "1x1x8", "reward_layout": "1x1x8@8"}
    assert S.Plan.from_json(apart.plan.to_json()).key() == apart.plan.key() != same.plan.key()
    # the search considers halves for those two calls (and the training), never for generation
    cands = S.candidates(graph, est, cluster)
    assert second in cands["reward_inf"] and second in cands["ref_inf"] and second in cands["actor_train"]
    assert all(lay.size == 16 for lay in cands["actor_gen"])


def test_the_critic_infers_on_half_the_gpus_beside_the_reference():
    """The critic's inference may take either half of the GPUs, priced as running beside the
    reference on the other half, with its weights reallocated there after each update; the
    trainer's flags place it."""
    models = {m: preset("llama2-7b") for m in ("actor", "reference", "critic")}
    from megatron_rlhf.plan.cost import HARDWARE

    est = Estimator(models, HARDWARE["h100"], options=Options(response_fractions=(0.25, 0.5, 1.0)))
    graph = rlhf_graph(64, 512, 512)
    cluster = mem.Cluster(nodes=2, gpus_per_node=8, gpu_memory_gb=80)
    cands = S.candidates(graph, est, cluster)
    first, second = Layout(tp=1, pp=1, dp=8), Layout(tp=2, pp=1, dp=4, ranks=tuple(range(8, 16)))
    assert first in cands["critic_inf"] and second in cands["critic_inf"]
    whole = Layout(tp=2, pp=1, dp=8)
    base = {c.name: whole for c in graph.calls}
    apart = S.evaluate(graph, S.Plan(dict(base, ref_inf=first, critic_inf=second)), est, cluster)
    ref, crit = apart.calls["ref_inf"]["total"], apart.calls["critic_inf"]["total"]
    assert apart.overlap_s == pytest.approx(min(ref, crit), rel=1e-12) and apart.overlap_s > 0
    # the critic's weights move from TP=2 on all 16 GPUs to TP=2 on the second half: each
    # of those GPUs already holds its TP shard (no bytes); to TP=1 on the first half they move
    assert apart.reallocs["critic_train->critic_inf"] == (0.0, 0)
    moved = S.evaluate(graph, S.Plan(dict(base, ref_inf=second, critic_inf=first)), est, cluster)
    assert moved.reallocs["critic_train->critic_inf"][1] > 0
    assert S.trainer_flags(apart.plan) == {"train_layout": "2x1x8", "gen_layout": "2x8",
                                           "ref_layout": "1x1x8", "critic_infer_layout": "2x1x4@8"}


def test_the_draft_distils_on_the_generation_or_the_train_layout():
    """Plans of the trainer's spaces put draft_train on the generation layout or on the
    train layout (PP=1), and the trainer's flags say which; a plan elsewhere is refused."""
    models = {m: preset("llama2-7b") for m in ("actor", "reference")}
    models["draft"] = preset("llama2-7b", num_layers=2)
    from megatron_rlhf.plan.cost import HARDWARE

    est = Estimator(models, HARDWARE["h100"], options=Options(response_fractions=(0.25, 0.5, 1.0)))
    graph = rlhf_graph(64, 512, 512, critic=False, draft=True, draft_distill=True)
    cluster = mem.Cluster(nodes=1, gpus_per_node=8, gpu_memory_gb=80)
    found = S.search(graph, est, cluster, space="models")
    lay = found.best.plan.layouts
    gen3 = Layout(lay["actor_gen"].tp, 1, lay["actor_gen"].dp)
    assert lay["draft_train"] in (gen3, lay["actor_train"])
    base = {"actor_gen": Layout(tp=1, pp=1, dp=8), "ref_inf": Layout(tp=2, pp=1, dp=4),
            "actor_train": Layout(tp=2, pp=1, dp=4)}
    on_gen = S.Plan(dict(base, draft_train=Layout(tp=1, pp=1, dp=8)))
    on_train = S.Plan(dict(base, draft_train=Layout(tp=2, pp=1, dp=4)))
    assert "draft_train_layout" not in S.trainer_flags(on_gen)
    assert S.trainer_flags(on_train)["draft_train_layout"] == "train"
    e_gen, e_train = (S.evaluate(graph, p, est, cluster) for p in (on_gen, on_train))
    assert e_gen.reallocs["draft_train->actor_gen"][0] == 0 < e_train.reallocs["draft_train->actor_gen"][0]
    for bad in (Layout(tp=4, pp=1, dp=2), None):
        layouts = dict(base, draft_train=bad) if bad else dict(base, actor_train=Layout(tp=2, pp=2, dp=2),
                                                               ref_inf=Layout(tp=2, pp=2, dp=2),
                                                               draft_train=Layout(tp=2, pp=2, dp=2))
        with pytest.raises(ValueError, match="the draft distils on the generation layout"):
            S.trainer_flags(S.Plan(layouts))


def _train_halves_case(**opt):
    """The tiny models on 1x4 GPUs, with the first and the second half of them."""
    cluster = mem.Cluster(nodes=1, gpus_per_node=4, gpu_memory_gb=80)
    return _est(**opt), cluster, Layout(tp=1, pp=1, dp=2), Layout(tp=1, pp=1, dp=2, ranks=(2, 3))


def _record_plans(monkeypatch) -> list:
    """The plans the search evaluates from now on."""
    seen, evaluate = [], S.evaluate

    def record(graph, plan, *args, **kw):
        seen.append(plan)
        return evaluate(graph, plan, *args, **kw)

    monkeypatch.setattr(S, "evaluate", record)
    return seen


def test_training_calls_on_disjoint_gpus_overlap():
    """The actor training on GPUs 0-1 and the critic on 2-3 run at once: the iteration pays
    the longer of the two, plus every other call and the reallocations, where each GPU
    the training left out receives its whole shard; on all GPUs they add up, as before."""
    est, cluster, first, second = _train_halves_case()
    graph = rlhf_graph(8, 6, 4)
    world = Layout(tp=1, pp=1, dp=4)
    base = {"actor_gen": world, "ref_inf": world, "critic_inf": world}
    apart = S.evaluate(graph, S.Plan(dict(base, actor_train=first, critic_train=second)), est, cluster)
    g = {c.name: c for c in graph.calls}
    others = sum(est.call_time(g[c], world)["total"] for c in base)
    actor = est.call_time(g["actor_train"], first)["total"]
    critic = est.call_time(g["critic_train"], second)["total"]
    assert actor != critic

    def moved(model):  # 1x1x2 -> 1x1x4: GPUs 2-3 (0-1) hold nothing of the actor (critic)
        nbytes = mem.stage_params(TINY, model).per_gpu(1) * 4
        return (9 * 2 + 3) * 1e-3 + nbytes / 1e9, nbytes

    assert apart.reallocs["actor_train->actor_gen"] == pytest.approx(moved("actor"), rel=1e-12)
    assert apart.reallocs["critic_train->critic_inf"] == pytest.approx(moved("critic"), rel=1e-12)
    reallocs = moved("actor")[0] + moved("critic")[0]
    assert apart.time_s == pytest.approx(others + max(actor, critic) + reallocs, rel=1e-12)
    assert apart.train_overlap_s == pytest.approx(min(actor, critic), rel=1e-12) and apart.overlap_s == 0
    assert apart.to_json()["train_overlap_s"] == apart.train_overlap_s
    # on all GPUs: the plain sum, nothing saved, no reallocation
    whole = S.evaluate(graph, S.Plan(dict(base, actor_train=world, critic_train=world)), est, cluster)
    plain = others + sum(est.call_time(g[c], world)["total"] for c in ("actor_train", "critic_train"))
    assert whole.train_overlap_s == 0.0 and all(t == 0 for t, _ in whole.reallocs.values())
    assert whole.time_s == pytest.approx(plain, rel=1e-12)
    # on overlapping GPUs (the critic on all, the actor on half): the GPUs of both pay both
    part = S.evaluate(graph, S.Plan(dict(base, actor_train=first, critic_train=world)), est, cluster)
    assert part.train_overlap_s == 0.0
    assert part.time_s == pytest.approx(others + actor + est.call_time(g["critic_train"], world)["total"]
                                        + moved("actor")[0], rel=1e-12)


def test_the_search_trains_the_actor_and_critic_side_by_side_where_that_wins(monkeypatch):
    """Training on either half is a candidate of the actor's and the critic's training
    (never of generation, nor of the trainer space's one layout). With an optimizer step
    that dominates (a cost per GPU's parameters that more data parallelism does not
    shrink), two halves training at once beat one after the other on all GPUs, and the
    trainer's flags place both."""
    est, cluster, first, second = _train_halves_case(distributed_optimizer=False)
    est.hw = dataclasses.replace(HW, optimizer_bytes_per_param=1e7)
    graph = rlhf_graph(8, 6, 4, reference=False)
    cands = S.candidates(graph, est, cluster)
    for call in ("actor_train", "critic_train", "critic_inf"):
        assert first in cands[call] and second in cands[call]
    assert all(lay.size == 4 for lay in cands["actor_gen"])
    seen = _record_plans(monkeypatch)
    one = S.search(graph, est, cluster, space="trainer")
    assert seen and all(lay.size == 4 for p in seen for lay in p.layouts.values())
    assert all(lay.size == 4 for lay in one.default.plan.layouts.values())
    found = S.search(graph, est, cluster, space="models")
    lay = found.best.plan.layouts
    assert found.method == "exhaustive" and found.best.fits
    assert lay["actor_train"].ranks == (0, 1) and lay["critic_train"].ranks == (2, 3)
    g = {c.name: c for c in graph.calls}
    actor = est.call_time(g["actor_train"], lay["actor_train"])["total"]
    critic = est.call_time(g["critic_train"], lay["critic_train"])["total"]
    assert found.best.train_overlap_s == pytest.approx(min(actor, critic), rel=1e-12)
    assert found.best.time_s < one.best.time_s
    flags = S.trainer_flags(found.best.plan)
    assert flags["train_layout"] == mem.layout_text(lay["actor_train"]) and "@" not in flags["train_layout"]
    assert flags["critic_layout"] == mem.layout_text(lay["critic_train"]) and flags["critic_layout"].endswith("@2")
    assert Layout.parse(flags["train_layout"]).size == Layout.parse(flags["critic_layout"]).size == 2


def test_the_draft_distils_on_a_partial_train_layout_never(monkeypatch):
    """The draft distils on the train layout only where that covers all GPUs: the trainer's
    flags refuse a plan that puts it on half of them, and the models space's plans with the
    actor training on half put the draft on the generation layout."""
    est, cluster, first, second = _train_halves_case()
    est.models["draft"] = TINY
    graph = rlhf_graph(8, 6, 4, critic=False, reference=False, draft=True, draft_distill=True)
    gen = Layout(tp=1, pp=1, dp=4)
    with pytest.raises(ValueError, match="the draft distils on the train layout only where it covers all GPUs"):
        S.trainer_flags(S.Plan({"actor_gen": gen, "actor_train": first, "draft_train": first}))
    assert "draft_train_layout" not in S.trainer_flags(S.Plan({"actor_gen": gen, "actor_train": first,
                                                               "draft_train": gen}))
    world = Layout(tp=2, pp=1, dp=2)
    assert S.trainer_flags(S.Plan({"actor_gen": gen, "actor_train": world, "draft_train": world})) == {
        "train_layout": "2x1x2", "gen_layout": "1x4", "draft_train_layout": "train"}
    seen = _record_plans(monkeypatch)
    S.search(graph, est, cluster, space="models")
    half = [p.layouts for p in seen if p.layouts["actor_train"].size == 2]
    assert half and all(p["draft_train"] == p["actor_gen"] for p in half)
    assert any(p.layouts["draft_train"] == p.layouts["actor_train"] != p.layouts["actor_gen"]
               for p in seen)  # on all GPUs it may
    # the draft's distillation reads the updated actor: after its training, even on other GPUs
    ev = S.evaluate(graph, S.Plan({"actor_gen": gen, "actor_train": first, "draft_train": second}), est, cluster)
    g = {c.name: c for c in graph.calls}
    assert ev.train_overlap_s == 0.0
    assert ev.time_s == pytest.approx(sum(est.call_time(g[c], lay)["total"] for c, lay in (
        ("actor_gen", gen), ("actor_train", first), ("draft_train", second)))
        + sum(t for t, _ in ev.reallocs.values()), rel=1e-12)


def test_resident_weights_count_only_on_their_own_gpus():
    """A training copy that stays on the GPUs counts on the GPUs of its layout, with the
    stage it holds there: nothing on a call over other GPUs, the larger of two on GPUs
    each model holds half of, the stage of the GPUs that share the call's."""
    est, _, first, second = _train_halves_case()
    o = mem.MemoryOptions(param_bytes=4)
    ref = Call("ref_inf", "reference", "infer", 8, 6, 4)
    gen = Call("actor_gen", "actor", "generate", 8, 6, 4)
    world = Layout(tp=1, pp=1, dp=4)
    actor = mem.stage_params(TINY, "actor").per_gpu(1) * 4
    critic = mem.stage_params(TINY, "critic").per_gpu(1) * 4
    assert est.call_memory(ref, second, {"actor": first}) == est.call_memory(ref, second, {})
    assert est.call_memory(ref, second, {"actor": second}) == est.call_memory(ref, second, {}) + actor
    bare = est.call_memory(gen, world, {})
    assert est.call_memory(gen, world, {"actor": first, "critic": second}) == bare + max(actor, critic)
    assert est.call_memory(gen, world, {"actor": world, "critic": world}) == bare + actor + critic
    # the actor over 1x2x2: GPUs 2-3 hold its second stage (the final norm, a copy of the
    # tied embedding), which is what a call on them carries beside itself
    staged = Layout(tp=1, pp=2, dp=2)
    last = mem.weight_bytes(TINY, "actor", staged, 1, o)
    assert last != mem.weight_bytes(TINY, "actor", staged, 0, o)
    assert est.call_memory(ref, second, {"actor": staged}) == est.call_memory(ref, second, {}) + last


def test_annealing_is_deterministic_and_reaches_the_exhaustive_optimum(monkeypatch):
    graph, est, cluster = _llama_case()
    exhaustive = S.search(graph, est, cluster, seed=0)
    assert exhaustive.method == "exhaustive"
    monkeypatch.setattr(S, "EXHAUSTIVE_LIMIT", 0)
    a = S.search(graph, est, cluster, seed=3, budget=1500)
    b = S.search(graph, est, cluster, seed=3, budget=1500)
    assert a.method == "simulated annealing"
    assert a.best.plan.key() == b.best.plan.key() and a.evaluated == b.evaluated
    assert a.best.time_s == pytest.approx(exhaustive.best.time_s, rel=1e-9)
    assert exhaustive.best.time_s <= exhaustive.default.time_s


def test_a_request_that_cannot_fit_names_its_smallest_shortfall():
    models = {"actor": preset("llama2-70b"), "reference": preset("llama2-70b")}
    from megatron_rlhf.plan.cost import HARDWARE

    est = Estimator(models, HARDWARE["h100"])
    cluster = mem.Cluster(nodes=1, gpus_per_node=8, gpu_memory_gb=24)
    with pytest.raises(ValueError, match=r"no plan fits 1x8 GPUs of 24 GB: the closest .* lacks "
                                         r"\d+\.\d GB per GPU in \w+"):
        S.search(rlhf_graph(64, 512, 512, critic=False), est, cluster)


def test_plans_the_trainer_executes_and_plan_files(tmp_path):
    graph, est, cluster = _llama_case(critic=True)
    found = S.search(graph, est, cluster, space="trainer")
    train, gen = S.trainer_layouts(found.best.plan)
    assert all(found.best.plan.text(c) == train for c in found.best.plan.layouts if c != "actor_gen")
    assert gen == found.best.plan.text("actor_gen")
    found.best.plan.save(tmp_path / "p.json")
    assert S.Plan.load(tmp_path / "p.json").key() == found.best.plan.key()
    split = dict(found.best.plan.layouts, ref_inf=Layout(tp=8, pp=1, dp=1))
    if split["ref_inf"] != found.best.plan.layouts["actor_train"]:
        with pytest.raises(ValueError, match="this trainer runs every call but generation on one layout"):
            S.trainer_layouts(S.Plan(split))
        # ... which the trainer runs with the reference on a layout of its own
        assert S.trainer_flags(S.Plan(split)) == {"train_layout": train, "gen_layout": gen,
                                                  "ref_layout": "8x1x1"}
    # the models space: per-model layouts the trainer executes, never slower than one layout
    models = S.search(graph, est, cluster, space="models")
    assert models.best.time_s <= found.best.time_s * (1 + 1e-9)
    flags = S.trainer_flags(models.best.plan)
    lay = models.best.plan.layouts
    assert flags["train_layout"] == models.best.plan.text("actor_train")
    for call, key in (("ref_inf", "ref_layout"), ("critic_train", "critic_layout")):
        assert flags.get(key, flags["train_layout"]) == models.best.plan.text(call)
    assert flags.get("critic_infer_layout", models.best.plan.text("critic_train")) == models.best.plan.text("critic_inf")
    # the critic's inference apart from its training: a second copy, reallocated (priced)
    apart = dict(lay, actor_train=Layout(tp=2, pp=1, dp=4), critic_train=Layout(tp=8, pp=1, dp=1),
                 critic_inf=Layout(tp=1, pp=1, dp=8))
    assert S.trainer_flags(S.Plan(apart)) == dict(
        S.trainer_flags(S.Plan(dict(apart, critic_train=apart["actor_train"], critic_inf=apart["actor_train"]))),
        critic_layout="8x1x1", critic_infer_layout="1x1x8")
    together = dict(apart, critic_inf=apart["critic_train"])
    assert "critic_infer_layout" not in S.trainer_flags(S.Plan(together))
    e_apart, e_together = (S.evaluate(graph, S.Plan(p), est, cluster) for p in (apart, together))
    assert e_apart.reallocs["critic_train->critic_inf"][0] > 0 == e_together.reallocs["critic_train->critic_inf"][0]
    # the training copy stays resident beside the inference copy
    assert e_apart.memory["critic_inf"] > S.evaluate(graph, S.Plan(dict(apart, critic_train=apart["critic_inf"])),
                                                     est, cluster).memory["critic_inf"]


def test_tools_plan_prints_and_writes_a_plan(tmp_path, capsys):
    import plan as tool  # tools/plan.py: tools/ is on pytest's pythonpath

    out = tmp_path / "plan.json"
    assert tool.main(["--actor", "llama2-7b", "--critic", "llama2-7b", "--nodes", "1",
                      "--rollout-batch", "64", "--space", "trainer", "--json", "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["best"]["fits"] and report["speedup_vs_default"] >= 1.0
    assert math.isclose(sum(p["total"] for p in report["best"]["calls"].values())
                        + sum(r["s"] for r in report["best"]["reallocations"].values()),
                        report["best"]["time_s"], rel_tol=1e-6)  # parts rounded to 1 us
    S.trainer_layouts(S.Plan.load(out))
    assert tool.main(["--actor", "llama2-70b", "--nodes", "1", "--gpu-memory-gb", "24"]) == 2
    assert "no plan fits" in capsys.readouterr().err


def test_plan_auto_gives_the_trainer_layouts_it_can_run(world1, tmp_path, monkeypatch):
    import torch

    import rlhf_fixtures as F
    from megatron_rlhf.config import GenerationConfig, LoopConfig, ParallelConfig, PPOConfig, SpecConfig
    from megatron_rlhf.models.checkpoint import read_checkpoint
    from megatron_rlhf.rlhf.planning import execution_plan

    info = read_checkpoint(F.make_actor_checkpoint(tmp_path / "actor", world1))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    par = execution_plan(ParallelConfig(plan="auto"), {"actor": info, "reference": info, "critic": info},
                         PPOConfig(global_batch_size=4, rollout_n=2, micro_batch_size=2),
                         LoopConfig(max_prompt_length=8), GenerationConfig(max_new_tokens=6),
                         SpecConfig(0), torch.float32, world_size=4)
    assert par.plan is None and par.train_layout and par.gen_layout
    train, gen = par.layouts(4)
    assert train.size == gen.size == 4 and gen.pp == 1


@pytest.mark.parametrize("device,memory_gb,preset_name,how", [
    ("NVIDIA H200", 140.4, "h200", "by name"),
    ("NVIDIA H100 80GB HBM3", 79.6, "h100", "by name"),
    ("NVIDIA A100-SXM4-80GB", 79.2, "a100", "by name"),
    ("NVIDIA A100-SXM4-40GB", 39.4, "a100", "by name"),
    ("NVIDIA L40S", 44.4, "a100", "unknown GPU"),  # 80 GB the closest; the lower peak of two
    ("Future GPU X", 178.0, "h200", "unknown GPU"),
])
def test_a_gpu_gets_its_preset_by_name_else_the_closest_in_memory(device, memory_gb, preset_name, how):
    from megatron_rlhf.plan.hardware import device_preset

    sheet, text = device_preset(device, memory_gb)
    assert sheet.preset == preset_name and how in text


def test_every_datasheet_prices_with_a_preset_below_its_peaks():
    """Each GPU's data-sheet figures (NVIDIA's) and the sustained preset that prices it: the
    same memory, rates at or under the peaks."""
    from megatron_rlhf.plan.hardware import DATASHEETS, HARDWARE

    assert {s.preset for s in DATASHEETS} >= {"h100", "h200", "a100"}
    for s in DATASHEETS:
        hw = HARDWARE[s.preset]
        assert hw.gpu_memory_gb == s.memory_gb
        assert hw.flops <= s.bf16_tflops * 1e12 and hw.mem_bw <= s.hbm_tb_s * 1e12
        assert hw.intra_bw <= s.nvlink_gb_s * 1e9


def test_plan_auto_prices_an_h200_as_an_h200(world1, tmp_path, monkeypatch, capsys):
    """--plan auto on a GPU named "NVIDIA H200": the search is priced with the h200 preset
    and the GPU's 141 GB, and says so; --plan-hardware names another."""
    from types import SimpleNamespace

    import torch

    import rlhf_fixtures as F
    from megatron_rlhf.config import GenerationConfig, LoopConfig, ParallelConfig, PPOConfig, SpecConfig
    from megatron_rlhf.models.checkpoint import read_checkpoint
    from megatron_rlhf.plan import cost
    from megatron_rlhf.rlhf.planning import execution_plan

    info = read_checkpoint(F.make_actor_checkpoint(tmp_path / "actor", world1))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    priced = []
    real = cost.Estimator

    def estimator(models, hw, *a, **k):
        priced.append(hw)
        return real(models, hw, *a, **k)

    monkeypatch.setattr(cost, "Estimator", estimator)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: SimpleNamespace(total_memory=141e9))
    for hardware, want in ((None, "h200"), ("a100", "a100")):
        execution_plan(ParallelConfig(plan="auto", plan_hardware=hardware),
                       {"actor": info, "reference": info, "critic": info},
                       PPOConfig(global_batch_size=4, rollout_n=2, micro_batch_size=2),
                       LoopConfig(max_prompt_length=8), GenerationConfig(max_new_tokens=6),
                       SpecConfig(0), torch.float32, world_size=4)
        hw = priced[-1]
        assert hw.name == want and hw.gpu_memory_gb == 141.0 and hw.gpus_per_node == 4
        assert hw.flops == cost.HARDWARE[want].flops
    err = capsys.readouterr().err
    assert "hardware preset h200 (H200 SXM 141GB data sheet) for GPU 'NVIDIA H200', matched by name" in err
    assert "hardware preset a100 (--plan-hardware)" in err
