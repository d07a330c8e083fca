"""Peak GPU memory per RLHF stage under each stage's layout: pure arithmetic, no torch.

The model of memory mirrors the trainer (:mod:`megatron_rlhf.rlhf.trainer`): every stage
runs on every GPU; what a stage does not use waits in host memory.

- **generation** (gen layout TPxDP, PP=1): the actor's weights in the gen layout (and the
  draft's), the actor's training copy unless it is released while generation runs
  (``release_train_copy``), the critic's weights in the train layout, the KV cache of the
  rollout's samples on one gen-DP rank at full length (the draft's too), and the larger of
  one prefill chunk's working set and one decode step's logits. Optimizer states are on
  the host; reference and reward model too.
- **inference** (experience; infer layout, default the train layout): actor, reference,
  critic and reward weights, and one forward micro-batch with nothing kept for backward
  (a layer's working set) plus the LM head's logits.
- **training** (train layout TPxPPxDP): actor and critic weights, gradient buffers, Adam
  states (sharded over DP by the distributed optimizer), and the activations that 1F1B
  pipelining keeps in flight (Korthikanti et al. 2022, adapted to SwiGLU), plus the LM
  head's logits on the last pipeline stage. Actor and critic train one after the other,
  so only the larger of their activations counts.

Gradients are freed between stages. Each stage reports its worst pipeline stage, per GPU.
Memory is in bytes; ``GB`` is 10**9 bytes (a "80 GB" GPU is taken as 80e9 bytes, which
under-counts an A100/H100's 80 GiB: conservative).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rlhf.config import ROLES, ModelConfig
from megatron_rlhf.parallel.layout import Layout

GB = 10**9
"""Bytes in the GB this module reports (decimal, as GPU vendors and the sanity numbers use)."""

STAGES = ("generation", "inference", "training")
RECOMPUTE = ("none", "selective", "full")
LM_ROLES = ("actor", "reference", "draft")
"""Roles with an LM head (logits over the vocabulary)."""
VALUE_ROLES = ("critic", "reward")
"""Roles whose LM head is replaced by a scalar head ``hidden -> 1``."""
STAGE_ROLES = {
    "generation": ("actor", "draft"),
    "inference": ("actor", "reference", "critic", "reward"),
    "training": ("actor", "critic"),
}
"""Models whose shapes a stage's layout must fit (the critic also sits, in its train layout,
on the GPUs during generation)."""

DEFAULT_RESERVE_FRACTION = 0.10
"""Share of each GPU kept free for the CUDA context (~0.5-1 GB), NCCL buffers and the
caching allocator's fragmentation, unless ``MemoryOptions.reserve_gb`` is given."""
ADAM_BYTES_PER_PARAM = 12
"""fp32 master weight (4) + Adam first and second moments (4 + 4)."""
LOGIT_BYTES_PER_ENTRY = 2 + 4 + 4
"""Whole-sequence logits: the head's bf16 output, its fp32 copy, and the fp32 log-softmax
(the softmax saved for backward, or the gradient, in training)."""
SAMPLING_BYTES_PER_ENTRY = 4 + 4
"""A decode step's logits in fp32 and the sampling probabilities derived from them."""
PREFILL_CHUNK_TOKENS = 8192
"""Real tokens per prefill run on a GPU (``generation.incremental.PREFILL_CHUNK_TOKENS["cuda"]``,
checked equal by a test)."""


@dataclass
class Cluster:
    """The GPUs every stage runs on."""

    nodes: int = 1
    """Number of nodes."""
    gpus_per_node: int = 8
    """GPUs per node (a TP group must stay inside a node)."""
    gpu_memory_gb: float = 80.0
    """Memory of one GPU in GB (10**9 bytes)."""

    def __post_init__(self) -> None:
        _positive_int("nodes", self.nodes)
        _positive_int("gpus_per_node", self.gpus_per_node)
        if not self.gpu_memory_gb > 0:
            raise ValueError(f"gpu_memory_gb must be positive, got {self.gpu_memory_gb}")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass
