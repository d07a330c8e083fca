"""Model architecture configs: :class:`ModelConfig`, the named presets and the model roles."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_rlhf.config.errors import ConfigError, finite, nonnegative, positive

# actor/reference/draft carry the LM head; critic/reward a scalar value head per token.
ROLES = ("actor", "reference", "draft", "critic", "reward")

# The embedding is padded to a multiple of this, independent of TP so checkpoints move
# between TP sizes (Llama-2's 32000 and SmolLM2's 49152 need no padding).
VOCAB_PAD_MULTIPLE = 128


# Hugging Face architectures a ModelConfig maps onto (``model_type``).
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")
# the families whose MLPs are mixtures of experts
MOE_FAMILIES = ("qwen3_moe", "mixtral")
ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass
class ModelConfig:
    """A Llama-family decoder: RoPE, RMSNorm, SwiGLU, grouped-query attention; with
    ``num_experts`` each layer's MLP is a mixture of SwiGLU experts (megatron's MoE layer)."""

    num_layers: int
    """Number of transformer layers."""
    hidden_size: int
    """Model width."""
    ffn_hidden_size: int
    """SwiGLU inner width (HF ``intermediate_size``)."""
    num_attention_heads: int
    """Query heads."""
    num_query_groups: int
    """Key/value heads (GQA groups); equal to ``num_attention_heads`` for MHA."""
    vocab_size: int
    """Tokenizer vocabulary size (the embedding is padded beyond it, see ``padded_vocab_size``)."""
    max_position_embeddings: int = 4096
    """Longest sequence the model is built for."""
    rotary_base: float = 10000.0
    """RoPE theta."""
    norm_epsilon: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share the input embedding with the LM head."""
    kv_channels: int | None = None
    """Head dimension; ``hidden_size // num_attention_heads`` when None."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token, if the tokenizer has one."""
    eos_token_id: int | None = None
    """End-of-sequence token: generation stops on it."""
    head_vocab_size: int | None = None
    """Draft models only: an LM head over this many frequent tokens (None: the whole vocabulary)."""
    # A multiple of 128; the other tokens get probability 0.
    feature_draft: bool = False
    """Draft models only: read the target's last hidden state with each token (EAGLE)."""
    # EAGLE (Li et al. 2024): the input at position t is fc([embed(x_t), h_{t-1}]) with h the
    # target's final-norm output, so one or two layers predict the target's next token far
    # better than a standalone small model.
    family: str = "llama"
    """The Hugging Face architecture (``model_type``) the weights map onto: llama, mistral or qwen2."""
    # mistral: Llama's layers and a sliding window; qwen2: biases on q, k and v.
    rope_scaling: dict | None = None
    """Llama-3.1/3.2 RoPE scaling (``rope_type`` llama3; None: plain RoPE)."""
    # Keys: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings.
    qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2)."""
    sliding_window: int | None = None
    """Each token attends to at most this many tokens (Mistral v0.1)."""
    # Not implemented: runs whose sequences are longer are refused (check_attention_span).
    qk_layernorm: bool = False
    """An RMSNorm over each query and key head before RoPE (Qwen3; megatron's ``qk_layernorm``)."""
    num_experts: int | None = None
    """Experts per layer (None: a dense MLP in every layer)."""
    moe_router_topk: int = 2
    """Experts each token is routed to."""
    moe_ffn_hidden_size: int | None = None
    """Each expert's SwiGLU inner width (HF Qwen3-MoE ``moe_intermediate_size``; Mixtral's
    experts are ``ffn_hidden_size`` wide, the default)."""
    moe_norm_topk: bool = True
    """The top-k routing weights renormalised to sum to 1 (Mixtral always; Qwen3-MoE's
    ``norm_topk_prob``); False: the softmax over all experts, top-k of it kept as is."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the router's load-balancing loss in training (Switch Transformer's; 0: none)."""
    moe_z_loss_coeff: float = 0.0
    """Weight of the router's z-loss in training (ST-MoE's, on the logits' log-sum-exp; 0: none)."""

    def __post_init__(self) -> None:
        finite(self)
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                     "num_query_groups", "vocab_size", "max_position_embeddings"):
            positive(name, getattr(self, name))
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"{self.num_query_groups} KV heads must divide {self.num_attention_heads} "
                "attention heads"
            )
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"{self.num_attention_heads} attention heads must divide hidden size "
                    f"{self.hidden_size} (or set kv_channels)"
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.head_vocab_size is not None:
            if not 0 < self.head_vocab_size <= self.padded_vocab_size or self.head_vocab_size % VOCAB_PAD_MULTIPLE:
                raise ValueError(
                    f"head_vocab_size {self.head_vocab_size} must be a positive multiple of "
                    f"{VOCAB_PAD_MULTIPLE} no larger than the vocabulary ({self.vocab_size})"
                )
            if self.tie_embeddings:
                raise ValueError("a reduced LM head (head_vocab_size) cannot be tied to the embedding")
        if self.rotary_base <= 0 or self.norm_epsilon <= 0:
            raise ConfigError("{rotary_base} and {norm_epsilon} must be positive")
        if self.family not in FAMILIES:
            raise ValueError(f"model family {self.family!r} is not supported; supported: {', '.join(FAMILIES)}")
        if self.rope_scaling is not None:
            missing = [k for k in ROPE_SCALING_KEYS if k not in self.rope_scaling]
            if missing:
                raise ValueError(f"rope_scaling lacks {missing}: give {', '.join(ROPE_SCALING_KEYS)}")
        if self.sliding_window is not None:
            positive("sliding_window", self.sliding_window)
        if self.num_experts is not None:
            positive("num_experts", self.num_experts)
            if self.family not in MOE_FAMILIES:
                raise ConfigError(f"{{num_experts}} is set, so {{family}} must be one with experts "
                                  f"({', '.join(MOE_FAMILIES)}), not {self.family!r}")
            if self.family == "mixtral" and not self.moe_norm_topk:
                raise ConfigError("Mixtral renormalises its top-k routing weights: set {moe_norm_topk}")
            if self.moe_router_topk == 1 and self.moe_norm_topk:
                raise ConfigError("top-1 routing with renormalised weights gives every token the weight 1 "
                                  "and the router no gradient (megatron refuses it): route to "
                                  "{moe_router_topk} >= 2 experts, or turn {!moe_norm_topk}")
            if self.moe_ffn_hidden_size is None:
                self.moe_ffn_hidden_size = self.ffn_hidden_size
            positive("moe_ffn_hidden_size", self.moe_ffn_hidden_size)
            nonnegative(self, "moe_aux_loss_coeff", "moe_z_loss_coeff")
            if not 0 < self.moe_router_topk <= self.num_experts:
                raise ConfigError(f"{{moe_router_topk}} ({self.moe_router_topk}) must be between 1 and "
                                  f"{{num_experts}} ({self.num_experts})")
        elif self.family in MOE_FAMILIES:
            raise ConfigError(f"a {self.family} model has experts: set {{num_experts}}")

    def check_attention_span(self, tokens: int) -> None:
        """Refuse sequences of ``tokens`` tokens that a sliding window would cut."""
        if self.sliding_window is not None and tokens > self.sliding_window:
            raise ConfigError(
                f"the model attends within a sliding window of {self.sliding_window} tokens and "
                f"sequences here reach {tokens}: sliding-window attention is not implemented, so "
                f"keep prompt + new tokens <= {self.sliding_window} ({{max_prompt_length}}, "
                "{max_new_tokens})")

    @property
    def padded_vocab_size(self) -> int:
        m = VOCAB_PAD_MULTIPLE
        return (self.vocab_size + m - 1) // m * m

    def check_tensor_parallel(self, tp: int) -> None:
        """Raise a message naming the problem when ``tp`` cannot shard this model."""
        positive("tensor parallel size", tp)
        for what, n in self._tp_sharded():
            if n % tp:
                valid = [d for d in range(1, n + 1) if self._tp_ok(d)][:8]
                raise ValueError(
                    f"tensor parallel size {tp} must divide {n} {what}; "
                    f"sizes that work for this model: {valid}"
                )

    def _tp_sharded(self) -> list[tuple[str, int]]:
        """The sizes TP shards, by name (experts are sharded over TP too)."""
        sizes = [("attention heads", self.num_attention_heads), ("KV heads", self.num_query_groups),
                 ("ffn hidden size", self.ffn_hidden_size), ("padded vocabulary", self.padded_vocab_size),
                 ("LM head tokens", self.head_vocab_size or self.padded_vocab_size)]
        if self.num_experts is not None:
            sizes.append(("expert ffn hidden size", self.moe_ffn_hidden_size))
        return sizes

    def check_pipeline_parallel(self, pp: int) -> None:
        """Raise a message naming the fix when ``pp`` stages cannot split the layers evenly."""
        positive("pipeline parallel size", pp)
        if self.num_layers % pp:
            valid = [d for d in range(1, self.num_layers + 1) if self.num_layers % d == 0]
            raise ValueError(f"pipeline parallel size {pp} must divide {self.num_layers} layers; "
                             f"sizes that work for this model: {valid}")
        if self.feature_draft and pp > 1:
            raise ValueError("a feature draft runs unpipelined (PP=1): it serves generation")

    def check_expert_parallel(self, ep: int) -> None:
        """Raise a message naming the fix when ``ep`` ranks cannot split the experts evenly."""
        positive("expert parallel size", ep)
        if self.num_experts is not None and self.num_experts % ep:
            valid = [d for d in range(1, self.num_experts + 1) if self.num_experts % d == 0]
            raise ValueError(f"expert parallel size {ep} must divide {self.num_experts} experts; "
                             f"sizes that work for this model: {valid}")

    def _tp_ok(self, tp: int) -> bool:
        return all(n % tp == 0 for _, n in self._tp_sharded())

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown model config fields {sorted(unknown)}")
        return cls(**d)

    def replace(self, **overrides) -> "ModelConfig":
        return dataclasses.replace(self, **overrides)


