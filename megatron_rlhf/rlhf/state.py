"""Training checkpoints: every model, optimizer, LR schedule, RNG state and the data position.

Entry points: :func:`save_training`, :func:`find_training_checkpoint`,
:func:`load_trainer_states`. One iteration is written atomically, as in
:mod:`megatron_rlhf.models.checkpoint`. A resume may change the number of ranks, TP and DP:
models and optimizer states are resharded as they load.
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
    save_sharded,
    tracked_iteration,
    verify_manifest,
    write_model,
)
from megatron_rlhf.rlhf.optim import chained, inner_optimizers
from megatron_rlhf.rlhf.placement import all_gather_object

# Layout (Megatron's tracker convention):
#   SAVE/latest_checkpointed_iteration.txt
#   SAVE/iter_0000010/
#       actor/  critic/  draft/     model checkpoints (layout-free: --actor-load .../actor works)
#       trainer/state.json          iteration, data position, LR schedules, layout, manifest
#       trainer/optim_actor/ ...    optimizer states (fp32 masters, Adam moments) in model space
#                                   ('fully_reshardable'): they load at any TP and DP size
#       trainer/rng_00000.pt ...    per rank: RNG states
STATE_FILE = "state.json"
# Fault injection for tests: set to an iteration number, that iteration's save SIGKILLs its
# process after writing the models, before the commit (what a node failure mid-save does).
KILL_IN_SAVE_ENV = "MEGATRON_RLHF_TEST_KILL_IN_SAVE"


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


OPTIM_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}


def _placeholder_adam_states(optimizer) -> None:
    """Give every parameter of a fresh optimizer an all-zero Adam state, ``step`` included."""
    # megatron describes what a checkpoint loads into by asking torch's Adam for the states'
    # common step (TE's and apex's keep it per group). Stepping with zero gradients instead,
    # as megatron does for FSDP, would apply weight decay.
    for inner in inner_optimizers(optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p].update(step=torch.zeros((), dtype=torch.float32),
                                          exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))


def _optimizer_state(t, is_loading: bool) -> dict:
    """The trainee's optimizer state as a sharded state dict in model space."""
    from megatron_rlhf import runtime
    from megatron_rlhf.models.checkpoint import sharded_state_dict

    model_sd = sharded_state_dict(t.model, t.pg)
    if is_loading:
        _placeholder_adam_states(t.optimizer)
    with runtime.cuda_as_cpu():
        sd = {"optimizer": t.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                          metadata=OPTIM_SHARDING)}
    if is_loading:  # megatron's load_state_dict allocates the states it loads, step apart
        for inner in inner_optimizers(t.optimizer):
            inner.state.clear()
    return sd


def _load_optimizer(optimizer, state: dict) -> None:
    """``optimizer.load_state_dict(state)``, around a megatron-core 0.16 bug with torch's Adam."""
    # megatron's distributed optimizer gives every state a step, then copies the loaded tensors
    # over all of a state's keys, step included, which the checkpoint keeps apart (KeyError).
    # So: the common part first, the per-parameter states with step set aside, then step back.
    # A chained optimizer (an MoE's dense and expert parameters) holds one state per optimizer.
    opts = chained(optimizer)
    states = [state] if len(opts) == 1 else [v for _, v in sorted(state.items())]
    if len(states) != len(opts) or any("param_state" not in st for st in states):
        optimizer.load_state_dict(state)
        return
    for opt, st in zip(opts, states):
        _load_distributed(opt, st)
    if len(opts) > 1:
        optimizer._synchronize_steps()


def _load_distributed(opt, state: dict) -> None:
    """One distributed optimizer's :func:`_load_optimizer`."""
    state = dict(state)
    param_state, kind = state.pop("param_state"), state.pop("param_state_sharding_type")
    if kind != OPTIM_SHARDING["distrib_optim_sharding_type"]:
        raise CheckpointError(f"optimizer states sharded as {kind!r}; this version reads "
                              f"{OPTIM_SHARDING['distrib_optim_sharding_type']!r}")
    opt.load_state_dict(state)
    steps = {p: st.pop("step") for p, st in opt.optimizer.state.items() if "step" in st}
    opt.load_parameter_state_from_fully_reshardable(param_state)
    for p, step in steps.items():  # megatron gave every state one shared tensor; Adam
        opt.optimizer.state[p]["step"] = step.clone()  # increments each in place


