"""Training checkpoints: every model, optimizer, LR schedule, RNG state and the data position.

Layout (one atomic iteration, Megatron's tracker convention)::

    SAVE/latest_checkpointed_iteration.txt
    SAVE/iter_0000010/
        actor/  critic/  draft/       model checkpoints (layout-free; load any one with
                                      --actor-load SAVE/iter_0000010/actor, or generate)
        trainer/state.json            iteration, data position, layout, file manifest
        trainer/rank_00000.pt ...     per rank: optimizers, LR schedules, RNG states

Everything is written under ``iter_X.tmp`` and renamed when complete; the tracker moves
last. Optimizer states are per rank, so a resume needs the same world size and TP size
(the message says so); the model checkpoints themselves load under any layout.
"""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_rlhf.models.checkpoint import (
    TRACKER_FILE,
    CheckpointError,
    begin_iteration,
    commit_iteration,
    file_manifest,
    tracked_iteration,
    verify_manifest,
    write_model,
)

STATE_FILE = "state.json"
KILL_IN_SAVE_ENV = "MEGATRON_RLHF_TEST_KILL_IN_SAVE"
"""Fault injection for tests: set to an iteration number, the save of that iteration kills
its process (SIGKILL) after writing the models, before the checkpoint is committed — what a
node failure mid-save does."""


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_training(root: str | os.PathLike, iteration: int, models: dict, trainees: dict,
                  state: dict, tokenizer=None) -> Path:
    """Save a resumable checkpoint; collective over the world. ``models``: name -> (model,
    pg); ``trainees``: name -> :class:`~megatron_rlhf.rlhf.update.Trainee`; ``state``:
    JSON-able loop state (data position, layout, ...)."""
    tmp = begin_iteration(root, iteration)
    for name, (model, pg) in models.items():
        write_model(tmp / name, iteration, model, pg, tokenizer if name == "actor" else None)
    rank = dist.get_rank()
    if rank == 0:
        (tmp / "trainer").mkdir()
    dist.barrier()
    per_rank = {
        "optimizers": {n: t.optimizer.state_dict() for n, t in trainees.items()},
        "schedulers": {n: t.scheduler.state_dict() for n, t in trainees.items()},
        "rng": rng_state(),
    }
    torch.save(per_rank, tmp / "trainer" / f"rank_{rank:05d}.pt")
    dist.barrier()
    if os.environ.get(KILL_IN_SAVE_ENV) == str(iteration):
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        meta = dict(state, iteration=iteration, world_size=dist.get_world_size(),
                    files=file_manifest(tmp / "trainer"))
        (tmp / "trainer" / STATE_FILE).write_text(json.dumps(meta, indent=1))
    return commit_iteration(root, iteration)


def find_training_checkpoint(root: str | os.PathLike) -> Path:
    """``SAVE`` (via the tracker) or ``SAVE/iter_X`` -> the iteration directory, verified
    (files present, sizes as written); no collectives."""
    p = Path(root)
    if (p / "trainer" / STATE_FILE).is_file():
        d = p
    else:
        tracked = tracked_iteration(p)
        if tracked is None:
            raise CheckpointError(f"{p} holds no training checkpoint ({TRACKER_FILE} is missing); "
                                  "pass the --save directory of an earlier run to --load")
        d = tracked[1]
    meta_path = d / "trainer" / STATE_FILE
    if not meta_path.is_file():
        raise CheckpointError(f"{d} is not a complete training checkpoint ({meta_path} is missing)")
    verify_manifest(d / "trainer", json.loads(meta_path.read_text())["files"])
    return d


def read_training_state(d: Path) -> dict:
    return json.loads((d / "trainer" / STATE_FILE).read_text())


def load_trainer_states(d: Path, trainees: dict) -> None:
    """Restore this rank's optimizers, LR schedules and RNG states."""
    state = torch.load(d / "trainer" / f"rank_{dist.get_rank():05d}.pt", weights_only=False)
    for name, t in trainees.items():
        t.optimizer.load_state_dict(state["optimizers"][name])
        t.scheduler.load_state_dict(state["schedulers"][name])
    set_rng_state(state["rng"])