PRESETS: dict[str, ModelConfig] = {
    "llama2-7b": ModelConfig(
        num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32,
        num_query_groups=32, vocab_size=32000, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2,
    ),
    "llama2-13b": ModelConfig(
        num_layers=40, hidden_size=5120, ffn_hidden_size=13824, num_attention_heads=40,
        num_query_groups=40, vocab_size=32000, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2,
    ),
    "llama2-70b": ModelConfig(
        num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
        num_query_groups=8, vocab_size=32000, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2,
    ),
    "smollm2-135m": ModelConfig(
        num_layers=30, hidden_size=576, ffn_hidden_size=1536, num_attention_heads=9,
        num_query_groups=3, vocab_size=49152, max_position_embeddings=8192,
        rotary_base=100000.0, norm_epsilon=1e-5, tie_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    ),
    # mixtures of experts (for the memory estimator and the plan search)
    "qwen3-30b-a3b": ModelConfig(
        num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32,
        num_query_groups=4, kv_channels=128, vocab_size=151936, max_position_embeddings=40960,
        rotary_base=1e6, norm_epsilon=1e-6, bos_token_id=None, eos_token_id=151645,
        family="qwen3_moe", qk_layernorm=True, num_experts=128, moe_router_topk=8,
        moe_ffn_hidden_size=768, moe_norm_topk=True,
    ),
    "mixtral-8x7b": ModelConfig(
        num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
        num_query_groups=8, vocab_size=32000, max_position_embeddings=32768, rotary_base=1e6,
        bos_token_id=1, eos_token_id=2, family="mixtral", num_experts=8, moe_router_topk=2,
    ),
    # Tiny random configs for tests: GQA with tied and untied embeddings, and MHA.
    "tiny": ModelConfig(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
        num_query_groups=2, vocab_size=256, max_position_embeddings=256, tie_embeddings=True,
        eos_token_id=1,
    ),
    "tiny-untied": ModelConfig(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
        num_query_groups=2, vocab_size=250, max_position_embeddings=256, rotary_base=500.0,
        norm_epsilon=1e-6, eos_token_id=1,
    ),
    "tiny-mha": ModelConfig(
        num_layers=3, hidden_size=48, ffn_hidden_size=96, num_attention_heads=4,
        num_query_groups=4, vocab_size=256, max_position_embeddings=256, eos_token_id=1,
    ),
    # the other families' features at tiny sizes: Llama-3.1 RoPE scaling (an original
    # context short enough that the scaling changes frequencies), Qwen2's q/k/v biases,
    # Mistral's sliding window
    "tiny-llama3": ModelConfig(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
        num_query_groups=2, vocab_size=256, max_position_embeddings=256, rotary_base=50000.0,
        eos_token_id=1, rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 64},
    ),
    "tiny-qwen2": ModelConfig(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
        num_query_groups=2, vocab_size=256, max_position_embeddings=256, rotary_base=1e6,
        norm_epsilon=1e-6, eos_token_id=1, family="qwen2", qkv_bias=True,
    ),
    "tiny-mistral": ModelConfig(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
        num_query_groups=2, vocab_size=256, max_position_embeddings=256, eos_token_id=1,
        family="mistral", sliding_window=128,
    ),
    # Qwen3's q/k norms with a head dim apart from hidden / heads; Qwen3-MoE's narrow experts
    # with unnormalised top-k weights; Mixtral's full-width experts
    "tiny-qwen3": ModelConfig(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
        num_query_groups=2, vocab_size=256, max_position_embeddings=256, rotary_base=1e6,
        norm_epsilon=1e-6, eos_token_id=1, family="qwen3", qk_layernorm=True, kv_channels=32,
    ),
    "tiny-qwen3-moe": ModelConfig(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
        num_query_groups=2, vocab_size=256, max_position_embeddings=256, rotary_base=1e6,
        norm_epsilon=1e-6, eos_token_id=1, family="qwen3_moe", qk_layernorm=True, num_experts=4,
        moe_router_topk=2, moe_ffn_hidden_size=32, moe_norm_topk=False,
    ),
    "tiny-mixtral": ModelConfig(
        num_layers=2, hidden_size=64, ffn_hidden_size=64, num_attention_heads=4,
        num_query_groups=2, vocab_size=256, max_position_embeddings=256, rotary_base=1e6,
        eos_token_id=1, family="mixtral", num_experts=4, moe_router_topk=2,
    ),
}


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides)


def check_role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"unknown model role {role!r}; choose one of {list(ROLES)}")
    return role
