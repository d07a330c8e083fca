"""Routing replay (``--routing-replay``): the rollout records every fed token's top-k experts
per layer; the actor's whole-sequence forwards replay them, or compare (``routing_*`` metrics).

Entry points: :func:`install` (every MoE model), :func:`recording` (the cached forward),
:func:`replaying` (``models.pipeline.model_output``), :func:`arm` / :func:`measuring` /
:func:`take_metrics`. Records: int16 global expert indices ``[tokens, layers, k]``, -1 where
none (padding; a response's last token, never fed). Invariant: with replay a recorded token
takes its experts in every layer, forward and recompute alike; others route themselves.
"""
# Each router's ``router_replay`` (megatron-core's hook inside topk_routing_with_score_function,
# built for its RouterReplay) is a :class:`Routes` of this module: megatron's RouterReplay keeps
# one process-wide list over every model built (actor, reference, generation copy), switches
# forward/backward replay by hand and replays all tokens or none.

from __future__ import annotations

import contextlib
from collections import deque

import torch
import torch.distributed as dist

RECORD_DTYPE = torch.int16


def _in_backward() -> bool:  # (a checkpointed layer's recompute)
    return torch._C._current_graph_task_id() != -1


def _differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # [n, k] each: other experts
    return (a.sort(1).values != b.sort(1).values).any(1)


class Routes:
    """One router's records and targets (its ``router_replay``)."""

    def __init__(self, router):
        self.layer = router.layer_number - 1  # its column in the records (global layer index)
        self.sink = None  # (records [rows, layers, k], row of each token): recording
        self.target = None  # [tokens, k] long, -1 where none: replaying or comparing
        self.replay = False
        self.keep = False  # keep the routes used for a recompute in the backward
        self.backward: deque = deque()
        # measuring (shared by the model's routers): routes recorded, own differing, used
        # differing, tokens recorded, tokens whose own routes differ in some layer
        self.counts = None
        self.flags = None  # [tokens] bool: own routes differing in a layer so far (one forward)

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        # megatron's hook: (values, indices [tokens, k]) of the experts each token takes
        if _in_backward():  # a recompute takes what its forward took
            if self.backward:
                used = self.backward.popleft()
                return scores.gather(1, used), used
            return default_compute_topk(scores, topk, num_groups, group_topk)
        values, own = default_compute_topk(scores, topk, num_groups, group_topk)
        if self.sink is not None:
            records, rows = self.sink
            records[rows, self.layer] = own.to(records.dtype)
        if self.target is None:
            return values, own
        target = self.target
        known = target[:, 0] >= 0
        used = torch.where(known[:, None], target, own) if self.replay else own
        if self.counts is not None:
            disagree = _differs(own, target) & known
            self.counts[:3] += torch.stack([known.sum(), disagree.sum(),
                                            (_differs(used, target) & known).sum()]).to(self.counts)
            if self.flags is not None:
                self.flags |= disagree
        if not self.replay:
            return values, own
        if self.keep:
            self.backward.append(used)
        return scores.gather(1, used), used


def routes(model) -> list[Routes]:  # this pipeline stage's, in layer order
    from megatron_rlhf.models.moe import routers

    return [r.router_replay for r in routers(model) if isinstance(r.router_replay, Routes)]


def install(model) -> None:
    """Give each router of ``model`` a :class:`Routes` (it records and replays nothing yet)."""
    from megatron_rlhf.models.moe import routers

    for router in routers(model):
        router.router_replay = Routes(router)


def layer_records(records: torch.Tensor, r: Routes) -> torch.Tensor:  # what router r replays
    return records[:, r.layer]


# ---------------------------------------------------------------------------- generation
@contextlib.contextmanager
def recording(model, records: torch.Tensor | None, rows: torch.Tensor | None):
    """Within the block every router of ``model`` writes the top-k experts of the ``i``-th token
    it routes to ``records[rows[i], layer]`` (``records`` None: nothing is recorded)."""
    if records is None:
        yield
        return
    mine = routes(model)
    for r in mine:
        r.sink = (records, rows)
    try:
        yield
    finally:
        for r in mine:
            r.sink = None


# ---------------------------------------------------------------------------- whole sequences
def replays(model) -> bool:  # (else its routers only compare)
    return bool(getattr(model, "mrlhf_routing_replay", False))


def set_replay(model, on: bool) -> None:
    model.mrlhf_routing_replay = bool(on)


