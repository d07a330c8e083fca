"""The memory estimator (``megatron_rlhf.plan.memory``, ``tools/memory_plan.py``): invariants
of the arithmetic, the known sizes, and layouts refused with the fix named."""

import json
import subprocess
import sys

import pytest

from launch import ROOT
from megatron_rlhf.config import preset
from megatron_rlhf.parallel.layout import Layout
from megatron_rlhf.plan import memory
from megatron_rlhf.plan.memory import (GB, Cluster, MemoryOptions, StageLayouts, Workload,
                                       count_parameters, estimate, fits_or_raise,
                                       kv_cache_bytes, layer_activation_bytes, stage_params,
                                       training_activation_bytes)

L7, L13, L70 = preset("llama2-7b"), preset("llama2-13b"), preset("llama2-70b")
RLHF_70B = {"actor": L70, "reference": L70, "critic": L7, "reward": L7}


def train(text, **kw):
    return StageLayouts(train=Layout.parse(text), **kw)


@pytest.mark.parametrize("cfg,expected", [(L7, 6.74e9), (L13, 13.02e9), (L70, 68.98e9)])
def test_parameter_counts_match_llama2(cfg, expected):
    assert count_parameters(cfg) == pytest.approx(expected, rel=0.01)


def test_tied_embedding_counted_once_but_copied_to_the_last_pipeline_stage():
    cfg = preset("smollm2-135m")  # tied, 30 layers
    assert count_parameters(cfg) == pytest.approx(134.5e6, rel=0.01)
    untied = cfg.replace(tie_embeddings=False)
    emb = cfg.padded_vocab_size * cfg.hidden_size
    assert count_parameters(untied) - count_parameters(cfg) == emb
    stages = [stage_params(cfg, "actor", 2, i).total for i in range(2)]
    assert sum(stages) == count_parameters(cfg) + emb  # megatron's copy on the last stage
    h = cfg.hidden_size  # a value head (1 x h) replaces the LM head
    assert count_parameters(cfg, "critic") == count_parameters(cfg) + h
    assert count_parameters(untied, "critic") == count_parameters(untied) - emb + h


def test_seven_b_unsharded_adam_is_18_bytes_per_param():
    est = estimate({"actor": L7}, Cluster(1, 1, 80), train("1x1x1"), Workload(rollout_batch=8),
                   MemoryOptions(distributed_optimizer=False))
    parts = est.stage("training").parts
    assert parts["actor_weights"] / GB == pytest.approx(13.5, rel=0.01)
    assert parts["actor_grads"] / GB == pytest.approx(27.0, rel=0.01)
    assert parts["actor_optimizer"] / GB == pytest.approx(81.0, rel=0.01)
    assert not est.fits


def test_weights_per_gpu_halve_when_tp_doubles():
    c, w = Cluster(1, 8, 80), Workload(rollout_batch=64)
    a = estimate({"actor": L7, "critic": L7}, c, train("2x1x4"), w)
    b = estimate({"actor": L7, "critic": L7}, c, train("4x1x2"), w)
    for stage in memory.STAGES:
        for part in ("actor_weights", "critic_weights"):
            ratio = b.stage(stage).parts[part] / a.stage(stage).parts[part]
            assert ratio == pytest.approx(0.5, rel=1e-3), (stage, part)


def test_distributed_optimizer_states_scale_one_over_dp():
    w = Workload(rollout_batch=64)
    dp2 = estimate({"actor": L7}, Cluster(1, 8, 80), train("4x1x2"), w).stage("training").parts
    dp4 = estimate({"actor": L7}, Cluster(2, 8, 80), train("4x1x4"), w).stage("training").parts
    assert dp2["actor_optimizer"] / dp4["actor_optimizer"] == pytest.approx(2, rel=1e-6)
    assert dp2["actor_weights"] == dp4["actor_weights"] and dp2["actor_grads"] == dp4["actor_grads"]
    plain = estimate({"actor": L7}, Cluster(2, 8, 80), train("4x1x4"), w,
                     MemoryOptions(distributed_optimizer=False)).stage("training").parts
    assert plain["actor_optimizer"] == 12 * dp4["actor_weights"] // 2
    bf16 = estimate({"actor": L7}, Cluster(2, 8, 80), train("4x1x4"), w,
                    MemoryOptions(fp32_grads=False)).stage("training").parts
    assert bf16["actor_grads"] == dp4["actor_grads"] // 2


