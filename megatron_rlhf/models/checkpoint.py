"""Model checkpoints: megatron-core ``dist_checkpointing``, written atomically.

Entry points: :func:`save_checkpoint`, :func:`load_checkpoint`, :func:`read_checkpoint`.
Invariants: a crash at any point leaves the previous checkpoint loadable. A missing or
truncated file is reported before any collective starts. Saved at one TP size, a
checkpoint loads at another.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from megatron_rlhf.config import ModelConfig, check_role

# Layout on disk (Megatron's convention):
#   ROOT/latest_checkpointed_iteration.txt    step of the newest complete checkpoint
#   ROOT/iter_0000010/                         one complete checkpoint
#       megatron_rlhf.json                     model config, role, step, file manifest
#       tokenizer/                             tokenizer files (when known)
#       common.pt .metadata __*_*.distcp ...   dist_checkpointing, layout-free
# The manifest lists every file with its size: that is how a truncated file is found.
METADATA_FILE = "megatron_rlhf.json"
TRACKER_FILE = "latest_checkpointed_iteration.txt"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked; the message says what to change."""


@dataclass
class CheckpointInfo:
    """What :func:`read_checkpoint` learns from the files alone (no collectives)."""

    path: Path  # the iter_* directory
    config: ModelConfig  # the model's architecture
    role: str  # actor / reference / draft / critic / reward
    step: int  # the training step it was written at
    extra: dict  # anything else the writer recorded

    @property
    def tokenizer_dir(self) -> Path | None:
        d = self.path / "tokenizer"
        return d if d.is_dir() else None


def iteration_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"iter_{step:07d}"


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_manifest(directory: Path) -> dict[str, int]:
    """``{relative path: size}`` of every file under ``directory`` (metadata excluded)."""
    return {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != METADATA_FILE
    }


def verify_manifest(directory: Path, files: dict[str, int]) -> None:
    """Raise naming the first file of a :func:`file_manifest` that is missing or resized."""
    for name, size in files.items():
        f = directory / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {directory} is incomplete: file {name} is missing")
        actual = f.stat().st_size
        if actual != size:
            raise CheckpointError(
                f"checkpoint {directory} is truncated or corrupt: {name} has {actual} bytes, "
                f"the manifest says {size}; load an earlier iteration or re-save"
            )


def tracked_iteration(root: Path) -> tuple[int, Path] | None:
    """The (step, ``iter_*`` directory) that ``ROOT``'s tracker names; None without one."""
    tracker = root / TRACKER_FILE
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{tracker} is corrupt (holds {text!r}, expected a step)")
    return int(text), iteration_dir(root, int(text))


def sharded_state_dict(model, pg_collection) -> dict:
    """The model's sharded state dict, as saved under the key ``model``."""
    from megatron.core import parallel_state

    # megatron-core 0.16 reads the DP rank from its global parallel_state for one entry (a tied
    # embedding's copy on the last pipeline stage). We keep no global layout (several coexist),
    # so that one call answers with the model's own.
    global_rank_of = parallel_state.get_data_parallel_rank
    parallel_state.get_data_parallel_rank = lambda *a, **k: pg_collection.dp.rank()
    try:
        return {"model": model.sharded_state_dict(metadata={"dp_cp_group": pg_collection.dp_cp})}
    finally:
        parallel_state.get_data_parallel_rank = global_rank_of


def _tmp_dir(final: Path) -> Path:
    return final.with_name(final.name + ".tmp")


def begin_iteration(root: str | os.PathLike, step: int) -> Path:
    """Create an empty ``ROOT/iter_<step>.tmp`` to write into; collective over the world."""
    tmp = _tmp_dir(iteration_dir(root, step))
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    return tmp


