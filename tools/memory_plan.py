#!/usr/bin/env python
"""Peak GPU memory per RLHF stage (generation, inference, training) for a layout per stage.

  python tools/memory_plan.py --actor llama2-70b --critic llama2-7b --reward llama2-7b --nodes 8 --gpus-per-node 8 \\
      --gpu-memory-gb 80 --train-layout 8x4x2 --gen-layout 8x8 [--json] [--search]
  python tools/memory_plan.py --measure [--work out/memory_measure] [--train-args "..."]

Models are presets or checkpoint directories; ``none`` leaves a role out. Prints a table per stage
(GB per GPU) or JSON lines; ``--search`` lists the train layouts that fit. ``--measure`` runs the CPU
demo's GRPO workload for one iteration and prints the estimate beside what rank 0 measured. Exit
code 0 whether or not it fits; 2 for invalid input. The model: ``megatron_rlhf/plan/memory.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from megatron_rlhf.config import PRESETS, ModelConfig, dataclass_from_namespace
from megatron_rlhf.parallel.layout import Layout
from megatron_rlhf.plan import memory
from megatron_rlhf.plan.memory import GB, Cluster, MemoryOptions, StageLayouts, Workload


def model_config(name: str) -> ModelConfig:
    """A preset name or a checkpoint directory -> its ModelConfig."""
    if name in PRESETS:
        return PRESETS[name]
    if Path(name).exists():
        from megatron_rlhf.models.checkpoint import read_checkpoint  # imports torch: only here

        return read_checkpoint(name).config
    raise ValueError(f"model {name!r} is neither a preset ({', '.join(sorted(PRESETS))}) "
                     "nor a checkpoint directory")


def add_models_and_cluster(p: argparse.ArgumentParser):
    """The models (presets or checkpoints) and the cluster: shared with tools/plan.py;
    returns the cluster group for more flags."""
    m = p.add_argument_group("models (preset name or checkpoint directory)")
    m.add_argument("--actor", required=True, help="the policy")
    m.add_argument("--critic", default="SAME", help="value model (SAME: the actor's shape; none: GRPO)")
    m.add_argument("--reference", default="SAME", help="KL reference (SAME: the actor; none: no KL)")
    m.add_argument("--reward", default="none", help="reward model (none: a rule reward)")
    m.add_argument("--draft", default="none", help="draft for speculative generation (none: plain)")
    c = p.add_argument_group("cluster")
    c.add_argument("--nodes", type=int, default=1)
    c.add_argument("--gpus-per-node", type=int, default=8)
    c.add_argument("--gpu-memory-gb", type=float, default=80.0)
    return c


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_models_and_cluster(p)
    lay = p.add_argument_group("layouts")
    lay.add_argument("--train-layout", help="TPxPPxDP of actor and critic training, e.g. 8x4x2")
    lay.add_argument("--gen-layout", help="TPxDP of generation (default: train TP, DP the rest)")
    lay.add_argument("--infer-layout", help="TPxPPxDP of the experience stage (default: train layout)")
    w = p.add_argument_group("workload")
    w.add_argument("--rollout-batch", type=int, help="samples per iteration (prompts x rollout-n), default 512")
    w.add_argument("--max-prompt-length", type=int, help="default 1024")
    w.add_argument("--max-new-tokens", type=int, help="default 1024")
    w.add_argument("--micro-batch-size", type=int, help="default 1")
    w.add_argument("--num-mini-batches", type=int, help="optimizer steps per PPO epoch, default 1")
    w.add_argument("--num-draft-tokens", type=int, help="tokens per verification with a draft, default 4")
    o = p.add_argument_group("memory options")
    o.add_argument("--recompute-granularity", dest="recompute", choices=memory.RECOMPUTE)
    o.add_argument("--sequence-parallel", action="store_true", default=None)
    o.add_argument("--no-distributed-optimizer", dest="distributed_optimizer",
                   action="store_false", default=None, help="Adam states on every DP replica")
    o.add_argument("--bf16-grads", dest="fp32_grads", action="store_false", default=None,
                   help="bf16 gradient buffers (default fp32)")
    o.add_argument("--keep-train-copy", dest="release_train_copy", action="store_false", default=None,
                   help="keep the actor's training-layout weights on the GPU during generation")
    o.add_argument("--gathered-logits", dest="vocab_parallel_logits", action="store_false", default=None,
                   help="logits gathered over TP for the loss (default: vocab-parallel)")
    o.add_argument("--fp32", dest="param_bytes", action="store_const", const=4,
                   help="fp32 weights, cache and activations (default bf16)")
    o.add_argument("--reserve-gb", type=float, help="GB per GPU kept free (default 10%% of the GPU)")
    p.add_argument("--json", action="store_true", help="one JSON line per stage")
    p.add_argument("--search", action="store_true", help="list the train layouts that fit")
    p.add_argument("--top", type=int, default=10, help="--search: layouts to list")
    m = p.add_argument_group("measure (the CPU demo's workload, one iteration)")
    m.add_argument("--measure", action="store_true", help="run it and print estimate beside measurement")
    m.add_argument("--work", default="out/memory_measure", help="checkpoints and the run (reused)")
    m.add_argument("--train-args", default="", help="extra megatron_rlhf.train flags, one string")
    return p


def models_from(args) -> dict[str, ModelConfig]:
    models = {"actor": model_config(args.actor)}
    for role in ("reference", "critic", "reward", "draft"):
        name = getattr(args, role)
        if name.lower() == "none":
            continue
        models[role] = models["actor"] if name == "SAME" else model_config(name)
    return models


def header(models: dict[str, ModelConfig], args, workload: Workload) -> dict:
    return {
        "models": {r: f"{getattr(args, r) if getattr(args, r) != 'SAME' else args.actor} "
                      f"({memory.count_parameters(cfg, r) / 1e9:.2f}B)" for r, cfg in models.items()},
        "rollout_batch": workload.rollout_batch, "seq_length": workload.seq_length,
        "micro_batch_size": workload.micro_batch_size,
    }


def main(argv: list[str] | None = None) -> int:
    p = parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--measure" in argv and "--actor" not in argv:  # the demo's models: --actor is implied
        argv += ["--actor", "smollm2-135m"]
    args = p.parse_args(argv)
    if args.measure:
        return measure(args)
    try:
        models = models_from(args)
        cluster = dataclass_from_namespace(Cluster, args)
        workload = dataclass_from_namespace(Workload, args)
        options = dataclass_from_namespace(MemoryOptions, args)
        gen = Layout.parse(args.gen_layout, pipeline=False) if args.gen_layout else None
        infer = Layout.parse(args.infer_layout) if args.infer_layout else None
        if args.search:
            return search(models, cluster, workload, options, gen, infer, args)
        if not args.train_layout:
            p.error("give --train-layout TPxPPxDP (or --search)")
        layouts = StageLayouts(train=Layout.parse(args.train_layout), gen=gen, infer=infer)
        est = memory.estimate(models, cluster, layouts, workload, options)
    except ValueError as e:
        p.error(str(e))
    head = header(models, args, workload)
    if args.json:
        print(json.dumps({"kind": "setup"} | head))
        for d in est.to_dicts():
            print(json.dumps({"kind": "stage"} | d))
        print(json.dumps({"kind": "summary", "fits": est.fits, "peak_gb": round(est.peak / GB, 3)}))
    else:
        print(", ".join(f"{r}: {v}" for r, v in head["models"].items())
              + f"; rollout {workload.rollout_batch} samples x {workload.seq_length} tokens, "
                f"micro-batch {workload.micro_batch_size}")
        print(est.table())
        print(f"fits: {'yes' if est.fits else 'NO'} (peak {est.peak / GB:.2f} GB per GPU)")
    return 0


def search(models, cluster, workload, options, gen, infer, args) -> int:
    found = memory.search_train_layouts(models, cluster, workload, options, gen=gen, infer=infer)
    rows = []
    for est in found[: args.top]:
        s = {st.stage: st for st in est.stages}
        rows.append({
            "kind": "layout",
            "train_layout": memory.layout_text(s["training"].layout),
            "gen_layout": memory.layout_text(s["generation"].layout, pipeline=False),
            "infer_layout": memory.layout_text(s["inference"].layout),
            **{f"{name}_gb": round(st.total / GB, 2) for name, st in s.items()},
            "peak_gb": round(est.peak / GB, 2),
        })
    if args.json:
        for r in rows:
            print(json.dumps(r))
        print(json.dumps({"kind": "summary", "fitting_layouts": len(found)}))
        return 0
    print(f"{len(found)} train layouts fit on {cluster.nodes} nodes x {cluster.gpus_per_node} GPUs "
          f"of {cluster.gpu_memory_gb:g} GB (usable {(cluster.gpu_memory_gb * GB - options.reserve_bytes(cluster)) / GB:.1f}); "
          "GB per GPU, smallest peak first:")
    print(f"{'train':>8} {'gen':>6} {'infer':>8} {'generation':>11} {'inference':>10} {'training':>9} {'peak':>7}")
    for r in rows:
        print(f"{r['train_layout']:>8} {r['gen_layout']:>6} {r['infer_layout']:>8} {r['generation_gb']:>11.2f} "
              f"{r['inference_gb']:>10.2f} {r['training_gb']:>9.2f} {r['peak_gb']:>7.2f}")
    return 0


# the demo's GRPO run (examples/cpu_demo.sh), one iteration, no evaluation; its prompts are
# at most MEASURE_PROMPT_TOKENS long with the chat template (the estimate's prompt length)
MEASURE_PROMPT_TOKENS = 96
DEMO_TRAIN_ARGS = [
    "--bf16", "--draft-source", "history", "--prompts", "megatron_rlhf/data/math_train.jsonl", "--reward-fn", "math",
    "--advantage-estimator", "grpo", "--global-batch-size", "16", "--rollout-n", "4",
    "--micro-batch-size", "8", "--num-mini-batches", "2", "--max-new-tokens", "128",
    "--max-prompt-length", str(MEASURE_PROMPT_TOKENS), "--temperature", "0.8",
    "--lr", "5e-5", "--drop-zero-advantage", "--lr-warmup-iters", "1", "--kl-coef", "0.0",
    "--clip-grad", "1.0", "--train-iters", "1"]
STAGES = {"generation": "rollout", "inference": "experience", "training": "train"}
"""Estimator stage -> the trainer's stage of the same work."""


