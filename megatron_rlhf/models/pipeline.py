"""Whole-sequence forwards (and backwards) of micro-batches, pipelined or not.

Entry points: :func:`map_micro_batches` (no gradients) and :func:`forward_backward`.
Invariant: callers see the same results at any PP size.
"""
# At PP > 1 megatron-core's schedules run (1F1B, or forward only). ``output`` is the model's
# raw output on the last stage: [b, s, V] LM logits (vocabulary padding included), the head's
# input [b, s, h] of a chunked LM head, or [b, s, 1] values.

from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.distributed as dist

from megatron_rlhf import runtime
from megatron_rlhf.models import routing, sequence_parallel
from megatron_rlhf.models.forward import head_as_output, head_chunk, masked_forward
from megatron_rlhf.models.moe import aux_loss_weight, ep_aligned, is_filler, set_aux_loss_weight
from megatron_rlhf.models.packed import packed_forward

LM_ROLES = ("actor", "reference", "draft")  # output vocabulary logits; the others a value


def pipelined(model) -> bool:
    return model.pg_collection.pp.size() > 1


def model_output(model, mb, training: bool = False) -> torch.Tensor:
    """The model's raw output for a micro-batch (one stage's, under PP). An LM's logits start at
    the column before the first response token (read by ``rlhf.batch.response_slice``); where
    its head is chunked (``forward.head_chunk``) its head's input ``[b, s, h]`` instead. An MoE
    actor's routers replay (or compare with) the micro-batch's routes (``training``: a
    backward follows; :mod:`.routing`)."""
    # The prompt's other columns predict nothing that is scored. A packed micro-batch's output
    # comes back in its padded columns (models.packed).
    lm = getattr(model, "mrlhf_role", None) in LM_ROLES
    output_from, hidden = (mb.prompt_len - 1 if lm else 0), lm and head_chunk(model) > 0
    with routing.replaying(model, mb, training):
        if getattr(mb, "packed", None) is not None:
            with head_as_output(model, hidden):
                return packed_forward(model, mb.packed, output_from)
        return masked_forward(model, mb.input_ids, mb.attention_mask, output_from=output_from, hidden=hidden)


def map_micro_batches(model, micro_batches: list, fn) -> list:
    """``[fn(output, mb) for mb in micro_batches]`` on every rank, without gradients."""
    # Under PP every stage receives the same micro-batches (the first reads their tokens, every
    # stage their masks); what the last stage computes comes back to every stage. Under expert
    # parallelism the ranks exchanging tokens run as many forwards (models.moe).
    micro_batches, real = ep_aligned(model, micro_batches)
    with torch.no_grad():
        if not pipelined(model):
            return [fn(model_output(model, mb), mb) for mb in micro_batches][:real]
        store = _schedule(model, micro_batches, partial(_keep, fn), forward_only=True)
        return from_last_stage(model, [d["out"] for d in store])[:real]


def forward_backward(model, micro_batches: list, loss, accumulating=None) -> None:
    """Back-propagate ``loss(output, mb)`` (a scalar, on the last stage) of every micro-batch;
    gradients accumulate in DDP's buffers. ``accumulating(last)``: the context of a
    micro-batch's backward (:meth:`~megatron_rlhf.rlhf.optim.Trainee.accumulating`)."""
    micro_batches, real = ep_aligned(model, micro_batches)
    if real < len(micro_batches):
        loss = partial(_filler_zero, loss)
    aux = aux_loss_weight(model, real)  # (None: no router losses)
    try:
        if not pipelined(model):
            for i, mb in enumerate(micro_batches):
                if aux is not None:  # a filler's router losses count 0 too
                    set_aux_loss_weight(0.0 if is_filler(mb) else aux)
                with accumulating(i == len(micro_batches) - 1) if accumulating else contextlib.nullcontext():
                    loss(model_output(model, mb, training=True), mb).backward()
            return
        if aux is not None:  # (under 1F1B the fillers' router losses count like the others')
            set_aux_loss_weight(aux * real / len(micro_batches))
        model.config.no_sync_func = (lambda: accumulating(False)) if accumulating else None
        _schedule(model, micro_batches, partial(_loss, loss), forward_only=False)
    finally:
        routing.end_backward(model)


def last_stage(model) -> bool:
    pp = model.pg_collection.pp
    return pp.rank() == pp.size() - 1


def from_last_stage(model, obj):
    """``obj`` as the pipeline's last stage has it, on every stage (identity at PP=1)."""
    if not pipelined(model):
        return obj
    pp = model.pg_collection.pp
    box = [obj if last_stage(model) else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(pp, pp.size() - 1), group=pp,
                               device=_object_device())
    return _to(box[0], next(model.parameters()).device)


# ---------------------------------------------------------------------------- internals
def _filler_zero(loss, output, mb):
    """``loss``, times 0 for an expert-parallel filler (models.moe.ep_aligned): zero gradients."""
    value = loss(output, mb)
    return value * 0 if is_filler(mb) else value


def _keep(fn, mb, output):
    return torch.zeros((), device=output.device), {"out": fn(output, mb)}


def _loss(loss, mb, output):
    value = loss(output, mb)
    # (loss, tokens, reduced): with calculate_per_token_loss (set on every model that
    # trains, rlhf.optim.build_trainee) megatron neither divides the loss by its token
    # count nor by the number of micro-batches: ours is normalised already
    return value, torch.ones((), dtype=torch.int, device=value.device), {}


def _schedule(model, micro_batches: list, loss_func, forward_only: bool) -> list:
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    pg, config = model.pg_collection, model.config
    # (what the first stage is fed: a packed micro-batch's tokens, else the padded rows, which
    # masked_forward pads to a multiple of TP under sequence parallelism)
    shapes = {tuple(_feed(mb).shape) for mb in micro_batches}
    if len(shapes) != 1:
        raise ValueError(f"pipelined micro-batches must share one shape [b, s], got {sorted(shapes)}")
    b, s = shapes.pop()
    s = sequence_parallel.padded_length(model, s)

    def step(data_iterator, chunk):
        mb = next(data_iterator)
        return model_output(chunk, mb, training=not forward_only), partial(loss_func, mb)

    run = get_forward_backward_func(pp_size=pg.pp.size())
    with runtime.cuda_as_cpu():
        return run(forward_step_func=step, data_iterator=iter(micro_batches), model=[model],
                   num_microbatches=len(micro_batches), seq_length=s, micro_batch_size=b,
                   forward_only=forward_only, p2p_communicator=P2PCommunicator(pg.pp, config),
                   pg_collection=pg)


def _feed(mb) -> torch.Tensor:
    packed = getattr(mb, "packed", None)
    return mb.input_ids if packed is None else packed.input_ids


def _object_device():
    return torch.device("cuda", torch.cuda.current_device()) if runtime.has_cuda() else None


def _to(obj, dev):
    if torch.is_tensor(obj):
        return obj.to(dev)
    if isinstance(obj, list):
        return [_to(x, dev) for x in obj]
    if isinstance(obj, dict):
        return {k: _to(v, dev) for k, v in obj.items()}
    return obj
