"""Full-recompute greedy decoding: the reference the real engine is checked against.

Every step runs the whole sequence through the model (no KV cache), so it is slow but has
no state to get wrong. Under TP all ranks of a group compute the same tokens.
"""

from __future__ import annotations

import torch

from megatron_rlhf.models.forward import lm_logits


@torch.no_grad()
def greedy_generate(model, prompt_ids: list[int], max_new_tokens: int,
                    eos_token_id: int | None = None) -> list[int]:
    """Greedy continuation of one prompt; stops after ``eos_token_id`` (included)."""
    limit = model.mrlhf_config.max_position_embeddings
    if len(prompt_ids) + max_new_tokens > limit:
        raise ValueError(
            f"prompt of {len(prompt_ids)} tokens + {max_new_tokens} new tokens exceeds the "
            f"model's {limit} positions; shorten the prompt or lower --max-new-tokens"
        )
    was_training = model.training
    model.eval()
    dev = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], device=dev)
    out: list[int] = []
    for _ in range(max_new_tokens):
        nxt = int(lm_logits(model, ids)[0, -1].argmax())
        out.append(nxt)
        if nxt == eos_token_id:
            break
        ids = torch.cat([ids, ids.new_tensor([[nxt]])], dim=1)
    model.train(was_training)
    return out
