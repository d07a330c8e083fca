"""How the models are split over ranks (:class:`ParallelConfig`) and their dtype."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_rlhf.config.errors import ConfigError, finite, positive

# Models whose layout may cover part of the world: the frozen reference and reward model,
# the critic's training (beside the actor's on other ranks) and its inference copy (its
# weights reallocated there from the training copy after each update).
SUBSET_MODELS = ("reference", "reward", "critic", "critic_inf")

# The layouts of ParallelConfig.model_layouts (critic: its training, critic_inf: its
# inference) and the field that sets each.
MODEL_LAYOUTS = {"reference": "ref_layout", "reward": "reward_layout",
                 "critic": "critic_layout", "critic_inf": "critic_infer_layout"}


@dataclass
class ParallelConfig:
    """How the models are split over ranks: one layout for training and inference, one for
    generation (the actor and the draft), weights reallocated between the two."""

    tensor_model_parallel_size: int = 1
    """TP size of the train layout (without --train-layout); must divide heads, KV heads and the ranks."""
    pipeline_model_parallel_size: int = 1
    """PP size of training and inference (without --train-layout); generation runs unpipelined."""
    train_layout: str | None = field(default=None, metadata={"metavar": "TPxPPxDP[:epE][@R]"})
    """Layout of training and of models without their own (None: TP x PP x the rest of the world); :epE splits an MoE's experts over E of the DP ranks."""
    # With a gen_layout it may cover ranks R..R+size-1 only (@R): the actor then trains there,
    # beside the critic on other ranks.
    gen_layout: str | None = field(default=None, metadata={"metavar": "TPxDP"})
    """Layout of generation, weights moved to it after every update (None: train TP x the rest)."""
    # With None the actor generates on its training copy: no move.
    ref_layout: str | None = field(default=None, metadata={"metavar": "TPxPPxDP[:epE][@R]"})
    """Layout of the reference model's inference, over all ranks or ranks R.. (None: train layout)."""
    # The samples move to its data-parallel ranks and the results back.
    reward_layout: str | None = field(default=None, metadata={"metavar": "TPxPPxDP[:epE][@R]"})
    """Layout of the reward model's inference, as ref_layout."""
    critic_layout: str | None = field(default=None, metadata={"metavar": "TPxPPxDP[:epE][@R]"})
    """Layout of the critic's training, and of its inference by default (None: the train layout)."""
    critic_infer_layout: str | None = field(default=None, metadata={"metavar": "TPxPPxDP[:epE][@R]"})
    """Layout of a second, inference-only critic copy (None: the training copy)."""
    # Its weights are reallocated there after every critic update.
    draft_train_layout: Literal["gen", "train"] = "gen"
    """Where draft distillation runs: gen (the actor's generation copy teaches) or train (PP=1)."""
    # train: the actor's training copy teaches, the draft's weights are reallocated to generation.
    recompute_granularity: Literal["full", "selective"] | None = None
    """Activation recompute in training: full (each layer), selective (attention core), None: off."""
    sequence_parallel: bool = False
    """With TP > 1, split sequences over TP ranks outside attention and MLP in training."""
    # The train layout's activations divide by TP; generation runs whole sequences.
    head_chunk_tokens: int = 1024
    """Tokens per chunk of the LM head in the actor's and reference's log-prob forwards (training and experience); 0: all tokens' logits at once."""
    # Chunked, no [tokens, vocab] logits exist: each chunk's are made, used and dropped, and
    # remade in the backward (rlhf.chunked_head).
    release_train_copy: bool | None = None
    """With a gen_layout, keep the actor's training copy in pinned host memory during generation."""
    # None: on GPU.
    park_optimizer: Literal["auto", "on", "off"] = "auto"
    """Optimizer states and fp32 masters in pinned host memory during generation: auto (when the memory estimate finds no room beside it), on, off."""
    # Decided once at start-up (rlhf.build); on CPU nothing moves whatever the setting.
    plan: str | None = field(default=None, metadata={"metavar": "FILE.json|auto"})
    """Layouts from a plan file (tools/plan.py --out FILE) or auto (searched at start-up)."""
    # It replaces the layout settings; auto runs megatron_rlhf.plan.search.
    plan_hardware: str | None = field(default=None, metadata={"metavar": "NAME|FILE.json"})
    """Plan auto: h100, h200, a100, cpu or a Hardware/Profile JSON (None: the GPU's preset by name, else cpu)."""

    def __post_init__(self) -> None:
        finite(self)
        positive("tensor_model_parallel_size", self.tensor_model_parallel_size)
        if self.plan is not None and (self.train_layout or self.gen_layout or self.ref_layout
                                      or self.reward_layout or self.critic_layout
                                      or self.critic_infer_layout):
            raise ConfigError("{plan} sets the layouts: drop the {*_layout} flags, or {plan}")
        positive("pipeline_model_parallel_size", self.pipeline_model_parallel_size)
        from megatron_rlhf.parallel.layout import Layout

        if self.train_layout is not None:
            t = Layout.parse(self.train_layout)
            for name, given, want in (("tensor_model_parallel_size", self.tensor_model_parallel_size, t.tp),
                                      ("pipeline_model_parallel_size", self.pipeline_model_parallel_size, t.pp)):
                if given not in (1, want):
                    raise ConfigError(f"{{{name}}} {given} contradicts {{train_layout}} "
                                      f"{self.train_layout}; give one of them")
            self.tensor_model_parallel_size, self.pipeline_model_parallel_size = t.tp, t.pp
        if self.gen_layout is not None and Layout.parse(self.gen_layout, pipeline=False).ep > 1:
            raise ConfigError(f"{{gen_layout}} {self.gen_layout}: generation decodes each data-parallel "
                              "rank's samples on its own, without expert parallelism; drop the :ep "
                              "(the weights move there from the training layout's experts)")
        for text in (self.ref_layout, self.reward_layout, self.critic_layout, self.critic_infer_layout):
            if text is not None:
                Layout.parse(text)
        if self.draft_train_layout not in ("gen", "train"):
            raise ConfigError(f"{{draft_train_layout}} {self.draft_train_layout!r}: use gen or train")
        if self.park_optimizer not in ("auto", "on", "off"):
            raise ConfigError(f"{{park_optimizer}} {self.park_optimizer!r}: use auto, on or off")
        if not isinstance(self.head_chunk_tokens, int) or self.head_chunk_tokens < 0:
            raise ConfigError(f"{{head_chunk_tokens}} {self.head_chunk_tokens!r}: a number of tokens "
                              "per chunk, or 0 for the whole logits at once")
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ConfigError(f"{{recompute_granularity}} {self.recompute_granularity!r}: "
                              "use full or selective")

    def check_world(self, world_size: int) -> int:
        """Return the train layout's data-parallel size, or raise if it does not fit."""
        return self.layouts(world_size)[0].dp

    def model_layouts(self, world_size: int) -> dict:
        """``{name: Layout}`` of the models given a layout of their own (:data:`MODEL_LAYOUTS`).

        Raises ConfigError naming the field when one does not fit the world."""
        from megatron_rlhf.parallel.layout import Layout

        out = {}
        for name, key in MODEL_LAYOUTS.items():
            text = getattr(self, key)
            if text is None:
                continue
            lay = Layout.parse(text)  # (over all ranks or over fewer: SUBSET_MODELS)
            if max(lay.ranks) >= world_size:
                raise ConfigError(f"{{{key}}} {text} needs ranks {lay.ranks[0]}..{lay.ranks[-1]}, the "
                                  f"world has 0..{world_size - 1}: fewer ranks or a lower @FIRST_RANK")
            out[name] = lay
        return out

    def layouts(self, world_size: int):
        """``(train, gen)`` Layouts over ``world_size`` ranks; ConfigError naming the fix."""
        from megatron_rlhf.parallel.layout import Layout

        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        if self.train_layout is not None:
            train = Layout.parse(self.train_layout)
            if max(train.ranks) >= world_size:
                raise ConfigError(f"{{train_layout}} {self.train_layout} needs ranks {train.ranks[0]}.."
                                  f"{train.ranks[-1]}, the world has 0..{world_size - 1}: TP x PP x DP "
                                  "must fit it")
            if train.size != world_size and self.gen_layout is None:
                raise ConfigError(f"{{train_layout}} {self.train_layout} covers {train.size} of the "
                                  f"world's {world_size} ranks: give {{gen_layout}} TPxDP over all of "
                                  f"them (the actor then generates there), or TP x PP x DP = {world_size}")
        else:
            if world_size % (tp * pp):
                raise ValueError(
                    f"tensor parallel size {tp} x pipeline parallel size {pp} must divide the "
                    f"world size {world_size} (launch with a multiple of {tp * pp} ranks)")
            train = Layout(tp=tp, pp=pp, dp=world_size // (tp * pp))
        if self.gen_layout is None:
            if world_size % train.tp:
                raise ValueError(f"the train layout's TP {train.tp} must divide the world size {world_size}")
            return train, Layout(tp=train.tp, dp=world_size // train.tp)
        gen = Layout.parse(self.gen_layout, pipeline=False)
        if gen.size != world_size or gen.first_rank != 0:
            raise ConfigError(f"{{gen_layout}} {self.gen_layout} covers {gen.size} ranks, the world "
                              f"has {world_size}: TP x DP must equal it (e.g. {{gen_layout}} "
                              f"{gen.tp}x{max(world_size // gen.tp, 1)})")
        return train, gen


@dataclass
class PrecisionConfig:
    """Parameter and compute dtype."""

    bf16: bool | None = field(default=None, metadata={"off": "--fp32"})
    """bf16 weights and activations with fp32 master weights and Adam states (--fp32: fp32
    throughout). Default: a resumed run's own; else bf16 on a GPU and on a CPU that reports
    amx_bf16 or avx512_bf16, fp32 on other CPUs. The run header (``precision: ...``) says which
    and why."""
