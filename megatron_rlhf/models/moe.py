"""Mixture-of-experts models on megatron-core: what its MoE layer needs in an RL program.

Entry points: :func:`prepare_moe` (called by the builder on every MoE model),
:func:`ep_aligned` (the micro-batches every whole-sequence forward runs),
:func:`aux_loss_weight` (before a training step's backwards) and :class:`RouterStats`.

Under expert parallelism each MoE layer exchanges tokens over its TP x EP group, a collective:
- the ranks of the group may feed different numbers of tokens (RL batches are ragged), which
  megatron's allgather dispatcher does not allow: :class:`RaggedAllGatherDispatcher` pads each
  rank's tokens to the group's largest count and drops the padding after the exchange;
- every rank of the group runs as many forwards (and backwards) as the others:
  :func:`ep_aligned` adds zero-weight micro-batches where a rank has fewer.
"""

from __future__ import annotations

import copy
import re

import torch
import torch.distributed as dist


def has_experts(model) -> bool:
    return bool(getattr(model.config, "num_moe_experts", None))


def exchange_group(model):
    """The group every MoE layer of ``model`` exchanges tokens over (None: no exchange)."""
    if not has_experts(model):
        return None
    group = model.pg_collection.tp_ep
    return group if group.size() > 1 else None


_LOCAL_EXPERT = re.compile(r"(\.experts\.local_experts\.)(\d+)(\.)")


def global_expert_name(name: str, model) -> str:
    """``name`` with its local expert index made global (EP rank ``e`` holds ``e * E/EP``...)."""
    if not has_experts(model) or "local_experts." not in name:
        return name
    ep = model.pg_collection.ep
    local = model.config.num_moe_experts // ep.size()
    return _LOCAL_EXPERT.sub(lambda m: f"{m[1]}{ep.rank() * local + int(m[2])}{m[3]}", name)


def routers(model) -> list:
    """``model``'s routers (this pipeline stage's), in layer order."""
    return [layer.mlp.router for layer in getattr(model.decoder, "layers", []) if hasattr(layer.mlp, "router")]


def prepare_moe(model) -> None:
    """Give ``model``'s MoE layers the ragged dispatcher, :func:`aux_loss_weight`'s weighting
    and routing records (:mod:`.routing`)."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    from megatron_rlhf.models import routing

    for layer in getattr(model.decoder, "layers", []):
        dispatcher = getattr(layer.mlp, "token_dispatcher", None)
        if type(dispatcher) is MoEAllGatherTokenDispatcher:
            dispatcher.__class__ = RaggedAllGatherDispatcher
    for router in routers(model):
        # (read by the router at construction, before training sets it on the config: the
        # auxiliary losses are per micro-batch means, weighted by aux_loss_weight)
        router.calculate_per_token_loss = False
    routing.install(model)
    # Expert parameters are expert-parallel at every EP size (megatron marks them only from
    # EP=2 on): DDP and the optimizer then keep them apart at EP=1 too (their groups are the
    # DP groups there), and the optimizer's checkpoint has the same structure at every EP size.
    for name, p in model.named_parameters():
        if ".experts." in name:
            p.allreduce = False


def freeze_routers(model) -> None:
    """``model``'s routers get no gradient (call before its optimizer is built)."""
    for router in routers(model):
        router.weight.requires_grad_(False)


def aux_loss_weight(model, micro_batches: int) -> float | None:
    """The routers' auxiliary-loss weight per backward: their mean over the micro-batches of
    all DP ranks (``micro_batches``: this rank's real ones), as megatron's schedules weight
    them; None without them. Collective over DP."""
    # Gradients are summed over DP (rlhf.optim: per-token normalisation): the weight is one
    # over the micro-batches of the whole DP group.
    config = model.config
    if not has_experts(model) or not (config.moe_aux_loss_coeff or config.moe_z_loss_coeff):
        return None
    total = torch.tensor(float(micro_batches), device=next(model.parameters()).device)
    dist.all_reduce(total, group=model.pg_collection.dp)
    return 1.0 / float(total)


