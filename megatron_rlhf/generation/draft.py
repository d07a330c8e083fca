"""Draft models for speculative decoding: shape, initialisation from the target, distillation.

A draft has a subset LM head over the target's frequent tokens (others get probability 0:
still lossless) and a few of the target's layers, or one layer that also reads the target's
``h_{t-1}`` (a feature draft, EAGLE). Entry points: :func:`draft_config`,
:func:`init_from_target`, the losses on the target's top-k (:func:`teacher_topk`).
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch

from megatron_rlhf.config import ModelConfig


def spread_layers(total: int, keep: int) -> list[int]:
    """``keep`` layer indices spread evenly over ``0..total-1``, first and last included."""
    if not 1 <= keep <= total:
        raise ValueError(f"a draft keeps between 1 and {total} layers, got {keep}")
    if keep == 1:
        return [0]
    return sorted({round(i * (total - 1) / (keep - 1)) for i in range(keep)})


def end_layers(total: int, keep: int) -> list[int]:
    """The first ``ceil(keep/2)`` and the last ``floor(keep/2)`` of ``total`` layers."""
    if not 1 <= keep <= total:
        raise ValueError(f"a draft keeps between 1 and {total} layers, got {keep}")
    head = (keep + 1) // 2
    return list(range(head)) + list(range(total - (keep - head), total))


def draft_config(target: ModelConfig, num_layers: int, head_vocab_size: int | None,
                 feature_draft: bool = False) -> ModelConfig:
    """The draft's architecture: the target's width and tokenizer, fewer layers, small head."""
    return target.replace(num_layers=num_layers, head_vocab_size=head_vocab_size,
                          tie_embeddings=False if head_vocab_size else target.tie_embeddings,
                          feature_draft=feature_draft)


def frequent_tokens(sequences: list[list[int]], k: int, always: list[int]) -> torch.Tensor:
    """The ``k`` most frequent token ids in ``sequences`` (``always`` included), sorted."""
    counts = Counter(t for s in sequences for t in s)
    chosen = list(dict.fromkeys([t for t in always if t is not None] +
                                [t for t, _ in counts.most_common()]))[:k]
    fill = (t for t in range(k * 4) if t not in set(chosen))  # pad with low ids if too few
    while len(chosen) < k:
        chosen.append(next(fill))
    return torch.tensor(sorted(chosen))


@torch.no_grad()
def init_from_target(draft, target, layers: list[int], token_ids: torch.Tensor | None) -> None:
    """Copy the target's embedding, ``layers``, final norm and head rows (``token_ids``) into
    ``draft``; both share a TP layout (each rank copies its own shards)."""
    draft.embedding.load_state_dict(target.embedding.state_dict())
    for dst, src in zip(draft.decoder.layers, layers):
        dst.load_state_dict(target.decoder.layers[src].state_dict())
    draft.decoder.final_layernorm.load_state_dict(target.decoder.final_layernorm.state_dict())
    full = (target.shared_embedding_or_output_weight() if target.share_embeddings_and_output_weights
            else target.output_layer.weight)
    if token_ids is None:
        draft.output_layer.weight.copy_(full)
        return
    head = draft.output_layer
    head.token_ids.copy_(token_ids)
    group = draft.pg_collection.tp
    shards = [full]
    if group.size() > 1:  # the target's head is vocab-sharded: every rank needs all rows
        shards = [torch.empty_like(full) for _ in range(group.size())]
        torch.distributed.all_gather(shards, full.contiguous(), group=group)
    per = head.weight.shape[0]  # this rank's slice of the draft head
    mine = token_ids[group.rank() * per:(group.rank() + 1) * per]
    head.weight.copy_(torch.cat(shards)[mine])


def distill_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor,
                 token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Forward KL(p_target || q_draft) per token of ``*_logits [B, T, V]``, averaged over
    ``mask [B, T]``; both restricted and renormalised to ``token_ids`` when given."""
    if token_ids is not None:
        draft_logits = draft_logits[..., token_ids]
        target_logits = target_logits[..., token_ids]
    logp = torch.log_softmax(target_logits.float(), -1)
    logq = torch.log_softmax(draft_logits.float(), -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    return (kl * mask).sum() / mask.sum().clamp(min=1)


def _masked_head_rows(logits: torch.Tensor, mask: torch.Tensor,
                      token_ids: torch.Tensor | None) -> torch.Tensor:
    """``[N, head]`` fp32 rows of ``logits [B, T, V]`` at the ``mask``-ed positions (row-major),
    restricted to ``token_ids`` when given."""
    rows = logits[mask.bool()].float()
    return rows if token_ids is None else rows[:, token_ids]


def teacher_topk(target_logits: torch.Tensor, mask: torch.Tensor, token_ids: torch.Tensor | None,
                 k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-``k`` tokens and renormalised log-probs at the ``mask [B, T]``-ed
    positions of ``target_logits [B, T, V]``: ``(index [N, k], logp [N, k])``, indices into
    ``token_ids`` when given."""
    logits = _masked_head_rows(target_logits, mask, token_ids)  # [N, head]
    top = torch.topk(logits, min(k, logits.shape[-1]), dim=-1)
    return top.indices, torch.log_softmax(top.values, -1)


def topk_distill_loss(draft_logits: torch.Tensor, mask: torch.Tensor, index: torch.Tensor,
                      logp: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """KL from the target's top-k distribution (:func:`teacher_topk`) to the draft's, per token."""
    logq = torch.log_softmax(_masked_head_rows(draft_logits, mask, token_ids), -1).gather(-1, index)
    return (logp.exp() * (logp - logq)).sum(-1).mean()


def topk_tv_loss(draft_logits: torch.Tensor, mask: torch.Tensor, index: torch.Tensor,
                 logp: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Total variation between the target's top-k distribution and the draft's, per token."""
    # 1 - sum_k min(p_k, q(x_k)): the rejection probability of speculative sampling
    # (DistillSpec, Zhou et al. 2023: raises acceptance at temperature 1 more than KL)
    q = torch.softmax(_masked_head_rows(draft_logits, mask, token_ids), -1).gather(-1, index)
    return (1 - torch.minimum(logp.exp(), q).sum(-1)).mean()


@contextlib.contextmanager
def final_hidden_states(model, enabled: bool = True):
    """Yields a dict whose ``"h"`` becomes the final norm's output ``[B, T, h]`` of the latest forward."""
    seen = {}
    if not enabled:
        yield seen
        return
    from megatron_rlhf.models.sequence_parallel import gather_output

    hook = model.decoder.final_layernorm.register_forward_hook(  # (whole sequences under SP)
        lambda m, i, o: seen.update(h=gather_output(model, o).transpose(0, 1)))
    try:
        yield seen
    finally:
        hook.remove()


def target_logits_and_features(target, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """The target's logits ``[B, T, V]`` and final-norm hidden states ``[B, T, h]``, one forward."""
    from megatron_rlhf.models.forward import lm_logits

    with final_hidden_states(target) as seen:
        logits = lm_logits(target, input_ids, attention_mask)
    return logits, seen["h"][:, : input_ids.shape[1]]  # (a sequence-parallel target pads)


def shifted_features(features: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The target's ``h_{t-1}`` at each position (zero at a sequence's first token), any padding."""
    prev = torch.cat([torch.zeros_like(attention_mask[:, :1]), attention_mask[:, :-1]], 1)
    shifted = torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], 1)
    return shifted * prev[..., None].to(shifted.dtype)


def head_logits(draft, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                features: torch.Tensor | None = None, return_features: bool = False):
    """The logits a draft trains on: ``[B, T, head_vocab_size]`` in ``token_ids`` order with a
    subset head, else ``[B, T, V]`` (:func:`teacher_topk`'s index space). ``features [B, T, h]``:
    the target's (a feature draft; raises ValueError without). ``return_features`` adds the
    draft's own ``[B, T, h]``."""
    from megatron_rlhf.models.forward import lm_logits, masked_forward, position_ids
    from megatron_rlhf.models.heads import head_logits_only

    fusion = getattr(draft, "feature_fusion", None)
    if fusion is not None and features is None:
        raise ValueError("a feature draft trains on the target's hidden states: pass features")
    subset = getattr(draft.output_layer, "token_ids", None) is not None
    with final_hidden_states(draft, enabled=return_features) as seen, \
            (head_logits_only(draft) if subset else contextlib.nullcontext()):
        if fusion is None:
            logits = lm_logits(draft, input_ids, attention_mask)
        else:
            pos = position_ids(attention_mask)
            x = fusion(draft.embedding(input_ids=input_ids, position_ids=pos),
                       shifted_features(features, attention_mask).transpose(0, 1))
            logits = masked_forward(draft, input_ids, attention_mask, decoder_input=x)
    if not subset:
        logits = logits[..., : draft.mrlhf_config.vocab_size]
    return (logits, seen["h"]) if return_features else logits


def feature_loss(draft_features: torch.Tensor, target_features: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
    """Smooth-L1 distance of the draft's hidden states to the target's at ``mask``-ed positions."""
    m = mask.bool()
    return torch.nn.functional.smooth_l1_loss(draft_features[m].float(), target_features[m].float())