def commit_iteration(root: str | os.PathLike, step: int) -> Path:
    """Publish ``iter_<step>.tmp`` as ``iter_<step>`` and point the tracker at it; collective.
    Call once every rank has written its files."""
    # The rename is atomic and the tracker is replaced last: a crash at any point leaves the
    # previous checkpoint as the latest.
    dist.barrier()
    final = iteration_dir(root, step)
    tmp = _tmp_dir(final)
    if dist.get_rank() == 0:
        if final.exists():  # an earlier save at the same step: replace it
            old = final.with_name(final.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
        _fsync_dir(final.parent)
        _atomic_write_text(Path(root) / TRACKER_FILE, f"{step}\n")
    dist.barrier()
    return final


def prune_iterations(root: str | os.PathLike, keep: int) -> list[int]:
    """Delete all but the newest ``keep`` ``iter_*`` directories (never the tracked one).
    Returns the deleted steps. Rank 0 only, no collectives."""
    root = Path(root)
    tracked = tracked_iteration(root)
    steps = sorted(int(p.name[5:]) for p in root.glob("iter_*")
                   if p.is_dir() and p.name[5:].isdigit())
    doomed = [s for s in steps[:-keep] if tracked is None or s != tracked[0]] if keep > 0 else []
    for s in doomed:
        d = iteration_dir(root, s)
        # Renamed out of the iter_* namespace first: a crash mid-delete leaves no half checkpoint.
        gone = d.with_name(d.name + ".deleting")
        os.replace(d, gone)
        shutil.rmtree(gone)
    return doomed


def write_model(directory: Path, step: int, model, pg_collection, tokenizer=None,
                extra: dict | None = None) -> None:
    """Write ``model`` (weights, metadata, the HF ``tokenizer`` if given) into ``directory``;
    collective. A rank outside the model's layout passes an
    :class:`~megatron_rlhf.parallel.reshard.Absent` copy and ``pg_collection`` None."""
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    save_sharded(sharded_state_dict(model, pg_collection) if pg_collection is not None else None,
                 directory)
    dist.barrier()
    if dist.get_rank() == 0:
        if tokenizer is not None:
            tokenizer.save_pretrained(str(directory / "tokenizer"))
        meta = {
            "format_version": FORMAT_VERSION,
            "role": model.mrlhf_role,
            "step": step,
            "model_config": model.mrlhf_config.to_dict(),
            "extra": extra or {},
            "files": file_manifest(directory),
        }
        _atomic_write_text(directory / METADATA_FILE, json.dumps(meta, indent=1))


def save_sharded(sd: dict | None, directory: Path) -> None:
    """``dist_checkpointing.save(sd, directory)``, collective over the world. ``sd`` is None on
    a rank that holds no part (a model or optimizer on a layout over part of the world)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    common = None
    if sd is not None:
        common = extract_matching_values(sd, lambda v: isinstance(v, ShardedBase))[1]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (sd is not None, common))
    # megatron writes the common (unsharded) part from rank 0 alone. A rank without a part takes
    # the first holder's, so the checkpoint is whole wherever rank 0 is.
    first = next((c for held, c in everyone if held), None)
    _write_results_in_process()
    dist_checkpointing.save(sd if sd is not None else (first or {}), str(directory))


def _write_results_in_process() -> None:
    """Give megatron's writer a plain in-process results queue."""
    # megatron's writer returns results through the queue of a multiprocessing Manager it
    # spawns, for asynchronous saves. Ours are synchronous: results are put and read in this
    # process. The Manager's spawn would re-import the entry point on every first save.
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    model,
    pg_collection,
    tokenizer=None,
    extra: dict | None = None,
) -> Path:
    """Save ``model`` to ``ROOT/iter_<step>`` atomically; collective. Returns that directory."""
    tmp = begin_iteration(root, step)
    write_model(tmp, step, model, pg_collection, tokenizer, extra)
    return commit_iteration(root, step)


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """``ROOT`` (follows the tracker file) or an ``iter_*`` directory -> the iter directory."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint {p} does not exist: check --load / --ckpt paths")
    if (p / METADATA_FILE).is_file():
        return p
    tracked = tracked_iteration(p)
    if tracked is not None:
        step, d = tracked
        if not (d / METADATA_FILE).is_file():
            raise CheckpointError(
                f"{p / TRACKER_FILE} points to step {step} but {d} is missing or incomplete"
            )
        return d
    raise CheckpointError(
        f"{p} is not a megatron_rlhf checkpoint: it has neither {METADATA_FILE} nor "
        f"{TRACKER_FILE} (convert HF/GGUF weights with tools/convert_checkpoint.py hf-to-mcore)"
    )


def read_checkpoint(path: str | os.PathLike) -> CheckpointInfo:
    """Read and verify a checkpoint's metadata and files; no collectives, no weights."""
    d = resolve_checkpoint(path)
    try:
        meta = json.loads((d / METADATA_FILE).read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{d / METADATA_FILE} is corrupt: {e}") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{d} has checkpoint format {meta.get('format_version')}, this version reads "
            f"{FORMAT_VERSION}"
        )
    verify_manifest(d, meta["files"])
    return CheckpointInfo(
        path=d,
        config=ModelConfig.from_dict(meta["model_config"]),
        role=check_role(meta["role"]),
        step=int(meta["step"]),
        extra=meta.get("extra", {}),
    )


