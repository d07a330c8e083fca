"""Training checkpoints: every model, optimizer, LR schedule, RNG state and the data position.

Layout (one atomic iteration, Megatron's tracker convention)::

    SAVE/latest_checkpointed_iteration.txt
    SAVE/iter_0000010/
        actor/  critic/  draft/       model checkpoints (layout-free; load any one with
                                      --actor-load SAVE/iter_0000010/actor, or generate)
        trainer/state.json            iteration, data position, layout, file manifest
        trainer/optim_tp000.pt ...    per tensor-parallel rank: optimizers (fp32 masters
                                      included) and LR schedules, written by data-parallel
                                      rank 0 (DP replicas hold identical states)
        trainer/rng_00000.pt ...      per rank: RNG states

Everything is written under ``iter_X.tmp`` and renamed when complete; the tracker moves
last; with ``keep_last`` only the newest checkpoints stay. Optimizer states are per TP
shard, so a resume needs the same world size and TP size (the message says so); the model
checkpoints themselves load under any layout. Checkpoints of earlier versions (one
``rank_00000.pt`` per rank with everything) still load.
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
    prune_iterations,
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


def _optim_file(tp_rank: int) -> str:
    return f"optim_tp{tp_rank:03d}.pt"


def save_training(root: str | os.PathLike, iteration: int, models: dict, trainees: dict,
                  state: dict, tokenizer=None, keep_last: int = 0) -> Path:
    """Save a resumable checkpoint; collective over the world. ``models``: name -> (model,
    pg); ``trainees``: name -> :class:`~megatron_rlhf.rlhf.update.Trainee` (all under one
    layout); ``state``: JSON-able loop state (data position, layout, ...). ``keep_last`` > 0
    deletes older checkpoints once this one is committed."""
    tmp = begin_iteration(root, iteration)
    for name, (model, pg) in models.items():
        write_model(tmp / name, iteration, model, pg, tokenizer if name == "actor" else None)
    rank = dist.get_rank()
    if rank == 0:
        (tmp / "trainer").mkdir()
    dist.barrier()
    pg = next(iter(trainees.values())).pg
    if pg.dp.rank() == 0:  # data-parallel replicas step identically: one copy per TP shard
        torch.save({"optimizers": {n: t.optimizer.state_dict() for n, t in trainees.items()},
                    "schedulers": {n: t.scheduler.state_dict() for n, t in trainees.items()}},
                   tmp / "trainer" / _optim_file(pg.tp.rank()))
    torch.save(rng_state(), tmp / "trainer" / f"rng_{rank:05d}.pt")
    dist.barrier()
    if os.environ.get(KILL_IN_SAVE_ENV) == str(iteration):
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        meta = dict(state, iteration=iteration, world_size=dist.get_world_size(),
                    files=file_manifest(tmp / "trainer"))
        (tmp / "trainer" / STATE_FILE).write_text(json.dumps(meta, indent=1))
    final = commit_iteration(root, iteration)
    if rank == 0 and keep_last > 0:
        prune_iterations(root, keep_last)
    dist.barrier()
    return final


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
    legacy = d / "trainer" / f"rank_{dist.get_rank():05d}.pt"
    if legacy.is_file():  # written before optimizer states were saved once per TP shard
        state = torch.load(legacy, weights_only=False)
    else:
        pg = next(iter(trainees.values())).pg
        state = torch.load(d / "trainer" / _optim_file(pg.tp.rank()), weights_only=False)
        state["rng"] = torch.load(d / "trainer" / f"rng_{dist.get_rank():05d}.pt", weights_only=False)
    for name, t in trainees.items():
        t.optimizer.load_state_dict(state["optimizers"][name])
        t.scheduler.load_state_dict(state["schedulers"][name])
    set_rng_state(state["rng"])