def save_training(root: str | os.PathLike, iteration: int, models: dict, trainees: dict,
                  state: dict, tokenizer=None, keep_last: int = 0) -> Path:
    """Save a resumable checkpoint; collective over the world. Returns its directory.

    ``models``: name -> (model, pg), an ``Absent`` copy and None outside the model's layout.
    ``trainees``: name -> :class:`~megatron_rlhf.rlhf.optim.Trainee` or None outside its layout.
    ``state``: JSON-able loop state. ``keep_last`` > 0 prunes older checkpoints after commit."""
    held = {n: t for n, t in trainees.items() if t is not None}
    for t in held.values():  # (weights read directly: no pending overlapped gather)
        t.gather_params()
    tmp = begin_iteration(root, iteration)
    for name, (model, pg) in models.items():
        write_model(tmp / name, iteration, model, pg, tokenizer if name == "actor" else None)
    rank = dist.get_rank()
    if rank == 0:
        (tmp / "trainer").mkdir()
    dist.barrier()
    for name, t in trainees.items():
        if rank == 0:
            (tmp / "trainer" / f"optim_{name}").mkdir()
        dist.barrier()
        save_sharded(_optimizer_state(t, is_loading=False) if t is not None else None,
                     tmp / "trainer" / f"optim_{name}")
    # (rank 0 writes them, and may hold not every trainee: each from the lowest rank with it)
    schedulers = all_gather_object({n: t.scheduler.state_dict() for n, t in held.items()})
    state = dict(state, schedulers={n: s[n] for s in reversed(schedulers) for n in s})
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
    """``SAVE`` (via the tracker) or ``SAVE/iter_X`` -> the verified iteration directory.
    No collectives. Raises CheckpointError, also for checkpoints older than megatron's
    optimizer (``optim_tp*.pt``), naming the way forward."""
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
    meta = json.loads(meta_path.read_text())
    verify_manifest(d / "trainer", meta["files"])
    if "schedulers" not in meta:
        raise CheckpointError(
            f"{d} was written before training moved to megatron's optimizer; its optimizer "
            f"states cannot be resumed. Start a new run from its weights: --actor-load "
            f"{d / 'actor'}" + (f" --critic-load {d / 'critic'}" if (d / "critic").is_dir() else ""))
    return d


def read_training_state(d: Path) -> dict:
    return json.loads((d / "trainer" / STATE_FILE).read_text())


def load_trainer_states(d: Path, trainees: dict) -> None:
    """Restore this rank's optimizers (resharded), LR schedules and RNG states; collective.
    ``trainees``: name -> Trainee, None outside its layout."""
    from megatron.core import dist_checkpointing

    from megatron_rlhf import runtime

    meta = read_training_state(d)
    for name, t in trainees.items():
        if t is None:  # outside its layout: this rank's part in the (collective) load
            dist_checkpointing.load({}, str(d / "trainer" / f"optim_{name}"))
            continue
        state = dist_checkpointing.load(_optimizer_state(t, is_loading=True),
                                        str(d / "trainer" / f"optim_{name}"))
        with runtime.cuda_as_cpu():
            _load_optimizer(t.optimizer, state["optimizer"])
        t.scheduler.load_state_dict(meta["schedulers"][name])
    # RNG states only where the world size is unchanged. Sampling is keyed by seed and sample
    # index, so it does not depend on them.
    rng = d / "trainer" / f"rng_{dist.get_rank():05d}.pt"
    if meta["world_size"] == dist.get_world_size() and rng.is_file():
        set_rng_state(torch.load(rng, weights_only=False))
