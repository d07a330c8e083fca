"""RLHF training at DP=2 (two gloo ranks) equals DP=1 on the same global batch, and a
DP=2 run resumed from its checkpoint, at DP=2, 1 or 4, continues as the uninterrupted run."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

import rlhf_fixtures as F
from launch import ROOT, torchrun
from megatron_rlhf.models.builder import build_model
from megatron_rlhf.models.checkpoint import load_checkpoint, read_checkpoint

pytestmark = [pytest.mark.dist, pytest.mark.slow]

# Greedy rollouts (identical however prompts are split over ranks), GAE with a critic; the
# DP=1 run trains 3 iterations in one go (saving after 2 and 3), the DP=2 run trains 2, then
# resumes for the 3rd (the critic's trunk gets no gradient in the first iteration: its
# value head starts at zero). --lr-decay-iters 3 gives both runs the same LR schedule.
# DP=2 holds 2 prompts = 4 samples per rank, one micro-batch of 2 after another;
# DP=1 accumulates over 4 micro-batches. --adam-eps 1e-5: Adam's first step is about
# lr * sign(g), so a gradient component below the default eps (1e-8) turns a 1-ulp
# difference in the order of summation into an update difference of ~1e-6; a larger eps
# keeps the update proportional to such tiny gradients.
FLAGS = dict(temperature=0, global_batch_size=4, rollout_n=2, micro_batch_size=2,
             max_new_tokens=8, advantage_estimator="gae", adam_eps=1e-5, lr=1e-3,
             critic_lr=1e-3, lr_decay_iters=3, seed=7)


def _load(path, role, pg):
    info = read_checkpoint(path)
    model = build_model(info.config, role, pg, dtype=torch.float32)
    load_checkpoint(model, pg, path)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _compare(run1, run2, iteration, init, pg, moved=1e-4):
    """Actor and critic weights of two runs at ``iteration`` agree to float32 rounding;
    every tensor that has an initial value in ``init`` moved by more than ``moved`` in
    some element."""
    for role in ("actor", "critic"):
        w1 = _load(run1 / "save" / f"iter_{iteration:07d}" / role, role, pg)
        w2 = _load(run2 / "save" / f"iter_{iteration:07d}" / role, role, pg)
        assert w1.keys() == w2.keys()
        for name in w1:
            a, b = w1[name], w2[name]
            where = f"iteration {iteration} {role} {name}"
            diff = (a - b).norm().item()
            # float32 sums in another order: a few ulps here and there, ~1e-7 of the tensor
            assert diff <= 1e-6 * a.norm().item(), f"{where}: {run2.name} differs by {diff:.2e}"
            worst = (a - b).abs().max().item()
            assert worst <= 1e-5 * a.abs().max().item(), f"{where}: one element off by {worst:.1e}"
            if name in init and init[name].shape == a.shape:
                # it trained (every tensor moved), and the two updates agree to 1e-4
                change = (a - init[name]).norm().item()
                assert (a - init[name]).abs().max().item() > moved, f"{where} did not change"
                assert diff <= 1e-4 * change, f"{where}: {diff:.2e} vs update {change:.2e}"


def _beside_one_process(tmp_path, one_args: list[str], ranks: int, dist_args: list[str]) -> None:
    """``python -m megatron_rlhf.train ONE_ARGS`` in one process, alongside (the two start
    up in parallel) ``torchrun --nproc_per_node RANKS -m megatron_rlhf.train DIST_ARGS``;
    both must succeed."""
    log1 = (tmp_path / "one_process.stderr").open("w+")
    one = subprocess.Popen([sys.executable, "-m", "megatron_rlhf.train", *one_args],
                           cwd=ROOT, env=F.env(), stdout=subprocess.DEVNULL, stderr=log1)
    with log1:
        try:
            torchrun(ranks, ["-m", "megatron_rlhf.train", *dist_args])
            one.wait(timeout=300)
        finally:
            if one.poll() is None:
                one.kill()
                one.wait()
        log1.seek(0)
        assert one.returncode == 0, log1.read()[-6000:]


class _OneProcess(NamedTuple):
    actor: Path
    prompts: Path
    run: Path  # its save/ and log/
    init: dict  # the actor's initial weights


def _one_process(world1, root: Path, train_iters: int, **flags) -> _OneProcess:
    actor = F.make_actor_checkpoint(root / "actor", world1)
    prompts = F.write_prompts(root / "prompts.jsonl")
    F.check_ok(F.run_train(F.train_args(actor, prompts, root / "one", train_iters=train_iters,
                                        save_interval=2, **flags)))
    return _OneProcess(actor, prompts, root / "one", _load(actor, "actor", world1))


@pytest.fixture(scope="module")
def one(world1, tmp_path_factory):
    """The reference of the DP, layout and disjoint-ranks tests: one process, FLAGS, three
    iterations saved after the 2nd and 3rd (its iteration 2 is a 2-iteration run's:
    --lr-decay-iters fixes the schedule). Run once for the module."""
    return _one_process(world1, tmp_path_factory.mktemp("one"), 3, **FLAGS)


@pytest.fixture(scope="module")
def one_clipped(world1, tmp_path_factory):
    """The TP tests' reference: one process, FLAGS with --clip-grad 0.05, two iterations."""
    return _one_process(world1, tmp_path_factory.mktemp("one_clipped"), 2, **FLAGS, clip_grad=0.05)


