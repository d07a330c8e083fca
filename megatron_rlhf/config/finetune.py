"""Fine-tuning stages: SFT, a reward model (Bradley-Terry) or DPO on preference pairs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from megatron_rlhf.config.errors import ConfigError, finite, positive
from megatron_rlhf.config.loop import OptimConfig

FinetuneLoss = Literal["sft", "bradley-terry", "dpo"]
FINETUNE_LOSSES = get_args(FinetuneLoss)


@dataclass
class FinetuneConfig:
    """A fine-tuning stage: SFT, a reward model (Bradley-Terry) or DPO on preference pairs."""

    loss: FinetuneLoss = "sft"
    """sft (next-token loss on response tokens), bradley-terry (reward model) or dpo."""
    data: str = field(default="", metadata={"required": True})
    """jsonl: SFT {"prompt", "response"} or {"messages"}; pairs {"prompt", "chosen", "rejected"}."""
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
    """SFT: pack examples into rows of ``seq_length`` tokens (attention stays inside each)."""
    beta: float = 0.1
    """DPO: the implicit reward's scale."""
    label_smoothing: float = 0.0
    """DPO: conservative DPO's label noise."""
    train_iters: int = 100
    """Optimizer steps."""
    eval_interval: int = 0
    """Evaluate on the held-out records every this many steps (0: at the end)."""
    save_interval: int = 0
    """Save every this many steps (0: at the end, with a save directory)."""
    keep_last_checkpoints: int = 0
    """Keep the newest this many checkpoints (0: all)."""
    seed: int = 1234
    """Seeds the split, the data order and the initialisations."""

    def __post_init__(self) -> None:
        finite(self)
        if self.loss not in FINETUNE_LOSSES:
            raise ConfigError(f"unknown loss {self.loss!r}; valid: {', '.join(FINETUNE_LOSSES)}")
        for name in ("global_batch_size", "micro_batch_size", "train_iters"):
            positive(name, getattr(self, name))
        if self.seq_length is None:
            self.seq_length = 512
        positive("seq_length", self.seq_length)
        if self.beta <= 0 or not 0 <= self.label_smoothing < 0.5:
            raise ConfigError("{beta} must be > 0 and {label_smoothing} in [0, 0.5)")
        if self.pack and self.loss != "sft":
            raise ConfigError("{pack} applies to SFT only")

    def check_data_parallel(self, dp: int) -> int:
        """Examples (or pairs) per rank and step, or a ConfigError naming the settings to change."""
        per = self.micro_batch_size * dp
        if self.global_batch_size % per:
            raise ConfigError(f"{{global_batch_size}} {self.global_batch_size} must be a multiple of "
                              f"{{micro_batch_size}} {self.micro_batch_size} x data-parallel size {dp} = {per}")
        return self.global_batch_size // dp


@dataclass
class PreferenceConfig(FinetuneConfig):
    """A fine-tuning stage on preference pairs (``train_rm``): a reward model or DPO."""

    loss: Literal["bradley-terry", "dpo"] = "bradley-terry"
    """bradley-terry: train a reward model (scalar head); dpo: train the policy on the pairs."""
    # DPO trains against a frozen reference.


@dataclass
class FinetuneOptimConfig(OptimConfig):
    """The optimizer of a fine-tuning stage: as RLHF's, with a higher peak learning rate."""

    lr: float = 1e-5
    """Peak learning rate."""