def measure(args) -> int:
    import shlex
    import subprocess

    root = Path(__file__).resolve().parent.parent
    work = Path(args.work)
    ckpt, run = work / "smollm2-135m", work / "run"
    py = sys.executable

    def sh(cmd, **kw):
        print("#", " ".join(map(str, cmd)), file=sys.stderr, flush=True)
        subprocess.run([str(c) for c in cmd], check=True, cwd=root, **kw)

    if not (ckpt / "latest_checkpointed_iteration.txt").exists():
        from megatron_rlhf.models.smollm2 import smollm2_gguf

        gguf = smollm2_gguf()
        sh([py, "tools/convert_checkpoint.py", "hf-to-mcore", "--input", gguf, "--output", ckpt])
    import shutil

    shutil.rmtree(run, ignore_errors=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    train_args = DEMO_TRAIN_ARGS + shlex.split(args.train_args)  # (a repeated flag: the last wins)
    sh([py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
        "megatron_rlhf.train", "--actor-load", ckpt, *train_args,
        "--log-dir", run], env=env)
    got = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    runtime = subprocess.run(
        [py, "-c", "import megatron_rlhf.train, megatron.core.optimizer\n"
                   "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmRSS')][0])"],
        capture_output=True, text=True, check=True, cwd=root, env=env).stdout.split()[-1]
    runtime_gb = int(runtime) * 1024 / GB
    # the estimate's workload comes from the very flags the run was given
    from megatron_rlhf.config import (GenerationConfig, LoopConfig, PPOConfig, SpecConfig,
                                      dataclass_from_namespace)
    from megatron_rlhf.train import parse_args

    ns = parse_args(["--actor-load", str(ckpt), *train_args])
    ppo, loop, gen, spec = (dataclass_from_namespace(c, ns)
                            for c in (PPOConfig, LoopConfig, GenerationConfig, SpecConfig))
    est = memory.estimate(
        {"actor": model_config(str(ckpt))},  # the demo drafts from its history: no draft model
        Cluster(nodes=1, gpus_per_node=2, gpu_memory_gb=1000.0),
        StageLayouts(train=Layout.parse("1x1x2"), gen=Layout.parse("1x2", pipeline=False)),
        Workload.from_configs(ppo, loop, gen, spec, has_draft=False),
        MemoryOptions(recompute=ns.recompute_granularity or "none", park_on_host=False,
                      head_chunk_tokens=ns.head_chunk_tokens))  # (a CPU run)
    gib = 2**30 / GB
    rows = []
    for st in est.stages:
        measured = got.get(f"peak_mem_{STAGES[st.stage]}_gb")
        predicted = st.total / GB + runtime_gb
        rows.append({"kind": "stage", "stage": st.stage, "estimate_gb": round(st.total / GB, 3),
                     "runtime_gb": round(runtime_gb, 3), "predicted_gb": round(predicted, 3),
                     "measured_gb": None if measured is None else round(measured * gib, 3),
                     "ratio": None if measured is None else round(measured * gib / predicted, 3),
                     "parts": {k: round(v / GB, 3) for k, v in st.parts.items()}})
    parts = {k[4:-3]: round(v * gib, 3) for k, v in got.items() if k.startswith("mem_")}
    rows.append({"kind": "components", "measured_gb": parts})
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    print(f"the demo's workload, one iteration, rank 0 (GB = 10^9 bytes; runtime {runtime_gb:.2f} GB: "
          f"Python, torch and megatron imported, nothing built){' ' + args.train_args if args.train_args else ''}")
    print(f"{'stage':<11} {'estimate':>9} {'+ runtime':>10} {'measured':>9} {'measured/predicted':>19}")
    for r in rows[:-1]:
        m = "-" if r["measured_gb"] is None else f"{r['measured_gb']:.2f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        print(f"{r['stage']:<11} {r['estimate_gb']:>9.2f} {r['predicted_gb']:>10.2f} {m:>9} {ratio:>19}")
    train = next(st for st in est.stages if st.stage == "training")
    print("components (estimate of the training stage / measured between stages):")
    pairs = [("actor_weights", "actor_weights"), ("actor_grads", "actor_grads"),
             ("actor_optimizer", "actor_optimizer"), ("draft_weights", "draft_weights")]
    for part, name in pairs:
        e = train.parts.get(part) or next((s.parts.get(part) for s in est.stages if part in s.parts), None)
        print(f"  {part:<18} {('-' if e is None else f'{e / GB:.2f}'):>6} / {parts.get(name, '-')}")
    print(f"  {'activations':<18} {train.parts.get('activations', 0) / GB:>6.2f} / "
          f"{rows[2]['measured_gb'] - runtime_gb - sum(parts.values()):.2f} (the training peak less the runtime and the above)"
          if rows[2]["measured_gb"] is not None else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