def _metrics_equal(one: _OneProcess, run: Path, iterations: int) -> list[tuple[dict, dict]]:
    """The reference's and ``run``'s metrics, iteration by iteration for the first
    ``iterations``: every deterministic one within 1e-5 (F.assert_metrics_equal)."""
    m1, m2 = F.read_metrics(one.run / "log")[:iterations], F.read_metrics(run / "log")
    assert [m["iteration"] for m in m2] == [m["iteration"] for m in m1] == list(range(1, iterations + 1))
    for a, b in zip(m1, m2, strict=True):
        F.assert_metrics_equal(a, b)
    return list(zip(m1, m2))


def test_dp2_equals_dp1_and_resumes(world1, one, tmp_path):
    run2 = tmp_path / "dp2"
    args2 = ["-m", "megatron_rlhf.train", *F.train_args(one.actor, one.prompts, run2, **FLAGS)]
    torchrun(2, [*args2, "--train-iters", "2"])
    _compare(one.run, run2, 2, one.init, world1)
    # the distributed optimizer's shards, saved in model space (dist_checkpointing); RNG per rank
    trainer = run2 / "save" / "iter_0000002" / "trainer"
    assert sorted(p.name for p in trainer.iterdir()) == [
        "optim_actor", "optim_critic", "rng_00000.pt", "rng_00001.pt", "state.json"]

    # resumed at DP=1 and DP=4 from the DP=2 checkpoint, iteration 3 is the uninterrupted
    # DP=1 run's: Adam's moments and step came back whole, resharded over the new DP size
    # (moments off by a factor, or lost, change every weight of the update)
    for dp in (1, 4):
        run = tmp_path / f"dp2_to_dp{dp}"
        shutil.copytree(run2 / "save", run / "save")
        torchrun(dp, ["-m", "megatron_rlhf.train", *F.train_args(one.actor, one.prompts, run, **FLAGS),
                      "--train-iters", "3", "--load", str(run / "save")])
        _compare(one.run, run, 3, one.init, world1)
        assert [m["iteration"] for m in F.read_metrics(run / "log")] == [3]

    torchrun(2, [*args2, "--train-iters", "3", "--load", str(run2 / "save")])
    _compare(one.run, run2, 3, one.init, world1)
    # the same rollouts, rewards and losses, iteration by iteration
    _metrics_equal(one, run2, 3)


