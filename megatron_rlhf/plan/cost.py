"""Time and memory of the RLHF dataflow graph's calls under a plan (ReaLHF's estimator,
with communication counted).

Compute comes from per-layer costs: a :class:`Hardware` profile (a device's FLOP/s,
memory bandwidth and link bandwidths: a roofline, for clusters you do not have) or, where
``tools/profile_costs.py`` measured this machine, its per-layer timings (:class:`Profile`),
interpolated. Communication comes from the link bandwidths and a latency per collective:

- TP: two all-reduces of the activations per layer and forward (two more in backward);
- PP: 1F1B with ``PP - 1`` bubble slots per optimizer step (forward-only calls pipeline
  their micro-batches too), plus the send/recv of one micro-batch's activations per slot;
- DP: the distributed optimizer's gradient reduce-scatter and parameter all-gather per
  optimizer step, and the Adam step itself (memory-bound);
- reallocation: a model's weights moved between two layouts (:func:`realloc_time`).

Generation is priced round by round over the response lengths' distribution (the long
tail: few samples live at the end) and, with a draft, under the drafting selector's rule:
at each live batch the draft length that minimises time per emitted token, given the
acceptance rate.

Memory per GPU comes from :mod:`megatron_rlhf.plan.memory`'s accounting, per call.
Everything is pure arithmetic (no torch).
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_rlhf.config import ModelConfig
from megatron_rlhf.parallel.layout import Layout
from megatron_rlhf.plan import memory as mem
from megatron_rlhf.plan.graph import Call


@dataclass(frozen=True)
class Hardware:
    """What a device and its links sustain (not their data-sheet peaks)."""

    name: str
    flops: float
    """Dense matmul FLOP/s of one device in the model's dtype."""
    mem_bw: float
    """Device memory bytes/s."""
    intra_bw: float
    """Bytes/s per device in a collective inside a node (NCCL bus bandwidth over NVLink)."""
    inter_bw: float
    """Bytes/s per device in a collective across nodes (the NIC's share)."""
    latency_s: float = 20e-6
    """Fixed cost of one collective or one point-to-point transfer."""
    layer_overhead_s: float = 0.0
    """Fixed cost per layer and forward launched eagerly (kernel launches, Python)."""
    decode_overhead_s: float = 0.0
    """Fixed cost per layer of one decode step (0 with CUDA graphs)."""
    gpus_per_node: int = 8
    gpu_memory_gb: float = 80.0

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path) -> "Hardware":
        return cls(**json.loads(Path(path).read_text()))


HARDWARE = {
    # ~60-70% of dense bf16 peak in large GEMMs, ~85% of HBM bandwidth, NCCL bus bandwidth
    "h100": Hardware("h100", flops=600e12, mem_bw=2.8e12, intra_bw=360e9, inter_bw=45e9,
                     latency_s=20e-6, layer_overhead_s=30e-6, gpu_memory_gb=80.0),
    # measured on one H200 (DESIGN.md): bf16 GEMM ~790 TFLOP/s, device copy ~4.3 TB/s
    "h200": Hardware("h200", flops=650e12, mem_bw=4.0e12, intra_bw=360e9, inter_bw=45e9,
                     latency_s=20e-6, layer_overhead_s=30e-6, gpu_memory_gb=141.0),
    "a100": Hardware("a100", flops=230e12, mem_bw=1.7e12, intra_bw=230e9, inter_bw=23e9,
                     latency_s=25e-6, layer_overhead_s=30e-6, gpu_memory_gb=80.0),
    # this project's 2-core CPU machine, rough (DESIGN.md): ~170 GFLOP/s fp32 GEMMs, 5-10 GB/s
    # memory, gloo between processes; tools/profile_costs.py measures it properly
    "cpu": Hardware("cpu", flops=1.5e11, mem_bw=7e9, intra_bw=2e9, inter_bw=1e9,
                    latency_s=1e-4, layer_overhead_s=3e-4, decode_overhead_s=3e-4,
                    gpus_per_node=2, gpu_memory_gb=12.0),
}


@dataclass
class Profile:
    """Measured per-layer seconds at TP=1 on this machine (``tools/profile_costs.py``), for
    one model shape: a forward of ``tokens`` tokens (``forward``), forward + backward
    (``train``), a decode step of ``batch`` samples after ``context`` cached tokens
    (``decode``), and the LM head's forward per token count (``head``)."""

    shape: str
    tokens: list[int]
    forward: list[float]
    train: list[float]
    head: list[float]
    batches: list[int]
    decode: list[float]
    context: int
    hardware: dict = field(default_factory=dict)
    """The :class:`Hardware` fitted alongside (links, overheads)."""

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path) -> "Profile":
        return cls(**json.loads(Path(path).read_text()))


