"""What one decode step costs beyond its arithmetic (JSON lines): aten ops per layer, host
reads per step, and the bytes a step reads (weights against the KV cache).

    python -m benchmarks.decode_step [--batches 1,64,256] [--prompt 256] [--new 768]

``ops``: the static step's aten ops per layer of a tiny random model, per attention backend
(``sdpa`` is the GPU's without flash-attn). ``host_reads``: reads of the device per decode
step of a plain rollout, the graph code run eagerly (a GPU without graphs, or after a failed
capture) against the dynamic step (what such a GPU ran before). ``bytes``: predicted per step
of a rollout of ``--prompt`` + ``--new`` tokens, the attention over the whole cache against
over its length bucket (mean over the rollout's steps), bf16. Runs on the CPU in seconds.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.harness import machine, markdown

HOST_READS = {"_local_scalar_dense", "item", "nonzero", "masked_select", "is_nonzero", "equal"}
# the GPU check's 1b shape, and models our users train
MODELS = {"1b": ("smollm2-135m", dict(hidden_size=2048, num_layers=16, num_attention_heads=32,
                                       num_query_groups=8, ffn_hidden_size=8192)),
          "llama2-7b": ("llama2-7b", {})}


class Ops(TorchDispatchMode):
    """Counts launched aten ops (views excluded) under ``self.tag``, and host reads: the ops
    of :data:`HOST_READS` and copies into ``self.hosts`` (a step's packed result)."""

    def __init__(self):
        super().__init__()
        self.tag, self.ops, self.reads, self.hosts = None, Counter(), Counter(), set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if self.tag is not None and not func.is_view:
            self.ops[self.tag] += 1
            self.reads[self.tag] += name in HOST_READS or (name == "copy_" and args[0].data_ptr() in self.hosts)
        return func(*args, **(kwargs or {}))


def ops_per_layer(model, backend: str, tokens: int = 1) -> int:
    """Most aten ops a layer of the static step of ``tokens`` per row runs (4 rows)."""
    from megatron_rlhf.generation import graphs, incremental

    runner = graphs.StepGraphs(model, 4, 64, capture=False, backend=backend)
    runner.new_cache(4).lengths.fill_(10)
    trace, real = Ops(), incremental._plain_layer_step

    def layer_step(layer, idx, *a, **k):
        trace.tag = idx
        try:
            return real(layer, idx, *a, **k)
        finally:
            trace.tag = None

    incremental._plain_layer_step = layer_step
    try:
        with torch.inference_mode(), trace:
            runner._forward_step(4, tokens, False)()
    finally:
        incremental._plain_layer_step = real
    return max(trace.ops.values())


def host_reads_per_step(model, graphs_mode: str) -> float:
    """Device reads per decode step of a sampled rollout of 15 prompts (prefill excluded)."""
    from megatron_rlhf.config import GenerationConfig
    from megatron_rlhf.generation.engine import Generator

    gen = Generator(model, graphs=graphs_mode)
    prompts = [[5 + i, 6, 7, 8 + i][: 1 + i % 4] for i in range(15)]
    cfg = GenerationConfig(max_new_tokens=32, temperature=0.8, top_k=40, stop_on_eos=False)
    trace, real_decode, real_tolist = Ops(), Generator._decode, torch.Tensor.tolist

    def decode(self, *a, **k):
        trace.tag = "decode"
        try:
            return real_decode(self, *a, **k)
        finally:
            trace.tag = None

    def tolist(t):  # a host buffer's tolist reads pinned host memory, not the device
        trace.hosts = {h.data_ptr() for r in gen._steps.values() for h in getattr(r, "hosts", [])}
        if trace.tag is not None and t.data_ptr() not in trace.hosts:
            trace.reads["decode"] += 1
        return real_tolist(t)

    gen.generate(prompts[:1], cfg, seed=1)  # the graph store: its host buffers are known below
    trace.hosts = {h.data_ptr() for r in gen._steps.values() for h in getattr(r, "hosts", [])}
    Generator._decode, torch.Tensor.tolist = decode, tolist
    try:
        with trace:
            out = gen.generate(prompts, cfg, seed=1)
    finally:
        Generator._decode, torch.Tensor.tolist = real_decode, real_tolist
    return trace.reads["decode"] / out.stats.actor_steps


def step_bytes(name: str, batches: list[int], prompt: int, new: int) -> list[dict]:
    """Predicted bytes per decode step (bf16): weights, KV over the whole cache and over the
    length bucket, the latter averaged over the rollout's steps."""
    from megatron_rlhf.config import preset
    from megatron_rlhf.generation.graphs import length_bucket
    from megatron_rlhf.plan.sizes import count_parameters, kv_cache_bytes

    base, overrides = MODELS[name]
    cfg = preset(base, **overrides)
    max_len = prompt + new
    weights = 2 * count_parameters(cfg)
    buckets = [length_bucket(prompt + t, max_len) for t in range(1, new + 1)]
    rows = []
    for b in batches:
        full = kv_cache_bytes(cfg, b, max_len, 1)
        bucketed = sum(kv_cache_bytes(cfg, b, k, 1) for k in buckets) / len(buckets)
        rows.append({"what": "bytes", "model": name, "batch": b, "prompt": prompt, "new": new,
                     "weights_gb": weights / 1e9, "kv_whole_cache_gb": full / 1e9,
                     "kv_bucketed_gb": bucketed / 1e9, "step_bytes_ratio": (weights + bucketed) / (weights + full)})
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,64,256", help="batch sizes for the bytes per step")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens of the rollout priced")
    p.add_argument("--new", type=int, default=768, help="new tokens of the rollout priced")
    args = p.parse_args(argv)
    from megatron_rlhf import runtime
    from megatron_rlhf.config import preset
    from megatron_rlhf.models.builder import build_model
    from megatron_rlhf.parallel.groups import build_process_groups
    from megatron_rlhf.parallel.layout import Layout

    runtime.quiet_third_party_warnings()
    runtime.init_distributed()
    model = build_model(preset("tiny-untied"), "actor", build_process_groups(Layout()), dtype=torch.float32, seed=1)
    lines = [machine(what="machine")]
    lines += [{"what": "ops", "backend": b, "ops_per_layer": ops_per_layer(model, b)} for b in ("sdpa", "matmul")]
    lines += [{"what": "host_reads", "engine": mode, "reads_per_step": host_reads_per_step(model, mode)}
              for mode in ("eager", "off")]
    for name in MODELS:
        lines += step_bytes(name, [int(b) for b in args.batches.split(",")], args.prompt, args.new)
    for line in lines:
        print(json.dumps(line), flush=True)
    rows = [[x["model"], x["batch"]] + [round(x[k], 2) for k in ("weights_gb", "kv_whole_cache_gb", "kv_bucketed_gb",
                                                                 "step_bytes_ratio")]
            for x in lines if x["what"] == "bytes"]
    print(markdown(["model", "batch", "weights GB", "KV whole GB", "KV bucketed GB", "step bytes ratio"], rows))


if __name__ == "__main__":
    main()