def test_recompute_full_below_selective_below_none():
    lay, w = Layout.parse("8x4x2"), Workload()
    acts = [training_activation_bytes(L70, "actor", w, lay, 0, MemoryOptions(recompute=r))
            for r in ("full", "selective", "none")]
    assert acts[0] < acts[1] < acts[2]


def test_sequence_parallel_divides_activations_by_tp():
    for recompute in memory.RECOMPUTE:
        one = layer_activation_bytes(L7, 1024, 2, tp=1, recompute=recompute)
        for t in (2, 4, 8):
            sp = layer_activation_bytes(L7, 1024, 2, tp=t, sequence_parallel=True, recompute=recompute)
            assert sp == pytest.approx(one / t, rel=1e-6)
            no_sp = layer_activation_bytes(L7, 1024, 2, tp=t, recompute=recompute)
            assert sp <= no_sp


def test_korthikanti_formula_for_a_4h_mlp():
    # with ffn = 8h/3 the SwiGLU term 6*ffn/h equals the paper's 16 for a 4h GeLU MLP
    cfg = preset("tiny-mha").replace(hidden_size=48, ffn_hidden_size=128)
    s, b, h, a, t = 64, 3, 48, 4, 2
    expected = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    assert layer_activation_bytes(cfg, s, b, tp=t) == int(expected)


def test_pipeline_first_stage_holds_pp_micro_batches():
    lay, opts = Layout.parse("1x4x1"), MemoryOptions()
    many = Workload(rollout_batch=16, max_prompt_length=64, max_new_tokens=64)
    acts = [training_activation_bytes(L7, "critic", many, lay, i, opts) for i in range(4)]
    assert acts[0] == 4 * acts[3] and acts[1] == 3 * acts[3]
    few = Workload(rollout_batch=2, max_prompt_length=64, max_new_tokens=64)  # 2 micro-batches
    assert training_activation_bytes(L7, "critic", few, lay, 0, opts) == 2 * acts[3]
    # the actor's last stage adds the LM head's logits
    assert training_activation_bytes(L7, "actor", many, lay, 3, opts) > acts[3]


def test_kv_cache_by_hand():
    cfg = preset("tiny")  # 2 layers, 2 KV heads, head dim 16
    assert kv_cache_bytes(cfg, samples=3, length=10, tp=2) == 2 * 2 * 1 * 16 * 2 * 3 * 10
    w = Workload(rollout_batch=12, max_prompt_length=6, max_new_tokens=4)
    est = estimate({"actor": cfg}, Cluster(1, 4, 1), StageLayouts(Layout.parse("2x1x2"),
                   gen=Layout.parse("2x2", pipeline=False)), w)
    assert est.stage("generation").parts["kv_cache"] == 2 * 2 * 1 * 16 * 2 * 6 * 10


def test_70b_does_not_fit_at_tp8_alone_but_fits_with_pp4_dp2():
    w = Workload(rollout_batch=512, max_prompt_length=1024, max_new_tokens=1024)
    alone = estimate(RLHF_70B, Cluster(1, 8, 80), train("8x1x1"), w)
    assert not alone.stage("training").fits
    with pytest.raises(ValueError, match="training on layout 8x1x1 needs"):
        fits_or_raise(alone)
    planned = estimate(RLHF_70B, Cluster(8, 8, 80),
                       train("8x4x2", gen=Layout.parse("8x8", pipeline=False)), w)
    assert planned.fits and fits_or_raise(planned) is planned
    assert planned.stage("training").pipeline_stage == 0  # 4 micro-batches in flight
    found = memory.search_train_layouts(RLHF_70B, Cluster(8, 8, 80), w,
                                        gen=Layout.parse("8x8", pipeline=False))
    assert "8x4x2" in [memory.layout_text(e.stage("training").layout) for e in found]
    assert all(e.fits for e in found)


