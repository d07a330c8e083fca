"""Peak GPU memory per RLHF stage under each stage's layout: pure arithmetic, no torch.

Entry point: :func:`estimate` (and :func:`fits_or_raise`, :func:`search_train_layouts`).
"""
# It mirrors the trainer: every stage (generation, inference, training) runs on every GPU,
# and what a stage does not use waits in host memory. Each stage reports its worst pipeline
# stage, per GPU; gradients are freed between stages. Inputs live in plan.workload, per-piece
# sizes in plan.sizes. GB is 10**9 bytes: an "80 GB" GPU is taken as 80e9 bytes, under its
# 80 GiB (conservative).

from __future__ import annotations

from dataclasses import dataclass

from megatron_rlhf.config import ROLES, ModelConfig
from megatron_rlhf.parallel.layout import Layout
from megatron_rlhf.plan.sizes import (
    LM_ROLES,
    StageParams,
    active_layer_params,
    check_pipeline,
    count_parameters,
    forward_working_bytes,
    kv_cache_bytes,
    layer_activation_bytes,
    layer_params,
    logits_bytes,
    stage_params,
    training_activation_bytes,
    weight_bytes,
)
from megatron_rlhf.plan.workload import GB, RECOMPUTE, Cluster, MemoryOptions, StageLayouts, Workload

STAGES = ("generation", "inference", "training")
# Models whose shapes a stage's layout must fit (the critic also sits, in its train layout,
# on the GPUs during generation).
STAGE_ROLES = {
    "generation": ("actor", "draft"),
    "inference": ("actor", "reference", "critic", "reward"),
    "training": ("actor", "critic"),
}

ADAM_BYTES_PER_PARAM = 12  # fp32 master weight (4) + Adam first and second moments (4 + 4).
# A decode step's logits in fp32 and the sampling probabilities derived from them.
SAMPLING_BYTES_PER_ENTRY = 4 + 4
# Real tokens per prefill run on a GPU (``generation.incremental.PREFILL_CHUNK_TOKENS["cuda"]``,
# checked equal by a test).
PREFILL_CHUNK_TOKENS = 8192


@dataclass
class StageEstimate:
    """Peak memory of one RLHF stage on one GPU (the worst pipeline stage)."""

    stage: str  # generation, inference or training.
    layout: Layout  # The stage's layout.
    # The pipeline stage reported: the one with the largest total (0 when PP is 1).
    pipeline_stage: int
    # What is resident, in bytes per GPU, e.g. ``{"actor_weights": ..., "kv_cache": ...}``.
    parts: dict[str, int]
    capacity: int  # Usable bytes per GPU: the GPU's memory less the reserve.

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

    stages: list[StageEstimate]  # generation, inference, training, in that order.
    cluster: Cluster  # The GPUs.
    reserve: int  # Bytes per GPU kept free (CUDA context, NCCL, fragmentation).
    # The options the estimate was made with (:func:`fits_or_raise` advises from them).
    options: MemoryOptions

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


# ---------------------------------------------------------------- validation

def check_layout(stage: str, layout: Layout, models: dict[str, ModelConfig],
                 cluster: Cluster, workload: Workload) -> None:
    """Raise ValueError naming the fix when a stage's layout cannot run."""
    # It must cover every GPU, keep TP inside a node, shard every model of the stage, and
    # split the rollout batch.
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
    """Generation's bytes per GPU (PP=1), by piece."""
    # Actor (+ draft) in the gen layout, the actor's training copy unless released
    # (release_train_copy), the critic in the train layout, the KV caches of one gen-DP
    # rank's samples at full length, and the larger of a prefill chunk's working set and a
    # decode step's logits. Optimizer states, reference and reward wait on the host.
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
    """Experience's bytes per GPU on pipeline stage ``stage``, by piece."""
    # Every model's weights, and the largest single-model forward of one micro-batch
    # (models run one after the other).
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
                w += logits_bytes(cfg, s * b, infer.tp, o, role)
            work.append(w)
    parts["activations"] = max(work)
    return parts


def training_parts(models: dict[str, ModelConfig], train: Layout, gen: Layout, stage: int,
                   workload: Workload, options: MemoryOptions) -> dict[str, int]:
    """Training's bytes per GPU on pipeline stage ``stage``, by piece."""
    # Weights, gradient buffers and Adam states of actor and critic; the larger of their
    # activations (they train one after the other), those 1F1B keeps in flight
    # (Korthikanti et al. 2022, adapted to SwiGLU).
    o = options
    parts, acts = {}, []
    for role in ("actor", "critic"):
        if role not in models:
            continue
        cfg = models[role]
        parts[f"{role}_weights"] = stage_params(cfg, role, train.pp, stage).per_gpu(train.tp, train.ep) \
            * o.param_bytes
        parts.update(trainee_state_parts({role: cfg}, train, o, stage))
        acts.append(training_activation_bytes(cfg, role, workload, train, stage, o))
    if "draft" in models:  # stays on the GPU, in the gen layout; its optimizer on the host
        parts["draft_weights"] = weight_bytes(models["draft"], "draft", gen, 0, o)
    parts["activations"] = max(acts)
    return parts


