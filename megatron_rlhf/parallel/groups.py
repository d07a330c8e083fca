"""Process groups for a :class:`~megatron_rlhf.parallel.layout.Layout`.

Entry point: :func:`build_process_groups`. megatron-core modules take its collection
(``pg_collection=``); nothing here touches megatron's global ``parallel_state``.
"""

from __future__ import annotations

import torch.distributed as dist

from megatron_rlhf.parallel.layout import Layout


def _new_groups(groups: list[list[int]], rank: int):
    mine = None
    for g in groups:
        pg = dist.new_group(ranks=g)
        if rank in g:
            mine = pg
    return mine


def build_process_groups(layout: Layout):
    """Create the layout's groups (collective over the world) and return this rank's
    ``ProcessGroupCollection``, or None on a rank outside the layout."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    # new_group is collective over the whole world: every rank creates every group in the same
    # order, members or not.

    world = dist.get_world_size()
    if max(layout.ranks) >= world:
        raise ValueError(f"{layout} uses ranks beyond the world size {world}")
    rank = dist.get_rank()
    tp = _new_groups(layout.tp_groups(), rank)
    dp = _new_groups(layout.dp_groups(), rank)
    pp = _new_groups(layout.pp_groups(), rank)
    mp = _new_groups(layout.mp_groups(), rank)
    embd = _new_groups(layout.embedding_groups(), rank)
    pos_embd = _new_groups([[g[0]] for g in layout.pp_groups()], rank)
    cp = _new_groups([[r] for r in layout.ranks], rank)  # size 1: no context parallelism
    tp_dp = _new_groups(
        [[layout.rank_at(t, d, p) for d in range(layout.dp) for t in range(layout.tp)]
         for p in range(layout.pp)],
        rank,
    )
    everyone = _new_groups([list(layout.ranks)], rank)
    # The expert layers' groups (expert TP is TP). At EP=1 they are the singletons, TP, TPxPP
    # and DP groups already built.
    if layout.ep > 1:
        ep = _new_groups(layout.ep_groups(), rank)
        expt_dp = _new_groups(layout.expt_dp_groups(), rank)
        tp_ep = _new_groups(layout.tp_ep_groups(), rank)
        tp_ep_pp = _new_groups(layout.tp_ep_pp_groups(), rank)
    else:
        ep, expt_dp, tp_ep, tp_ep_pp = cp, dp, tp, mp
    if rank not in layout:
        return None
    # megatron's DDP and distributed optimizer also ask for the optimizer-instance group: with
    # one instance it is the whole layout (gradient norms are reduced over it); expert
    # gradients are reduced over expt_dp, the others over dp.
    return ProcessGroupCollection(
        tp=tp, dp=dp, pp=pp, mp=mp, embd=embd, pos_embd=pos_embd, cp=cp,
        tp_cp=tp, dp_cp=dp, tp_dp_cp=tp_dp,
        ep=ep, expt_tp=tp, tp_ep=tp_ep, tp_ep_pp=tp_ep_pp, expt_dp=expt_dp,
        intra_dp_cp=dp, intra_expt_dp=expt_dp, intra_dist_opt=everyone,
    )