@pytest.mark.parametrize("layouts,cluster,message", [
    (train("1x3x4"), Cluster(1, 12, 80), "pipeline parallel size 3 must divide 32 layers"),
    (train("3x1x4"), Cluster(1, 12, 80), "tensor parallel size 3 must divide 32 attention heads"),
    (train("8x1x1"), Cluster(2, 8, 80), "make TP x PP x DP = 16, e.g. 8x1x2"),
    (train("16x1x1"), Cluster(2, 8, 80), "spans nodes of 8 GPUs: use a TP that divides 8"),
    (train("8x1x2", gen=Layout(tp=8, pp=2, dp=1)), Cluster(2, 8, 80), "generation runs with PP=1"),
    (train("8x1x2", gen=Layout.parse("4x2", pipeline=False)), Cluster(2, 8, 80),
     "generation layout 4x2 uses 8 GPUs"),
    (train("1x1x8"), Cluster(1, 8, 80), "rollout batch 12 samples does not split"),
])
def test_bad_layouts_name_the_fix(layouts, cluster, message):
    with pytest.raises(ValueError, match=message):
        estimate({"actor": L7, "critic": L7}, cluster, layouts, Workload(rollout_batch=12))


def test_kv_heads_limit_tp_of_70b():
    bad = {"actor": L70.replace(num_query_groups=4)}  # 4 KV heads: TP 8 cannot shard them
    with pytest.raises(ValueError, match="tensor parallel size 8 must divide 4 KV heads"):
        estimate(bad, Cluster(1, 8, 80), train("8x1x1"), Workload(rollout_batch=8))


def run_tool(*args):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "memory_plan.py"), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_cli_json_lines():
    r = run_tool("--actor", "llama2-70b", "--critic", "llama2-7b", "--reward", "llama2-7b",
                 "--nodes", "8", "--gpus-per-node", "8", "--gpu-memory-gb", "80",
                 "--train-layout", "8x4x2", "--gen-layout", "8x8", "--json")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    stages = [d for d in lines if d["kind"] == "stage"]
    assert [d["stage"] for d in stages] == list(memory.STAGES)
    assert all(d["fits"] for d in stages)
    assert lines[0]["kind"] == "setup" and lines[-1]["kind"] == "summary" and lines[-1]["fits"]
    assert stages[2]["total_gb"] == pytest.approx(sum(stages[2]["parts_gb"].values()), abs=0.01)