def shape_key(cfg: ModelConfig) -> str:
    return (f"{cfg.num_layers}x{cfg.hidden_size}/{cfg.ffn_hidden_size} h{cfg.num_attention_heads}"
            f"/{cfg.num_query_groups} v{cfg.padded_vocab_size}")


def _interp(xs: list, ys: list, x: float) -> float:
    """Piecewise-linear in x, extrapolated linearly (proportionally beyond the largest)."""
    if x <= xs[0]:
        return ys[0] * x / xs[0] if xs[0] else ys[0]
    if x >= xs[-1]:
        return ys[-1] * x / xs[-1]
    i = bisect.bisect_right(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class Speculation:
    """A draft for generation and the acceptance it reaches."""

    draft: ModelConfig
    acceptance: float = 0.6
    """Probability that the actor accepts one draft token (per position)."""
    max_draft_tokens: int = 4


@dataclass
class Options:
    """How calls run (beyond their layouts)."""

    param_bytes: int = 2
    micro_batch_size: int = 1
    recompute: str = "none"
    distributed_optimizer: bool = True
    response_fractions: tuple = (1.0,)
    """Each sample's response length as a fraction of ``gen_len`` (quantiles of the
    distribution; ``(1.0,)``: every sample runs to the maximum, no tail)."""
    speculation: Speculation | None = None


class Estimator:
    """Seconds and bytes of calls under layouts, for one set of models and one machine."""

    def __init__(self, models: dict[str, ModelConfig], hardware: Hardware,
                 profiles: dict[str, Profile] | None = None, options: Options | None = None):
        self.models, self.hw = models, hardware
        self.profiles = profiles or {}
        self.opt = options or Options()
        self._memo: dict = {}

    # ------------------------------------------------------------------ primitives
    def _bw(self, group: int) -> float:
        return self.hw.intra_bw if group <= self.hw.gpus_per_node else self.hw.inter_bw

    def all_reduce(self, nbytes: float, group: int) -> float:
        if group <= 1:
            return 0.0
        return self.hw.latency_s + 2 * (group - 1) / group * nbytes / self._bw(group)

    def reduce_scatter(self, nbytes: float, group: int) -> float:
        """Also an all-gather of ``nbytes`` in total."""
        if group <= 1:
            return 0.0
        return self.hw.latency_s + (group - 1) / group * nbytes / self._bw(group)

    def _profile(self, cfg: ModelConfig) -> Profile | None:
        return self.profiles.get(shape_key(cfg))

    def layer_forward(self, cfg: ModelConfig, batch: int, seq: int, tp: int) -> float:
        """One layer's forward of ``batch`` sequences of ``seq`` tokens on one TP rank,
        including its two activation all-reduces."""
        tokens = batch * seq
        p = self._profile(cfg)
        if p is not None:
            compute = _interp(p.tokens, p.forward, tokens) / tp
        else:
            params = mem.layer_params(cfg).sharded
            flops = tokens * (2 * params + 2 * seq * cfg.hidden_size) / tp
            compute = max(flops / self.hw.flops, params * self.opt.param_bytes / tp / self.hw.mem_bw) \
                + self.hw.layer_overhead_s
        return compute + 2 * self.all_reduce(tokens * cfg.hidden_size * self.opt.param_bytes, tp)

    def layer_train(self, cfg: ModelConfig, batch: int, seq: int, tp: int) -> float:
        """Forward and backward of one layer (re-run forward under full recompute)."""
        tokens = batch * seq
        p = self._profile(cfg)
        if p is not None:
            compute = _interp(p.tokens, p.train, tokens) / tp
        else:
            compute = 3 * (self.layer_forward(cfg, batch, seq, tp)
                           - 2 * self.all_reduce(tokens * cfg.hidden_size * self.opt.param_bytes, tp))
        if self.opt.recompute == "full":
            compute += self.layer_forward(cfg, batch, seq, tp)
        return compute + 4 * self.all_reduce(tokens * cfg.hidden_size * self.opt.param_bytes, tp)

    def head(self, cfg: ModelConfig, tokens: int, tp: int, value: bool = False) -> float:
        """The LM head (or a value head: negligible) over ``tokens`` positions."""
        if value:
            return 0.0
        p = self._profile(cfg)
        if p is not None:
            return _interp(p.tokens, p.head, tokens) / tp
        vocab = cfg.head_vocab_size or cfg.padded_vocab_size
        return max(2 * tokens * cfg.hidden_size * vocab / tp / self.hw.flops,
                   vocab * cfg.hidden_size * self.opt.param_bytes / tp / self.hw.mem_bw)

    def layer_decode(self, cfg: ModelConfig, batch: int, context: int, n: int, tp: int) -> float:
        """One layer of a cached step feeding ``n`` tokens to each of ``batch`` samples."""
        p = self._profile(cfg)
        if p is not None:
            # measured at ``p.context``: weights dominate at small batches, so scale by tokens
            compute = _interp(p.batches, p.decode, batch * n) / tp
        else:
            params = mem.layer_params(cfg).sharded
            kv = 2 * cfg.num_query_groups * cfg.kv_channels * self.opt.param_bytes
            flops = batch * n * (2 * params + 4 * context * cfg.num_attention_heads * cfg.kv_channels) / tp
            nbytes = (params * self.opt.param_bytes + batch * context * kv) / tp
            compute = max(flops / self.hw.flops, nbytes / self.hw.mem_bw) + self.hw.decode_overhead_s
        return compute + 2 * self.all_reduce(batch * n * cfg.hidden_size * self.opt.param_bytes, tp)

    # ------------------------------------------------------------------ calls
    def call_time(self, call: Call, layout: Layout) -> dict:
        """``{"total": s, ...parts}`` for ``call`` under ``layout`` (memoised)."""
        key = (call, layout.tp, layout.pp, layout.dp)
        if key not in self._memo:
            fn = {"generate": self._generate, "infer": self._infer, "train": self._train}[call.kind]
            parts = fn(call, layout)
            parts["total"] = sum(parts.values())
            self._memo[key] = parts
        return self._memo[key]

    def _pipelined(self, call: Call, layout: Layout, per_layer, value: bool) -> tuple[float, float]:
        """(seconds of the micro-batches through the pipeline, of which bubble)."""
        cfg = self.models[call.model]
        mbs = self.opt.micro_batch_size
        per_rank = math.ceil(call.samples / layout.dp)
        micro = math.ceil(per_rank / mbs)
        layers = cfg.num_layers // layout.pp
        stage = layers * per_layer(cfg, mbs, call.seq_len, layout.tp) \
            + self.head(cfg, mbs * call.seq_len, layout.tp, value) / layout.pp
        if layout.pp > 1:
            stage += self.hw.latency_s + mbs * call.seq_len * cfg.hidden_size * self.opt.param_bytes \
                / self._bw(layout.pp * layout.tp)
        steps = call.passes * call.steps if call.kind == "train" else 1
        slots = call.passes * micro + steps * (layout.pp - 1)
        return slots * stage, steps * (layout.pp - 1) * stage

    def _infer(self, call: Call, layout: Layout) -> dict:
        total, bubble = self._pipelined(call, layout, self.layer_forward, call.model in ("critic", "reward"))
        return {"compute": total - bubble, "bubble": bubble}

    def _train(self, call: Call, layout: Layout) -> dict:
        cfg = self.models[call.model]
        total, bubble = self._pipelined(call, layout, self.layer_train, call.model == "critic")
        params = mem.stage_params(cfg, call.model, layout.pp, 0).per_gpu(layout.tp)
        steps = call.passes * call.steps
        dp = layout.dp
        grad_sync = steps * (self.reduce_scatter(params * 4, dp)  # fp32 gradients
                             + self.reduce_scatter(params * self.opt.param_bytes, dp))  # params back
        shard = params / dp if self.opt.distributed_optimizer else params
        optimizer = steps * shard * 16 * 2 / self.hw.mem_bw  # Adam: read and write 16 B/param
        if call.model == "draft":  # distillation reads the actor's logits: one actor forward
            actor = Call("teacher", "actor", "infer", call.samples, call.prompt_len, call.gen_len)
            total += self._infer(actor, layout)["compute"]
        return {"compute": total - bubble, "bubble": bubble, "grad_sync": grad_sync,
                "optimizer": optimizer}

    def _generate(self, call: Call, layout: Layout) -> dict:
        cfg = self.models[call.model]
        tp, per_rank = layout.tp, math.ceil(call.samples / layout.dp)
        prefill = cfg.num_layers * self.layer_forward(cfg, per_rank, call.prompt_len, tp) \
            + self.head(cfg, per_rank, tp)
        lengths = sorted(max(1, round(f * call.gen_len)) for f in self.opt.response_fractions)
        spec = self.opt.speculation
        decode, emitted = 0.0, 0
        # samples live while their length exceeds what was emitted: a quantile each
        share = per_rank / len(lengths)
        for i, length in enumerate(lengths):
            live = max(1, math.ceil(share * (len(lengths) - i)))
            tokens = length - emitted
            if tokens <= 0:
                continue
            context = call.prompt_len + (emitted + length) // 2
            decode += tokens * self._per_token(cfg, live, context, tp, spec)
            emitted = length
        return {"prefill": prefill, "decode": decode}

    def _per_token(self, cfg: ModelConfig, live: int, context: int, tp: int, spec) -> float:
        """Seconds per emitted token (per sample) at ``live`` samples: a plain step, or the
        best draft length under the selector's rule."""
        def step(model, n):
            return model.num_layers * self.layer_decode(model, live, context, n, tp) \
                + self.head(model, live * n, tp)

        best = step(cfg, 1)
        if spec is not None:
            a = spec.acceptance
            for n in range(1, spec.max_draft_tokens + 1):
                emitted = (1 - a ** (n + 1)) / (1 - a) if a < 1 else n + 1
                cost = n * step(spec.draft, 1) + step(cfg, n + 1)
                best = min(best, cost / emitted)
        return best

    # ------------------------------------------------------------------ reallocation
    def realloc(self, model: str, src: Layout, dst: Layout) -> tuple[float, int]:
        """(seconds, bytes received per GPU) to move ``model``'s weights from layout ``src``
        to ``dst`` (the same GPUs): each GPU receives its new shard, less what it already
        holds (the same TP shard of the same layers, when TP and PP agree)."""
        if (src.tp, src.pp) == (dst.tp, dst.pp):
            return 0.0, 0
        cfg = self.models[model]
        nbytes = mem.stage_params(cfg, model, dst.pp, 0).per_gpu(dst.tp) * self.opt.param_bytes
        tensors = 9 * cfg.num_layers // dst.pp + 3
        group = max(src.size, dst.size)
        return tensors * self.hw.latency_s + nbytes / self._bw(group), nbytes

    # ------------------------------------------------------------------ memory
    def call_memory(self, call: Call, layout: Layout, resident: dict[str, Layout]) -> int:
        """Peak bytes on the worst GPU while ``call`` runs: its own working set plus the
        weights that stay on the GPUs between calls (``resident``: model -> layout of the
        actor's and critic's training copies; the reference and reward wait on the host)."""
        o = mem.MemoryOptions(param_bytes=self.opt.param_bytes, recompute=self.opt.recompute,
                              distributed_optimizer=self.opt.distributed_optimizer)
        cfg = self.models[call.model]
        w = mem.Workload(rollout_batch=call.samples, max_prompt_length=call.prompt_len,
                         max_new_tokens=call.gen_len, micro_batch_size=self.opt.micro_batch_size)
        worst = 0
        for stage in range(layout.pp):
            total = mem.weight_bytes(cfg, call.model, layout, stage, o)
            for other, lay in resident.items():
                if other != call.model or call.kind == "generate":
                    total += mem.weight_bytes(self.models[other], other, lay, min(stage, lay.pp - 1), o)
            per_rank = math.ceil(call.samples / layout.dp)
            if call.kind == "generate":
                total += mem.kv_cache_bytes(cfg, per_rank, call.seq_len, layout.tp, o.param_bytes)
                spec = self.opt.speculation
                if spec is not None:
                    total += mem.weight_bytes(spec.draft, "draft", layout, 0, o)
                    total += mem.kv_cache_bytes(spec.draft, per_rank, call.seq_len, layout.tp, o.param_bytes)
            elif call.kind == "infer":
                total += mem.forward_working_bytes(cfg, call.seq_len, self.opt.micro_batch_size, layout.tp, o.param_bytes)
                if call.model in mem.LM_ROLES:
                    total += mem.logits_bytes(cfg, call.seq_len * self.opt.micro_batch_size, layout.tp, o)
            else:
                params = mem.stage_params(cfg, call.model, layout.pp, stage).per_gpu(layout.tp)
                total += params * (4 if o.fp32_grads else 2)
                total += params * 12 // (layout.dp if o.distributed_optimizer else 1)
                try:
                    total += mem.training_activation_bytes(cfg, call.model, w, layout, stage, o)
                except ValueError:
                    total += mem.layer_activation_bytes(cfg, call.seq_len, self.opt.micro_batch_size, layout.tp) \
                        * cfg.num_layers // layout.pp
            worst = max(worst, total)
        return worst