def check_shapes(model, pg_collection, info: CheckpointInfo, skip: tuple[str, ...] = ()) -> None:
    """Raise :class:`CheckpointError` naming the first tensor whose global shape differs from
    the checkpoint's. Keys starting with one of ``skip`` are not checked."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from torch.distributed.checkpoint import FileSystemReader

    stored = FileSystemReader(str(info.path)).read_metadata().state_dict_metadata
    sd = sharded_state_dict(model, pg_collection)
    apply_factories(sd)
    for t in nested_values(sd):
        if not isinstance(t, ShardedTensor) or t.key.startswith(skip):
            continue
        if t.key not in stored:
            raise CheckpointError(
                f"checkpoint {info.path} has no tensor {t.key} (a {info.role} checkpoint "
                f"loaded into a {model.mrlhf_role} model?)"
            )
        have = tuple(stored[t.key].size)
        if have != tuple(t.global_shape):
            raise CheckpointError(
                f"tensor {t.key} has shape {have} in {info.path} but the model config "
                f"expects {tuple(t.global_shape)}: the checkpoint's config and the model differ"
            )


def stored_dtype(path: str | os.PathLike):
    """The torch dtype the weights of checkpoint ``path`` were written in (a run's own
    precision: weights are saved as the model holds them); None where the files do not say.
    Reads the index only, no collectives."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        stored = FileSystemReader(str(resolve_checkpoint(path))).read_metadata().state_dict_metadata
    except Exception:  # unreadable here: the checks that load it report why
        return None
    dtypes = [getattr(getattr(m, "properties", None), "dtype", None) for m in stored.values()]
    return next((d for d in dtypes if d is not None and d.is_floating_point), None)


def load_elsewhere(path: str | os.PathLike) -> None:
    """This rank's part in a load of ``path`` into a model it does not hold."""
    from megatron.core import dist_checkpointing

    # megatron's loader is collective over the world (metadata exchange, torch's planning):
    # this rank takes part with nothing to read.
    dist_checkpointing.load({}, str(read_checkpoint(path).path))


def load_checkpoint(model, pg_collection, path: str | os.PathLike,
                    skip: tuple[str, ...] = ()) -> CheckpointInfo:
    """Load weights into ``model`` (any TP size); collective over the world (ranks without the
    model call :func:`load_elsewhere`). Keys starting with one of ``skip`` keep their values
    (e.g. a critic's value head over an actor's trunk). Raises :class:`CheckpointError`."""
    from megatron.core import dist_checkpointing

    # Files and shapes are verified on every rank before any collective.
    info = read_checkpoint(path)
    check_shapes(model, pg_collection, info, skip)
    sd = sharded_state_dict(model, pg_collection)
    if skip:
        sd = {"model": {k: v for k, v in sd["model"].items() if not k.startswith(skip)}}
    state = dist_checkpointing.load(sd, str(info.path))
    model.load_state_dict(state["model"], strict=False)
    return info
