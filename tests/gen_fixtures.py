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


def feature_draft_for(actor, pg, noise: float = 0.01, seed: int = 3):
    """A feature (EAGLE) draft that is the actor plus a perturbation through the features.

    It copies the actor's layers, norm and head, and its fusion is ``[I | noise * R]``: with
    ``noise`` 0 it ignores the features and computes exactly the actor (accepts everything);
    otherwise the actor's hidden states push its predictions off. ``R`` is seeded on CPU,
    so the draft is the same at every TP size.
    """
    from megatron_rlhf.generation.draft import init_from_target

    cfg = actor.mrlhf_config.replace(feature_draft=True)
    draft = build_model(cfg, "draft", pg, dtype=torch.float32, seed=seed)
    init_from_target(draft, actor, list(range(cfg.num_layers)), None)
    h = cfg.hidden_size
    r = torch.randn(h, h, generator=torch.Generator().manual_seed(seed)) / h ** 0.5
    with torch.no_grad():
        draft.feature_fusion.weight.copy_(torch.cat([torch.eye(h), noise * r], 1))
    return draft


def decode_attention_error(model, static: bool = False, drop_mask: bool = False) -> float:
    """Largest error, relative to the largest reference logit, of cached decoding against
    the whole-sequence forward of each prompt: :data:`PROMPTS` (lengths 1-9, so the rows
    of the batch are padded against each other) prefilled, then decode steps and
    verifications of several widths, with the decode attention backend in force (the
    caller sets it). ``static``: the step a CUDA graph captures (the attention over the
    whole cache, positions past each row's length masked). ``drop_mask``: a control with
    every key visible (padding and the future included), which must fail."""
    from unittest import mock

    import megatron_rlhf.generation.incremental as inc
    from megatron_rlhf.generation.kv_cache import KVCache
    from megatron_rlhf.models.forward import lm_logits

    max_len = 32
    cache, rope = KVCache.for_model(model, len(PROMPTS), max_len), inc.RopeTable(model, max_len)
    g = torch.Generator().manual_seed(0)
    seqs = [list(p) for p in PROMPTS]
    worst = 0.0
    real_mask = inc.attention_mask
    visible = (lambda lengths, n, k_len: torch.ones_like(real_mask(lengths, n, k_len))) if drop_mask else real_mask
    with torch.no_grad(), mock.patch.object(inc, "attention_mask", visible):
        inc.prefill(model, cache, PROMPTS, rope)
        for n in (1, 3, 1, 2):
            toks = torch.randint(2, 200, (len(PROMPTS), n), generator=g)
            out = inc.forward_cached(model, cache, toks, rope, static=static)
            for b, s in enumerate(seqs):
                s += toks[b].tolist()
                ref = lm_logits(model, torch.tensor([s]))[0, -n:].float()
                worst = max(worst, float((out[b].float() - ref).abs().max() / ref.abs().max()))
    return worst


class RandomSelector:
    """An ``auto`` selector that picks plain decoding or ``1..max_n`` drafts uniformly at
    random every round (seeded), to mix plain steps and every draft length in one run."""

    def __init__(self, max_n: int, seed: int):
        self.max_n, self.choices = max_n, []
        self.gen = torch.Generator().manual_seed(seed)

    def choose(self, batch: int, found=None, widest: int | None = None) -> int:
        top = self.max_n if widest is None else widest
        self.choices.append(int(torch.randint(0, top + 1, (1,), generator=self.gen)))
        return self.choices[-1]

    def observe(self, *args) -> None:
        pass
