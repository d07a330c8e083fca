"""What the generator produces: sampling, speculative decoding, sample migration."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from megatron_rlhf.config.errors import ConfigError, finite, positive

SpecVerify = Literal["exact", "rejection"]
DraftSource = Literal["model", "history", "both"]
SPEC_VERIFY = get_args(SpecVerify)
DRAFT_SOURCES = get_args(DraftSource)

# History drafts of a sample that has run long (long_after tokens, generation.history's
# HistoryDrafter) may be this many times longer than n: the long tail of a rollout is where
# drafting pays (DAS).
HISTORY_LONG_BOOST = 2


@dataclass
class GenerationConfig:
    """What the generator produces and how it samples."""

    max_new_tokens: int = 64
    """Tokens to generate after each prompt (fewer when EOS comes first)."""
    temperature: float = 1.0
    """Sampling temperature: logits are divided by it (0: greedy, argmax)."""
    top_k: int = 0
    """Sample among the k most likely tokens only (0: all)."""
    top_p: float = 1.0
    """Sample among the smallest set of tokens whose probability reaches top_p (1.0: all)."""
    stop_on_eos: bool = field(default=True, metadata={"off": "--ignore-eos"})
    """Finish a sample at the model's EOS token (off: every response runs to max_new_tokens)."""
    cuda_graphs: bool = True
    """On a GPU, replay CUDA graphs for decode, verification and draft steps (off: eager)."""

    def __post_init__(self) -> None:
        finite(self)
        positive("max_new_tokens", self.max_new_tokens)
        if self.temperature < 0:
            raise ConfigError(f"{{temperature}} must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"{{top_k}} must be an integer >= 0, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"{{top_p}} must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class SpecConfig:
    """Speculative decoding: drafts from a draft model and/or the rollout's own history."""

    # auto: before every round the selector (generation/strategy.py) picks plain decoding or
    # 1..max_draft_tokens for the live batch; without a draft, plain decoding.
    num_draft_tokens: int | Literal["auto"] = "auto"
    """Draft tokens per verification: N >= 0 (0: plain decoding) or auto (picked per round)."""
    max_draft_tokens: int = 4
    """Largest draft length auto considers."""
    cost_profile: str | None = None
    """Auto: a JSON file of measured step latencies (None: learned from the rounds as they run)."""
    # Loaded if it exists, else profiled at the first call and written there.
    acceptance_decay: float = field(default=0.98, metadata={"flag": None})
    """Auto: weight the acceptance estimate keeps per generation round."""
    # Below 1 so that the estimate follows the actor as it trains.
    # exact: a draft token is accepted iff plain sampling draws it there, so the samples are
    # speculation off's, token for token. rejection (model drafts): lossless in distribution
    # only; the samples then depend on the selector's choices and timing.
    verify: SpecVerify = field(default="exact", metadata={"flag": "--spec-verify"})
    """exact (samples equal plain decoding's) or rejection (not reproducible from the seed)."""
    draft_source: DraftSource | None = None
    """Drafts from the draft model, the rollout's history or both (None: model if one is loaded)."""
    # history needs no draft model; None without a draft model: no speculation.
    history_responses: int = 16
    """History drafts: earlier responses kept per prompt (newest first)."""
    history_prompts: int = 4096
    """History drafts: prompts whose responses are kept (least recently used dropped)."""
    history_global: int = 0
    """History drafts: newest responses to any prompt kept in a global index (0: off)."""
    # Drafted from where they match longer than the prompt's own history.

    def __post_init__(self) -> None:
        finite(self)
        n = self.num_draft_tokens
        if isinstance(n, str) and n.strip().isdigit():
            n = self.num_draft_tokens = int(n)
        if n != "auto" and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
            raise ConfigError(f"{{num_draft_tokens}} must be an integer >= 0 or 'auto', got {n!r}")
        positive("max_draft_tokens", self.max_draft_tokens)
        if not 0 < self.acceptance_decay <= 1:
            raise ConfigError(f"{{acceptance_decay}} must lie in (0, 1], got {self.acceptance_decay}")
        if self.verify not in SPEC_VERIFY:
            raise ConfigError(f"{{verify}} {self.verify!r}: use one of {', '.join(SPEC_VERIFY)}")
        if self.draft_source is not None and self.draft_source not in DRAFT_SOURCES:
            raise ConfigError(f"{{draft_source}} {self.draft_source!r}: use one of {', '.join(DRAFT_SOURCES)}")
        if self.verify == "rejection" and self.uses_history:
            raise ConfigError(f"{{verify}} rejection needs the draft's distribution; {{draft_source}} "
                              f"{self.draft_source} drafts single tokens from the history: use {{verify}} exact")
        positive("history_responses", self.history_responses)
        positive("history_prompts", self.history_prompts)
        if self.history_global < 0:
            raise ConfigError(f"{{history_global}} must be >= 0, got {self.history_global}")

    @property
    def uses_history(self) -> bool:
        """Drafts come (also) from the rollout's history."""
        return self.draft_source in ("history", "both")

    def check_sources(self, has_model: bool) -> None:
        """Raise unless the draft sources asked for are there (before any collective)."""
        if self.draft_source in ("model", "both") and not has_model:
            raise ConfigError(f"{{draft_source}} {self.draft_source} needs a draft model ({{draft_load}}); "
                              "without one use {draft_source} history")
        if self.draft_source == "history" and has_model:
            raise ConfigError("{draft_source} history drafts without a model: drop {draft_load}, or "
                              "use {draft_source} both (history where it matches, the model elsewhere)")

    @property
    def auto(self) -> bool:
        return self.num_draft_tokens == "auto"

    def base_tokens(self, has_draft: bool) -> int:
        """Draft tokens per verification as asked: ``n``, or auto's largest (0: plain decoding)."""
        # has_draft: a draft model is loaded.
        if not (has_draft or self.uses_history):
            return 0 if self.auto else self.num_draft_tokens
        return self.max_draft_tokens if self.auto else self.num_draft_tokens

    def max_tokens(self, has_draft: bool) -> int:
        """The most draft tokens one verification can take."""
        # base_tokens, times HISTORY_LONG_BOOST when only the history drafts (the cache keeps
        # room for base_tokens).
        n = self.base_tokens(has_draft)
        return n * HISTORY_LONG_BOOST if self.draft_source == "history" else n


@dataclass
class MigrationConfig:
    """Sample reallocation between data-parallel ranks during generation (RLHFSpec)."""

    sample_migration: bool | None = field(default=None, metadata={"form": "on-off"})
    """Move unfinished samples with their KV cache to idle DP ranks (None: on with 2+ DP ranks)."""
    migration_interval: int = 4
    """Rounds between exchanges of the ranks' live-sample counts (one small all-gather)."""
    # also at least 2 samples more than the idlest; samples then move until every rank is
    # within one of the mean
    migration_threshold: float = 0.25
    """Migrate when the busiest rank holds more than (1 + this) x the mean live count."""

    def __post_init__(self) -> None:
        finite(self)
        positive("migration_interval", self.migration_interval)
        if self.migration_threshold < 0:
            raise ConfigError(f"{{migration_threshold}} must be >= 0, got {self.migration_threshold}")

    def enabled(self, dp: int) -> bool:
        return dp > 1 and self.sample_migration is not False
