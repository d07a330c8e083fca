"""Time and memory of the RLHF dataflow graph's calls under a plan (ReaLHF's estimator,
with communication counted). Pure arithmetic, no torch.

Entry point: :class:`Estimator` (``call_time``, ``call_memory``, ``realloc``).
"""
# Compute comes from per-layer costs: a roofline Hardware or a measured, interpolated Profile
# (plan.hardware). Communication is priced per parallel dimension (the comment above
# Estimator). Generation is priced round by round over the response lengths' distribution
# and, with a draft, at the draft length that minimises time per emitted token. Memory per
# GPU comes from plan.memory.

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_rlhf.config import ModelConfig
from megatron_rlhf.parallel.layout import Layout
from megatron_rlhf.plan import memory as mem
from megatron_rlhf.plan.graph import Call
from megatron_rlhf.plan.hardware import HARDWARE, Hardware, Profile, interp, merge_meta, shape_key

__all__ = ["HARDWARE", "Estimator", "Hardware", "Options", "Profile", "Speculation", "merge_meta",
           "shape_key"]


def _stages(lay: Layout):
    """(rank -> stage in ``lay`` or None, the ranks where a stage's run of GPUs starts or ends)."""
    block, first = lay.tp * lay.dp, lay.first_rank
    if first is None:
        where = {r: i // block for i, r in enumerate(lay.ranks)}
        return where.get, sorted({x for r in lay.ranks for x in (r, r + 1)})
    end = first + lay.size

    def stage_of(rank):
        return (rank - first) // block if first <= rank < end else None
    return stage_of, [first + k * block for k in range(lay.pp + 1)]


def _holds_its_shard(src: Layout, dst: Layout) -> bool:
    """Every GPU of ``dst`` is in ``src`` at the same TP rank and pipeline stage."""
    where = {r: (i % src.tp, i // (src.tp * src.dp)) for i, r in enumerate(src.ranks)}
    return all(where.get(r) == (i % dst.tp, i // (dst.tp * dst.dp)) for i, r in enumerate(dst.ranks))


def _tp_share(seconds: float, overhead: float, tp: int) -> float:
    """One TP rank's share of ``seconds`` measured at TP=1."""
    # Every rank pays the fixed per-layer ``overhead`` (launches, Python:
    # Hardware.layer_overhead_s); the rest splits ``tp`` ways, as in the roofline path,
    # where only the FLOPs and bytes divide.
    fixed = min(max(overhead, 0.0), seconds)
    return fixed + (seconds - fixed) / tp


@dataclass
class Speculation:
    """A draft for generation and the acceptance it reaches."""

    draft: ModelConfig
    acceptance: float = 0.6  # Probability that the actor accepts one draft token (per position).
    max_draft_tokens: int = 4


@dataclass
class Options:
    """How calls run (beyond their layouts)."""

    param_bytes: int = 2
    micro_batch_size: int = 1
    recompute: str = "none"
    distributed_optimizer: bool = True
    # Each sample's response length as a fraction of ``gen_len`` (quantiles of the
    # distribution; ``(1.0,)``: every sample runs to the maximum, no tail).
    response_fractions: tuple = (1.0,)
    speculation: Speculation | None = None


# What each parallel dimension costs:
# - TP: two all-reduces of the activations per layer and forward (two more in backward), each
#   2 (g-1) ring steps that pay a latency apiece where the machine's fit has one
#   (Hardware.ring_latency_s); where a profile measured TP-sharded layers and heads
#   (Profile.tp_tables), those tables, their all-reduces included. Without a TP table, a
#   rank's share of a forward or decode step is the fixed per-layer overhead, whole, and the
#   rest / TP (_tp_share).
# - PP: 1F1B with PP - 1 bubble slots per optimizer step (forward-only calls pipeline their
#   micro-batches too), plus the send/recv of one micro-batch's activations per slot; no
#   bubble where the ranks of a node oversubscribe its cores (Hardware.oversubscribed: a
#   waiting rank hands its core to a busy one); a micro-batch holds at most the samples of
#   one data-parallel rank.
# - DP: the distributed optimizer's gradient reduce-scatter and parameter all-gather per
#   optimizer step (at their own fitted bandwidths where measured), or an all-reduce without
#   it; a tied embedding's gradient all-reduced between the first and last stage; the
#   optimizer step (memory-bound: Hardware.optimizer_bytes_per_param) and the zeroing of the
#   gradient buffer.
# - An LM's training pays its head's forward and backward with the loss over the response's
#   positions (Profile.head_train, or three forwards' worth) and the head's matmul forward
#   and backward over the prompt's; a critic's value head is negligible.
# - Reallocation: a model's weights moved between two layouts (Estimator.realloc).
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
        bw, hw = self._bw(group), self.hw
        if hw.ring_latency_s > 0:
            return 2 * (group - 1) * (hw.ring_latency_s + nbytes / group / bw)
        return hw.latency_s + 2 * (group - 1) / group * nbytes / bw

    def reduce_scatter(self, nbytes: float, group: int, op: str = "reduce_scatter") -> float:
        """Seconds of ``op`` on ``nbytes`` in (all_gather: out) over ``group`` ranks."""
        # Inside a node at the fitted bandwidth of that collective where the hardware has one.
        if group <= 1:
            return 0.0
        bw, latency = getattr(self.hw, f"{op}_bw"), getattr(self.hw, f"{op}_latency_s")
        if bw <= 0 or group > self.hw.gpus_per_node:
            bw, latency = self._bw(group), self.hw.latency_s
        return latency + (group - 1) / group * nbytes / bw

    def all_gather(self, nbytes: float, group: int) -> float:
        return self.reduce_scatter(nbytes, group, "all_gather")

    def _profile(self, cfg: ModelConfig) -> Profile | None:
        return self.profiles.get(shape_key(cfg))

    def layer_forward(self, cfg: ModelConfig, batch: int, seq: int, tp: int, ep: int = 1) -> float:
        """One layer's forward of ``batch`` x ``seq`` tokens on one TP rank, all-reduces (and an
        MoE's token exchange over TP x EP) included."""
        tokens = batch * seq
        p = self._profile(cfg)
        measured = p.tp_table(tp, "forward", tokens) if p is not None else None
        exchange = self.expert_exchange(cfg, tokens, tp, ep)
        if measured is not None:
            return measured + exchange
        if p is not None:
            compute = _tp_share(interp(p.tokens, p.forward, tokens), self.hw.layer_overhead_s, tp)
        else:
            # a token multiplies with the router and its top-k experts (mem.active_layer_params);
            # the GPU reads the weights it holds
            flops = tokens * (2 * mem.active_layer_params(cfg) + 2 * seq * cfg.hidden_size) / tp
            held = mem.layer_params(cfg)
            nbytes = (held.sharded / tp + held.experts_per_gpu(tp, ep)) * self.opt.param_bytes
            compute = max(flops / self.hw.flops, nbytes / self.hw.mem_bw) + self.hw.layer_overhead_s
        return compute + exchange + 2 * self.all_reduce(tokens * cfg.hidden_size * self.opt.param_bytes, tp)

    def expert_exchange(self, cfg: ModelConfig, tokens: int, tp: int, ep: int) -> float:
        """An MoE layer's token exchange over its TP x EP ranks: the allgather dispatcher gathers
        every rank's tokens and reduce-scatters the experts' outputs back."""
        group = tp * ep
        if not cfg.num_experts or group == 1:
            return 0.0
        gathered = tokens * group * cfg.hidden_size * self.opt.param_bytes
        return self.all_gather(gathered, group) + self.reduce_scatter(gathered, group)

    def layer_train(self, cfg: ModelConfig, batch: int, seq: int, tp: int, ep: int = 1) -> float:
        """Forward and backward of one layer (re-run forward under full recompute)."""
        tokens = batch * seq
        p = self._profile(cfg)
        recompute = self.layer_forward(cfg, batch, seq, tp, ep) if self.opt.recompute == "full" else 0.0
        exchange = 2 * self.expert_exchange(cfg, tokens, tp, ep)  # forward and backward
        measured = p.tp_table(tp, "train", tokens) if p is not None else None
        if measured is not None:
            return measured + recompute + exchange
        if p is not None:
            compute = interp(p.tokens, p.train, tokens) / tp
        else:
            compute = 3 * (self.layer_forward(cfg, batch, seq, tp, ep) - self.expert_exchange(cfg, tokens, tp, ep)
                           - 2 * self.all_reduce(tokens * cfg.hidden_size * self.opt.param_bytes, tp))
        return compute + recompute + exchange \
            + 4 * self.all_reduce(tokens * cfg.hidden_size * self.opt.param_bytes, tp)

    def head(self, cfg: ModelConfig, tokens: int, tp: int, value: bool = False, train: bool = False) -> float:
        """The LM head over ``tokens`` positions (``train``: forward and backward with the loss)."""
        # A value head is negligible; the training loss adds log-probs and entropy.
        if value:
            return 0.0
        p = self._profile(cfg)
        name = "head_train" if train else "head"
        measured = p.tp_table(tp, name, tokens) if p is not None else None
        if measured is not None:
            return measured
        if p is not None and (not train or p.head_train):
            return interp(p.tokens, p.head_train if train else p.head, tokens) / tp
        if train:  # the backward's two matmuls: twice the forward
            return 3 * self.head(cfg, tokens, tp)
        vocab = cfg.head_vocab_size or cfg.padded_vocab_size
        return max(2 * tokens * cfg.hidden_size * vocab / tp / self.hw.flops,
                   vocab * cfg.hidden_size * self.opt.param_bytes / tp / self.hw.mem_bw)

    def layer_decode(self, cfg: ModelConfig, batch: int, context: int, n: int, tp: int) -> float:
        """One layer of a cached step feeding ``n`` tokens to each of ``batch`` samples."""
        p = self._profile(cfg)
        if p is not None:
            # measured at ``p.context``: weights dominate at small batches, so scale by tokens
            compute = _tp_share(interp(p.batches, p.decode, batch * n), self.hw.decode_overhead_s, tp)
        else:
            held = mem.layer_params(cfg)
            kv = 2 * cfg.num_query_groups * cfg.kv_channels * self.opt.param_bytes
            flops = batch * n * (2 * mem.active_layer_params(cfg)
                                 + 4 * context * cfg.num_attention_heads * cfg.kv_channels) / tp
            # the experts some token of the step is routed to are read (at most all of them)
            hit = min(1.0, batch * n * cfg.moe_router_topk / cfg.num_experts) if cfg.num_experts else 1.0
            nbytes = ((held.sharded + hit * held.experts) * self.opt.param_bytes + batch * context * kv) / tp
            compute = max(flops / self.hw.flops, nbytes / self.hw.mem_bw) + self.hw.decode_overhead_s
        return compute + 2 * self.all_reduce(batch * n * cfg.hidden_size * self.opt.param_bytes, tp)

    # ------------------------------------------------------------------ calls
    def call_time(self, call: Call, layout: Layout) -> dict:
        """``{"total": s, ...parts}`` for ``call`` under ``layout`` (memoised)."""
        key = (call, layout.tp, layout.pp, layout.dp, layout.ep)
        if key not in self._memo:
            fn = {"generate": self._generate, "infer": self._infer, "train": self._train}[call.kind]
            parts = fn(call, layout)
            parts["total"] = sum(parts.values())
            self._memo[key] = parts
        return self._memo[key]

    def micro_batches(self, call: Call, layout: Layout) -> tuple[int, int]:
        """(micro-batch size, micro-batches per pass) on one data-parallel rank."""
        # A micro-batch holds at most the samples the rank has.
        per_rank = math.ceil(call.samples / layout.dp)
        mbs = min(self.opt.micro_batch_size, per_rank)
        return mbs, math.ceil(per_rank / mbs)

    def _pipelined(self, call: Call, layout: Layout, per_layer, value: bool) -> tuple[float, float]:
        """(seconds of the micro-batches through the pipeline, of which bubble)."""
        cfg = self.models[call.model]
        mbs, micro = self.micro_batches(call, layout)
        layers = cfg.num_layers // layout.pp
        train = call.kind == "train"
        if train:  # the loss (log-probs, entropy) reads the response's positions only; the
            # head's matmul runs forward and backward over the prompt's too
            head = self.head(cfg, mbs * call.gen_len, layout.tp, value, train=True) \
                + 3 * self.head(cfg, mbs * call.prompt_len, layout.tp, value)
        else:
            head = self.head(cfg, mbs * call.seq_len, layout.tp, value)
        stage = layers * per_layer(cfg, mbs, call.seq_len, layout.tp, layout.ep) + head / layout.pp
        if layout.pp > 1:
            stage += self.hw.latency_s + mbs * call.seq_len * cfg.hidden_size * self.opt.param_bytes \
                / self._bw(layout.pp * layout.tp)
        steps = call.passes * call.steps if train else 1
        bubble = 0.0 if self.hw.oversubscribed else steps * (layout.pp - 1) * stage
        return call.passes * micro * stage + bubble, bubble

    def _infer(self, call: Call, layout: Layout) -> dict:
        total, bubble = self._pipelined(call, layout, self.layer_forward, call.model in ("critic", "reward"))
        return {"compute": total - bubble, "bubble": bubble}

    def _train(self, call: Call, layout: Layout) -> dict:
        cfg = self.models[call.model]
        total, bubble = self._pipelined(call, layout, self.layer_train, call.model == "critic")
        held = mem.stage_params(cfg, call.model, layout.pp, 0)
        steps = call.passes * call.steps
        sync, shard = 0.0, 0.0
        # dense gradients reduce over DP, the experts' over the expert-DP ranks (DP / EP)
        for params, dp in ((held.dense_per_gpu(layout.tp), layout.dp),
                           (held.experts_per_gpu(layout.tp, layout.ep), layout.dp // layout.ep)):
            if not params:  # (a dense model has no expert collectives)
                continue
            if self.opt.distributed_optimizer:
                sync += self.reduce_scatter(params * 4, dp) + self.all_gather(params * self.opt.param_bytes, dp)
            else:
                sync += self.all_reduce(params * 4, dp)  # fp32 gradients
            shard += params / dp if self.opt.distributed_optimizer else params
        params = held.per_gpu(layout.tp, layout.ep)
        if layout.pp > 1 and cfg.tie_embeddings and call.model in mem.LM_ROLES:
            sync += self.all_reduce(cfg.padded_vocab_size * cfg.hidden_size / layout.tp * 4, 2)
        # the step's traffic over its shard, and zeroing the fp32 gradient buffer
        optimizer = steps * (shard * self.hw.optimizer_bytes_per_param + params * 4) / self.hw.mem_bw
        if call.model == "draft":  # distillation reads the actor's logits: one actor forward
            actor = Call("teacher", "actor", "infer", call.samples, call.prompt_len, call.gen_len)
            total += self._infer(actor, layout)["compute"]
        return {"compute": total - bubble, "bubble": bubble, "grad_sync": steps * sync,
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
        """Seconds per emitted token (per sample) at ``live`` samples."""
        # A plain step, or the best draft length under the selector's rule.
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
        """(seconds, bytes received per GPU) to move ``model``'s weights from ``src`` to ``dst``."""
        # Each GPU of ``dst`` receives its new shard, less what it already holds (the same TP
        # shard of the same layers: TP and PP agree and ``src`` puts that GPU at the same TP
        # rank and stage). A GPU of ``dst`` outside ``src`` (training on half the GPUs,
        # generating on all) receives its whole shard.
        key = ("realloc", model, src, dst)
        if key not in self._memo:
            self._memo[key] = self._realloc(model, src, dst)
        return self._memo[key]

    def _realloc(self, model: str, src: Layout, dst: Layout) -> tuple[float, int]:
        if (src.tp, src.pp, src.ep) == (dst.tp, dst.pp, dst.ep) and _holds_its_shard(src, dst):
            return 0.0, 0
        cfg = self.models[model]
        nbytes = mem.stage_params(cfg, model, dst.pp, 0).per_gpu(dst.tp, dst.ep) * self.opt.param_bytes
        tensors = 9 * cfg.num_layers // dst.pp + 3
        group = max(src.size, dst.size)
        return tensors * self.hw.latency_s + nbytes / self._bw(group), nbytes

    # ------------------------------------------------------------------ memory
    def call_memory(self, call: Call, layout: Layout, resident: dict[str, Layout]) -> int:
        """Peak bytes on the worst GPU while ``call`` runs, ``resident`` (model -> layout) included."""
        # Its own working set plus the weights that stay on the GPUs between calls: the
        # actor's and critic's training copies, counted beside a second copy of the same model
        # in another layout (the reference and reward wait on the host). A resident model
        # counts on the GPUs its layout covers, with the stage it holds there: one over other
        # GPUs only (the critic training on the other half) adds nothing.
        held = {other: lay for other, lay in resident.items()
                if other != call.model or call.kind == "generate" or lay != layout}
        return max(own + more for own, more in zip(self._working_bytes(call, layout),
                                                   self._resident_bytes(layout, held)))

    def _options(self) -> mem.MemoryOptions:
        return mem.MemoryOptions(param_bytes=self.opt.param_bytes, recompute=self.opt.recompute,
                                 distributed_optimizer=self.opt.distributed_optimizer)

    def _working_bytes(self, call: Call, layout: Layout) -> list[int]:
        """Per pipeline stage: the bytes ``call`` itself keeps on one GPU (memoised)."""
        key = ("working", call, layout.tp, layout.pp, layout.dp, layout.ep)
        if key in self._memo:
            return self._memo[key]
        o = self._options()
        cfg = self.models[call.model]
        w = mem.Workload(rollout_batch=call.samples, max_prompt_length=call.prompt_len,
                         max_new_tokens=call.gen_len, micro_batch_size=self.opt.micro_batch_size)
        out = []
        for stage in range(layout.pp):
            total = mem.weight_bytes(cfg, call.model, layout, stage, o)
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
                    total += mem.logits_bytes(cfg, call.seq_len * self.opt.micro_batch_size, layout.tp, o,
                                              call.model)
            else:
                total += sum(mem.trainee_state_bytes(cfg, call.model, layout, o, stage))
                try:
                    total += mem.training_activation_bytes(cfg, call.model, w, layout, stage, o)
                except ValueError:
                    total += mem.layer_activation_bytes(cfg, call.seq_len, self.opt.micro_batch_size, layout.tp) \
                        * cfg.num_layers // layout.pp
            out.append(total)
        self._memo[key] = out
        return out

    def _resident_bytes(self, layout: Layout, held: dict[str, Layout]) -> list[int]:
        """Per pipeline stage of ``layout``: the most bytes of ``held`` weights one GPU keeps."""
        # Each model counts on the GPUs of its layout, at the stage it has there.
        out = [0] * layout.pp
        if not held:
            return out
        key = ("resident", layout, tuple(sorted(held.items())))
        if key in self._memo:
            return self._memo[key]
        o = self._options()
        mine, cuts = _stages(layout)
        theirs = []
        for other, lay in held.items():
            stage_of, starts = _stages(lay)
            theirs.append((other, lay, stage_of))
            cuts = cuts + starts
        # the GPUs fall into runs on which every layout keeps one stage: the first GPU of each
        for rank in sorted(set(cuts)):
            stage = mine(rank)
            if stage is None:
                continue
            total = 0
            for other, lay, stage_of in theirs:
                s = stage_of(rank)
                if s is not None:
                    total += mem.weight_bytes(self.models[other], other, lay, s, o)
            out[stage] = max(out[stage], total)
        self._memo[key] = out
        return out
