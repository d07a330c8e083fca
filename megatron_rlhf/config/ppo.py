"""One RLHF iteration: how much is generated, and how actor and critic learn from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from megatron_rlhf.config.errors import ConfigError, finite, nonnegative, positive

AdvantageEstimator = Literal["gae", "grpo", "rloo", "reinforce++"]
KLEstimator = Literal["k1", "k2", "k3", "abs"]
RoutingReplay = Literal["off", "rollout"]
LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                          "seq-mean-token-sum-norm"]
# gae: a critic; grpo: group-normalised scores, KL as a loss term; rloo: leave-one-out
# baselines within a prompt's group, KL in the reward; reinforce++: discounted returns of
# the KL-shaped reward whitened over the batch (no baseline model).
ADVANTAGE_ESTIMATORS = get_args(AdvantageEstimator)
KL_ESTIMATORS = get_args(KLEstimator)
LOSS_AGGREGATIONS = get_args(LossAggregation)


@dataclass
class PPOConfig:
    """One RLHF iteration: how much is generated, and how actor and critic learn from it."""

    global_batch_size: int = 8
    """Prompts per iteration, over all data-parallel ranks."""
    rollout_n: int = 2
    """Responses sampled per prompt (a GRPO group)."""
    micro_batch_size: int = 4
    """Sequences per forward/backward pass (gradients accumulate over micro-batches)."""
    max_tokens_per_micro_batch: int | None = None
    """Tokens per packed micro-batch of the experience and training forwards: rows concatenated
    without padding, as many as fit (None: micro_batch_size x the batch's longest sequence; 0:
    no packing, micro_batch_size padded rows)."""
    # verl's dynamic batch size with remove-padding. A packed row attends within itself and its
    # RoPE positions restart; only models with the SDPA attention of the local spec pack.
    num_mini_batches: int = 1
    """Optimizer steps per PPO epoch: the iteration's samples are split into this many."""
    ppo_epochs: int = 1
    """Passes over the iteration's samples."""
    advantage_estimator: AdvantageEstimator = "gae"
    """gae (with a critic), grpo (scores normalised in their group), rloo or reinforce++
    (the last three train no critic)."""
    # grpo: group-normalised, KL as a loss; rloo: leave-one-out baseline in the group;
    # reinforce++: whitened returns.
    grpo_std_norm: bool = True
    """grpo: divide each group's centred scores by their std (unbiased, + 1e-6, as verl);
    off: Dr. GRPO."""
    # Off, the advantage is score - group mean (Dr. GRPO, verl's norm_adv_by_std_in_grpo=False):
    # a group of nearly equal scores is not blown up by a tiny std. Dr. GRPO pairs it with
    # --loss-agg seq-mean-token-sum-norm.
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
    """Upper ratio clip (None: ``clip_eps``); DAPO's clip-higher sets it above the lower one."""
    # DAPO uses 0.28 against 0.2, so that unlikely tokens can gain probability.
    dual_clip: float | None = None
    """Dual-clip PPO: cap the ratio term of negative advantages at ``-A * C``, C > 1 (None: off)."""
    # So one token far off-policy cannot dominate the loss.
    value_clip_eps: float = 0.2
    """Clip of the critic's new values around the old ones (0: no value clipping)."""
    kl_coef: float = 0.05
    """KL(actor || reference) weight: a per-token reward penalty with gae, a loss term with grpo."""
    # As a loss, k1 and abs are refused: k1's expected gradient is zero, abs's is not the KL's.
    kl_estimator: KLEstimator | None = None
    """Per-token KL estimate (None: k3 where the KL is a loss, grpo; k1 in the reward)."""
    entropy_coef: float = 0.0
    """Entropy bonus weight in the policy loss."""
    moe_aux_loss_coeff: float = 0.0
    """Mixture-of-experts models: weight of the routers' load-balancing loss in the update (0: none)."""
    # Switch Transformer's; megatron's router attaches it to the activations.
    moe_z_loss_coeff: float = 0.0
    """Mixture-of-experts models: weight of the routers' z-loss (ST-MoE's) in the update (0: none)."""
    moe_freeze_router: bool = False
    """Mixture-of-experts actors: the routers keep their loaded weights (no gradient, no update)."""
    # An upcycled model's pieces of one replica share a router row: trained, the rows drift
    # apart and top-k mixes pieces of different replicas, which the dense model never computed.
    routing_replay: RoutingReplay = "off"
    """Mixture-of-experts actors: ``rollout`` replays the experts each token took in the rollout in the actor's experience and training forwards; ``off``: its routers choose (routing_disagreement reports how often otherwise)."""
    skip_zero_advantage: bool = True
    """Leave out of the actor's forward and backward the responses whose advantages are all 0."""
    # Only where nothing else gives them a loss (no entropy bonus, no KL loss term): then
    # they add exact zeros, and the updated weights are bitwise those of the full step.
    drop_zero_advantage: bool = False
    """Drop the responses whose advantages are all 0 from the batch: the loss normalisers count only the others (DAPO's filtering of equal-score groups without generating replacements)."""
    # token-mean: over the mini-batch's response tokens on all ranks; seq-mean-token-mean:
    # each response's token mean, averaged; seq-mean-token-sum: each response's token sum,
    # averaged; seq-mean-token-sum-norm (Dr. GRPO): each response's token sum over the
    # response-length limit, averaged.
    loss_agg: LossAggregation = "token-mean"
    """How per-token policy losses become one (Dr. GRPO: seq-mean-token-sum-norm)."""
    filter_groups: bool = False
    """DAPO's dynamic sampling: drop groups of equal scores (before the overlong penalty),
    generate more until the batch is full."""
    # A group of equal scores gives a group baseline no signal, whatever its lengths.
    filter_max_tries: int = 4
    """filter_groups: most generation rounds per iteration (then dropped groups fill the batch)."""
    # The dropped groups that fill it are counted in the metrics.
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: tokens before --max-new-tokens where it starts (0: off)."""
    # Responses within this many tokens of the limit lose up to overlong_penalty, linearly.
    overlong_penalty: float = 1.0
    """The largest soft overlong penalty, reached at the length limit."""
    rollout_is_cap: float | None = None
    """Truncated importance sampling of the generator's samples (verl's and slime's TIS): each token's policy loss weighted by min(pi_old / pi_generator, C), pi_old from a training forward (needs log pi_old recomputed); None: off."""
    # None: on for bf16 models (the cached decode and the full forward round differently)
    # and for tempered or truncated sampling, so that the first PPO ratio is exactly 1;
    # off when old_from_update gives log pi_old without a forward.
    recompute_logprobs: bool | None = None
    """Take log pi_old from a training forward instead of from generation (None: when needed)."""

    def __post_init__(self) -> None:
        finite(self)
        for name in ("global_batch_size", "rollout_n", "micro_batch_size", "num_mini_batches",
                     "ppo_epochs", "filter_max_tries"):
            positive(name, getattr(self, name))
        if self.rollout_is_cap is not None and not self.rollout_is_cap > 0:
            raise ConfigError(f"{{rollout_is_cap}} must be > 0 (a cap on pi_old / pi_generator), got {self.rollout_is_cap}")
        nonnegative(self, "moe_aux_loss_coeff", "moe_z_loss_coeff")
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ConfigError(f"unknown advantage estimator {self.advantage_estimator!r}; "
                             f"valid: {', '.join(ADVANTAGE_ESTIMATORS)}")
        if self.kl_estimator is None:
            self.kl_estimator = "k3" if self.kl_in_loss else "k1"
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ConfigError(f"unknown KL estimator {self.kl_estimator!r}; "
                             f"valid: {', '.join(KL_ESTIMATORS)}")
        if self.kl_in_loss and self.kl_coef and self.kl_estimator in ("k1", "abs"):
            why = ("its expected gradient is zero (E[grad log pi] = 0), so the KL term would do "
                   "nothing" if self.kl_estimator == "k1" else
                   "its gradient is sign(log pi/pi_ref) * grad log pi, not the KL's")
            raise ConfigError(f"{{kl_estimator}} {self.kl_estimator} cannot be the KL loss of "
                             f"{self.advantage_estimator}: {why}; use k3 (the default) or k2")
        if self.advantage_estimator in ("grpo", "rloo") and self.rollout_n < 2:
            raise ConfigError(f"{self.advantage_estimator} compares the responses to one prompt: "
                              "use {rollout_n} >= 2")
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ConfigError(f"{{gamma}} and {{lam}} must lie in [0, 1], got {self.gamma}, {self.lam}")
        if self.clip_eps <= 0 or self.value_clip_eps < 0 or self.kl_coef < 0:
            raise ConfigError("{clip_eps} must be > 0, {value_clip_eps} and {kl_coef} >= 0")
        for name in ("clip_eps_low", "clip_eps_high"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ConfigError(f"{{{name}}} must be > 0, got {v}")
        if self.clip_low >= 1:
            raise ConfigError(f"the lower ratio clip {self.clip_low} must be < 1 (the ratio is "
                             f"clipped to [1 - low, 1 + high])")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ConfigError(f"{{dual_clip}} {self.dual_clip} must be > 1 (a cap on the ratio for "
                             "negative advantages, above the clip range; typically 3)")
        if not self.grpo_std_norm and self.advantage_estimator != "grpo":
            raise ConfigError(f"{{!grpo_std_norm}} changes grpo's advantages; the advantage "
                              f"estimator is {self.advantage_estimator}: drop the flag or use "
                              "{advantage_estimator} grpo")
        if self.loss_agg not in LOSS_AGGREGATIONS:
            raise ConfigError(f"unknown {{loss_agg}} {self.loss_agg!r}; valid: {', '.join(LOSS_AGGREGATIONS)}")
        if self.filter_groups and self.rollout_n < 2:
            raise ConfigError("{filter_groups} drops groups whose rewards are all equal: it needs "
                              "{rollout_n} >= 2")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 0:
            raise ConfigError(f"{{max_tokens_per_micro_batch}} {self.max_tokens_per_micro_batch} must be "
                              ">= 0 (0: padded micro-batches)")
        if self.overlong_buffer < 0 or self.overlong_penalty < 0:
            raise ConfigError(f"{{overlong_buffer}} {self.overlong_buffer} and {{overlong_penalty}} "
                              f"{self.overlong_penalty} must be >= 0")

    def check_generation(self, max_new_tokens: int, max_prompt_length: int | None = None) -> None:
        """Raise a ConfigError unless the overlong buffer fits the response-length limit and a
        packed micro-batch holds the longest prompt + response."""
        budget = self.max_tokens_per_micro_batch
        if budget and max_prompt_length is not None and budget < max_prompt_length + max_new_tokens:
            raise ConfigError(
                f"{{max_tokens_per_micro_batch}} {budget} is less than the longest sequence, "
                f"{{max_prompt_length}} {max_prompt_length} + {{max_new_tokens}} {max_new_tokens}: "
                "raise it, or lower those limits")
        if self.overlong_buffer > max_new_tokens:
            raise ConfigError(
                f"{{overlong_buffer}} {self.overlong_buffer} exceeds {{max_new_tokens}} "
                f"{max_new_tokens}: the penalty would start before the first token and punish "
                "every response; use a buffer of at most the length limit")

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
        """log pi_old is the update forward's own log-probs, detached."""
        # With one optimizer step per iteration (one PPO epoch, one mini-batch) the policy
        # being updated *is* the old one, so the ratio is exactly 1 without a forward to
        # recompute it (as TRL and verl do). Only when recompute_logprobs is left unset, and no
        # KL term shapes the reward (that one is computed from log pi_old before the update).
        return (self.recompute_logprobs is None and self.ppo_epochs == 1 and self.num_mini_batches == 1
                and not (self.kl_coef and not self.kl_in_loss))

    @property
    def uses_reference(self) -> bool:
        """Whether the reference model is loaded and run (only a KL term reads it)."""

        return self.kl_coef > 0

    @property
    def kl_in_loss(self) -> bool:
        """The KL to the reference is a loss term (GRPO), not part of the reward."""
        return self.advantage_estimator == "grpo"

    @property
    def samples_per_iteration(self) -> int:
        return self.global_batch_size * self.rollout_n

    def check_data_parallel(self, dp: int) -> int:
        """Samples per rank, or a ConfigError saying which settings to change."""
        if self.global_batch_size % dp:
            raise ConfigError(
                f"{{global_batch_size}} {self.global_batch_size} prompts must split evenly over "
                f"{dp} data-parallel ranks (a prompt's {self.rollout_n} samples stay on one rank)"
            )
        per_step = self.micro_batch_size * dp * self.num_mini_batches
        if self.samples_per_iteration % per_step:
            raise ConfigError(
                f"{{global_batch_size}} {self.global_batch_size} x {{rollout_n}} {self.rollout_n} = "
                f"{self.samples_per_iteration} samples per iteration is not divisible by "
                f"{{micro_batch_size}} {self.micro_batch_size} x {dp} data-parallel ranks x "
                f"{{num_mini_batches}} {self.num_mini_batches} = {per_step}"
            )
        return self.samples_per_iteration // dp


