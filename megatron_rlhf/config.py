"""Config dataclasses, validated in ``__post_init__``.

Entry points map argparse flags onto these by field name (:mod:`megatron_rlhf.arguments`);
the library never sees ``args``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_rlhf.model_config import (  # noqa: F401  (re-exported: the configs' one home)
    FAMILIES,
    PRESETS,
    ROLES,
    ROPE_SCALING_KEYS,
    VOCAB_PAD_MULTIPLE,
    ModelConfig,
    _positive,
    check_role,
    preset,
)

SUBSET_MODELS = ("reference", "reward", "critic", "critic_inf")
"""Models whose layout may cover part of the world: the frozen reference and reward model,
the critic's training (beside the actor's on other ranks, ``--train-layout`` over part of
the world too) and its inference copy (its weights reallocated there from the training
copy after each update)."""

MODEL_LAYOUT_FLAGS = {"reference": "--ref-layout", "reward": "--reward-layout",
                      "critic": "--critic-layout", "critic_inf": "--critic-infer-layout"}
"""The layouts of :meth:`ParallelConfig.model_layouts` (``critic``: its training,
``critic_inf``: its inference) and the flag that sets each."""


def flag_field(flag: str) -> str:
    """The config field (argparse ``dest``) a ``--flag-name`` sets: ``flag_name``."""
    return flag.removeprefix("--").replace("-", "_")


@dataclass
class ParallelConfig:
    """How the models are split over ranks: one layout for training and inference, one for
    generation (the actor and the draft; weights are reallocated between the two)."""

    tensor_model_parallel_size: int = 1
    """TP size of the train layout when ``train_layout`` is not given."""
    pipeline_model_parallel_size: int = 1
    """PP size of the train layout when ``train_layout`` is not given (generation never
    pipelines: with PP > 1 the actor gets a generation copy)."""
    train_layout: str | None = None
    """``TPxPPxDP`` of the actor's training and of the other models without a layout of
    their own (None: ``tensor_model_parallel_size`` x ``pipeline_model_parallel_size`` x
    the rest of the world). With a ``gen_layout`` it may cover part of the world
    (``TPxPPxDP@R``, ranks R..R+size-1): the actor then trains there only, beside the critic
    on other ranks (``critic_layout``), and the generation layout's ranks hold the samples."""
    gen_layout: str | None = None
    """``TPxDP`` of generation (None: the train layout's TP x the rest of the world, i.e.
    no reallocation)."""
    ref_layout: str | None = None
    """``TPxPPxDP`` of the reference model's inference (None: the train layout); over all
    ranks, or over fewer with ``@R`` (ranks R..R+size-1; the model lives there only, and
    runs beside a reward model on other ranks)."""
    reward_layout: str | None = None
    """``TPxPPxDP[@R]`` of the reward model's inference (None: the train layout), as
    ``ref_layout``."""
    critic_layout: str | None = None
    """``TPxPPxDP[@R]`` of the critic's training, and of its inference unless
    ``critic_infer_layout`` says otherwise (None: the train layout); over all ranks, or over
    fewer (beside the actor's training on the others)."""
    critic_infer_layout: str | None = None
    """``TPxPPxDP[@R]`` of the critic's inference (values) when it differs from its training
    layout: a second critic copy there (over all ranks, or over fewer as ``ref_layout``),
    its weights reallocated after every critic update (None: the critic's training layout,
    one copy)."""
    draft_train_layout: str = "gen"
    """Where the draft's distillation runs: ``gen`` (with the draft's generation copy,
    the teacher the actor's generation copy) or ``train`` (a second draft copy on the
    train layout, PP=1, the teacher the actor's training copy; the draft's weights are
    then reallocated to its generation copy with the actor's)."""
    recompute_granularity: str | None = None
    """Activation recompute of the models that train: ``full`` (each layer re-run in
    backward from its input), ``selective`` (the attention core only), None (keep all)."""
    sequence_parallel: bool = False
    """Split whole sequences over TP between its regions in the train layout's models
    (actor, reference, critic, reward; not the generation copy or the draft): activations
    outside attention/MLP divided by TP. Nothing changes at TP = 1."""
    release_train_copy: bool | None = None
    """When the actor generates on a copy of its own (a generation layout), its training
    copy's weights wait in pinned host memory during the rollout. None: on GPU."""
    plan: str | None = None
    """An execution plan (``tools/plan.py --out FILE``) or ``auto`` (searched at start-up,
    :mod:`megatron_rlhf.plan.search`): sets ``train_layout`` and ``gen_layout``."""
    plan_hardware: str | None = None
    """``plan auto``: a hardware profile name or file (see :mod:`megatron_rlhf.plan.cost`)."""

    def __post_init__(self) -> None:
        _positive("tensor parallel size", self.tensor_model_parallel_size)
        if self.plan is not None and (self.train_layout or self.gen_layout or self.ref_layout
                                      or self.reward_layout or self.critic_layout
                                      or self.critic_infer_layout):
            raise ValueError("--plan sets the layouts: drop the --*-layout flags, or --plan")
        _positive("pipeline parallel size", self.pipeline_model_parallel_size)
        from megatron_rlhf.parallel.layout import Layout

        if self.train_layout is not None:
            t = Layout.parse(self.train_layout)
            for flag, given, want in (("--tensor-model-parallel-size", self.tensor_model_parallel_size, t.tp),
                                      ("--pipeline-model-parallel-size", self.pipeline_model_parallel_size, t.pp)):
                if given not in (1, want):
                    raise ValueError(f"{flag} {given} contradicts --train-layout {self.train_layout}; "
                                     f"give one of them")
            self.tensor_model_parallel_size, self.pipeline_model_parallel_size = t.tp, t.pp
        if self.gen_layout is not None:
            Layout.parse(self.gen_layout, pipeline=False)
        for text in (self.ref_layout, self.reward_layout, self.critic_layout, self.critic_infer_layout):
            if text is not None:
                Layout.parse(text)
        if self.draft_train_layout not in ("gen", "train"):
            raise ValueError(f"--draft-train-layout {self.draft_train_layout!r}: use gen or train")
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ValueError(f"--recompute-granularity {self.recompute_granularity!r}: use full or selective")

    def check_world(self, world_size: int) -> int:
        """Return the train layout's data-parallel size, or raise if it does not fit."""
        return self.layouts(world_size)[0].dp

    def model_layouts(self, world_size: int) -> dict:
        """``{name: Layout}`` of the models given a layout of their own (``reference``,
        ``reward``, ``critic``: its training) and of the critic's inference when given apart
        (``critic_inf``); ValueError naming the flag when one does not fit the world."""
        from megatron_rlhf.parallel.layout import Layout

        out = {}
        for name, flag in MODEL_LAYOUT_FLAGS.items():
            text = getattr(self, flag_field(flag))
            if text is None:
                continue
            lay = Layout.parse(text)  # (over all ranks or over fewer: SUBSET_MODELS)
            if max(lay.ranks) >= world_size:
                raise ValueError(f"{flag} {text} needs ranks {lay.ranks[0]}..{lay.ranks[-1]}, the "
                                 f"world has 0..{world_size - 1}: fewer ranks or a lower @FIRST_RANK")
            out[name] = lay
        return out

    def layouts(self, world_size: int):
        """``(train, gen)`` :class:`~megatron_rlhf.parallel.layout.Layout` over
        ``world_size`` ranks; ValueError naming the fix when one does not cover the world."""
        from megatron_rlhf.parallel.layout import Layout

        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        if self.train_layout is not None:
            train = Layout.parse(self.train_layout)
            if max(train.ranks) >= world_size:
                raise ValueError(f"--train-layout {self.train_layout} needs ranks {train.ranks[0]}.."
                                 f"{train.ranks[-1]}, the world has 0..{world_size - 1}: TP x PP x DP "
                                 "must fit it")
            if train.size != world_size and self.gen_layout is None:
                raise ValueError(f"--train-layout {self.train_layout} covers {train.size} of the "
                                 f"world's {world_size} ranks: give --gen-layout TPxDP over all of "
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
            raise ValueError(f"--gen-layout {self.gen_layout} covers {gen.size} ranks, the world "
                             f"has {world_size}: TP x DP must equal it (e.g. --gen-layout "
                             f"{gen.tp}x{max(world_size // gen.tp, 1)})")
        return train, gen


@dataclass
class PrecisionConfig:
    """Parameter and compute dtype."""

    bf16: bool | None = None
    """True: bf16; False: fp32; None: bf16 on GPU, fp32 on CPU."""


@dataclass
class GenerationConfig:
    """What the generator produces and how it samples."""

    max_new_tokens: int = 64
    """Tokens to generate after each prompt (fewer when EOS comes first)."""
    temperature: float = 1.0
    """0 is greedy (argmax); otherwise logits are divided by it."""
    top_k: int = 0
    """Sample among the k most likely tokens only (0: all)."""
    top_p: float = 1.0
    """Sample among the smallest set of tokens whose probability reaches top_p (1.0: all)."""
    stop_on_eos: bool = True
    """Finish a sample at the model's EOS token."""
    cuda_graphs: bool = True
    """On a GPU, decode steps, verifications and draft steps replay captured CUDA graphs
    (:mod:`megatron_rlhf.generation.graphs`); off: every step is launched eagerly."""

    def __post_init__(self) -> None:
        _positive("max_new_tokens", self.max_new_tokens)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class SpecConfig:
    """Speculative decoding: drafts from a draft model and/or the rollout's own history."""

    num_draft_tokens: int | str = "auto"
    """Draft tokens per verification: a fixed ``n >= 0`` (0: plain decoding), or ``"auto"``:
    before every round the selector (:mod:`megatron_rlhf.generation.strategy`) picks plain
    decoding or ``n`` in ``1..max_draft_tokens`` for the live batch. Without a draft model
    ``auto`` is plain decoding."""
    max_draft_tokens: int = 4
    """Largest ``n`` the ``auto`` selector considers."""
    cost_profile: str | None = None
    """``auto``: a JSON file of measured step latencies, loaded when it exists, else
    written after the engine profiles itself at the first call. None: no profile, the
    selector learns the costs from the rounds as they run
    (:class:`~megatron_rlhf.generation.strategy.OnlineCosts`)."""
    acceptance_decay: float = 0.98
    """``auto``: weight the acceptance estimate keeps per generation round (plain or
    speculative); older rounds fade so the estimate follows the actor as it trains."""
    verify: str = "exact"
    """``exact``: a draft token is accepted iff it is the token plain sampling draws at its
    position with that position's keyed uniform, so the samples are those of speculation
    off, token for token, whatever the drafts and the selector's choices. ``rejection``
    (model drafts only): rejection sampling against the draft's distribution, lossless in
    distribution, but the samples then depend on the drafting choices (under ``auto``, on
    the selector's timings), so a run is not reproducible from its seed."""
    draft_source: str | None = None
    """Where drafts come from: ``model`` (the draft model), ``history`` (the rollout's own
    history: no draft model, no forward pass; :mod:`~megatron_rlhf.generation.history`),
    ``both`` (history where it matches, the model elsewhere). None: ``model`` with a draft
    model, else no speculation."""
    history_responses: int = 16
    """History drafts: earlier responses kept per prompt (newest first)."""
    history_prompts: int = 4096
    """History drafts: prompts whose responses are kept (least recently used dropped)."""
    history_global: int = 0
    """History drafts: the newest responses to any prompt kept in a global index, drafted
    from where they match longer than the prompt's own history (0: no global index)."""

    def __post_init__(self) -> None:
        n = self.num_draft_tokens
        if isinstance(n, str) and n.strip().isdigit():
            n = self.num_draft_tokens = int(n)
        if n != "auto" and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
            raise ValueError(f"--num-draft-tokens must be an integer >= 0 or 'auto', got {n!r}")
        _positive("max_draft_tokens", self.max_draft_tokens)
        if not 0 < self.acceptance_decay <= 1:
            raise ValueError(f"acceptance_decay must lie in (0, 1], got {self.acceptance_decay}")
        if self.verify not in SPEC_VERIFY:
            raise ValueError(f"--spec-verify {self.verify!r}: use one of {', '.join(SPEC_VERIFY)}")
        if self.draft_source is not None and self.draft_source not in DRAFT_SOURCES:
            raise ValueError(f"--draft-source {self.draft_source!r}: use one of {', '.join(DRAFT_SOURCES)}")
        if self.verify == "rejection" and self.uses_history:
            raise ValueError(f"--spec-verify rejection needs the draft's distribution; --draft-source "
                             f"{self.draft_source} drafts single tokens from the history: use --spec-verify exact")
        _positive("history_responses", self.history_responses)
        _positive("history_prompts", self.history_prompts)
        if self.history_global < 0:
            raise ValueError(f"--history-global must be >= 0, got {self.history_global}")

    @property
    def uses_history(self) -> bool:
        """Drafts come (also) from the rollout's history."""
        return self.draft_source in ("history", "both")

    def check_sources(self, has_model: bool) -> None:
        """Raise unless the draft sources asked for are there (before any collective)."""
        if self.draft_source in ("model", "both") and not has_model:
            raise ValueError(f"--draft-source {self.draft_source} needs a draft model (--draft-load); "
                             "without one use --draft-source history")
        if self.draft_source == "history" and has_model:
            raise ValueError("--draft-source history drafts without a model: drop --draft-load, or "
                             "use --draft-source both (history where it matches, the model elsewhere)")

    @property
    def auto(self) -> bool:
        return self.num_draft_tokens == "auto"

    def base_tokens(self, has_draft: bool) -> int:
        """Draft tokens per verification as asked (the fixed ``n``, or ``auto``'s largest;
        0: plain decoding only); ``has_draft``: a draft model is loaded."""
        if not (has_draft or self.uses_history):
            return 0 if self.auto else self.num_draft_tokens
        return self.max_draft_tokens if self.auto else self.num_draft_tokens

    def max_tokens(self, has_draft: bool) -> int:
        """The most draft tokens one verification can take: :meth:`base_tokens`, times
        :data:`HISTORY_LONG_BOOST` when only the history drafts (a long-running sample's
        history drafts run further, as in DAS, where its cache row has the room; the cache
        keeps room for :meth:`base_tokens`)."""
        n = self.base_tokens(has_draft)
        return n * HISTORY_LONG_BOOST if self.draft_source == "history" else n


HISTORY_LONG_BOOST = 2
"""History drafts of a sample that has run long (``long_after`` tokens,
:class:`~megatron_rlhf.generation.history.HistoryDrafter`) may be this many times longer
than ``n``: the long tail of a rollout is where drafting pays (DAS)."""
SPEC_VERIFY = ("exact", "rejection")
DRAFT_SOURCES = ("model", "history", "both")


@dataclass
class MigrationConfig:
    """Sample reallocation between data-parallel ranks during generation (RLHFSpec)."""

    sample_migration: bool | None = None
    """Move unfinished samples (KV cache included) from busy to idle data-parallel ranks;
    None: on when there is more than one data-parallel rank."""
    migration_interval: int = 4
    """Rounds between exchanges of the ranks' live-sample counts (one small all-gather)."""
    migration_threshold: float = 0.25
    """Migrate when the busiest rank holds more than ``1 + threshold`` times the mean live
    count and at least 2 samples more than the idlest; samples then move until every rank
    is within one of the mean."""

    def __post_init__(self) -> None:
        _positive("migration_interval", self.migration_interval)
        if self.migration_threshold < 0:
            raise ValueError(f"migration_threshold must be >= 0, got {self.migration_threshold}")

    def enabled(self, dp: int) -> bool:
        return dp > 1 and self.sample_migration is not False


ADVANTAGE_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce++")
"""gae: a critic; grpo: group-normalised scores, KL as a loss term; rloo: leave-one-out
baselines within a prompt's group, KL in the reward; reinforce++: discounted returns of
the KL-shaped reward whitened over the batch (no baseline model)."""
KL_ESTIMATORS = ("k1", "k2", "k3", "abs")
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass
class PPOConfig:
    """One RLHF iteration: how much is generated, and how actor and critic learn from it."""

    global_batch_size: int = 8
    """Prompts per iteration, over all data-parallel ranks."""
    rollout_n: int = 2
    """Responses sampled per prompt (a GRPO group)."""
    micro_batch_size: int = 4
    """Sequences per forward/backward pass (gradients accumulate over micro-batches)."""
    num_mini_batches: int = 1
    """Optimizer steps per PPO epoch: the iteration's samples are split into this many."""
    ppo_epochs: int = 1
    """Passes over the iteration's samples."""
    advantage_estimator: str = "gae"
    """gae (with a critic) or grpo (group-normalised rewards, no critic)."""
    gamma: float = 1.0
    """GAE discount."""
    lam: float = 0.95
    """GAE lambda."""
    whiten_advantages: bool = True
    """Normalise GAE advantages over the whole batch (all data-parallel ranks)."""
    clip_eps: float = 0.2
    """PPO ratio clip: ``[1 - clip_eps_low, 1 + clip_eps_high]``, both this unless set."""
    clip_eps_low: float | None = None
    """Lower ratio clip (None: ``clip_eps``)."""
    clip_eps_high: float | None = None
    """Upper ratio clip (None: ``clip_eps``); DAPO's clip-higher sets it above the lower
    one (0.28 against 0.2) so that unlikely tokens can gain probability."""
    dual_clip: float | None = None
    """Dual-clip PPO: for negative advantages the ratio term is capped at ``-A * C`` (C > 1),
    so one token far off-policy cannot dominate the loss (None: off)."""
    value_clip_eps: float = 0.2
    """Clip of the critic's new values around the old ones (0: no value clipping)."""
    kl_coef: float = 0.05
    """KL(actor || reference) weight: a per-token reward penalty with gae, a loss term with grpo."""
    kl_estimator: str | None = None
    """Per-token KL estimate: k1 (log-ratio), k2, k3 (Schulman), abs. None: k3 where the KL
    is a loss (grpo), k1 where it shapes the reward. As a loss, k1 and abs are refused: the
    expected gradient of k1 is zero, and that of abs is not the KL's."""
    entropy_coef: float = 0.0
    """Entropy bonus weight in the policy loss."""
    loss_agg: str = "token-mean"
    """How per-token policy losses become one: token-mean (over the mini-batch's response
    tokens on all ranks), seq-mean-token-mean (each response's token mean, averaged over
    responses) or seq-mean-token-sum-norm (Dr. GRPO: each response's token sum over a
    constant, the response-length limit, averaged over responses)."""
    filter_groups: bool = False
    """DAPO's dynamic sampling: drop prompt groups whose rewards are all equal (no signal
    for a group baseline) and generate for more prompts until the batch is full."""
    filter_max_tries: int = 4
    """--filter-groups: generation rounds per iteration at most; a batch still short after
    them is filled with dropped groups (counted in the metrics)."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: responses within this many tokens of the length
    limit lose up to ``overlong_penalty``, linearly (0: off)."""
    overlong_penalty: float = 1.0
    """The largest soft overlong penalty, reached at the length limit."""
    recompute_logprobs: bool | None = None
    """Take log pi_old from a training forward instead of from generation (None: for bf16
    models, where the cached decode and the full forward round differently, and when
    sampling is tempered or truncated, so that the first PPO ratio is exactly 1; unless
    :attr:`old_from_update`, which needs no forward at all)."""

    def __post_init__(self) -> None:
        for name in ("global_batch_size", "rollout_n", "micro_batch_size", "num_mini_batches",
                     "ppo_epochs", "filter_max_tries"):
            _positive(name, getattr(self, name))
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"unknown advantage estimator {self.advantage_estimator!r}; "
                             f"valid: {', '.join(ADVANTAGE_ESTIMATORS)}")
        if self.kl_estimator is None:
            self.kl_estimator = "k3" if self.kl_in_loss else "k1"
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"unknown KL estimator {self.kl_estimator!r}; "
                             f"valid: {', '.join(KL_ESTIMATORS)}")
        if self.kl_in_loss and self.kl_coef and self.kl_estimator in ("k1", "abs"):
            why = ("its expected gradient is zero (E[grad log pi] = 0), so the KL term would do "
                   "nothing" if self.kl_estimator == "k1" else
                   "its gradient is sign(log pi/pi_ref) * grad log pi, not the KL's")
            raise ValueError(f"--kl-estimator {self.kl_estimator} cannot be the KL loss of "
                             f"{self.advantage_estimator}: {why}; use k3 (the default) or k2")
        if self.advantage_estimator in ("grpo", "rloo") and self.rollout_n < 2:
            raise ValueError(f"{self.advantage_estimator} compares the responses to one prompt: "
                             "use --rollout-n >= 2")
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ValueError(f"gamma and lam must lie in [0, 1], got {self.gamma}, {self.lam}")
        if self.clip_eps <= 0 or self.value_clip_eps < 0 or self.kl_coef < 0:
            raise ValueError("clip_eps must be > 0, value_clip_eps and kl_coef >= 0")
        for name in ("clip_eps_low", "clip_eps_high"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {v}")
        if self.clip_low >= 1:
            raise ValueError(f"the lower ratio clip {self.clip_low} must be < 1 (the ratio is "
                             f"clipped to [1 - low, 1 + high])")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"--dual-clip {self.dual_clip} must be > 1 (a cap on the ratio for "
                             "negative advantages, above the clip range; typically 3)")
        if self.loss_agg not in LOSS_AGGREGATIONS:
            raise ValueError(f"unknown --loss-agg {self.loss_agg!r}; valid: {', '.join(LOSS_AGGREGATIONS)}")
        if self.filter_groups and self.rollout_n < 2:
            raise ValueError("--filter-groups drops groups whose rewards are all equal: it needs "
                             "--rollout-n >= 2")
        if self.overlong_buffer < 0 or self.overlong_penalty < 0:
            raise ValueError(f"--overlong-buffer {self.overlong_buffer} and --overlong-penalty "
                             f"{self.overlong_penalty} must be >= 0")

    @property
    def clip_low(self) -> float:
        return self.clip_eps if self.clip_eps_low is None else self.clip_eps_low

    @property
    def clip_high(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high

    @property
    def use_critic(self) -> bool:
        return self.advantage_estimator == "gae"

    @property
    def old_from_update(self) -> bool:
        """log pi_old is the update forward's own log-probs, detached: with one optimizer step
        per iteration (one PPO epoch, one mini-batch) the policy being updated *is* the old
        one, so the ratio is exactly 1 without a forward to recompute it (as TRL and verl
        do). Only when ``recompute_logprobs`` is left unset, and no KL term shapes the
        reward (that one is computed from log pi_old before the update)."""
        return (self.recompute_logprobs is None and self.ppo_epochs == 1 and self.num_mini_batches == 1
                and not (self.kl_coef and not self.kl_in_loss))

    @property
    def uses_reference(self) -> bool:
        """A KL term reads the reference's log-probs; without one (``kl_coef`` 0) the reference
        model is neither loaded nor run."""
        return self.kl_coef > 0

    @property
    def kl_in_loss(self) -> bool:
        """The KL to the reference is a loss term (GRPO), not part of the reward."""
        return self.advantage_estimator == "grpo"

    @property
    def samples_per_iteration(self) -> int:
        return self.global_batch_size * self.rollout_n

    def check_data_parallel(self, dp: int) -> int:
        """Samples per rank, or a message saying which flags to change."""
        if self.global_batch_size % dp:
            raise ValueError(
                f"--global-batch-size {self.global_batch_size} prompts must split evenly over "
                f"{dp} data-parallel ranks (a prompt's {self.rollout_n} samples stay on one rank)"
            )
        per_step = self.micro_batch_size * dp * self.num_mini_batches
        if self.samples_per_iteration % per_step:
            raise ValueError(
                f"--global-batch-size {self.global_batch_size} x --rollout-n {self.rollout_n} = "
                f"{self.samples_per_iteration} samples per iteration is not divisible by "
                f"--micro-batch-size {self.micro_batch_size} x {dp} data-parallel ranks x "
                f"--num-mini-batches {self.num_mini_batches} = {per_step}"
            )
        return self.samples_per_iteration // dp


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine decay, and gradient clipping."""

    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the cosine decay."""
    lr_warmup_iters: int = 0
    """Iterations of linear warmup from 0."""
    lr_decay_iters: int | None = None
    """Iterations until min_lr (None: the whole run)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay (not applied to norms and biases)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip over all ranks of the model (0: none)."""
    critic_lr: float = 5e-6
    """Peak learning rate of the critic (same schedule)."""
    draft_lr: float = 1e-4
    """Learning rate of the draft under --draft-distill (constant)."""
    use_distributed_optimizer: bool = True
    """Shard the fp32 master weights and Adam states over data-parallel ranks (megatron's
    distributed optimizer, ZeRO-1); False: every DP rank holds them all."""
    overlap_grad_reduce: bool | None = None
    """Reduce gradients bucket by bucket during the last micro-batch's backward (megatron's
    DDP) instead of after it; None: on GPU only."""
    overlap_param_gather: bool | None = None
    """With the distributed optimizer and overlapped gradient reduction: gather the updated
    parameters bucket by bucket during the next mini-batch's forward instead of in the
    optimizer step (megatron's DDP forward pre-hooks); the trainer completes the gather when
    a training stage ends. None: wherever gradients overlap."""

    def __post_init__(self) -> None:
        if self.lr < 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= min_lr <= lr, got lr={self.lr}, min_lr={self.min_lr}")
        if self.critic_lr < 0 or self.draft_lr < 0:
            raise ValueError("critic_lr and draft_lr must be >= 0")
        if self.lr_warmup_iters < 0 or self.clip_grad < 0 or self.weight_decay < 0:
            raise ValueError("lr_warmup_iters, clip_grad and weight_decay must be >= 0")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError("--overlap-param-gather gathers the distributed optimizer's shards: "
                             "drop --no-distributed-optimizer or --overlap-param-gather")
        if self.overlap_param_gather and self.overlap_grad_reduce is False:
            raise ValueError("--overlap-param-gather needs overlapped gradient reduction: drop "
                             "--no-overlap-grad-reduce or --overlap-param-gather")



@dataclass
class LoopConfig:
    """The RLHF run around the iterations: length, data, checkpoints, draft upkeep."""

    train_iters: int = 20
    """RLHF iterations (rollout + experience + PPO update each)."""
    save_interval: int = 0
    """Save a resumable checkpoint every this many iterations (0: only at the end)."""
    keep_last_checkpoints: int = 0
    """Keep only the newest this many checkpoints under --save (0: keep every one)."""
    seed: int = 1234
    """Seeds the prompt order, the sampling of every iteration and the initialisations."""
    max_prompt_length: int = 256
    """Longest prompt in tokens (chat template included); longer prompts are an error."""
    chat: bool = True
    """Format prompts with the tokenizer's chat template."""
    draft_distill: bool = False
    """Distil the draft towards the updated actor on each iteration's rollouts."""
    draft_distill_topk: int = 64
    """Teacher tokens per position for --draft-distill."""
    prompt_key: str = "prompt"
    """The field of a dataset record holding the prompt: a string or a chat messages list."""
    wandb_project: str | None = None
    """Log every metric to this Weights & Biases project too (offline without a network)."""

    def __post_init__(self) -> None:
        _positive("train_iters", self.train_iters)
        _positive("max_prompt_length", self.max_prompt_length)
        _positive("draft_distill_topk", self.draft_distill_topk)
        if self.save_interval < 0:
            raise ValueError("save_interval must be >= 0")
        if self.keep_last_checkpoints < 0:
            raise ValueError("keep_last_checkpoints must be >= 0 (0 keeps every checkpoint)")


@dataclass
class RewardConfig:
    """How a reward function (``--reward-fn``) scores the samples."""

    answer_key: str = "answer"
    """The record field a verifier (``--reward-fn math``) checks the final answer against."""
    reward_timeout: float = 10.0
    """Seconds one verifier call may take; past it the sample scores 0 (counted)."""
    reward_workers: int | None = None
    """Processes verifying a batch (None: a small default; 0: in this process)."""
    strict_rewards: bool = False
    """A crash, a non-number or a timeout of the reward stops the run with a RewardError
    (default: the sample scores 0, counted in ``reward_errors`` / ``reward_timeouts``)."""
    tolerate_reward_errors: bool = False
    """Train on when every sample of a batch failed its reward function (default: stop with a
    RewardError; one failed sample among others always scores 0 and is counted)."""

    def __post_init__(self) -> None:
        if not self.reward_timeout > 0:
            raise ValueError(f"--reward-timeout must be > 0 seconds, got {self.reward_timeout}")
        if self.reward_workers is not None and self.reward_workers < 0:
            raise ValueError(f"--reward-workers must be >= 0, got {self.reward_workers}")


@dataclass
class EvalConfig:
    """Held-out evaluation: the policy generates for every held-out record (on the
    generation layout, with the engine and its speculation), scored with the run's reward."""

    eval_interval: int = 0
    """Evaluate before iteration 1 and every this many iterations (and after the last);
    0: only before the first and after the last iteration."""
    eval_samples: int = 1
    """Responses per held-out prompt (K); pass@K is reported for K > 1."""
    eval_temperature: float = 0.0
    """Sampling temperature of the evaluation (0: greedy)."""
    eval_threshold: float = 1.0
    """A response counts as correct (``eval/accuracy``) when it scores at least this."""
    eval_limit: int = 0
    """Evaluate on the first this many held-out records (0: all)."""

    def __post_init__(self) -> None:
        _positive("eval_samples", self.eval_samples)
        if self.eval_interval < 0 or self.eval_limit < 0:
            raise ValueError("--eval-interval and --eval-limit must be >= 0")
        if self.eval_temperature < 0:
            raise ValueError(f"--eval-temperature must be >= 0, got {self.eval_temperature}")
        if self.eval_samples > 1 and self.eval_temperature == 0:
            raise ValueError(f"--eval-samples {self.eval_samples} greedy responses would all be "
                             "the same: set --eval-temperature > 0 (e.g. 1.0) or --eval-samples 1")

    def due(self, iteration: int, last: int) -> bool:
        """Whether to evaluate after ``iteration`` (0: before the first one)."""
        return (iteration == 0 or iteration == last
                or bool(self.eval_interval and iteration % self.eval_interval == 0))


FINETUNE_LOSSES = ("sft", "bradley-terry", "dpo")


@dataclass
class FinetuneConfig:
    """A fine-tuning stage: SFT on responses, a reward model on preference pairs
    (Bradley-Terry), or DPO on preference pairs."""

    loss: str = "sft"
    """sft (next-token loss on response tokens), bradley-terry (reward model) or dpo."""
    data: str = ""
    """jsonl: SFT ``{"prompt", "response"}`` or chat ``{"messages"}``; pairs ``{"prompt",
    "chosen", "rejected"}``."""
    held_out_fraction: float = 0.1
    """Records held out for evaluation (a seeded split)."""
    seq_length: int | None = None
    """Longest prompt + response in tokens (None: 512); longer records are an error."""
    chat: bool = True
    """Format prompts with the tokenizer's chat template (as the RLHF loop does)."""
    global_batch_size: int = 16
    """Examples (SFT) or pairs per optimizer step, over all data-parallel ranks."""
    micro_batch_size: int = 4
    """Examples or pairs per forward on one rank."""
    pack: bool = False
    """SFT: pack several examples into rows of ``seq_length`` tokens (attention stays
    inside each example)."""
    beta: float = 0.1
    """DPO: the implicit reward's scale."""
    label_smoothing: float = 0.0
    """DPO: conservative DPO's label noise."""
    train_iters: int = 100
    """Optimizer steps."""
    eval_interval: int = 0
    """Evaluate on the held-out records every this many steps (0: at the end)."""
    save_interval: int = 0
    """Save every this many steps (0: at the end, with ``--save``)."""
    keep_last_checkpoints: int = 0
    """Keep the newest this many checkpoints (0: all)."""
    seed: int = 1234
    """Seeds the split, the data order and the initialisations."""

    def __post_init__(self) -> None:
        if self.loss not in FINETUNE_LOSSES:
            raise ValueError(f"unknown loss {self.loss!r}; valid: {', '.join(FINETUNE_LOSSES)}")
        for name in ("global_batch_size", "micro_batch_size", "train_iters"):
            _positive(name, getattr(self, name))
        if self.seq_length is None:
            self.seq_length = 512
        _positive("seq_length", self.seq_length)
        if self.beta <= 0 or not 0 <= self.label_smoothing < 0.5:
            raise ValueError("--beta must be > 0 and --label-smoothing in [0, 0.5)")
        if self.pack and self.loss != "sft":
            raise ValueError("--pack applies to SFT only")

    def check_data_parallel(self, dp: int) -> int:
        """Examples (or pairs) per rank and step, or a message naming the flags to change."""
        per = self.micro_batch_size * dp
        if self.global_batch_size % per:
            raise ValueError(f"--global-batch-size {self.global_batch_size} must be a multiple of "
                             f"--micro-batch-size {self.micro_batch_size} x data-parallel size {dp} = {per}")
        return self.global_batch_size // dp


def dataclass_from_namespace(cls, namespace, **extra):
    """Build ``cls`` from the argparse attributes that share its field names."""
    values = {
        f.name: getattr(namespace, f.name)
        for f in dataclasses.fields(cls)
        if getattr(namespace, f.name, None) is not None
    }
    values.update(extra)
    return cls(**values)


__all__ = [
    "ModelConfig", "ParallelConfig", "PrecisionConfig", "GenerationConfig", "SpecConfig", "MigrationConfig", "PPOConfig", "OptimConfig", "LoopConfig", "RewardConfig", "EvalConfig", "FinetuneConfig", "FINETUNE_LOSSES",
    "ADVANTAGE_ESTIMATORS", "KL_ESTIMATORS", "LOSS_AGGREGATIONS", "PRESETS", "ROLES",
    "preset", "check_role", "dataclass_from_namespace",
]