class Workload:
    """What one RLHF iteration processes."""

    rollout_batch: int = 512
    """Samples generated per iteration over all GPUs (prompts x responses per prompt)."""
    max_prompt_length: int = 1024
    """Longest prompt in tokens."""
    max_new_tokens: int = 1024
    """Longest response in tokens; sequences are taken at prompt + response length."""
    micro_batch_size: int = 1
    """Sequences per forward (inference) and per forward/backward (training)."""
    num_mini_batches: int = 1
    """Optimizer steps per PPO epoch; micro-batches per step = samples / (DP x mbs x this)."""
    num_draft_tokens: int = 4
    """Tokens a draft proposes per verification (with a draft: the actor scores this + 1
    tokens per sample per step)."""

    def __post_init__(self) -> None:
        for name in ("rollout_batch", "max_prompt_length", "max_new_tokens",
                     "micro_batch_size", "num_mini_batches"):
            _positive_int(name, getattr(self, name))
        if not isinstance(self.num_draft_tokens, int) or self.num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be an integer >= 0, got {self.num_draft_tokens!r}")

    @property
    def seq_length(self) -> int:
        return self.max_prompt_length + self.max_new_tokens

    def micro_batches(self, dp: int) -> int:
        """Micro-batches per optimizer step on one DP rank; ValueError naming the fix."""
        per_step = dp * self.micro_batch_size * self.num_mini_batches
        if self.rollout_batch % per_step:
            raise ValueError(
                f"rollout batch {self.rollout_batch} samples does not split into micro-batches: "
                f"it must be a multiple of DP {dp} x micro-batch size {self.micro_batch_size} x "
                f"mini-batches {self.num_mini_batches} = {per_step}; change the DP size, "
                "--micro-batch-size, --num-mini-batches or --rollout-batch"
            )
        return self.rollout_batch // per_step


