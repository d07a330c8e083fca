"""Tiny random actor/draft pairs with peaked distributions (so greedy text is varied).

Weights are identical at every TP size: megatron's CPU init is TP-invariant, and the
draft is the actor plus a multiple of a third TP-invariant random model.
"""

from __future__ import annotations

import torch

from megatron_rlhf.config import preset
from megatron_rlhf.models.builder import build_model

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18], [3] * 9, [200]]


def actor_and_draft(pg, name: str = "tiny-untied", eos: int | None = None, sharpness: float = 60.0,
                    noise: float = 0.5, seed: int = 1, **overrides):
    """An actor with a sharpened LM head and a draft near it (``noise`` 0: identical)."""
    cfg = preset(name, eos_token_id=eos, **overrides)
    actor = build_model(cfg, "actor", pg, dtype=torch.float32, seed=seed)
    draft = build_model(cfg, "draft", pg, dtype=torch.float32, seed=seed)
    other = build_model(cfg, "draft", pg, dtype=torch.float32, seed=seed + 1)
    with torch.no_grad():
        actor.output_layer.weight.mul_(sharpness)
        other.output_layer.weight.mul_(sharpness)
        for a, d, o in zip(actor.parameters(), draft.parameters(), other.parameters()):
            d.copy_(a + noise * o)
    return actor, draft
