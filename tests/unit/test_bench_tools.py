"""The benchmarks' own arithmetic (no real model, no processes): variant parsing, the
rollout benchmark's makespan/ideal/idle records and busy clock, benchmarks.rlhf's ratios."""

from __future__ import annotations

import argparse
import importlib

import pytest

from gen_fixtures import PROMPTS, actor_and_draft


def tool(name: str):
    """``benchmarks.NAME`` (the repository root is on pytest's pythonpath)."""
    return importlib.import_module(f"benchmarks.{name}")


def test_draft_lengths_and_variants_parse():
    gen, roll, rlhf = tool("generation"), tool("rollout"), tool("rlhf")
    assert gen.draft_list("1,2,4,auto") == [1, 2, 4, "auto"]
    assert gen.parse_args(["--num-draft-tokens", "2,auto"]).num_draft_tokens == [2, "auto"]
    with pytest.raises(SystemExit):
        gen.parse_args(["--num-draft-tokens", "0,auto"])
    assert [roll.parse_variant(x) for x in ("off", "2", "auto", "auto+mig")] == [
        ("off", 0, False), ("2", 2, False), ("auto", "auto", False), ("auto+mig", "auto", True)]
    assert rlhf.parse_variant("auto+mig") == ("auto+mig", "auto", True, None)
    assert rlhf.parse_variant("2") == ("spec n=2", 2, False, None)
    assert rlhf.parse_variant("history+mig") == ("history+mig", "auto", True, "history")
    assert not rlhf.uses_model(rlhf.parse_variant("history")) and rlhf.uses_model(rlhf.parse_variant("both"))
    with pytest.raises(SystemExit):  # the model's variants need a draft
        rlhf.main(["--actor-load", "x", "--num-draft-tokens", "auto"])
    for bad in ("x", "2+fast", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            roll.parse_variant(bad)
    with pytest.raises(SystemExit):  # 25 samples do not split over 2 ranks x 2 per prompt
        roll.parse_args(["--global-batch", "25"])


def rank(wall, busy, lengths, out=0, hist=(3, 1)):
    return {"wall_s": wall, "busy_s": busy, "lengths": lengths, "finish": ["eos"] * len(lengths),
            "migrated_out": out, "migration_bytes": 2 * 2**20 * out, "rounds_by_draft_len": list(hist),
            "verifications": 4, "accepted": 2}


def test_rollout_records_makespan_ideal_idle_and_ratios():
    roll = tool("rollout")
    off = roll.run_record("off", 0, [rank(10.0, 10.0, [100, 8]), rank(4.0, 4.0, [8, 8])], 100)
    assert off["makespan_s"] == 10.0 and off["ideal_s"] == 7.0
    assert off["makespan_vs_ideal"] == pytest.approx(10 / 7)
    assert off["idle_frac"] == pytest.approx([0.0, 0.6])
    assert off["new_tokens"] == 124 and off["cut_fraction"] == 0.25
    assert off["rank_owned_tokens"] == [108, 16] and off["rounds_by_draft_len"] == [6, 2]
    mig = roll.run_record("auto+mig", 0, [rank(5.0, 4.8, [60, 8], out=1), rank(5.0, 4.6, [8, 8])], 100)
    assert mig["migrated"] == 1 and mig["migration_mb"] == 1.0
    v = roll.variant_record("auto+mig", [mig], [off], "off")
    assert v["speedup"] == 2.0 and v["tokens_per_s_ratio"] == pytest.approx((84 / 5) / (124 / 10))
    g = roll.goals_record({"auto+mig": v})
    assert g["met"] == {"speedup": True, "makespan_vs_ideal": True, "idle_frac": True}
    assert "goals for auto+mig vs off" in roll.summary([off, mig, v, g])


def test_busy_clock_times_the_engine_compute(world1):
    roll = tool("rollout")
    from megatron_rlhf.config import GenerationConfig, SpecConfig
    from megatron_rlhf.generation.engine import Generator

    actor, draft = actor_and_draft(world1)
    engine = Generator(actor, draft)
    clock = roll.BusyClock(engine)
    r = engine.generate(PROMPTS[:2], GenerationConfig(max_new_tokens=6, temperature=1.0), SpecConfig(2))
    assert 0 < clock.seconds <= r.stats.elapsed_s
    assert r.stats.new_tokens == 12


def test_rlhf_compare_is_the_median_of_per_round_ratios():
    rlhf = tool("rlhf")

    def row(gen, it, rew):
        return {"time_rollout_s": gen, "iteration_s": it, "gen_tokens_per_s": 10 / gen, "reward_mean": rew,
                "reward_std": 0.1, "accepted_length": 1.5, "gen_idle_frac_max": 0.2}

    c = rlhf.compare("auto", [row(1.0, 5.0, 0.3), row(2.0, 6.0, 0.2), row(1.0, 4.0, 0.5)],
                     [row(2.0, 6.0, 0.2), row(2.0, 6.0, 0.2), row(4.0, 8.0, 0.2)])
    assert c["generation_speedup"] == 2.0 and c["iteration_speedup"] == pytest.approx(1.2)
    assert c["reward_mean_diff"] == pytest.approx(0.1)


def test_plan_bench_rows_ratios_and_replayed_predictions():
    plan = tool("plan")
    assert not hasattr(plan, "Proposed") and not hasattr(plan, "_proposed_class")
    meas = {"time_rollout_s": 2.0, "time_experience_s": 1.0, "time_train_s": 6.0, "time_reallocate_s": 0.0,
            "time_iteration_s": 9.0, "wall_iteration_s": 10.0}
    pred = {"time_rollout_s": 3.0, "time_experience_s": 1.0, "time_train_s": 6.35, "time_reallocate_s": 0.0,
            "time_iteration_s": 10.35}
    row = plan.compare_row("1x1x4/1x4", 0, meas, {}, (pred, {}), [{"realloc_mb": 0.0}] * 3)
    assert row["ratio"]["time_iteration_s"] == pytest.approx(1.15) and row["ratio"]["time_reallocate_s"] is None
    assert row["within_20pct"] and row["ratio"]["wall_iteration_s"] == pytest.approx(1.035)
    row["replayed"] = {"predicted": 7.2, "ratio": 0.8}
    other = dict(row, plan="2x1x2/2x2", ratio=dict(row["ratio"], time_iteration_s=1.3))
    acc = plan.accuracy({"1x1x4/1x4": [row], "2x1x2/2x2": [other]})
    assert acc["within_20pct"] == 1 and not acc["met"]
    assert acc["replayed"] == {"ratios": {"1x1x4/1x4": 0.8, "2x1x2/2x2": 0.8}, "within_20pct": 2}
    assert "one-sample-steps" in plan.SEARCH_CASES
    # plans with calls on layouts of their own (the trainer's flags, the estimator's plan)
    import types

    from megatron_rlhf.parallel.layout import Layout

    assert plan.own_layouts("2x1x2/2x2") == {}
    assert plan.own_layouts("2x1x2/2x2/ref_inf=1x1x2,reward_inf=1x1x2@2") == {"ref_inf": "1x1x2",
                                                                              "reward_inf": "1x1x2@2"}
    p = object.__new__(plan.Predictor)
    p.flags = types.SimpleNamespace(reward_load="rm")
    lay = p.plan_of("2x1x2/1x4/reward_inf=1x1x2@2,critic_train=1x1x4").layouts
    assert lay["reward_inf"] == Layout(1, 1, 2, ranks=(2, 3)) and lay["ref_inf"] == lay["actor_train"] == Layout(2, 1, 2)
    assert lay["critic_inf"] == lay["critic_train"] == Layout(1, 1, 4) and lay["actor_gen"] == Layout(1, 1, 4)


def test_plan_bench_profiles_again_for_each_round_when_asked(monkeypatch, tmp_path):
    """``--profile-each-round``: round R's profile is measured afresh (``--force``) into a
    file of its own; without it the cached profile is reused (no ``--force``)."""
    import types

    plan = tool("plan")
    cmds = []

    def run(cmd, **kw):
        cmds.append(cmd)
        return types.SimpleNamespace(returncode=0, stderr="profiled\n")

    monkeypatch.setattr(plan.subprocess, "run", run)
    args = types.SimpleNamespace(profile=tmp_path / "prof.json", model_dir=tmp_path, dtype="fp32", nproc=4)
    assert plan.profile(args, 128, 64) == tmp_path / "prof.json" and "--force" not in cmds[-1]
    assert plan.profile(args, 128, 64, 2) == tmp_path / "prof_round2.json"
    assert "--force" in cmds[-1] and str(tmp_path / "prof_round2.json") in cmds[-1]


def test_bench_history_oracle_drafts_the_answer_from_where_the_sample_is(tmp_path):
    """The oracle variant's drafter proposes the sample's own answer from its position on
    (the ceiling of any draft); the bench takes a trained actor's iteration directory."""
    hist = tool("history")
    drafter = hist.oracle_drafter()
    drafter.answers = {7: [10, 11, 12, 13]}
    drafter.begin(7, [1, 2, 3])
    assert drafter.propose(7, 2) == [10, 11]
    drafter.extend(7, [10, 11])
    assert drafter.propose(7, 3) == [12, 13]  # no more than the answer holds
    drafter.begin(8, [1, 2, 3], response=[4])  # arrived by migration, no answer known
    assert drafter.propose(8, 3) == []
    actor = tmp_path / "iter_0000016" / "actor"
    actor.mkdir(parents=True)
    with pytest.raises(SystemExit):
        hist.parse_args(["--load", str(actor)])
    (actor / "megatron_rlhf.json").write_text("{}")
    args = hist.parse_args(["--load", str(actor), "--variants", "off,oracle-auto"])
    assert args.variants == ["off", "oracle-auto"]
    assert hist.spec_of("oracle-8").num_draft_tokens == 8


def test_bench_history_argmax_answers_are_the_greedy_continuations(world1):
    """The argmax variant drafts the policy's most likely token at each position of an
    answer: for a greedy answer that is the answer itself; for any other answer it differs
    where the answer left the mode."""
    import torch

    from megatron_rlhf.config import GenerationConfig, SpecConfig
    from megatron_rlhf.generation.engine import Generator

    hist = tool("history")
    actor, _ = actor_and_draft(world1)
    prompts = [list(p) for p in PROMPTS]
    greedy = Generator(actor).generate(prompts, GenerationConfig(max_new_tokens=8, temperature=0.0),
                                       SpecConfig(0)).responses()
    assert hist.greedy_answers(actor, prompts, greedy, pad=0) == greedy
    changed = [a[:3] + [(a[3] + 1) % 200] + a[4:] for a in greedy]  # off the mode at position 3
    argmax = hist.greedy_answers(actor, prompts, changed, pad=0)
    assert all(g[:4] == c[:3] + [a[3]] for g, c, a in zip(argmax, changed, greedy))
    assert torch.tensor([g[3] != c[3] for g, c in zip(argmax, changed)]).all()


def test_train_step_bench_skips_the_zero_groups_and_compares_to_base(capsys):
    """``benchmarks.train_step`` on a tiny model: the variants with the skip leave out the
    zero-advantage groups' share, the padded ones pad, and a ratio line compares each to base."""
    import json

    from benchmarks import train_step

    assert train_step.main(["--preset", "tiny", "--rows", "8", "--group", "2", "--zero-groups", "0.5",
                            "--repeats", "1", "--variants", "base,all", "--dtype", "fp32"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    rows = {x["variant"]: x for x in lines if x["kind"] == "variant"}
    assert rows["base"]["skipped_fraction"] == 0 and rows["all"]["skipped_fraction"] == 0.5
    assert rows["base"]["padded_tokens"] > rows["base"]["real_tokens"]
    ratio = [x for x in lines if x["kind"] == "ratio"]
    assert [x["variant"] for x in ratio] == ["all"]
    assert ratio[0]["faster_than_base"] == round(rows["base"]["s"] / rows["all"]["s"], 2)
    with pytest.raises(SystemExit):
        train_step.main(["--variants", "base,nope"])


def test_mismatch_bench_variants_give_the_demos_flags():
    """``benchmarks.mismatch``: variants parse (replay only for an MoE), each runs the demo's
    GRPO flags in its precision with log pi_old recomputed, and the train CLI accepts them."""
    import argparse
    from types import SimpleNamespace

    from megatron_rlhf.train import parse_args

    bench = tool("mismatch")
    assert bench.parse_variant("moe-bf16+replay") == ("moe", "bf16", True)
    for bad in ("dense-bf16+replay", "moe-fp16", "sparse-fp32"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_variant(bad)
    args = SimpleNamespace(prompts=8, iters=2, seed=1)
    for text in bench.VARIANTS:
        variant = bench.parse_variant(text)
        argv = [str(a) for a in bench.flags(variant, "ckpt", args)]
        assert f"--{variant[1]}" in argv and "--recompute-logprobs" in argv
        assert ("--routing-replay" in argv) == variant[2]
        parse_args(argv)
