"""The trained policy's log-probs and entropy from an LM's head input, the head's logits made a
chunk of tokens at a time: no ``[tokens, V]`` tensor in training or in the experience.

Entry points: :func:`policy_of_output` (a log-prob forward's output, chunked head or not),
:func:`policy_from_hidden` (on the output of a model whose head is chunked:
``models.forward.set_head_chunk``).
Invariants: the values and gradients are :mod:`.policy`'s on the whole logits, up to the
rounding of the head's matmuls over other shapes; at most one chunk's ``[chunk, V]`` logits
(and the tensors made from them) exist at a time, in the forward and in the backward.
"""
# Chunks split the tokens, never the vocabulary, so each chunk's rows go through
# policy.policy_logprobs(_and_entropy) unchanged (temperature, top-k/top-p, the truncated
# entropy). In training each chunk is checkpointed: its forward keeps none of its [chunk, V]
# tensors, and the backward reruns the chunk to form its gradients, one chunk after the other.
# Padding positions are not computed: they get 0.

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from megatron_rlhf.config import GenerationConfig
from megatron_rlhf.models.forward import head_chunk, head_weight, logits_of
from megatron_rlhf.rlhf.batch import Experience, response_slice
from megatron_rlhf.rlhf.policy import policy_logprobs, policy_logprobs_and_entropy


def policy_of_output(model, output: Tensor, mb: Experience, entropy: bool = True,
                     entropy_grad: bool = True) -> tuple[Tensor, Tensor | None]:
    """``(log pi(a_t | s_t), entropy or None)``, both ``[b, T]``, of an LM's raw output over
    micro-batch ``mb`` under ``mb.policy``: from its head's input where the head is chunked
    (0 at padding), else from its logits. ``entropy``, ``entropy_grad`` as in
    :func:`policy_from_hidden`."""
    if head_chunk(model):
        return policy_from_hidden(model, response_slice(output, mb), mb.response_ids, mb.response_mask,
                                  mb.policy, entropy, entropy_grad)
    logits = response_slice(logits_of(model, output), mb)
    if not entropy:
        return policy_logprobs(logits, mb.response_ids, mb.policy), None
    return policy_logprobs_and_entropy(logits, mb.response_ids, mb.policy, entropy_grad)


def policy_from_hidden(model, hidden: Tensor, tokens: Tensor, mask: Tensor,
                       policy: GenerationConfig | None, entropy: bool = True,
                       entropy_grad: bool = True) -> tuple[Tensor, Tensor | None]:
    """``(log pi(tokens), entropy of pi)``, both ``[B, T]`` and 0 where ``mask`` is 0, from
    ``model``'s head input ``hidden [B, T, h]`` at the positions that chose ``tokens [B, T]``;
    the entropy None unless ``entropy``, outside autograd unless ``entropy_grad``."""
    step = head_chunk(model)
    if step <= 0:
        raise ValueError(f"this {model.mrlhf_role}'s head is not chunked: its output holds logits")
    keep = mask.bool()
    x, ids = hidden[keep], tokens[keep]  # [n, h], [n]
    weight = head_weight(model)
    tp = model.pg_collection.tp
    tp = tp if tp.size() > 1 else None
    vocab = model.mrlhf_config.vocab_size
    grads = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    parts = []
    for i in range(0, max(x.shape[0], 1), step):  # (one empty chunk without tokens: a loss still has a graph)
        args = (x[i:i + step], weight, ids[i:i + step], policy, vocab, tp, entropy, entropy_grad)
        parts.append(checkpoint(_chunk, *args, use_reentrant=False, preserve_rng_state=False)
                     if grads else _chunk(*args))
    out = [x.new_zeros(keep.shape, dtype=torch.float32).masked_scatter(keep, torch.cat(p))
           for p in zip(*parts)]
    return out[0], (out[1] if entropy else None)


def _chunk(x: Tensor, weight: Tensor, tokens: Tensor, policy: GenerationConfig | None, vocab: int,
           tp, entropy: bool, entropy_grad: bool) -> tuple[Tensor, ...]:
    """``(log pi, entropy)`` ``[c]`` (the log-probs alone unless ``entropy``) of one chunk's head
    input ``x [c, h]``; its logits ``[c, V]`` live only here."""
    logits = F.linear(x, weight)  # [c, V_padded / TP]
    if tp is not None:
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        logits = gather_from_tensor_model_parallel_region(logits, group=tp)  # [c, V_padded]
    logits = logits[:, :vocab]
    if not entropy:
        return (policy_logprobs(logits, tokens, policy),)
    return policy_logprobs_and_entropy(logits, tokens, policy, entropy_grad)
