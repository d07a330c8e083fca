"""Parameter reallocation: copy one model's weights between two layouts (ReaLHF).

Entry point: :class:`Reallocator`, on ``megatron.core.resharding``. Collective over the
world: every rank calls it (a rank outside a layout passes an :class:`Absent` copy).
"""
# Transfers go over gloo on CPU, NCCL on GPU.

from __future__ import annotations

import contextlib
import time
import types
from dataclasses import dataclass

import torch

from megatron_rlhf import runtime


def _copy_service():
    if runtime.has_cuda():
        from megatron.core.resharding.copy_services.nccl_copy_service import NCCLCopyService

        return NCCLCopyService()
    from megatron.core.resharding.copy_services.gloo_copy_service import GlooCopyService

    class CpuGlooCopyService(GlooCopyService):
        """megatron's gloo service less the ``torch.cuda.Stream`` it makes for device copies."""

        def __init__(self):
            stream = torch.cuda.Stream
            torch.cuda.Stream = lambda *a, **k: None
            try:
                super().__init__()
            finally:
                torch.cuda.Stream = stream

    return CpuGlooCopyService()


class Absent(torch.nn.Module):
    """A model's copy on a rank outside its layout (e.g. ``--critic-infer-layout 1x1x2@2``)."""
    # No parameters: only what megatron's planner reads on every rank (pg_collection.dp,
    # config), and the role and model config a checkpoint records. With it the rank takes
    # part in collective reallocations and saves, sending and receiving nothing.

    def __init__(self, config, role: str | None = None, model_config=None):
        super().__init__()
        import torch.distributed as dist

        self.config = config
        # (no groups: no shard lives here; megatron fills a source's missing ``dp`` from its
        # global parallel state, which this program does not set up)
        self.pg_collection = types.SimpleNamespace(dp=dist.group.WORLD)
        self.mrlhf_role, self.mrlhf_config = role, model_config


@dataclass
class ReallocationStats:
    """One reallocation, as this rank saw it."""

    seconds: float  # wall time of the copies (and of the plan at the first call)
    bytes_received: int  # from other ranks
    bytes_local: int  # copied within this rank (a shard both layouts place here)


class Reallocator:
    """Moves weights from ``src`` to ``dst`` (the same architecture, other layouts)."""

    # megatron's planner matches every destination shard to source shards (TP slicing, GLU
    # strides, pipeline stages, DP replicas balanced as senders) once per pair, at the first
    # call; each call runs the planned point-to-point copies.

    def __init__(self):
        self._service = None

    def __call__(self, src: torch.nn.Module, dst: torch.nn.Module) -> ReallocationStats:
        from megatron.core.resharding.refit import swap_model_weights

        if self._service is None:
            self._service = _copy_service()
        start = time.perf_counter()
        with torch.no_grad(), _without_tied_copy(dst), _global_expert_names(src, dst):
            swap_model_weights(src, dst, self._service)
            planned = _planned_bytes(dst)
        _sync_tied_copy(dst)
        if runtime.has_cuda():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        return ReallocationStats(seconds, *planned)


@contextlib.contextmanager
def _renamed(model, rename):
    """Within the block ``model.named_parameters()`` yields ``rename(name)`` for each name."""
    before = model.__dict__.get("named_parameters")  # (another patch's, restored after)
    inner = model.named_parameters
    model.named_parameters = lambda *a, **k: ((rename(n), p) for n, p in inner(*a, **k))
    try:
        yield
    finally:
        if before is None:
            del model.named_parameters
        else:
            model.named_parameters = before


@contextlib.contextmanager
def _global_expert_names(*models):
    """Within the block the experts of ``models`` under expert parallelism are named by their
    global index, so that the planner matches expert ``k`` of one layout with the other's."""
    # megatron's planner maps local expert indices to global ones for TE's grouped experts
    # (``weightK``) only; SequentialMLP's are in the module path (local_experts.K).
    from megatron_rlhf.models.moe import global_expert_name, has_experts

    with contextlib.ExitStack() as stack:
        for m in models:
            if not isinstance(m, Absent) and has_experts(m) and m.pg_collection.ep.size() > 1:
                stack.enter_context(_renamed(m, lambda n, m=m: global_expert_name(n, m)))
        yield


def _tied(model) -> bool:
    """Whether ``model`` is a pipeline stage of a model whose LM head is its embedding."""
    return (getattr(model, "share_embeddings_and_output_weights", False)
            and model.pg_collection.pp.size() > 1)


@contextlib.contextmanager
def _without_tied_copy(dst):
    """Hide a last stage's copy of a tied embedding from the plan."""
    # Under PP the last stage holds its own output_layer.weight, which a model outside the
    # pipeline lacks: the planner would look for a source. _sync_tied_copy fills it afterwards.
    if not (_tied(dst) and dst.post_process and not dst.pre_process):
        yield
        return
    everything = dst.named_parameters
    dst.named_parameters = lambda *a, **k: ((n, p) for n, p in everything(*a, **k)
                                            if n != "output_layer.weight")
    try:
        yield
    finally:
        del dst.named_parameters


def _sync_tied_copy(dst) -> None:
    """The last stage's copy of a tied embedding := the first stage's."""
    # megatron's own start-up step: the copy zeroed, then summed over the embedding group.
    if not (_tied(dst) and (dst.pre_process or dst.post_process)):
        return
    import torch.distributed as dist

    weight = dst.shared_embedding_or_output_weight()
    with torch.no_grad():
        if not dst.pre_process:
            weight.zero_()
        dist.all_reduce(weight.data, group=dst.pg_collection.embd)


def _planned_bytes(dst: torch.nn.Module) -> tuple[int, int]:
    """(bytes received from other ranks, bytes copied locally) by this rank's plan."""
    import torch.distributed as dist

    plan = getattr(dst, "_cached_reshard_plan", None)
    if plan is None:
        return 0, 0
    params = dict(dst.named_parameters())
    me, remote, local = dist.get_rank(), 0, 0
    for op in plan.recv_ops:
        p = params.get(op.param_name)
        if p is None:
            continue
        n = p.data[op.my_slice].numel() * p.element_size()
        if op.peer_rank == me:
            local += n
        else:
            remote += n
    return remote, local