@pytest.mark.parametrize("extra", [(), ("--sequence-parallel",)], ids=["tp", "tp_sp"])
def test_tp2_equals_tp1(world1, one_clipped, tmp_path, extra):
    """TP=2 (two gloo ranks, DP=1) trains as TP=1, with gradient clipping active in both;
    also with sequence parallelism (the actor's, reference's and critic's whole-sequence
    forwards split over TP, lengths padded to a multiple of TP; the actor generates with
    whole sequences):
    --clip-grad 0.05 sits below every iteration's gradient norm (actor ~5, critic 1.6-2.9), so
    the TP-aware norm (sharded parameters summed over the TP ranks, replicated ones counted
    once) sets the scale of every update; a norm off at TP=2 changes the weights and the
    logged grad norms.

    Clipped gradients are small: the critic trunk's, in its one step with a gradient
    (iteration 2), lie mostly below --adam-eps, so its layer norms move by ~6e-5 only,
    hence ``moved=1e-5`` here (the equality tolerances are the DP test's)."""
    run2 = tmp_path / "tp2"
    torchrun(2, ["-m", "megatron_rlhf.train",
                 *F.train_args(one_clipped.actor, one_clipped.prompts, run2, train_iters=2, **FLAGS, clip_grad=0.05),
                 "--tensor-model-parallel-size", "2", *extra])
    _compare(one_clipped.run, run2, 2, one_clipped.init, world1, moved=1e-5)
    state = json.loads((run2 / "save" / "iter_0000002" / "trainer" / "state.json").read_text())
    assert state["sequence_parallel"] is bool(extra)
    # every deterministic metric (reward_mean, policy_loss, value_loss, kl, grad norms,
    # entropy, ...) within 1e-5, relative or absolute (policy_loss is ~1e-7 noise)
    for a, b in _metrics_equal(one_clipped, run2, 2):
        # clipping was active: the (pre-clip) norms lie above --clip-grad
        for m in (a, b):
            assert m["actor_grad_norm"] > 0.05 and m["critic_grad_norm"] > 0.05, m


OVERLAP = ("--overlap-grad-reduce",)  # gradients reduced during the last micro-batch's backward
# (with overlapped reduction the parameter gather overlaps too; the training copy's weights
# wait in host memory while the generation copy generates, forced on CPU)
LAYOUTS = [("2x1x1", "1x2", ()), ("1x1x2", "2x1", (*OVERLAP, "--release-train-copy")),  # TP <-> DP
           ("1x2x1", "1x2", ("--recompute-granularity", "full")),  # PP=2 (1F1B over gloo)
           # PP=2 x DP=2, 4 ranks, with the reference (DP=4) and the critic (training at
           # TP=2 x DP=2, inference at DP=4: a second copy, reallocated) on layouts of their own
           ("1x2x2", "1x4", (*OVERLAP, "--ref-layout", "1x1x4", "--critic-layout", "2x1x2",
                             "--critic-infer-layout", "1x1x4")),
           ("2x2x1", "2x2", ("--sequence-parallel",))]  # TP=2 x PP=2, sequence shards pipelined


@pytest.mark.parametrize("train_layout, gen_layout, extra", LAYOUTS)
def test_generation_layout_trains_as_one_layout(world1, one, tmp_path, train_layout, gen_layout, extra):
    """Training and inference under a train layout (TP, PP, DP), generation under its own
    (the actor's weights reallocated after every update, the samples regrouped onto the
    train layout's data-parallel ranks): the same updated weights after 2 iterations as one
    process (fp32, the DP test's tolerances), the same metrics (loss parity across layouts)."""
    run2 = tmp_path / "layouts"
    torchrun(math.prod(int(x) for x in train_layout.split("x")),
             ["-m", "megatron_rlhf.train", *F.train_args(one.actor, one.prompts, run2, train_iters=2, **FLAGS),
              "--train-layout", train_layout, "--gen-layout", gen_layout, *extra])
    _compare(one.run, run2, 2, one.init, world1)
    for a, b in _metrics_equal(one, run2, 2):
        assert b["realloc_mb"] > 0 and "time_reallocate_s" in b and "realloc_mb" not in a
    state = json.loads((run2 / "save" / "iter_0000002" / "trainer" / "state.json").read_text())
    for flag, model in (("--ref-layout", "reference"), ("--critic-layout", "critic"),
                        ("--critic-infer-layout", "critic_inf")):
        if flag in extra:  # the model really ran on its own layout
            assert state[f"{model}_layout"] == extra[extra.index(flag) + 1], state