def in_router_order(model, mb) -> torch.Tensor | None:
    """``mb.routes [b, s, layers, k]`` in this rank's routers' token order (sequence-first, or
    packed; its sequence share under sequence parallelism), long; None without records."""
    from megatron_rlhf.models import sequence_parallel

    records = getattr(mb, "routes", None)
    if records is None:
        return None
    layers, k = records.shape[2:]
    packed = getattr(mb, "packed", None)
    if packed is not None:  # the real tokens row after row, then the packing's padding
        flat = records[mb.attention_mask.bool()]
        flat = torch.cat([flat, flat.new_full((packed.tokens - flat.shape[0], layers, k), -1)])
    else:  # megatron's [s, b]; masked_forward pads s to a multiple of TP under sequence parallelism
        extra = sequence_parallel.padded_length(model, records.shape[1]) - records.shape[1]
        if extra:
            records = torch.cat([records, records.new_full((records.shape[0], extra, layers, k), -1)], 1)
        flat = records.transpose(0, 1).reshape(-1, layers, k)
    if sequence_parallel.enabled(model):
        tp = model.pg_collection.tp
        share = flat.shape[0] // tp.size()
        flat = flat[tp.rank() * share:(tp.rank() + 1) * share]
    return flat.long()


@contextlib.contextmanager
def replaying(model, mb, training: bool = False):
    """Within the block ``model``'s routers take the micro-batch's records as targets: replayed
    where :func:`replays`, else compared. ``training``: a backward follows, whose recomputes
    take the routes the forward took (:func:`end_backward` forgets them)."""
    mine = routes(model) if getattr(model, "mrlhf_role", None) == "actor" else []
    flat = in_router_order(model, mb) if mine else None
    if flat is None:
        yield
        return
    replay = replays(model)
    # tokens disagreeing in some layer: where this stage holds every layer
    flags = None
    if mine[0].counts is not None and model.pg_collection.pp.size() == 1:
        flags = torch.zeros(flat.shape[0], dtype=torch.bool, device=flat.device)
    for r in mine:
        r.target, r.replay, r.keep = layer_records(flat, r), replay, training and replay
        r.flags = flags
    try:
        yield
    finally:
        for r in mine:
            r.target = r.flags = None
        if flags is not None:
            known = flat[:, 0, 0] >= 0
            mine[0].counts[3:] += torch.stack([known.sum(), (flags & known).sum()]).to(mine[0].counts)


def end_backward(model) -> None:  # after a step's backwards: forget the routes kept for recomputes
    for r in routes(model):
        r.backward.clear()


# ---------------------------------------------------------------------------- metrics
def arm(model) -> None:  # the next measuring block of ``model`` measures (once)
    model.mrlhf_routes_armed = True


@contextlib.contextmanager
def measuring(model):
    """When :func:`arm`-ed, count the block's routes against the records and keep the metrics
    for :func:`take_metrics` (collective over ``model``'s DP, PP and TP groups on exit)."""
    mine = routes(model)
    if not getattr(model, "mrlhf_routes_armed", False) or not mine:
        yield
        return
    model.mrlhf_routes_armed = False
    dev = next(model.parameters()).device
    counts = torch.zeros(5, dtype=torch.float64, device=dev)
    for r in mine:
        r.counts = counts
    try:
        yield
    finally:
        for r in mine:
            r.counts = None
    pg = model.pg_collection
    for group in (pg.dp, pg.pp, pg.tp):  # other rows, other layers; TP ranks alike or shares
        if group.size() > 1:
            dist.all_reduce(counts, group=group)
    known, own, used, tokens, tokens_own = counts.tolist()
    if known:
        model.mrlhf_route_metrics = {"routing_disagreement": own / known, "routing_mismatch": used / known}
    if tokens:  # (under PP no stage sees every layer of a token)
        model.mrlhf_route_metrics["routing_tokens_disagreeing"] = tokens_own / tokens


def take_metrics(model) -> dict:
    """Once: the shares of (token, layer) routes the routers chose (``routing_disagreement``)
    and the forward took (``routing_mismatch``: 0 with replay) otherwise than the rollout, and
    of tokens whose routers chose otherwise in some layer (``routing_tokens_disagreeing``)."""
    out = getattr(model, "mrlhf_route_metrics", {})
    model.mrlhf_route_metrics = {}
    return out
