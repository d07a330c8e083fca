"""Per-iteration metrics: ``metrics.jsonl``, TensorBoard and optionally Weights & Biases
(rank 0), and a progress bar."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path


class MetricsLog:
    """Appends one JSON line per iteration to ``LOG_DIR/metrics.jsonl`` and the same scalars
    to TensorBoard under ``LOG_DIR/tensorboard`` (and to W&B with ``wandb_project``). Only
    rank 0 writes."""

    def __init__(self, log_dir: str | None, enabled: bool, resume_from: int = 0,
                 wandb_project: str | None = None, config: dict | None = None):
        self.enabled = enabled and log_dir is not None
        self.path = None if log_dir is None else Path(log_dir) / "metrics.jsonl"
        self.tb = None
        self.wandb = start_wandb(wandb_project, log_dir, config) if enabled and wandb_project else None
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # On resume from iteration k, lines of later iterations (of the run that stopped) are
        # dropped: the file reads as one uninterrupted run.
        kept = []
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    if json.loads(line).get("iteration", 0) <= resume_from:
                        kept.append(line)
                except json.JSONDecodeError:
                    pass  # a line cut short by a crash
        self.path.write_text("".join(x + "\n" for x in kept))
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(log_dir) / "tensorboard"), purge_step=resume_from + 1)
        except ImportError:
            print("warning: tensorboard is not installed; metrics go to metrics.jsonl only",
                  file=sys.stderr)

    def write(self, iteration: int, metrics: dict) -> None:
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=iteration)
        if not self.enabled:
            return
        row = {"iteration": iteration, **metrics}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(f"rlhf/{k}", v, iteration)
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def wandb_mode() -> str:
    """``WANDB_MODE`` when set; else online with credentials (``WANDB_API_KEY``, or a login
    in ``~/.netrc``), offline without (sync later with ``wandb sync``)."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    netrc = Path.home() / ".netrc"
    logged_in = netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")
    return "online" if os.environ.get("WANDB_API_KEY") or logged_in else "offline"


def start_wandb(project: str, log_dir: str | None, config: dict | None):
    """A W&B run of ``project`` (files under ``log_dir``), offline when an online start fails."""
    import wandb  # optional: checked before the run starts (train_plan.make_plan)

    kwargs = dict(project=project, dir=log_dir, config=config or {}, reinit=True)
    mode = wandb_mode()
    try:
        return wandb.init(mode=mode, **kwargs)
    except Exception as e:
        if mode == "offline":
            raise
        print(f"warning: wandb online start failed ({e}); logging offline", file=sys.stderr)
        return wandb.init(mode="offline", **kwargs)


def progress(start: int, total: int, enabled: bool):
    """A tqdm bar over iterations ``start+1..total`` on rank 0 (None elsewhere)."""
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc="rlhf", unit="it", dynamic_ncols=True,
                file=sys.stderr)
