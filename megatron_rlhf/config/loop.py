"""The RLHF run around the iterations: optimizer, length and checkpoints, rewards, evaluation."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rlhf.config.errors import ConfigError, finite, positive


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
    """Learning rate of the draft under draft_distill (constant)."""
    use_distributed_optimizer: bool = field(default=True, metadata={"off": "--no-distributed-optimizer",
                                                                    "both": True})
    """Shard fp32 master weights and Adam states over data-parallel ranks (ZeRO-1)."""
    # megatron's distributed optimizer; False: every DP rank holds them all.
    overlap_grad_reduce: bool | None = None
    """Reduce gradients bucket by bucket during the last backward (None: on GPU only)."""
    # megatron's DDP: during the last micro-batch's backward instead of after it.
    # megatron's DDP forward pre-hooks; the trainer completes the gather when a training
    # stage ends. Needs the distributed optimizer and overlapped gradient reduction.
    overlap_param_gather: bool | None = None
    """Gather updated parameters during the next forward (None: wherever gradients overlap)."""
    # Instead of in the optimizer step.

    def __post_init__(self) -> None:
        finite(self)
        if self.lr < 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"need 0 <= {{min_lr}} <= {{lr}}, got lr={self.lr}, min_lr={self.min_lr}")
        if self.critic_lr < 0 or self.draft_lr < 0:
            raise ConfigError("{critic_lr} and {draft_lr} must be >= 0")
        if self.lr_warmup_iters < 0 or self.clip_grad < 0 or self.weight_decay < 0:
            raise ConfigError("{lr_warmup_iters}, {clip_grad} and {weight_decay} must be >= 0")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ConfigError("{overlap_param_gather} gathers the distributed optimizer's shards: "
                              "drop {!use_distributed_optimizer} or {overlap_param_gather}")
        if self.overlap_param_gather and self.overlap_grad_reduce is False:
            raise ConfigError("{overlap_param_gather} needs overlapped gradient reduction: drop "
                              "{!overlap_grad_reduce} or {overlap_param_gather}")



@dataclass
class LoopConfig:
    """The RLHF run around the iterations: length, data, checkpoints, draft upkeep."""

    train_iters: int = 20
    """RLHF iterations (rollout + experience + PPO update each)."""
    save_interval: int = 0
    """Save a resumable checkpoint every this many iterations (0: only at the end)."""
    keep_last_checkpoints: int = 0
    """Keep only the newest this many checkpoints under the save directory (0: keep every one)."""
    seed: int = 1234
    """Random seed, the same on all ranks: prompt order, sampling and initialisations."""
    max_prompt_length: int = 256
    """Longest prompt in tokens (chat template included); longer prompts are an error."""
    chat: bool = True
    """Format prompts with the tokenizer's chat template."""
    draft_distill: bool = False
    """Distil the draft towards the updated actor on each iteration's rollouts."""
    draft_distill_topk: int = 64
    """Teacher tokens per position for draft_distill."""
    prompt_key: str = "prompt"
    """The field of a dataset record holding the prompt: a string or a chat messages list."""
    wandb_project: str | None = None
    """Log every metric to this Weights & Biases project too (offline without a network)."""

    def __post_init__(self) -> None:
        finite(self)
        positive("train_iters", self.train_iters)
        positive("max_prompt_length", self.max_prompt_length)
        positive("draft_distill_topk", self.draft_distill_topk)
        if self.save_interval < 0:
            raise ConfigError("{save_interval} must be >= 0")
        if self.keep_last_checkpoints < 0:
            raise ConfigError("{keep_last_checkpoints} must be >= 0 (0 keeps every checkpoint)")


@dataclass
class RewardConfig:
    """How a reward function scores the samples."""

    answer_key: str = "answer"
    """The record field a verifier (the math reward) checks the final answer against."""
    reward_timeout: float = 10.0
    """Seconds one verifier call may take; past it the sample scores 0 (counted)."""
    reward_workers: int | None = None
    """Processes verifying a batch (None: a small default; 0: in this process)."""
    strict_rewards: bool = False
    """Stop with a RewardError on a reward's crash, non-number or timeout (default: score 0)."""
    # The default counts them in reward_errors / reward_timeouts.
    tolerate_reward_errors: bool = False
    """Train on when every sample of a batch failed its reward function (default: stop with an error)."""

    def __post_init__(self) -> None:
        finite(self)
        if not self.reward_timeout > 0:
            raise ConfigError(f"{{reward_timeout}} must be > 0 seconds, got {self.reward_timeout}")
        if self.reward_workers is not None and self.reward_workers < 0:
            raise ConfigError(f"{{reward_workers}} must be >= 0, got {self.reward_workers}")


@dataclass
class EvalConfig:
    """Held-out evaluation: the policy's responses to held-out records, scored with the run's reward."""
    # Generated on the generation layout, with the engine and its speculation.

    eval_interval: int = 0
    """Evaluate before the first, every this many (0: none) and after the last iteration."""

    eval_samples: int = 1
    """Responses per held-out prompt (K); pass@K is reported for K > 1."""
    eval_temperature: float = 0.0
    """Sampling temperature of the evaluation (0: greedy)."""
    eval_threshold: float = 1.0
    """A response counts as correct (``eval/accuracy``) when it scores at least this."""
    eval_limit: int = 0
    """Evaluate on the first this many held-out records (0: all)."""

    def __post_init__(self) -> None:
        finite(self)
        positive("eval_samples", self.eval_samples)
        if self.eval_interval < 0 or self.eval_limit < 0:
            raise ConfigError("{eval_interval} and {eval_limit} must be >= 0")
        if self.eval_temperature < 0:
            raise ConfigError(f"{{eval_temperature}} must be >= 0, got {self.eval_temperature}")
        if self.eval_samples > 1 and self.eval_temperature == 0:
            raise ConfigError(f"{{eval_samples}} {self.eval_samples} greedy responses would all be "
                              "the same: set {eval_temperature} > 0 (e.g. 1.0) or {eval_samples} 1")

    def due(self, iteration: int, last: int) -> bool:
        """Whether to evaluate after ``iteration`` (0: before the first one)."""
        return (iteration == 0 or iteration == last
                or bool(self.eval_interval and iteration % self.eval_interval == 0))
