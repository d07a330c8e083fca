"""What the memory estimator prices: the cluster, one iteration's workload, how the
trainer stores things, and a layout per stage. Memory is in bytes; ``GB`` is 10**9 bytes."""
# Workload.from_configs builds the workload from a run's configs, so the trainer's check
# and the tools price the same numbers.

from __future__ import annotations

from dataclasses import dataclass

from megatron_rlhf.config import GenerationConfig, LoopConfig, PPOConfig, SpecConfig
from megatron_rlhf.parallel.layout import Layout

# Bytes in the GB this module reports (decimal, as GPU vendors and the sanity numbers use).
GB = 10**9

RECOMPUTE = ("none", "selective", "full")
# Share of each GPU kept free for the CUDA context (~0.5-1 GB), NCCL buffers and the
# caching allocator's fragmentation, unless ``MemoryOptions.reserve_gb`` is given.
DEFAULT_RESERVE_FRACTION = 0.10


@dataclass
class Cluster:
    """The GPUs every stage runs on."""

    nodes: int = 1  # Number of nodes.
    gpus_per_node: int = 8  # GPUs per node (a TP group must stay inside a node).
    gpu_memory_gb: float = 80.0  # Memory of one GPU in GB (10**9 bytes).

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

    # Samples generated per iteration over all GPUs (prompts x responses per prompt).
    rollout_batch: int = 512
    max_prompt_length: int = 1024  # Longest prompt in tokens.
    # Longest response in tokens; sequences are taken at prompt + response length.
    max_new_tokens: int = 1024
    # Sequences per forward (inference) and per forward/backward (training).
    micro_batch_size: int = 1
    # Optimizer steps per PPO epoch; micro-batches per step = samples / (DP x mbs x this).
    num_mini_batches: int = 1
    # Tokens a draft proposes per verification (with a draft: the actor scores this + 1
    # tokens per sample per step).
    num_draft_tokens: int = 4

    def __post_init__(self) -> None:
        for name in ("rollout_batch", "max_prompt_length", "max_new_tokens",
                     "micro_batch_size", "num_mini_batches"):
            _positive_int(name, getattr(self, name))
        if not isinstance(self.num_draft_tokens, int) or self.num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be an integer >= 0, got {self.num_draft_tokens!r}")

    @classmethod
    def from_configs(cls, ppo: PPOConfig, loop: LoopConfig, gen: GenerationConfig, spec: SpecConfig,
                     has_draft: bool) -> "Workload":
        """The workload of a training run with these settings."""
        # has_draft: a draft model is loaded, so verification scores spec's draft tokens.
        return cls(rollout_batch=ppo.samples_per_iteration, max_prompt_length=loop.max_prompt_length,
                   max_new_tokens=gen.max_new_tokens, micro_batch_size=ppo.micro_batch_size,
                   num_mini_batches=ppo.num_mini_batches, num_draft_tokens=spec.base_tokens(has_draft))

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

    # Bytes per weight, KV-cache entry and activation element (2: bf16, 4: fp32).
    param_bytes: int = 2
    # Gradient buffers in fp32 (megatron DDP's grad buffer, 4 B/param); False: bf16 (2 B).
    fp32_grads: bool = True
    # Shard fp32 masters and Adam moments (12 B/param) over DP; False: every replica holds all.
    distributed_optimizer: bool = True
    # Activation recompute in training: none, selective (attention core) or full (each layer).
    recompute: str = "none"
    # Megatron sequence parallelism: activations outside attention/MLP split over TP too.
    sequence_parallel: bool = False
    # Release (or offload) the actor's training-layout weights while generation runs (ReaLHF).
    release_train_copy: bool = True
    # The loss reads each TP rank's vocabulary shard of the logits (megatron's vocab-parallel
    # cross entropy); False: logits gathered over TP, as ``models.forward.lm_logits`` does today.
    vocab_parallel_logits: bool = True
    # The actor's and reference's log-prob forwards apply the LM head this many tokens at a time
    # (--head-chunk-tokens; rlhf.chunked_head): a chunk's logits, gathered over TP, at most; 0:
    # the whole sequence's.
    head_chunk_tokens: int = 1024
    # GB per GPU kept free; None: ``DEFAULT_RESERVE_FRACTION`` of the GPU's memory.
    reserve_gb: float | None = None
    # Between training stages the trainees' gradient buffers and optimizer states wait in
    # host memory (``rlhf.offload.park_trainee``, a GPU run); False: they stay where they are
    # and count in generation and inference too (a CPU run, whose host is its device).
    park_on_host: bool = True

    def __post_init__(self) -> None:
        if self.param_bytes not in (2, 4):
            raise ValueError(f"param_bytes must be 2 (bf16) or 4 (fp32), got {self.param_bytes!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        if self.head_chunk_tokens < 0:
            raise ValueError(f"head_chunk_tokens must be >= 0 (0: off), got {self.head_chunk_tokens}")
        if self.reserve_gb is not None and self.reserve_gb < 0:
            raise ValueError(f"reserve_gb must be >= 0, got {self.reserve_gb}")

    def reserve_bytes(self, cluster: Cluster) -> int:
        gb = self.reserve_gb if self.reserve_gb is not None else DEFAULT_RESERVE_FRACTION * cluster.gpu_memory_gb
        return int(gb * GB)


@dataclass
class StageLayouts:
    """A layout per stage; all stages run on every GPU of the cluster."""

    # Training of actor and critic (TPxPPxDP); the critic also keeps it during generation.
    train: Layout
    # Generation (TPxDP, PP=1); None: the train TP with DP taking the rest (today's behaviour).
    gen: Layout | None = None
    # Experience (reference/critic/reward/actor forwards); None: the train layout.
    infer: Layout | None = None

    def resolved(self) -> dict[str, Layout]:
        """``{stage: layout}`` with the defaults filled in."""
        gen = self.gen
        if gen is None:
            gen = Layout(tp=self.train.tp, pp=1, dp=max(1, self.train.size // self.train.tp))
        return {"generation": gen, "inference": self.infer or self.train, "training": self.train}


def _positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