def trainee_state_parts(models: dict[str, ModelConfig], train: Layout, options: MemoryOptions,
                        stage: int = 0) -> dict[str, int]:
    """``<role>_grads`` and ``<role>_optimizer`` bytes on pipeline stage ``stage``."""
    # Gradient buffers and Adam states (with fp32 masters) of actor and critic, in their
    # train layout.
    parts = {}
    for role in ("actor", "critic"):
        if role in models:
            parts[f"{role}_grads"], parts[f"{role}_optimizer"] = trainee_state_bytes(
                models[role], role, train, options, stage)
    return parts


def trainee_state_bytes(cfg: ModelConfig, role: str, train: Layout, options: MemoryOptions,
                        stage: int = 0) -> tuple[int, int]:
    """(gradient buffer, optimizer) bytes of ``role`` on one GPU of pipeline stage ``stage``."""
    params = stage_params(cfg, role, train.pp, stage)
    dense, experts = params.dense_per_gpu(train.tp), params.experts_per_gpu(train.tp, train.ep)
    grads = (dense + experts) * (4 if options.fp32_grads else 2)
    # the distributed optimizer shards the dense states over DP, the experts' over the
    # expert-DP ranks (DP / EP)
    dp, expt_dp = (train.dp, train.dp // train.ep) if options.distributed_optimizer else (1, 1)
    return grads, -(-dense * ADAM_BYTES_PER_PARAM // dp) - (-experts * ADAM_BYTES_PER_PARAM // expt_dp)


def _worst(stage: str, layout: Layout, capacity: int, parts_of) -> StageEstimate:
    candidates = [StageEstimate(stage, layout, i, parts_of(i), capacity) for i in range(layout.pp)]
    return max(candidates, key=lambda e: (e.total, -e.pipeline_stage))


def estimate(models: dict[str, ModelConfig], cluster: Cluster, layouts: StageLayouts,
             workload: Workload | None = None, options: MemoryOptions | None = None) -> Estimate:
    """Peak memory per GPU of each stage; ValueError naming the fix for a bad layout.

    ``models``: role (actor, reference, critic, reward, draft) -> config; a role left out
    is not resident (no critic: GRPO; no reward model: a rule reward)."""
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

def candidate_layouts(cluster: Cluster, experts: int | None = None) -> list[Layout]:
    """Every TPxPPxDP over the cluster with TP dividing a node's GPUs; for a model with
    ``experts``, each also with every expert-parallel size dividing both DP and the experts."""
    out = []
    for tp in range(1, cluster.gpus_per_node + 1):
        if cluster.gpus_per_node % tp:
            continue
        for pp in range(1, cluster.gpus // tp + 1):
            if cluster.gpus % (tp * pp) == 0:
                dp = cluster.gpus // (tp * pp)
                out += [Layout(tp=tp, pp=pp, dp=dp, ep=ep) for ep in range(1, dp + 1)
                        if ep == 1 or (experts and dp % ep == 0 and experts % ep == 0)]
    return out


def search_train_layouts(models: dict[str, ModelConfig], cluster: Cluster,
                         workload: Workload | None = None, options: MemoryOptions | None = None,
                         gen: Layout | None = None, infer: Layout | None = None,
                         fitting_only: bool = True) -> list[Estimate]:
    """Estimates of every valid train layout, smallest peak first (only those that fit
    unless ``fitting_only`` is False)."""
    # The gen and infer layouts stay fixed, or at their defaults.
    found = []
    for train in candidate_layouts(cluster, models["actor"].num_experts if "actor" in models else None):
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
    """``"TPxPPxDP"`` (``"TPxDP"`` without pipeline), ``":epE"`` with expert parallelism, ``"@R"``
    from rank R > 0 (``Layout.parse``'s form)."""

    text = f"{layout.tp}x{layout.pp}x{layout.dp}" if pipeline else f"{layout.tp}x{layout.dp}"
    if layout.ep > 1:
        text += f":ep{layout.ep}"
    first = layout.first_rank
    if first is None:
        raise ValueError(f"{layout} is not over contiguous ranks: no TPxPPxDP@R text")
    return f"{text}@{first}" if first else text


# The estimator's public names, its inputs (:mod:`~megatron_rlhf.plan.workload`) and sizes
# (:mod:`~megatron_rlhf.plan.sizes`) included.
__all__ = [
    "GB", "STAGES", "RECOMPUTE", "Cluster", "Workload", "MemoryOptions", "StageLayouts",
    "StageParams", "StageEstimate", "Estimate", "estimate", "fits_or_raise", "check_layouts",
    "check_layout", "check_pipeline", "count_parameters", "stage_params", "layer_params",
    "active_layer_params", "trainee_state_bytes",
    "layer_activation_bytes", "training_activation_bytes", "forward_working_bytes",
    "kv_cache_bytes", "logits_bytes", "weight_bytes", "LM_ROLES", "search_train_layouts",
    "candidate_layouts", "layout_text",
]