def test_calls_on_disjoint_ranks(world1, one, tmp_path):
    """ReaLHF's concurrent calls, on 4 ranks: the actor trains at DP=2 on ranks 0-1 while the
    critic trains at DP=2 on ranks 2-3; in the experience the actor's old log-prob
    recompute and the critic's inference copy run on ranks 0-1 while the reference runs on
    ranks 2-3; generation covers all four (its data-parallel ranks hold the samples). Each
    model is built on its ranks only; after each update the actor's weights move from ranks
    0-1 to all four, the critic's from ranks 2-3 to ranks 0-1 (the actor's second update
    learns from the advantages of the critic's reallocated copy). Trained two iterations,
    saved (each model and optimizer by the ranks that hold it; rank 0 holds no critic),
    resumed for the third: the weights and metrics of one process after 2 and 3 iterations."""
    run2 = tmp_path / "apart"
    apart = ["-m", "megatron_rlhf.train", *F.train_args(one.actor, one.prompts, run2, **FLAGS),
             "--train-layout", "1x1x2", "--critic-layout", "1x1x2@2", "--critic-infer-layout", "1x1x2",
             "--ref-layout", "1x1x2@2", "--gen-layout", "1x4"]
    torchrun(4, apart)
    _compare(one.run, run2, 2, one.init, world1)
    torchrun(4, [*apart, "--train-iters", "3", "--load", str(run2 / "save")])
    _compare(one.run, run2, 3, one.init, world1)
    for _, b in _metrics_equal(one, run2, 3):
        assert b["realloc_mb"] > 0 and b["critic_grad_norm"] > 0 and b["actor_grad_norm"] > 0, b
    state = json.loads((run2 / "save" / "iter_0000003" / "trainer" / "state.json").read_text())
    assert (state["train_layout"], state["critic_layout"], state["critic_inf_layout"],
            state["reference_layout"]) == ("1x1x2", "1x1x2@2", "1x1x2", "1x1x2@2"), state
    assert set(state["schedulers"]) == {"actor", "critic"}, state


def test_draft_distilled_on_the_train_layout(world1, tmp_path):
    """``--draft-train-layout train``: the draft distils on a copy of its own at TP=2 (the
    train layout), taught by the actor's training copy, its weights reallocated to the
    generation copy (DP=2) with the actor's: after 2 iterations the actor, critic and draft
    weights of one process (where generation and training share one copy)."""
    from megatron_rlhf.config import preset
    from megatron_rlhf.models.checkpoint import save_checkpoint

    actor = F.make_actor_checkpoint(tmp_path / "actor", world1)
    prompts = F.write_prompts(tmp_path / "prompts.jsonl")
    cfg = preset("tiny", vocab_size=F.VOCAB, max_position_embeddings=F.POSITIONS, num_layers=1)
    save_checkpoint(tmp_path / "draft", 0, build_model(cfg, "draft", world1, dtype=torch.float32, seed=3), world1)
    flags = dict(FLAGS, draft_load=str(tmp_path / "draft"), num_draft_tokens=2, draft_distill=True, draft_lr=1e-3)
    run1, run2 = tmp_path / "one", tmp_path / "draft_on_train"
    _beside_one_process(tmp_path, F.train_args(actor, prompts, run1, **flags), 2,
                        [*F.train_args(actor, prompts, run2, **flags), "--train-layout", "2x1x1",
                         "--gen-layout", "1x2", "--draft-train-layout", "train"])
    _compare(run1, run2, 2, _load(actor, "actor", world1), world1)
    d1, d2, d0 = (_load(p, "draft", world1) for p in (run1 / "save" / "iter_0000002" / "draft",
                                                       run2 / "save" / "iter_0000002" / "draft", tmp_path / "draft"))
    for name, a in d1.items():
        assert (a - d2[name]).abs().max().item() <= 1e-5 * a.abs().max().item(), name
        assert (a - d0[name]).abs().max().item() > 1e-4, f"draft {name} did not train"
    for a, b in zip(F.read_metrics(run1 / "log"), F.read_metrics(run2 / "log"), strict=True):
        F.assert_metrics_equal(a, b)
        assert b["draft_kl"] > 0 and b["realloc_mb"] > 0
    state = json.loads((run2 / "save" / "iter_0000002" / "trainer" / "state.json").read_text())
    assert state["draft_train_layout"] == "train", state


@pytest.mark.shared_launch(2, "overlap.py")  # in the launch shared with other scripts
def test_overlapped_gradient_reduction(shared_launch):
    r = shared_launch()
    assert "OK" in r.stdout