@dataclass
class MemoryOptions:
    """How the trainer stores things; defaults are megatron-core's usual choices."""

    param_bytes: int = 2
    """Bytes per weight, KV-cache entry and activation element (2: bf16, 4: fp32)."""
    fp32_grads: bool = True
    """Gradient buffers in fp32 (megatron DDP's grad buffer, 4 B/param); False: bf16 (2 B)."""
    distributed_optimizer: bool = True
    """Shard fp32 masters and Adam moments (12 B/param) over DP; False: every replica holds all."""
    recompute: str = "none"
    """Activation recompute in training: none, selective (attention core) or full (each layer)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: activations outside attention/MLP split over TP too."""
    release_train_copy: bool = True
    """Release (or offload) the actor's training-layout weights while generation runs (ReaLHF)."""
    vocab_parallel_logits: bool = True
    """The loss reads each TP rank's vocabulary shard of the logits (megatron's vocab-parallel
    cross entropy); False: logits gathered over TP, as ``models.forward.lm_logits`` does today."""
    reserve_gb: float | None = None
    """GB per GPU kept free; None: ``DEFAULT_RESERVE_FRACTION`` of the GPU's memory."""
    park_on_host: bool = True
    """Between training stages the trainees' gradient buffers and optimizer states wait in
    host memory (``rlhf.offload.park_trainee``, a GPU run); False: they stay where they are
    and count in generation and inference too (a CPU run, whose host is its device)."""

    def __post_init__(self) -> None:
        if self.param_bytes not in (2, 4):
            raise ValueError(f"param_bytes must be 2 (bf16) or 4 (fp32), got {self.param_bytes!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        if self.reserve_gb is not None and self.reserve_gb < 0:
            raise ValueError(f"reserve_gb must be >= 0, got {self.reserve_gb}")

    def reserve_bytes(self, cluster: Cluster) -> int:
        gb = self.reserve_gb if self.reserve_gb is not None else DEFAULT_RESERVE_FRACTION * cluster.gpu_memory_gb
        return int(gb * GB)


@dataclass
class StageLayouts:
    """A layout per stage; all stages run on every GPU of the cluster."""

    train: Layout
    """Training of actor and critic (TPxPPxDP); the critic also keeps it during generation."""
    gen: Layout | None = None
    """Generation (TPxDP, PP=1); None: the train TP with DP taking the rest (today's behaviour)."""
    infer: Layout | None = None
    """Experience (reference/critic/reward/actor forwards); None: the train layout."""

    def resolved(self) -> dict[str, Layout]:
        """``{stage: layout}`` with the defaults filled in."""
        gen = self.gen
        if gen is None:
            gen = Layout(tp=self.train.tp, pp=1, dp=max(1, self.train.size // self.train.tp))
        return {"generation": gen, "inference": self.infer or self.train, "training": self.train}


@dataclass(frozen=True)
class StageParams:
    """Parameters of one pipeline stage of one model, before tensor parallelism."""

    sharded: int
    """Split over TP: attention and MLP matrices, the vocab-parallel embedding and LM head."""
    replicated: int
    """Held whole by every TP rank: RMSNorm weights, a value head, a feature draft's fusion."""

    @property
    def total(self) -> int:
        return self.sharded + self.replicated

    def per_gpu(self, tp: int) -> int:
        return self.sharded // tp + self.replicated


@dataclass
class StageEstimate:
    """Peak memory of one RLHF stage on one GPU (the worst pipeline stage)."""

    stage: str
    """generation, inference or training."""
    layout: Layout
    """The stage's layout."""
    pipeline_stage: int
    """The pipeline stage reported: the one with the largest total (0 when PP is 1)."""
    parts: dict[str, int]
    """What is resident, in bytes per GPU, e.g. ``{"actor_weights": ..., "kv_cache": ...}``."""
    capacity: int
    """Usable bytes per GPU: the GPU's memory less the reserve."""

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def to_dict(self) -> dict:
        return {
            "stage": self.stage,
            "layout": layout_text(self.layout, pipeline=self.stage != "generation"),
            "pipeline_stage": self.pipeline_stage,
            "parts_gb": {k: round(v / GB, 3) for k, v in self.parts.items()},
            "total_gb": round(self.total / GB, 3),
            "usable_gb": round(self.capacity / GB, 3),
            "fits": self.fits,
        }


@dataclass
class Estimate:
    """Peak memory per GPU of every stage of one iteration."""

    stages: list[StageEstimate]
    """generation, inference, training, in that order."""
    cluster: Cluster
    """The GPUs."""
    reserve: int
    """Bytes per GPU kept free (CUDA context, NCCL, fragmentation)."""
    options: MemoryOptions
    """The options the estimate was made with (:func:`fits_or_raise` advises from them)."""

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.stages)

    @property
    def peak(self) -> int:
        """The largest stage total: the GPU memory one iteration needs."""
        return max(s.total for s in self.stages)

    def stage(self, name: str) -> StageEstimate:
        for s in self.stages:
            if s.stage == name:
                return s
        raise KeyError(f"no stage {name!r}; stages: {[s.stage for s in self.stages]}")

    def to_dicts(self) -> list[dict]:
        """One dict per stage (``--json`` prints each as a line)."""
        return [s.to_dict() | {"gpu_memory_gb": self.cluster.gpu_memory_gb} for s in self.stages]

    def table(self) -> str:
        """A human table: each stage's parts in GB per GPU, its total and whether it fits."""
        c = self.cluster
        lines = [f"GB per GPU (10^9 bytes); {c.nodes} nodes x {c.gpus_per_node} GPUs of "
                 f"{c.gpu_memory_gb:g} GB, {self.reserve / GB:.1f} GB reserved, "
                 f"{self.stages[0].capacity / GB:.1f} GB usable"]
        for s in self.stages:
            where = f", pipeline stage {s.pipeline_stage}" if s.layout.pp > 1 else ""
            lines.append(f"{s.stage:<11} layout {layout_text(s.layout, s.stage != 'generation')}"
                         f" (TP {s.layout.tp}, PP {s.layout.pp}, DP {s.layout.dp}{where})")
            for name, b in s.parts.items():
                lines.append(f"  {name:<28}{b / GB:9.2f}")
            lines.append(f"  {'total':<28}{s.total / GB:9.2f}   fits: {'yes' if s.fits else 'NO'}")
        return "\n".join(lines)


# ---------------------------------------------------------------- parameters

def layer_params(cfg: ModelConfig) -> StageParams:
    """One transformer layer: q, k, v, o (GQA), SwiGLU's three matrices, two RMSNorms."""
    h, d = cfg.hidden_size, cfg.kv_channels
    attention = 2 * h * cfg.num_attention_heads * d + 2 * h * cfg.num_query_groups * d
    mlp = 3 * h * cfg.ffn_hidden_size
    return StageParams(sharded=attention + mlp, replicated=2 * h)


def stage_params(cfg: ModelConfig, role: str, pp: int = 1, stage: int = 0) -> StageParams:
    """Parameters on pipeline stage ``stage`` of ``pp``: its layers, the embedding on the
    first stage, final norm and head on the last. A tied LM head on a last stage that is not
    also the first holds its own copy of the embedding (as megatron does)."""
    check_pipeline(cfg, pp, role)
    if not 0 <= stage < pp:
        raise ValueError(f"pipeline stage {stage} outside 0..{pp - 1}")
    h, n = cfg.hidden_size, cfg.num_layers // pp
    layer = layer_params(cfg)
    sharded, replicated = n * layer.sharded, n * layer.replicated
    first, last = stage == 0, stage == pp - 1
    if first:
        sharded += cfg.padded_vocab_size * h
        if role == "draft" and cfg.feature_draft:
            replicated += 2 * h * h  # fc([embed(x_t), h_{t-1}]), replicated over TP
    if last:
        replicated += h  # final norm
        if role in VALUE_ROLES:
            replicated += h  # value head hidden -> 1, replicated over TP
        elif not cfg.tie_embeddings:
            sharded += (cfg.head_vocab_size or cfg.padded_vocab_size) * h
        elif not first:
            sharded += cfg.padded_vocab_size * h
    return StageParams(sharded=sharded, replicated=replicated)


def count_parameters(cfg: ModelConfig, role: str = "actor") -> int:
    """Parameters of the whole model (a tied embedding counted once)."""
    return stage_params(cfg, role).total


def weight_bytes(cfg: ModelConfig, role: str, layout: Layout, stage: int,
                 options: MemoryOptions) -> int:
    """Weights on one GPU of pipeline stage ``stage``."""
    return stage_params(cfg, role, layout.pp, stage).per_gpu(layout.tp) * options.param_bytes


# ---------------------------------------------------------------- activations

def layer_activation_bytes(cfg: ModelConfig, seq: int, batch: int, tp: int = 1,
                           sequence_parallel: bool = False, recompute: str = "none",
                           param_bytes: int = 2) -> int:
    """Bytes one layer keeps for backward per micro-batch (Korthikanti et al. 2022, Sec. 4).

    The paper, 16-bit, GeLU MLP of width 4h: ``s*b*h*(10 + 24/t + 5*a*s/(h*t))`` with TP
    ``t``, ``s*b*h*(34 + 5*a*s/h)/t`` with sequence parallelism. Its 24/t is attention's
    8 (Q, K, V and the output projection's input) plus the MLP's 16 (the 4h-wide GeLU input
    and fc2 input, 2 bytes each, ``4*ffn/h``). SwiGLU keeps its fc1 output, 2*ffn wide
    (gate and up), and the product ``silu(gate)*up``, ffn wide, so the MLP term is
    ``6*ffn/h`` (16.1 for Llama-2-7B's 11008/4096, close to the paper's 16). GQA changes
    nothing: the unfused attention stores K and V expanded to all query heads. The
    replicated 10 (two norm inputs, the QKV and fc1 inputs, two dropout masks) is kept
    although Llama trains without dropout: conservative. Selective recompute drops the
    ``5*a*s/h`` attention-core term; full recompute keeps only the layer input ``2*s*b*h``
    (/t with sequence parallelism); the one layer being recomputed is added once by the
    caller (:func:`training_activation_bytes`).
    """
    s, b, h, a, t = seq, batch, cfg.hidden_size, cfg.num_attention_heads, tp
    scale = param_bytes / 2  # the formulas count 2-byte elements
    if recompute == "full":
        return int(scale * 2 * s * b * h / (t if sequence_parallel else 1))
    sharded = 8 + 6 * cfg.ffn_hidden_size / h
    core = 5 * a * s / h if recompute == "none" else 0.0
    if sequence_parallel:
        per_sbh = (10 + sharded + core) / t
    else:
        per_sbh = 10 + (sharded + core) / t
    return int(scale * s * b * h * per_sbh)


def logits_bytes(cfg: ModelConfig, tokens: int, tp: int, options: MemoryOptions) -> int:
    """Whole-sequence logits of ``tokens`` positions on the last stage, at
    ``LOGIT_BYTES_PER_ENTRY`` (bf16 output, fp32 copy, fp32 log-softmax), vocab split over TP
    unless ``options.vocab_parallel_logits`` is False."""
    vocab = cfg.head_vocab_size or cfg.padded_vocab_size
    if options.vocab_parallel_logits:
        vocab //= tp
    return tokens * vocab * LOGIT_BYTES_PER_ENTRY


def training_activation_bytes(cfg: ModelConfig, role: str, workload: Workload, layout: Layout,
                              stage: int, options: MemoryOptions) -> int:
    """Activations on pipeline stage ``stage`` under 1F1B: stage ``i`` holds
    ``min(PP - i, micro-batches)`` micro-batches in flight; the last adds the LM logits."""
    s, b = workload.seq_length, workload.micro_batch_size
    n_layers = cfg.num_layers // layout.pp
    in_flight = min(layout.pp - stage, workload.micro_batches(layout.dp))
    kw = dict(tp=layout.tp, sequence_parallel=options.sequence_parallel,
              param_bytes=options.param_bytes)
    stored = n_layers * in_flight * layer_activation_bytes(cfg, s, b, recompute=options.recompute, **kw)
    if options.recompute == "full":  # the layer being recomputed holds its full set
        stored += layer_activation_bytes(cfg, s, b, recompute="none", **kw)
    if stage == layout.pp - 1 and role in LM_ROLES:
        stored += logits_bytes(cfg, s * b, layout.tp, options)
    return stored


def forward_working_bytes(cfg: ModelConfig, seq: int, batch: int, tp: int,
                          param_bytes: int = 2) -> int:
    """Peak of one layer's forward with nothing kept for backward (inference, prefill): the
    residual input and the norm output, the larger of attention's intermediates (q, k, v
    expanded to all heads, scores and probabilities ``[b, a/t, s, s]``, the context) and
    the MLP's (fc1 output 2*ffn wide, the product), and the output before the all-reduce."""
    s, b, h, t = seq, batch, cfg.hidden_size, tp
    attention = 4 * s * b * h / t + 2 * cfg.num_attention_heads * s * s * b / t
    mlp = 3 * s * b * cfg.ffn_hidden_size / t
    return int(param_bytes * (3 * s * b * h + max(attention, mlp)))


def kv_cache_bytes(cfg: ModelConfig, samples: int, length: int, tp: int, param_bytes: int = 2) -> int:
    """Keys and values of every layer: ``2 * layers * (kv_heads/TP) * head_dim * bytes *
    samples * length``."""
    return (2 * cfg.num_layers * (cfg.num_query_groups // tp) * cfg.kv_channels * param_bytes
            * samples * length)


# ---------------------------------------------------------------- validation

def check_pipeline(cfg: ModelConfig, pp: int, role: str = "model") -> None:
    """ValueError naming the sizes that work when ``pp`` does not divide the layers (the
    model's own check, :meth:`~megatron_rlhf.config.ModelConfig.check_pipeline_parallel`)."""
    try:
        cfg.check_pipeline_parallel(pp)
    except ValueError as e:
        raise ValueError(f"{e} (the {role})") from None


def check_layout(stage: str, layout: Layout, models: dict[str, ModelConfig],
                 cluster: Cluster, workload: Workload) -> None:
    """Refuse a stage's layout, naming the fix: it must cover every GPU, keep TP inside a
    node, shard every model of the stage, and split the rollout batch."""
    name = layout_text(layout, pipeline=stage != "generation")
    if stage == "generation" and layout.pp != 1:
        raise ValueError(f"the gen layout {name} has pipeline parallel size {layout.pp}: "
                         "generation runs with PP=1, give it as TPxDP, e.g. 8x8")
    if layout.size != cluster.gpus:
        hint = ""
        if cluster.gpus % (layout.tp * layout.pp) == 0:
            fixed = Layout(tp=layout.tp, pp=layout.pp, dp=cluster.gpus // (layout.tp * layout.pp))
            hint = f", e.g. {layout_text(fixed, stage != 'generation')}"
        raise ValueError(
            f"the {stage} layout {name} uses {layout.size} GPUs but the cluster has "
            f"{cluster.gpus} ({cluster.nodes} nodes x {cluster.gpus_per_node}): every stage "
            f"must use all GPUs, so make TP x PP x DP = {cluster.gpus}{hint}"
        )
    if layout.tp > cluster.gpus_per_node or cluster.gpus_per_node % layout.tp:
        raise ValueError(
            f"the {stage} layout {name} has tensor parallel size {layout.tp}, which spans nodes "
            f"of {cluster.gpus_per_node} GPUs: use a TP that divides {cluster.gpus_per_node} "
            "and scale with PP or DP"
        )
    for role in STAGE_ROLES[stage]:
        if role not in models:
            continue
        try:
            models[role].check_tensor_parallel(layout.tp)
            check_pipeline(models[role], layout.pp, role)
        except ValueError as e:
            raise ValueError(f"the {stage} layout {name}, {role}: {e}") from None
    if stage == "training":
        workload.micro_batches(layout.dp)
    elif workload.rollout_batch % layout.dp:
        raise ValueError(
            f"rollout batch {workload.rollout_batch} samples must split evenly over the "
            f"{stage} layout's {layout.dp} data-parallel ranks: change its DP size or --rollout-batch"
        )


def check_models(models: dict[str, ModelConfig]) -> None:
    if "actor" not in models:
        raise ValueError("an estimate needs an actor model (models['actor'])")
    for role in models:
        if role not in ROLES:
            raise ValueError(f"unknown model role {role!r}; choose among {list(ROLES)}")


def check_layouts(models: dict[str, ModelConfig], cluster: Cluster, layouts: StageLayouts,
                  workload: Workload) -> dict[str, Layout]:
    """Validate every stage's layout (no collectives); returns ``{stage: layout}``."""
    check_models(models)
    resolved = layouts.resolved()
    for stage in ("training", "inference", "generation"):  # the gen default derives from train
        check_layout(stage, resolved[stage], models, cluster, workload)
    return resolved


# ---------------------------------------------------------------- stages

def generation_parts(models: dict[str, ModelConfig], gen: Layout, train: Layout,
                     workload: Workload, options: MemoryOptions) -> dict[str, int]:
    """Generation: actor (+ draft) in the gen layout, critic in the train layout, KV caches,
    and the larger of a prefill chunk's working set and a decode step's logits."""
    actor, draft = models["actor"], models.get("draft")
    o = options
    parts = {"actor_weights": weight_bytes(actor, "actor", gen, 0, o)}
    same_shards = train.pp == 1 and train.tp == gen.tp  # the gen copy is the train copy
    if not o.release_train_copy and not same_shards:
        parts["actor_train_copy"] = max(weight_bytes(actor, "actor", train, i, o) for i in range(train.pp))
    if draft is not None:
        parts["draft_weights"] = weight_bytes(draft, "draft", gen, 0, o)
    if "critic" in models:
        parts["critic_weights"] = max(weight_bytes(models["critic"], "critic", train, i, o)
                                      for i in range(train.pp))
    if not o.park_on_host:
        parts.update(trainee_state_parts(models, train, o))
    samples = workload.rollout_batch // gen.dp
    parts["kv_cache"] = kv_cache_bytes(actor, samples, workload.seq_length, gen.tp, o.param_bytes)
    step_tokens = 1
    if draft is not None:
        parts["draft_kv_cache"] = kv_cache_bytes(draft, samples, workload.seq_length, gen.tp, o.param_bytes)
        step_tokens = workload.num_draft_tokens + 1
    # decode-step logits are gathered over TP for sampling; the draft's proposals add one step's
    draft_vocab = (draft.head_vocab_size or draft.padded_vocab_size) if draft is not None else 0
    sampling = samples * (step_tokens * actor.padded_vocab_size + draft_vocab) * SAMPLING_BYTES_PER_ENTRY
    rows = max(1, min(samples, PREFILL_CHUNK_TOKENS // workload.max_prompt_length))
    prefill = forward_working_bytes(actor, workload.max_prompt_length, rows, gen.tp, o.param_bytes)
    parts["activations"] = max(sampling, prefill)
    return parts


def inference_parts(models: dict[str, ModelConfig], infer: Layout, gen: Layout, stage: int,
                    workload: Workload, options: MemoryOptions) -> dict[str, int]:
    """Experience on pipeline stage ``stage``: every model's weights, and the largest
    single-model forward of one micro-batch (models run one after the other)."""
    s, b, o = workload.seq_length, workload.micro_batch_size, options
    parts = {}
    for role in ("actor", "reference", "critic", "reward"):
        if role in models:
            parts[f"{role}_weights"] = weight_bytes(models[role], role, infer, stage, o)
    if "draft" in models:  # stays on the GPU, in the gen layout
        parts["draft_weights"] = weight_bytes(models["draft"], "draft", gen, 0, o)
    if not o.park_on_host:
        parts.update(trainee_state_parts(models, infer, o))
    work = []
    for role in ("actor", "reference", "critic", "reward"):  # one model at a time
        if role in models:
            cfg = models[role]
            w = forward_working_bytes(cfg, s, b, infer.tp, o.param_bytes)
            if stage == infer.pp - 1 and role in LM_ROLES:
                w += logits_bytes(cfg, s * b, infer.tp, o)
            work.append(w)
    parts["activations"] = max(work)
    return parts


def training_parts(models: dict[str, ModelConfig], train: Layout, gen: Layout, stage: int,
                   workload: Workload, options: MemoryOptions) -> dict[str, int]:
    """Training on pipeline stage ``stage``: weights, gradient buffers and Adam states of
    actor and critic; the larger of their activations (they train one after the other)."""
    o = options
    parts, acts = {}, []
    for role in ("actor", "critic"):
        if role not in models:
            continue
        cfg = models[role]
        parts[f"{role}_weights"] = stage_params(cfg, role, train.pp, stage).per_gpu(train.tp) * o.param_bytes
        parts.update(trainee_state_parts({role: cfg}, train, o, stage))
        acts.append(training_activation_bytes(cfg, role, workload, train, stage, o))
    if "draft" in models:  # stays on the GPU, in the gen layout; its optimizer on the host
        parts["draft_weights"] = weight_bytes(models["draft"], "draft", gen, 0, o)
    parts["activations"] = max(acts)
    return parts


def trainee_state_parts(models: dict[str, ModelConfig], train: Layout, options: MemoryOptions,
                        stage: int = 0) -> dict[str, int]:
    """Gradient buffers and Adam states (with fp32 masters) of actor and critic on pipeline
    stage ``stage`` of their train layout: ``<role>_grads``, ``<role>_optimizer``."""
    parts = {}
    for role in ("actor", "critic"):
        if role in models:
            n = stage_params(models[role], role, train.pp, stage).per_gpu(train.tp)
            parts[f"{role}_grads"] = n * (4 if options.fp32_grads else 2)
            shard = train.dp if options.distributed_optimizer else 1
            parts[f"{role}_optimizer"] = -(-n * ADAM_BYTES_PER_PARAM // shard)
    return parts


def _worst(stage: str, layout: Layout, capacity: int, parts_of) -> StageEstimate:
    candidates = [StageEstimate(stage, layout, i, parts_of(i), capacity) for i in range(layout.pp)]
    return max(candidates, key=lambda e: (e.total, -e.pipeline_stage))


def estimate(models: dict[str, ModelConfig], cluster: Cluster, layouts: StageLayouts,
             workload: Workload | None = None, options: MemoryOptions | None = None) -> Estimate:
    """Peak memory per GPU of each stage; ValueError naming the fix for a bad layout.

    ``models`` maps roles (actor, and any of reference, critic, reward, draft) to configs;
    a role left out is not resident (no critic: GRPO; no reward model: a rule reward).
    """
    workload = workload or Workload()
    options = options or MemoryOptions()
    lay = check_layouts(models, cluster, layouts, workload)
    gen, infer, train = lay["generation"], lay["inference"], lay["training"]
    reserve = options.reserve_bytes(cluster)
    capacity = int(cluster.gpu_memory_gb * GB) - reserve
    stages = [
        _worst("generation", gen, capacity,
               lambda i: generation_parts(models, gen, train, workload, options)),
        _worst("inference", infer, capacity,
               lambda i: inference_parts(models, infer, gen, i, workload, options)),
        _worst("training", train, capacity,
               lambda i: training_parts(models, train, gen, i, workload, options)),
    ]
    return Estimate(stages=stages, cluster=cluster, reserve=reserve, options=options)


def fits_or_raise(est: Estimate) -> Estimate:
    """Return ``est`` if every stage fits; otherwise a ValueError saying what to change."""
    bad = [s for s in est.stages if not s.fits]
    if not bad:
        return est
    lines = []
    for s in bad:
        largest = max(s.parts, key=s.parts.get)
        lines.append(
            f"{s.stage} on layout {layout_text(s.layout, s.stage != 'generation')} needs "
            f"{s.total / GB:.1f} GB per GPU, {s.capacity / GB:.1f} GB usable "
            f"(largest: {largest} {s.parts[largest] / GB:.1f} GB); {_advice(s, largest, est.options)}"
        )
    raise ValueError("the iteration does not fit in GPU memory:\n  " + "\n  ".join(lines)
                     + "\n(python tools/memory_plan.py --search lists train layouts that fit)")


def _advice(s: StageEstimate, largest: str, options: MemoryOptions) -> str:
    if largest.endswith("_optimizer"):
        if not options.distributed_optimizer:
            return "use the distributed optimizer, or a larger TP x PP"
        return "use a larger TP x PP or more GPUs (the distributed optimizer shards it over DP)"
    if largest == "activations" and s.stage == "training":
        if options.recompute != "full":
            return "use --recompute-granularity full (or selective), --sequence-parallel, or a larger TP x PP"
        return "use a smaller --micro-batch-size or a larger TP x PP"
    if largest in ("kv_cache", "draft_kv_cache", "activations") and s.stage == "generation":
        return "use a larger gen TP, a smaller rollout batch, or shorter sequences"
    if largest == "activations":
        return "use a smaller --micro-batch-size or a larger TP x PP"
    return "use a larger TP x PP (fewer parameters per GPU)"


# ---------------------------------------------------------------- search

def candidate_layouts(cluster: Cluster) -> list[Layout]:
    """Every TPxPPxDP over the cluster with TP dividing a node's GPUs."""
    out = []
    for tp in range(1, cluster.gpus_per_node + 1):
        if cluster.gpus_per_node % tp:
            continue
        for pp in range(1, cluster.gpus // tp + 1):
            if cluster.gpus % (tp * pp) == 0:
                out.append(Layout(tp=tp, pp=pp, dp=cluster.gpus // (tp * pp)))
    return out


def search_train_layouts(models: dict[str, ModelConfig], cluster: Cluster,
                         workload: Workload | None = None, options: MemoryOptions | None = None,
                         gen: Layout | None = None, infer: Layout | None = None,
                         fitting_only: bool = True) -> list[Estimate]:
    """Estimates of every valid train layout (the gen and infer layouts fixed, or their
    defaults), smallest peak first; only those that fit unless ``fitting_only`` is False."""
    found = []
    for train in candidate_layouts(cluster):
        try:
            est = estimate(models, cluster, StageLayouts(train=train, gen=gen, infer=infer),
                           workload, options)
        except ValueError:
            continue
        if est.fits or not fitting_only:
            found.append(est)
    return sorted(found, key=lambda e: (e.peak, e.stage("training").layout.pp))


# ---------------------------------------------------------------- small helpers

def layout_text(layout: Layout, pipeline: bool = True) -> str:
    """``"TPxPPxDP"``, or ``"TPxDP"`` for a layout without pipeline (generation); with
    ``"@R"`` for one over ranks ``R..R+size-1``, R > 0 (:meth:`Layout.parse`'s form)."""
    text = f"{layout.tp}x{layout.pp}x{layout.dp}" if pipeline else f"{layout.tp}x{layout.dp}"
    first = layout.first_rank
    if first is None:
        raise ValueError(f"{layout} is not over contiguous ranks: no TPxPPxDP@R text")
    return f"{text}@{first}" if first else text


def _positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


__all__ = [
    "GB", "STAGES", "RECOMPUTE", "Cluster", "Workload", "MemoryOptions", "StageLayouts",
    "StageParams", "StageEstimate", "Estimate", "estimate", "fits_or_raise", "check_layouts",
    "check_layout", "check_pipeline", "count_parameters", "stage_params", "layer_params",
    "layer_activation_bytes", "training_activation_bytes", "forward_working_bytes",
    "kv_cache_bytes", "logits_bytes", "search_train_layouts", "candidate_layouts", "layout_text",
]