def test_cli_reports_no_fit_with_exit_0_and_refuses_bad_layouts():
    r = run_tool("--actor", "llama2-70b", "--train-layout", "8x1x1", "--gen-layout", "8x1")
    assert r.returncode == 0 and "fits: NO" in r.stdout
    r = run_tool("--actor", "llama2-7b", "--nodes", "3", "--train-layout", "8x3x1")
    assert r.returncode == 2 and "pipeline parallel size 3 must divide 32 layers" in r.stderr
    r = run_tool("--actor", "llama2-7b", "--nodes", "2", "--search", "--json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    peaks = [d["peak_gb"] for d in rows if d["kind"] == "layout"]
    assert peaks and peaks == sorted(peaks) and max(peaks) <= 72


def test_the_trainer_validation_asks_the_estimator(world1, tmp_path):
    """On GPU, make_plan warns with the estimator's verdict: silent when the run fits, the
    stage and what to change when it does not."""
    import rlhf_fixtures as F
    from megatron_rlhf import train
    from megatron_rlhf.rlhf.train_plan import memory_warning

    actor = F.make_actor_checkpoint(tmp_path / "actor", world1)
    prompts = F.write_prompts(tmp_path / "prompts.jsonl")
    plan = train.validate(train.parse_args(F.train_args(actor, prompts, tmp_path / "out")))
    assert memory_warning(plan, gpu_memory_gb=80.0, gpus_per_node=8) is None
    warning = memory_warning(plan, gpu_memory_gb=1e-4, gpus_per_node=8)
    assert warning.startswith("memory estimate: the iteration does not fit in GPU memory")
    assert "training on layout 1x1x1 needs" in warning and "--search" in warning
    # the actor training on 2 of 4 ranks (beside the critic): priced on its own 2 GPUs
    import dataclasses

    from megatron_rlhf.config import ParallelConfig

    apart = dataclasses.replace(plan, world_size=4, par=ParallelConfig(train_layout="1x1x2", gen_layout="1x4"))
    assert memory_warning(apart, gpu_memory_gb=80.0, gpus_per_node=8) is None
    warning = memory_warning(apart, gpu_memory_gb=1e-4, gpus_per_node=8)
    assert "training on layout 1x1x2 needs" in warning, warning


def test_measure_runs_the_demos_workload():
    """``memory_plan.py --measure`` and the benchmarks' GRPO task run the flags of
    examples/cpu_demo.sh's GRPO job (one iteration, the prompt limit the estimate takes): the
    three stay in step."""
    import re
    import shlex
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    import memory_plan  # tools/ is on pytest's pythonpath

    script = (root / "examples/cpu_demo.sh").read_text()
    grpo = script[script.index("megatron_rlhf.train --bf16"):]
    grpo = grpo[:grpo.index('"${RESUME[@]}"')].replace("\\\n", " ")
    demo = shlex.split(re.sub(r'"\$[A-Z_]+[^"]*"', "VAR", grpo))[1:]

    def flags(args):
        out, i = {}, 0
        while i < len(args):
            takes = i + 1 < len(args) and not args[i + 1].startswith("--")
            out[args[i]] = args[i + 1] if takes else True
            i += 2 if takes else 1
        return out

    ours, theirs = flags(memory_plan.DEMO_TRAIN_ARGS), flags(demo)
    own = {"--max-prompt-length", "--train-iters", "--prompts"}  # (the demo's files and length)
    run = {k: v for k, v in theirs.items() if k not in own | {"--actor-load", "--draft-load", "--eval-prompts",
                                                             "--eval-interval", "--save", "--save-interval",
                                                             "--keep-last-checkpoints", "--log-dir", "--seed"}}
    assert {k: v for k, v in ours.items() if k not in own} == run
    # the benchmarks' GRPO task is the demo's too (each benchmark picks its own drafting)
    from benchmarks.workloads import TASK_FLAGS

    assert flags(TASK_FLAGS["grpo"]) | {"--draft-source": "history"} == run | {"--prompts": TASK_FLAGS["grpo"][2]}


def test_a_cpu_run_keeps_the_trainee_state_in_every_stage():
    """park_on_host=False (a CPU run): gradient buffers and Adam states stay resident in
    generation and inference; training is unchanged."""
    from megatron_rlhf.config import PRESETS
    from megatron_rlhf.parallel.layout import Layout
    from megatron_rlhf.plan import memory

    models = {"actor": PRESETS["smollm2-135m"]}
    lay = memory.StageLayouts(train=Layout.parse("1x1x2"), gen=Layout.parse("1x2", pipeline=False))
    cluster = memory.Cluster(nodes=1, gpus_per_node=2, gpu_memory_gb=100)
    gpu = memory.estimate(models, cluster, lay, options=memory.MemoryOptions())
    cpu = memory.estimate(models, cluster, lay, options=memory.MemoryOptions(park_on_host=False))
    train = cpu.stage("training").parts
    state = train["actor_grads"] + train["actor_optimizer"]
    assert state > 0
    for name in ("generation", "inference"):
        assert cpu.stage(name).total - gpu.stage(name).total == state
        assert "actor_optimizer" not in gpu.stage(name).parts
    assert cpu.stage("training").total == gpu.stage("training").total


def test_workload_from_configs():
    """The trainer's workload comes from its configs: samples per iteration, lengths,
    micro- and mini-batches, and the draft tokens verified only with a draft."""
    from megatron_rlhf.config import GenerationConfig, LoopConfig, PPOConfig, SpecConfig

    ppo = PPOConfig(global_batch_size=6, rollout_n=4, micro_batch_size=3, num_mini_batches=2)
    loop, gen = LoopConfig(max_prompt_length=77), GenerationConfig(max_new_tokens=55)
    spec = SpecConfig(num_draft_tokens=3)
    w = Workload.from_configs(ppo, loop, gen, spec, has_draft=True)
    assert w == Workload(rollout_batch=24, max_prompt_length=77, max_new_tokens=55, micro_batch_size=3,
                         num_mini_batches=2, num_draft_tokens=3)
    assert Workload.from_configs(ppo, loop, gen, SpecConfig(), has_draft=False).num_draft_tokens == \
        SpecConfig().base_tokens(False)


def test_the_warning_keeps_the_optimizer_on_the_device_under_park_optimizer_off(world1, tmp_path):
    """With --park-optimizer off the warning prices generation and inference with the
    optimizer states and gradient buffers resident (auto and on: parked there)."""
    import dataclasses
    import re

    import rlhf_fixtures as F
    from megatron_rlhf import train
    from megatron_rlhf.rlhf.train_plan import memory_warning

    actor = F.make_actor_checkpoint(tmp_path / "actor", world1)
    prompts = F.write_prompts(tmp_path / "prompts.jsonl")
    plan = train.validate(train.parse_args(F.train_args(actor, prompts, tmp_path / "out")))
    resident = r"generation on layout \S+ needs [\d.]+ GB per GPU, [\d.]+ GB usable \(largest: \w+_optimizer"
    for mode, kept in (("auto", False), ("on", False), ("off", True)):
        run = dataclasses.replace(plan, par=dataclasses.replace(plan.par, park_optimizer=mode))
        warning = memory_warning(run, gpu_memory_gb=1e-4, gpus_per_node=8)
        assert bool(re.search(resident, warning)) == kept, (mode, warning)


def test_a_chunked_head_holds_one_chunk_of_logits():
    from megatron_rlhf.plan.sizes import LOGIT_BYTES_PER_ENTRY, logits_bytes

    cfg, tokens = preset("smollm2-135m"), 32 * 128
    whole = MemoryOptions(head_chunk_tokens=0)
    assert logits_bytes(cfg, tokens, 2, whole) == tokens * cfg.padded_vocab_size // 2 * LOGIT_BYTES_PER_ENTRY
    # a chunk's logits are gathered over TP: the whole vocabulary, 1024 tokens
    chunked = MemoryOptions(head_chunk_tokens=1024)
    assert logits_bytes(cfg, tokens, 2, chunked) == 1024 * cfg.padded_vocab_size * LOGIT_BYTES_PER_ENTRY
    assert logits_bytes(cfg, 100, 1, chunked) == logits_bytes(cfg, 100, 1, whole)  # fewer tokens than a chunk
    assert logits_bytes(cfg, tokens, 1, chunked, "draft") == logits_bytes(cfg, tokens, 1, whole, "draft")
    lay = Layout.parse("1x1x1")
    w = Workload(rollout_batch=32, max_prompt_length=64, max_new_tokens=64, micro_batch_size=32)
    assert (training_activation_bytes(cfg, "actor", w, lay, 0, whole)
            > training_activation_bytes(cfg, "actor", w, lay, 0, chunked))
    with pytest.raises(ValueError, match="head_chunk_tokens"):
        MemoryOptions(head_chunk_tokens=-1)
