#!/usr/bin/env python
"""Measure this machine's per-layer costs of one model shape for the plan estimator.

    torchrun --nproc_per_node N tools/profile_costs.py --model PRESET|CKPT --out FILE.json [--dtype fp32|bf16] ...

Writes a :class:`megatron_rlhf.plan.cost.Profile` (``tools/plan.py --profile FILE``, ``train --plan auto
--plan-hardware FILE``): seconds of one layer's forward, forward + backward, the LM head and a cached decode
step, TP-sharded tables, and a ``Hardware`` fitted from timed collectives. Run it under the launch the
costs are for: every rank times the same things at once, so the tables hold the contention the trainer
meets. Each entry is the median over ``--passes`` of the ranks' mean of their medians, made
non-decreasing in tokens and batch. ``FILE.meta.json`` keeps the raw data and the cache key: an
existing ``--out`` with the same key is reused unless ``--force``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

DEFAULT_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
DEFAULT_BATCHES = [1, 2, 4, 8, 16, 32]
TP_MIN_TOKENS = 32
ALLREDUCE_BYTES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20]
SHARD_BYTES = 64 << 20  # reduce-scatter/all-gather also at a size near megatron's buckets


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a preset name or a checkpoint directory")
    p.add_argument("--out", required=True, type=Path, help="the Profile JSON to write (or reuse)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--layers", type=int, default=2, help="layers of the model that is timed")
    p.add_argument("--seq", type=int, default=128,
                   help="sequence length of the forward/train batches (token counts above it "
                        "are batches of this length)")
    p.add_argument("--context", type=int, default=64, help="cached tokens before a decode step")
    p.add_argument("--tokens", type=int, nargs="+", default=DEFAULT_TOKENS)
    p.add_argument("--batches", type=int, nargs="+", default=DEFAULT_BATCHES)
    p.add_argument("--repeats", type=int, default=3,
                   help="timed repetitions (median) per entry, at least (short entries get more)")
    p.add_argument("--passes", type=int, default=3,
                   help="times the whole set of timings is taken, one after the other; each "
                        "entry is their median (a slow spell of the machine spoils one pass)")
    p.add_argument("--gpu-memory-gb", type=float, default=None,
                   help="memory per rank (default: host memory / ranks)")
    p.add_argument("--tp", type=int, nargs="*", default=[2, 4],
                   help="TP sizes whose layer and head costs are also measured (meta only; "
                        "those that do not divide the ranks or the heads are skipped)")
    p.add_argument("--force", action="store_true", help="measure even if --out matches")
    return p


def cache_key(args, cfg, world: int) -> dict:
    from megatron_rlhf.plan.cost import shape_key

    return {"shape": shape_key(cfg), "ranks": world, "threads": torch.get_num_threads(),
            "dtype": args.dtype, "layers": args.layers, "seq": args.seq, "context": args.context,
            "tokens": sorted(args.tokens), "batches": sorted(args.batches), "tp": sorted(args.tp),
            "passes": args.passes}


def meta_path(out: Path) -> Path:
    return out.with_name(out.name + ".meta.json") if out.suffix != ".json" \
        else out.with_name(out.stem + ".meta.json")


def cached(out: Path, key: dict) -> bool:
    try:
        return json.loads(meta_path(out).read_text())["key"] == key and out.is_file()
    except (OSError, ValueError, KeyError):
        return False


# ---------------------------------------------------------------------------- timing
class Timer:
    """Times ``fn`` on every rank at the same time: a barrier before each sample. A sample
    runs ``fn`` enough times in a row to last about ``SAMPLE_S`` (so that it averages over
    the scheduler's time slices of ranks sharing cores), counted from the slowest rank's
    timed warm-up run so that every rank agrees; the result is the median over
    ``repeats`` samples of the seconds per run (one more sample only, for runs over
    ``SAMPLE_S``: their noise is small)."""

    SAMPLE_S = 0.1

    def __init__(self, repeats: int):
        self.repeats = repeats

    def __call__(self, fn) -> float:
        return self.parts(lambda: [_timed(fn)])[0]

    def parts(self, fn) -> list[float]:
        """``fn()`` returns a list of seconds (parts it timed itself); medians per part."""
        import torch.distributed as dist

        dist.barrier()
        first = fn()
        t = torch.tensor([sum(first)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        warm = float(t)
        if warm > self.SAMPLE_S:
            dist.barrier()
            second = fn()
            return [(a + b) / 2 for a, b in zip(first, second)]
        inner = max(1, round(self.SAMPLE_S / max(warm, 1e-6)))
        samples = []
        for _ in range(self.repeats):
            dist.barrier()
            runs = [fn() for _ in range(inner)]
            samples.append([sum(r[i] for r in runs) / inner for i in range(len(first))])
        return [statistics.median(x[i] for x in samples) for i in range(len(first))]


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class DecoderClock:
    """Seconds spent in ``model.decoder``'s forward and backward, from hooks (the layers
    and the final norm; not the embedding, the rotary table or the head)."""

    def __init__(self, model):
        self.fwd = self.bwd = 0.0
        self._t: dict[str, float] = {}
        decoder = model.decoder
        decoder.register_forward_pre_hook(self._pre, with_kwargs=True)
        decoder.register_forward_hook(self._post, with_kwargs=True)

    def reset(self) -> None:
        self.fwd = self.bwd = 0.0
        self._t.clear()

    def _pre(self, module, args, kwargs):
        x = kwargs.get("hidden_states", args[0] if args else None)
        if torch.is_tensor(x) and x.requires_grad:
            x.register_hook(self._bwd_end)
        self._t["fwd"] = time.perf_counter()

    def _post(self, module, args, kwargs, output):
        self.fwd += time.perf_counter() - self._t["fwd"]
        out = output[0] if isinstance(output, tuple) else output
        if torch.is_tensor(out) and out.requires_grad:
            out.register_hook(self._bwd_start)

    def _bwd_start(self, grad):
        self._t["bwd"] = time.perf_counter()

    def _bwd_end(self, grad):
        self.bwd += time.perf_counter() - self._t["bwd"]


# ---------------------------------------------------------------------------- measurements
def batch_of(tokens: int, seq: int, vocab: int, gen: torch.Generator):
    """``[b, s]`` ids with ``b * s == tokens`` (``s = min(seq, tokens)``, rounded up)."""
    s = min(seq, tokens)
    b = max(1, -(-tokens // s))
    return torch.randint(0, vocab, (b, s), generator=gen)


def head_logprobs(model, hidden: torch.Tensor, ids: torch.Tensor, entropy: bool = False):
    """What follows the layers (and the final norm, which the decoder applies) in an LM
    call: the output layer (tied or not), log-probs of ``ids`` (and the entropy, as the PPO
    loss computes it). ``hidden``: [s, b, h]."""
    from megatron_rlhf.models.forward import logits_of
    from megatron_rlhf.rlhf.policy import entropy_from_logits, logprobs_from_logits

    x = hidden
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    logits, _ = model.output_layer(x, weight=weight)
    logits = logits_of(model, logits.transpose(0, 1))  # [b, s, V]
    out = logprobs_from_logits(logits, ids)
    if entropy:
        out = out + 0.0 * entropy_from_logits(logits)
    return out


def measure_forward(model, clock, timer, cfg, args, gen, tokens=None) -> tuple[list, list]:
    """Per token count: (decoder seconds per layer, seconds of the rest of a forward:
    embedding, masks, rotary table; the head excluded)."""
    model.eval()
    per_layer, rest = [], []
    for t in tokens or args.tokens:
        ids = batch_of(t, args.seq, cfg.vocab_size, gen)

        @torch.no_grad()
        def run():
            clock.reset()
            t0 = time.perf_counter()
            h = masked_forward_hidden(model, ids)
            total = time.perf_counter() - t0
            del h
            return [clock.fwd, total - clock.fwd]

        dec, other = timer.parts(run)
        per_layer.append(dec / args.layers)
        rest.append(other)
    return per_layer, rest


def masked_forward_hidden(model, ids: torch.Tensor):
    """The model's forward through its layers only (its output layer skipped: the head is
    timed apart), through the same ``masked_forward`` path the trainer takes."""
    from megatron_rlhf.models.forward import masked_forward

    post = model.post_process
    model.post_process = False  # GPTModel returns the decoder's hidden states
    try:
        return masked_forward(model, ids, torch.ones_like(ids))
    finally:
        model.post_process = post


def measure_train(model, clock, timer, cfg, args, gen, tokens=None) -> tuple[list, list]:
    """Per token count: (decoder forward + backward seconds per layer, the rest of a
    training forward + backward besides the head)."""
    model.train()
    per_layer, rest = [], []
    for t in tokens or args.tokens:
        ids = batch_of(t, args.seq, cfg.vocab_size, gen)

        def run():
            clock.reset()
            t0 = time.perf_counter()
            h = masked_forward_hidden(model, ids)
            h.float().square().mean().backward()  # a loss on the hidden states: no head
            total = time.perf_counter() - t0
            model.zero_grad(set_to_none=True)
            return [clock.fwd + clock.bwd, total - clock.fwd - clock.bwd]

        dec, other = timer.parts(run)
        per_layer.append(dec / args.layers)
        rest.append(other)
    model.eval()
    return per_layer, rest


def measure_head(model, timer, cfg, args, gen, dtype, tokens=None) -> tuple[list, list]:
    """Per token count: (head forward seconds, head forward + backward as the PPO loss
    runs it: log-probs and entropy)."""
    fwd, train = [], []
    for t in tokens or args.tokens:
        ids = batch_of(t, args.seq, cfg.vocab_size, gen)
        hidden = torch.randn(ids.shape[1], ids.shape[0], cfg.hidden_size, generator=gen).to(dtype)

        @torch.no_grad()
        def forward():
            head_logprobs(model, hidden, ids)

        def backward():
            h = hidden.detach().requires_grad_(True)
            head_logprobs(model, h, ids, entropy=True).sum().backward()
            model.zero_grad(set_to_none=True)

        fwd.append(timer(forward))
        train.append(timer(backward))
    return fwd, train


class LayerStepClock:
    """Seconds spent in the generator's per-layer step functions (wrapped while active)."""

    def __init__(self):
        from megatron_rlhf.generation import incremental

        self.mod, self.seconds = incremental, 0.0
        self.saved = {n: getattr(incremental, n) for n in ("_plain_layer_step", "_layer_step")}

    def __enter__(self):
        for name, fn in self.saved.items():
            setattr(self.mod, name, self._wrap(fn))
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(self.mod, name, fn)

    def _wrap(self, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            self.seconds += time.perf_counter() - t0
            return out
        return timed


def tp_models(cfg, small, args, world: int, dtype) -> dict:
    """``{tp: (model, clock)}`` per TP size of ``--tp`` that fits the ranks and the heads
    (and ``TP_MIN_TOKENS``): the TP-sharded models :func:`measure_tp` times, each TP
    group of the world at once (the layout the trainer runs)."""
    from megatron_rlhf.models.builder import build_model
    from megatron_rlhf.parallel.groups import build_process_groups
    from megatron_rlhf.parallel.layout import Layout

    out = {}
    if not any(t >= TP_MIN_TOKENS for t in args.tokens):
        return out
    for tp in args.tp:
        if tp < 2 or world % tp or cfg.num_attention_heads % tp or cfg.num_query_groups % tp:
            continue
        pg = build_process_groups(Layout(tp=tp, pp=1, dp=world // tp))
        model = build_model(small, "actor", pg, dtype=dtype, seed=0)
        out[tp] = (model, DecoderClock(model))
    return out


def measure_tp(models: dict, cfg, args, dtype, timer, gen) -> dict:
    """Per model of :func:`tp_models`: the same forward, train and head tables (token
    counts from ``TP_MIN_TOKENS`` on): what TP really costs here, its all-reduces, its
    thinner GEMMs and the full-vocabulary work every TP rank repeats included, where the
    estimator divides the TP=1 costs by TP and adds all-reduces."""
    tokens = [t for t in args.tokens if t >= TP_MIN_TOKENS]
    out = {}
    for tp, (model, clock) in models.items():
        fwd, _ = measure_forward(model, clock, timer, cfg, args, gen, tokens)
        train, _ = measure_train(model, clock, timer, cfg, args, gen, tokens)
        head, head_train = measure_head(model, timer, cfg, args, gen, dtype, tokens)
        out[tp] = {"tokens": tokens, "forward": fwd, "train": train, "head": head, "head_train": head_train}
    return out


def measure_decode(model, timer, cfg, args, gen) -> tuple[list, list]:
    """Per batch: (one layer of a cached 1-token step after ``context`` tokens, the rest of
    the step: embedding, masks, rotary angles, final norm, head, sampling)."""
    from megatron_rlhf.generation.incremental import RopeTable, forward_cached
    from megatron_rlhf.generation.kv_cache import KVCache

    model.eval()
    rope = RopeTable(model, args.context + 8)
    per_layer, rest = [], []
    with LayerStepClock() as clock:
        for b in args.batches:
            cache = KVCache.for_model(model, b, args.context + 4)
            for k, v in zip(cache.keys, cache.values):
                k.normal_(generator=gen)
                v.normal_(generator=gen)
            tokens = torch.randint(0, cfg.vocab_size, (b, 1), generator=gen)

            @torch.inference_mode()
            def step():
                clock.seconds = 0.0
                t0 = time.perf_counter()
                cache.lengths.fill_(args.context)
                logits = forward_cached(model, cache, tokens, rope)
                probs = torch.softmax(logits[:, -1].float(), -1)
                torch.multinomial(probs, 1, generator=gen)
                return [clock.seconds, time.perf_counter() - t0 - clock.seconds]

            layers, other = timer.parts(step)
            per_layer.append(layers / args.layers)
            rest.append(other)
    return per_layer, rest


def collective_groups(world: int) -> dict:
    """``{size: group}``: the world (``None``) and, with 4 or more ranks, this rank's pair
    (every pair at once)."""
    import torch.distributed as dist

    groups = {world: None}
    if world >= 4 and world % 2 == 0:
        pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
        groups[2] = pairs[dist.get_rank() // 2]
    return groups


def measure_collective(timer, groups: dict, op: str, sizes=ALLREDUCE_BYTES) -> list[dict]:
    """Seconds of ``op`` (all_reduce, reduce_scatter: ``reduce_scatter_tensor`` of
    ``bytes`` in, all_gather: ``all_gather_into_tensor`` of ``bytes`` out) per size over
    each of :func:`collective_groups`."""
    import torch.distributed as dist

    out = []
    for size, group in groups.items():
        for nbytes in sizes:
            full = torch.ones(nbytes // 4, dtype=torch.float32)
            part = torch.empty(nbytes // 4 // size, dtype=torch.float32)
            fn = {"all_reduce": lambda: dist.all_reduce(full, group=group),
                  "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full, group=group),
                  "all_gather": lambda: dist.all_gather_into_tensor(full, part, group=group)}[op]
            out.append({"op": op, "group": size, "bytes": nbytes, "s": timer(fn)})
    return out


def optimizer_step(model, pg):
    """``(step, params, shard)``: one step of megatron's distributed optimizer (as the
    trainer builds it) on ``model`` at DP = the world, with random gradients (clipping's
    norm, Adam over this rank's shard, the copy back and the parameters' all-gather), and
    the parameter count and the shard's."""
    import torch.distributed as dist

    from megatron_rlhf import runtime
    from megatron_rlhf.config import OptimConfig
    from megatron_rlhf.rlhf.optim import build_trainee

    t = build_trainee(model, pg, OptimConfig(lr=1e-6), 1e-6)
    params = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(dist.get_rank())
    for p in params:
        p.main_grad.copy_(torch.randn(p.shape, generator=gen) * 1e-3)

    def step():
        with runtime.cuda_as_cpu():
            t.optimizer.step()

    total = sum(p.numel() for p in params)
    return step, total, total / dist.get_world_size()


def fit_bus(rows: list[dict], steps) -> tuple[float, float]:
    """(bandwidth, latency) from ``t = latency + steps(g) * bytes / bw``, least squares."""
    xs = [steps(r["group"]) * r["bytes"] for r in rows]
    ys = [r["s"] for r in rows]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0, 1e-12)
    return 1.0 / slope, max(my - slope * mx, min(ys) / 2)


# ---------------------------------------------------------------------------- fitting
def fit_links(rows: list[dict]) -> tuple[float, float]:
    """(bus bandwidth bytes/s, latency s) of all-reduces from ``t = latency + 2 (g-1)/g *
    bytes / bw`` (the estimator's formula), least squares over every row."""
    return fit_bus(rows, lambda g: 2 * (g - 1) / g)


def fit_ring(rows: list[dict]) -> tuple[float, float]:
    """(bus bandwidth, latency per ring step) from ``t = 2 (g-1) * step + 2 (g-1)/g * bytes /
    bw`` (a ring all-reduce's ``2 (g-1)`` steps each pay a latency): least squares in two
    unknowns."""
    a = [(2 * (r["group"] - 1), 2 * (r["group"] - 1) / r["group"] * r["bytes"]) for r in rows]
    y = [r["s"] for r in rows]
    s11 = sum(u * u for u, _ in a)
    s12 = sum(u * v for u, v in a)
    s22 = sum(v * v for _, v in a)
    b1 = sum(u * t for (u, _), t in zip(a, y))
    b2 = sum(v * t for (_, v), t in zip(a, y))
    det = s11 * s22 - s12 * s12
    step, inv_bw = (s22 * b1 - s12 * b2) / det, (s11 * b2 - s12 * b1) / det
    return 1.0 / max(inv_bw, 1e-12), max(step, 0.0)


def fit_hardware(cfg, args, world: int, per_layer_fwd, per_layer_decode, head_fwd, links,
                 param_bytes: int, shards: list[dict] = (), cores: int = 0, threads: int = 1,
                 optimizer: dict | None = None) -> dict:
    """The Hardware of the measurements (``shards``: reduce-scatter and all-gather rows;
    ``optimizer``: :func:`measure_optimizer`'s step, less the parameters' all-gather at its
    fitted cost, gives the bytes of memory traffic per shard parameter at ``mem_bw``)."""
    from megatron_rlhf.plan import memory as mem
    from megatron_rlhf.plan.cost import Hardware

    params = mem.layer_params(cfg).sharded
    tokens = args.tokens[-1]
    flops = 2 * params * tokens / per_layer_fwd[-1]
    vocab = cfg.head_vocab_size or cfg.padded_vocab_size
    mem_bw = vocab * cfg.hidden_size * param_bytes / head_fwd[0]
    stream = params * param_bytes / mem_bw
    _, latency = fit_links(links)
    bw, step = fit_ring(links)
    if args.gpu_memory_gb is not None:
        gb = args.gpu_memory_gb
    else:
        gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9 / world
    fits = {}
    for op in ("reduce_scatter", "all_gather"):
        rows = [r for r in shards if r["op"] == op]
        if rows:
            fits[f"{op}_bw"], fits[f"{op}_latency_s"] = fit_bus(rows, lambda g: (g - 1) / g)
    if optimizer is not None:
        gather = 0.0
        if "all_gather_bw" in fits:
            gather = fits["all_gather_latency_s"] + (world - 1) / world * optimizer["params"] \
                * param_bytes / fits["all_gather_bw"]
        adam = max(optimizer["optimizer_s"] - gather, 0.0)
        fits["optimizer_bytes_per_param"] = adam * mem_bw / optimizer["shard"]
    hw = Hardware("cpu-measured", flops=flops, mem_bw=mem_bw, intra_bw=bw, inter_bw=bw,
                  latency_s=latency, layer_overhead_s=max(per_layer_fwd[0] - stream, 0.0),
                  decode_overhead_s=max(per_layer_decode[0] - stream, 0.0),
                  gpus_per_node=world, gpu_memory_gb=round(gb, 2), ring_latency_s=step,
                  cores=cores, threads_per_rank=threads, **fits)
    return asdict(hw)


TABLES = ("forward", "forward_rest", "train", "train_rest", "head", "head_train", "decode", "decode_rest")
MONOTONE = ("forward", "train", "head", "head_train", "decode")
"""The tables over token counts (or batch sizes) whose cost cannot fall as they grow."""
TP_KEYS = ("forward", "train", "head", "head_train")


def sweep(model, clock, tp: dict, groups: dict, opt_step, timer, cfg, args, gen, dtype) -> dict:
    """One pass over everything the profile holds, each number the mean over the ranks:
    ``{table: [s, ...]}`` for :data:`TABLES`, ``tp`` (:func:`measure_tp`), ``links`` (the
    all-reduce rows), ``shards`` (reduce-scatter and all-gather rows), ``optimizer_s``."""
    out = {}
    out["forward"], out["forward_rest"] = measure_forward(model, clock, timer, cfg, args, gen)
    out["train"], out["train_rest"] = measure_train(model, clock, timer, cfg, args, gen)
    out["head"], out["head_train"] = measure_head(model, timer, cfg, args, gen, dtype)
    out["decode"], out["decode_rest"] = measure_decode(model, timer, cfg, args, gen)
    tp_tables = measure_tp(tp, cfg, args, dtype, timer, gen)
    links = measure_collective(timer, groups, "all_reduce")
    big = [*ALLREDUCE_BYTES[-3:], SHARD_BYTES]
    shards = measure_collective(timer, groups, "reduce_scatter", big) + \
        measure_collective(timer, groups, "all_gather", big)
    optimizer_s = timer(opt_step)
    flat = [*(x for k in TABLES for x in out[k]),
            *(x for t in tp_tables.values() for k in TP_KEYS for x in t[k]),
            *(r["s"] for r in links + shards), optimizer_s]
    avg = iter(average_over_ranks(flat))  # one all-reduce, unpacked in the same order
    for k in TABLES:
        out[k] = [next(avg) for _ in out[k]]
    for t in tp_tables.values():
        for k in TP_KEYS:
            t[k] = [next(avg) for _ in t[k]]
    for r in links + shards:
        r["s"] = next(avg)
    return {**out, "tp": tp_tables, "links": links, "shards": shards, "optimizer_s": next(avg)}


def combine(passes: list[dict]) -> dict:
    """The median over :func:`sweep`'s passes of every entry (same structure)."""
    def med(seqs):
        return [statistics.median(v) for v in zip(*seqs)]

    first = passes[0]
    out = {k: med([p[k] for p in passes]) for k in TABLES}
    out["tp"] = {tp: {"tokens": t["tokens"], **{k: med([p["tp"][tp][k] for p in passes]) for k in TP_KEYS}}
                 for tp, t in first["tp"].items()}
    for name in ("links", "shards"):
        out[name] = [dict(r, s=statistics.median(p[name][i]["s"] for p in passes))
                     for i, r in enumerate(first[name])]
    out["optimizer_s"] = statistics.median(p["optimizer_s"] for p in passes)
    return out


def monotone(xs: list[float]) -> list[float]:
    """The non-decreasing sequence closest to ``xs`` in least squares (pool adjacent
    violators): a table over growing token counts whose noise made it fall somewhere."""
    blocks: list[list[float]] = []  # [sum, count] of pooled runs
    for x in xs:
        blocks.append([x, 1])
        while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] > blocks[-1][0] * blocks[-2][1]:
            total, n = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += n
    return [total / n for total, n in blocks for _ in range(int(n))]


def monotone_tables(c: dict) -> dict:
    """:func:`combine`'s result with :data:`MONOTONE` and the TP tables made non-decreasing."""
    out = dict(c, **{k: monotone(c[k]) for k in MONOTONE})
    out["tp"] = {tp: dict(t, **{k: monotone(t[k]) for k in TP_KEYS}) for tp, t in c["tp"].items()}
    return out


def average_over_ranks(values: list[float]) -> list[float]:
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


# ---------------------------------------------------------------------------- main
def main(argv=None) -> int:
    args = parser().parse_args(argv)
    args.tokens, args.batches = sorted(set(args.tokens)), sorted(set(args.batches))
    if min(args.layers, args.repeats, args.passes, *args.tokens, *args.batches) < 1:
        sys.exit("profile_costs.py: --layers, --repeats, --passes, --tokens and --batches must be >= 1")
    from memory_plan import model_config

    from megatron_rlhf import runtime

    try:
        cfg = model_config(args.model)
    except ValueError as e:
        sys.exit(f"profile_costs.py: {e}")
    runtime.quiet_third_party_warnings()
    rank, world = runtime.init_distributed()
    key = cache_key(args, cfg, world)
    if not args.force and cached(args.out, key):
        if rank == 0:
            print(f"profile_costs.py: {args.out} already profiles {key['shape']} on {world} ranks "
                  f"x {key['threads']} threads, {args.dtype} (--force to measure again)", file=sys.stderr)
        runtime.shutdown()
        return 0
    import torch.distributed as dist

    from megatron_rlhf.models.builder import build_model
    from megatron_rlhf.parallel.groups import build_process_groups
    from megatron_rlhf.parallel.layout import Layout
    from megatron_rlhf.plan.cost import Profile

    start = time.perf_counter()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    small = cfg.replace(num_layers=args.layers)
    pg = build_process_groups(Layout(tp=1, pp=1, dp=world))
    model = build_model(small, "actor", pg, dtype=dtype, seed=0)
    clock = DecoderClock(model)
    timer = Timer(args.repeats)
    gen = torch.Generator().manual_seed(1234 + rank)

    tp = tp_models(cfg, small, args, world, dtype)
    groups = collective_groups(world)
    step, n_params, shard = optimizer_step(model, pg)
    passes = []
    for i in range(args.passes):
        t0 = time.perf_counter()
        passes.append(sweep(model, clock, tp, groups, step, timer, cfg, args, gen, dtype))
        if rank == 0:
            print(f"profile_costs.py: pass {i + 1}/{args.passes} in {time.perf_counter() - t0:.1f} s",
                  file=sys.stderr)
    medians = combine(passes)
    c = monotone_tables(medians)
    fwd, train, head, head_train, decode = (c[k] for k in ("forward", "train", "head", "head_train", "decode"))
    links, shards, tp_tables = c["links"], c["shards"], c["tp"]
    optimizer = {"optimizer_s": c["optimizer_s"], "params": n_params, "shard": shard}
    param_bytes = 2 if args.dtype == "bf16" else 4
    cores = len(os.sched_getaffinity(0))
    hw = fit_hardware(cfg, args, world, fwd, decode, head, links, param_bytes, shards, cores,
                      key["threads"], optimizer)
    prof = Profile(shape=key["shape"], tokens=args.tokens, forward=fwd, train=train, head=head,
                   batches=args.batches, decode=decode, context=args.context, hardware=hw,
                   head_train=head_train, tp_tables={str(tp): t for tp, t in tp_tables.items()})
    elapsed = time.perf_counter() - start
    if rank == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        prof.save(args.out)
        meta = {"key": key, "model": args.model, "seconds": elapsed,
                "machine": _machine(), "cores": cores,
                "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                "passes": args.passes, "forward_rest_s": c["forward_rest"], "train_rest_s": c["train_rest"],
                "head_train_s": head_train, "decode_rest_s": c["decode_rest"], "allreduce": links,
                "ring_fit": dict(zip(("bus_bw", "latency_per_step_s"), fit_ring(links))),
                "shard_collectives": shards, "tp_tables": tp_tables, "optimizer_step": optimizer,
                **{f"{op}_fit": {"bw": hw.get(f"{op}_bw"), "latency_s": hw.get(f"{op}_latency_s")}
                   for op in ("reduce_scatter", "all_gather")},  # (fitted in fit_hardware)
                "medians": {k: medians[k] for k in MONOTONE}, "medians_tp": medians["tp"],
                "pass_tables": [{k: p[k] for k in (*TABLES, "optimizer_s")} for p in passes],
                "notes": "per-layer seconds at TP=1 (mean over ranks of each rank's median, the "
                         "median over the passes, made non-decreasing in tokens/batch; "
                         "'medians': before that); "
                         "*_rest_s: per call, outside the layers and the head (forward: "
                         "embedding, masks, rotary table; decode: the whole step without "
                         "layers, head and sampling included); head_train_s: the head's "
                         "forward + backward with log-probs and entropy"}
        meta_path(args.out).write_text(json.dumps(meta, indent=1) + "\n")
        print(f"profile_costs.py: wrote {args.out} ({key['shape']}, {world} ranks x "
              f"{key['threads']} threads, {args.dtype}) in {elapsed:.1f} s", file=sys.stderr)
    dist.barrier()
    runtime.shutdown()
    return 0


def _machine() -> str:
    """The CPU's model name, a label only (tools/ cannot import benchmarks.harness.cpu_model)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    return next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")), "unknown")


if __name__ == "__main__":
    sys.exit(main())