def set_aux_loss_weight(weight: float) -> None:
    """The weight the routers' auxiliary-loss gradients take in the next backwards."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(weight))


class RouterStats:
    """Per-layer routing counts of ``model``'s forwards while attached (a context manager):
    each expert's load, and the tokens a capacity dropped."""

    def __init__(self, model):
        self.model = model
        self.loads: dict[int, torch.Tensor] = {}  # layer number -> tokens per expert
        self.routed: dict[int, int] = {}  # layer number -> tokens x top-k asked for
        self.handles = []

    def __enter__(self):
        for router in routers(self.model):
            self.handles.append(router.register_forward_hook(self._count))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []

    def _count(self, router, inputs, output):
        _, routing_map = output  # [tokens, experts] bool, after any capacity
        layer = router.layer_number
        load = routing_map.sum(0).to(torch.long)
        self.loads[layer] = self.loads.get(layer, 0) + load.detach()
        self.routed[layer] = self.routed.get(layer, 0) + routing_map.shape[0] * router.topk

    def metrics(self, prefix: str = "moe") -> dict:
        """``{prefix}_layer{L}_load_max``/``_load_min`` (an expert's share of the routes times the
        experts: 1 is balanced) and ``_dropped`` (routes a capacity dropped), over DP, every
        pipeline stage's layers on every stage (collective)."""
        pp = self.model.pg_collection.pp
        if pp.size() > 1:
            stages = [None] * pp.size()
            dist.all_gather_object(stages, self._metrics(prefix), group=pp)
            return {k: v for stage in stages for k, v in stage.items()}
        return self._metrics(prefix)

    def _metrics(self, prefix: str) -> dict:
        if not self.loads:
            return {}
        layers = sorted(self.loads)
        loads = torch.stack([self.loads[i] for i in layers]).to(torch.float64)
        asked = torch.tensor([self.routed[i] for i in layers], dtype=torch.float64, device=loads.device)
        both = torch.cat([loads, asked[:, None]], 1)
        dist.all_reduce(both, group=self.model.pg_collection.dp)
        loads, asked = both[:, :-1], both[:, -1]
        share = loads / loads.sum(1, keepdim=True).clamp(min=1) * loads.shape[1]
        dropped = 1 - loads.sum(1) / asked.clamp(min=1)
        out = {}
        for row, layer in enumerate(layers):
            out[f"{prefix}_layer{layer}_load_max"] = float(share[row].max())
            out[f"{prefix}_layer{layer}_load_min"] = float(share[row].min())
            out[f"{prefix}_layer{layer}_dropped"] = float(dropped[row])
        return out


def _counts(n: int, group, device) -> list[int]:
    sizes = [torch.zeros((), dtype=torch.long, device=device) for _ in range(group.size())]
    dist.all_gather(sizes, torch.tensor(n, dtype=torch.long, device=device), group=group)
    return [int(s) for s in sizes]


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    extra = rows - t.shape[0]
    return t if extra == 0 else torch.cat([t, t.new_zeros(extra, *t.shape[1:])])


def _real_rows(counts: list[int], top: int, device) -> torch.Tensor:
    """Indices of the real rows in the gathered ``[top * group, ...]`` tensor."""
    return torch.cat([torch.arange(i * top, i * top + c, device=device) for i, c in enumerate(counts)])


def _ragged_base():
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    return MoEAllGatherTokenDispatcher


class RaggedAllGatherDispatcher(_ragged_base()):
    """megatron's allgather token dispatcher for TP x EP ranks holding different token counts."""

    # The exchange runs at the group's largest count (equal-size collectives, as NCCL and gloo
    # want); the rows beyond a rank's count are zeros, routed nowhere after the gather.

    def token_dispatch(self, hidden_states, probs):
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        if self.tp_size == 1 and self.ep_size == 1:
            return hidden_states, probs
        group, n = self.tp_ep_group, hidden_states.shape[0]
        counts = _counts(n, group, hidden_states.device)
        if len(set(counts)) == 1:
            self._ragged = None
            return super().token_dispatch(hidden_states, probs)
        top = max(counts)
        real = _real_rows(counts, top, hidden_states.device)
        self._ragged = (len(counts) * top, n, real)  # (read back by token_combine)
        with torch.no_grad():
            self.routing_map = gather_from_sequence_parallel_region(
                _padded(self.routing_map, top), group=group)[real]
        probs = gather_from_sequence_parallel_region(_padded(probs, top), group=group)[real]
        hidden_states = gather_from_sequence_parallel_region(_padded(hidden_states, top), group=group)[real]
        return hidden_states, probs

    def token_combine(self, hidden_states):
        from megatron.core.tensor_parallel.mappings import reduce_scatter_to_sequence_parallel_region

        if self.tp_size == 1 and self.ep_size == 1:
            return hidden_states
        if self._ragged is None:
            return super().token_combine(hidden_states)
        rows, n, real = self._ragged
        dtype = hidden_states.dtype
        full = hidden_states.new_zeros(rows, *hidden_states.shape[1:], dtype=self.local_probs.dtype)
        full = full.index_put((real,), hidden_states.to(full.dtype))
        return reduce_scatter_to_sequence_parallel_region(full, group=self.tp_ep_group)[:n].to(dtype)


def is_filler(mb) -> bool:
    return getattr(mb, "ep_filler", False)


def ep_aligned(model, micro_batches: list) -> tuple[list, int]:
    """``(micro_batches + fillers, real)``: as many as the exchange group's rank with the most;
    fillers are :func:`is_filler` copies of the first (outputs dropped, losses weighted 0)."""
    group = exchange_group(model)
    real = len(micro_batches)
    if group is None:
        return micro_batches, real
    most = torch.tensor(real, device=next(model.parameters()).device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
    if real == 0 and int(most):
        raise ValueError("a rank without micro-batches cannot join its expert-parallel group's "
                         "forwards: every rank needs at least one row")
    fillers = [copy.copy(micro_batches[0]) for _ in range(int(most) - real)]
    for mb in fillers:
        mb.ep_filler = True
        for name in ("response_mask", "loss_weights"):  # no token counts in a loss or metric
            if torch.is_tensor(getattr(mb, name, None)):
                setattr(mb, name, torch.zeros_like(getattr(mb, name)))
    return micro_batches + fillers, real
