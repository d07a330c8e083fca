"""Tiny random actor/draft pairs with peaked distributions (so greedy text is varied).

Weights are identical at every TP size: megatron's CPU init is TP-invariant, and the
draft is the actor plus a multiple of a third TP-invariant random model.
"""

from __future__ import annotations

import math

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


def eos_mid_batch(actor, cfg) -> None:
    """Make ``actor``'s EOS the token its greedy responses to :data:`PROMPTS` (under ``cfg``)
    most often hold in their first 8: samples then finish at different steps."""
    from collections import Counter

    from megatron_rlhf.generation.engine import Generator

    plain = Generator(actor, graphs="off").generate(PROMPTS, cfg)
    actor.mrlhf_config.eos_token_id = Counter(t for r in plain.responses() for t in set(r[:8])).most_common(1)[0][0]


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


def decode_attention_error(model, backend: str | None = None, static: bool = False, drop_mask: bool = False) -> float:
    """Largest error, relative to the largest reference logit, of cached decoding against
    the whole-sequence forward of each prompt: :data:`PROMPTS` (lengths 1-9, so the rows
    of the batch are padded against each other) prefilled, then decode steps and
    verifications of several widths, through the decode attention ``backend`` (None: the
    device's default). ``static``: the step a CUDA graph captures (the attention over the
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
    # flash: every row's keys end at the end of the cache
    ends = (lambda lengths, n: torch.full_like(lengths, max_len, dtype=torch.int32)) if drop_mask else inc.flash_seqlens
    with torch.no_grad(), mock.patch.object(inc, "attention_mask", visible), \
            mock.patch.object(inc, "flash_seqlens", ends):
        inc.prefill(model, cache, PROMPTS, rope, backend=backend)
        for n in (1, 3, 1, 2):
            toks = torch.randint(2, 200, (len(PROMPTS), n), generator=g)
            out = inc.forward_cached(model, cache, toks, rope, static=static, backend=backend)
            for b, s in enumerate(seqs):
                s += toks[b].tolist()
                ref = lm_logits(model, torch.tensor([s]))[0, -n:].float()
                err = float((out[b].float() - ref).abs().max() / ref.abs().max())
                worst = max(worst, err if math.isfinite(err) else math.inf)  # NaN: max() would drop it
    return worst


def explicit_attention(q, k, v, mask):
    """Textbook grouped-query attention in fp32: each query head against its KV group's keys
    repeated (``q [B, H, n, d]``, ``k, v [B, KV, L, d]``, ``mask [B, 1, n, L]`` True where
    a query sees a key)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1).float(), v.repeat_interleave(g, 1).float()
    scores = (q.float() @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def reference_flash_kvcache(q, k_cache, v_cache, cache_seqlens=None, causal=False, **unused):
    """flash-attn's ``flash_attn_with_kvcache`` as its documentation states it (the part the
    engine uses: no new k/v, no rotary, no paging, the default scale), with the input
    checks its kernel makes, for running
    :func:`~megatron_rlhf.generation.attention.flash_attention` on the CPU. ``q [B, n, H,
    d]``, caches ``[B, L, KV, d]`` (head ``h`` reads KV head ``h // (H / KV)``), each row's
    keys ``[0, cache_seqlens[b])``; causal aligns the query rows to the end of the keys
    (query ``j`` sees keys up to ``cache_seqlens[b] - n + j``)."""
    assert not unused, f"arguments the engine does not pass: {sorted(unused)}"
    assert q.dtype in (torch.float16, torch.bfloat16) and k_cache.dtype == v_cache.dtype == q.dtype
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    b, n, h, d = q.shape
    length, kv = k_cache.shape[1], k_cache.shape[2]
    assert cache_seqlens.dtype == torch.int32 and cache_seqlens.is_contiguous() and tuple(cache_seqlens.shape) == (b,)
    assert h % kv == 0 and k_cache.shape[0] >= b and k_cache.shape[3] == d and v_cache.shape == k_cache.shape
    keys = torch.arange(length)[None, None, :]
    ends = cache_seqlens.long()[:, None, None]
    visible = keys < ends  # [B, n, L]
    if causal:
        visible = visible & (keys <= ends - n + torch.arange(n)[None, :, None])
    out = explicit_attention(q.transpose(1, 2), k_cache[:b].transpose(1, 2), v_cache[:b].transpose(1, 2),
                             visible[:, None])
    return out.transpose(1, 2).to(q.dtype)


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

    def choose_widths(self, found: list[int], remaining=None) -> list[int]:
        """A ragged round: each sample verifies a random number of its proposal's drafts."""
        widths = [int(torch.randint(0, f + 1, (1,), generator=self.gen)) for f in found]
        self.choices.append(max(widths, default=0))
        return widths

    def observe(self, *args, **kw) -> None:
        pass
