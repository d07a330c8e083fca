"""The batched, tensor-parallel generator with optional lossless speculative decoding.

State per live sample (a row of the caches): the actor cache holds every token of the
sequence except ``pending`` (the newest token, sampled but not yet fed); the draft cache
is kept one token further behind, so each speculative round starts by feeding the draft
the same two tokens for every sample: ``[last_in_cache, pending]``.

A feature draft (EAGLE; :class:`~megatron_rlhf.models.heads.FeatureFusion`) reads at
position ``t`` the token ``x_t`` and the actor's final hidden state ``h_{t-1}``. Its cache
holds every token including ``pending``; each round starts by catching up with the
tokens the last verification emitted, paired with the actor's hidden states from that
verification (``k + 1`` per sample, padded to ``n + 1``), then drafts on its own predicted
hidden states; only the caught-up entries (true hidden states) are kept.

A plain step feeds ``pending`` and samples the next token. A speculative round lets the
draft propose ``n`` tokens, feeds ``[pending, d1..dn]`` to the actor once, accepts a
prefix per sample (:mod:`megatron_rlhf.generation.speculative`) and rolls both caches
back to what was accepted. Finished rows stay in the batch (fed a pad token, results
ignored) until a quarter of the batch is dead, then the caches are compacted.

Under TP every rank of the group runs this loop on the same prompts with the same
generator seed; logits are gathered over TP, so every rank draws the same tokens.
"""

from __future__ import annotations

import time

import torch

from megatron_rlhf.config import GenerationConfig, SpecConfig
from megatron_rlhf.generation import speculative
from megatron_rlhf.generation.incremental import RopeTable, forward_cached, pad_right, prefill
from megatron_rlhf.generation.kv_cache import KVCache
from megatron_rlhf.generation.rollout import GenerationStats, Rollout
from megatron_rlhf.generation.sampling import logprob_pair, probs_for_sampling, sample


class _Samples:
    """Per-sample outputs, indexed by the sample's original position in the batch."""

    def __init__(self, batch: int, cfg: GenerationConfig, eos: int | None):
        self.tokens: list[list[int]] = [[] for _ in range(batch)]
        self.logprobs: list[list[float]] = [[] for _ in range(batch)]
        self.sampling_logprobs: list[list[float]] = [[] for _ in range(batch)]
        self.reasons: list[str | None] = [None] * batch
        self.cfg, self.eos = cfg, eos

    def emit(self, i: int, tokens: list[int], lps: list[float], slps: list[float]) -> bool:
        """Append tokens to sample ``i`` up to EOS or the budget; True if it finished."""
        for t, lp, slp in zip(tokens, lps, slps):
            self.tokens[i].append(t)
            self.logprobs[i].append(lp)
            self.sampling_logprobs[i].append(slp)
            if self.cfg.stop_on_eos and t == self.eos:
                self.reasons[i] = "eos"
                return True
            if len(self.tokens[i]) >= self.cfg.max_new_tokens:
                self.reasons[i] = "length"
                return True
        return False


def _logprob_pair(logits: torch.Tensor, probs: torch.Tensor | None, tokens: torch.Tensor,
                  cfg: GenerationConfig):
    """(log pi at T=1, log of the sampling distribution) of ``tokens [...]``; lists per row."""
    lp, slp = logprob_pair(logits, probs, tokens, cfg)
    lps = lp.tolist()
    return lps, (lps if slp is lp else slp.tolist())


def check_draft(actor_cfg, draft_cfg) -> None:
    """A draft must share the actor's tokenizer (vocabulary)."""
    if draft_cfg.vocab_size != actor_cfg.vocab_size:
        raise ValueError(
            f"the draft's vocabulary ({draft_cfg.vocab_size} tokens) differs from the actor's "
            f"({actor_cfg.vocab_size}): a draft must share the actor's tokenizer"
        )
    if draft_cfg.feature_draft and draft_cfg.hidden_size != actor_cfg.hidden_size:
        raise ValueError(
            f"the feature draft reads hidden states of width {draft_cfg.hidden_size}, the actor's "
            f"are {actor_cfg.hidden_size}: distil the draft from this actor (tools/train_draft.py)"
        )


def check_request(prompts: list[list[int]], cfg: GenerationConfig, spec: SpecConfig,
                  actor_cfg, draft_cfg=None) -> int:
    """Validate a request against the model configs (no models, no collectives needed).

    Returns the KV-cache length the request needs.
    """
    if not prompts:
        raise ValueError("no prompts to generate from")
    if spec.num_draft_tokens and draft_cfg is None:
        raise ValueError("--num-draft-tokens > 0 needs a draft model (--draft-load)")
    if draft_cfg is not None:
        check_draft(actor_cfg, draft_cfg)
    limit = actor_cfg.max_position_embeddings
    if draft_cfg is not None:
        limit = min(limit, draft_cfg.max_position_embeddings)
    extra = spec.num_draft_tokens + 1
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        if len(p) + cfg.max_new_tokens + extra > limit:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens: with max_new_tokens {cfg.max_new_tokens} "
                f"(+{extra} for verification) it exceeds the cache of {limit} positions; "
                "shorten the prompt or lower --max-new-tokens"
            )
    return max(len(p) for p in prompts) + cfg.max_new_tokens + extra


class Generator:
    """Generates with ``actor`` (and ``draft``, when given) over their shared TP group."""

    def __init__(self, actor, draft=None, pad_id: int = 0):
        self.actor, self.draft, self.pad_id = actor, draft, pad_id
        if draft is not None:
            check_draft(actor.mrlhf_config, draft.mrlhf_config)
            if draft.pg_collection.tp.size() != actor.pg_collection.tp.size():
                raise ValueError("draft and actor must run under the same tensor-parallel group")
        self.eos = actor.mrlhf_config.eos_token_id
        self.feature_draft = draft is not None and draft.mrlhf_config.feature_draft

    def check(self, prompts: list[list[int]], cfg: GenerationConfig, spec: SpecConfig) -> int:
        """Raise before any collective if the request cannot run; returns the cache length."""
        return check_request(prompts, cfg, spec, self.actor.mrlhf_config,
                             None if self.draft is None else self.draft.mrlhf_config)

    # ------------------------------------------------------------------ main loop
    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], cfg: GenerationConfig,
                 spec: SpecConfig | None = None, seed: int = 0,
                 accept_rule=speculative.accept_sampling) -> Rollout:
        spec = spec or SpecConfig()
        max_len = self.check(prompts, cfg, spec)
        t0 = time.perf_counter()
        for m in (self.actor, self.draft):
            if m is not None:
                m.eval()
        dev = self.actor.embedding.word_embeddings.weight.device
        gen = torch.Generator(device=dev).manual_seed(seed)
        n = spec.num_draft_tokens
        out = _Samples(len(prompts), cfg, self.eos)
        stats = GenerationStats(num_draft_tokens=n, accepted_per_position=[0] * n)

        # cache rows in prompt-length order (prefill pads each run of rows to its own longest);
        # ``rows`` maps a cache row to its sample's index in ``prompts``
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        ordered = [prompts[i] for i in order]
        rope = RopeTable(self.actor, max_len)
        cache = KVCache.for_model(self.actor, len(prompts), max_len)
        feature = bool(n) and self.feature_draft
        logits = prefill(self.actor, cache, ordered, rope, self.pad_id, return_features=feature)
        if feature:
            logits, hidden = logits  # [B, V], [B, P, h]
        first, probs = sample(logits, cfg, gen)
        lp, slp = _logprob_pair(logits, probs, first, cfg)
        rows = torch.tensor(order, device=dev)
        alive = torch.ones(len(prompts), dtype=torch.bool, device=dev)
        for r, tok in enumerate(first.tolist()):
            if out.emit(order[r], [tok], [lp[r]], [slp[r]]):
                alive[r] = False
        state = {"cache": cache, "pending": first}
        if n:
            d_rope = RopeTable(self.draft, max_len)
            d_cache = KVCache.for_model(self.draft, len(prompts), max_len)
            if feature:  # catch up with the prompt and the first token: h_{-1} = 0
                tokens = pad_right([p + [t] for p, t in zip(ordered, first.tolist())], self.pad_id, dev)
                feats = torch.cat([torch.zeros_like(hidden[:, :1]), hidden], 1)
                lens = torch.tensor([len(p) + 1 for p in ordered], device=dev)
                state.update(d_cache=d_cache, catch_tokens=tokens, catch_features=feats, catch_count=lens)
            else:
                prefill(self.draft, d_cache, ordered, d_rope, self.pad_id)
                d_cache.truncate(d_cache.lengths - 1)
                state.update(d_cache=d_cache, last=torch.tensor([p[-1] for p in ordered], device=dev))

        stats.prefill_s = time.perf_counter() - t0
        while bool(alive.any()):
            dead = int((~alive).sum())
            if dead and dead * 4 >= len(rows):
                keep = alive.nonzero()[:, 0]
                rows, alive = rows[keep], alive[keep]
                for key, val in state.items():
                    if isinstance(val, KVCache):
                        val.select(keep)
                    else:
                        state[key] = val[keep]
            if n:
                self._spec_round(state, rows, alive, out, cfg, n, gen, rope, d_rope, stats, accept_rule)
            else:
                self._plain_step(state, rows, alive, out, cfg, gen, rope, stats)
        stats.elapsed_s = time.perf_counter() - t0
        return self._rollout(prompts, out, stats, dev)

    def _plain_step(self, st, rows, alive, out, cfg, gen, rope, stats):
        cache = st["cache"]
        cache.lengths[~alive] = 0  # dead rows compute garbage at position 0
        feed = torch.where(alive, st["pending"], self.pad_id)[:, None]
        logits = forward_cached(self.actor, cache, feed, rope)[:, 0]  # [R, V]
        stats.actor_steps += 1
        tok, probs = sample(logits, cfg, gen)
        lp, slp = _logprob_pair(logits, probs, tok, cfg)
        toks, origin = tok.tolist(), rows.tolist()
        for r in alive.nonzero()[:, 0].tolist():
            if out.emit(origin[r], [toks[r]], [lp[r]], [slp[r]]):
                alive[r] = False
        st["pending"] = tok

    def _spec_round(self, st, rows, alive, out, cfg, n, gen, rope, d_rope, stats, accept_rule):
        cache, d_cache = st["cache"], st["d_cache"]
        cache.lengths[~alive] = 0
        d_cache.lengths[~alive] = 0
        pending = torch.where(alive, st["pending"], self.pad_id)
        base = cache.lengths.clone()  # tokens in the actor cache before this round

        propose = self._propose_with_features if self.feature_draft else self._propose
        drafts, q_probs = propose(st, alive, pending, cfg, n, gen, d_rope)
        stats.draft_steps += n
        drafts_t = torch.stack(drafts, 1)  # [R, n]

        # actor: verify all n+1 positions in one forward
        a_logits = forward_cached(self.actor, cache, torch.cat([pending[:, None], drafts_t], 1), rope,
                                  return_features=self.feature_draft)
        if self.feature_draft:
            a_logits, a_hidden = a_logits  # hidden states the draft catches up with next round
        stats.actor_steps += 1
        if cfg.greedy:
            verdict, p_probs = speculative.accept_greedy(drafts_t, a_logits), None
        else:
            p_probs = probs_for_sampling(a_logits, cfg)
            verdict = accept_rule(drafts_t, torch.stack(q_probs, 1), p_probs, gen)
        k = verdict.accepted  # [R]
        emitted = torch.cat([drafts_t, drafts_t[:, :1]], 1)  # [R, n+1]; slot k <- next token
        emitted.scatter_(1, k[:, None], verdict.next_token[:, None])
        lp, slp = _logprob_pair(a_logits, p_probs, emitted, cfg)  # lists of [n+1]

        live = alive.nonzero()[:, 0]
        stats.verifications += len(live)
        for i in range(n):
            stats.accepted_per_position[i] += int((k[live] > i).sum())
        ks, toks, origin = k.tolist(), emitted.tolist(), rows.tolist()
        for r in live.tolist():
            kr = ks[r] + 1
            if out.emit(origin[r], toks[r][:kr], lp[r][:kr], slp[r][:kr]):
                alive[r] = False

        # roll back: actor keeps pending + accepted drafts
        cache.truncate(base + 1 + k)
        if self.feature_draft:  # next round the draft reads d_1..d_k, next with h_base..h_base+k
            st.update(catch_tokens=emitted, catch_features=a_hidden, catch_count=k + 1)
        else:  # the draft stays one behind
            d_cache.truncate(base + k)
            st["last"] = torch.where(k > 0, drafts_t.gather(1, (k - 1).clamp(min=0)[:, None])[:, 0],
                                     pending)
        st["pending"] = verdict.next_token

    def _propose(self, st, alive, pending, cfg, n, gen, d_rope):
        """A standalone draft's ``n`` proposals; the first step catches up with
        ``[last_in_cache, pending]``. Leaves the draft cache ``n`` tokens ahead."""
        last = torch.where(alive, st["last"], self.pad_id)
        feed = torch.stack([last, pending], 1)
        drafts, q_probs = [], []
        for _ in range(n):
            d_logits = forward_cached(self.draft, st["d_cache"], feed, d_rope)[:, -1]
            tok, q = sample(d_logits, cfg, gen)
            drafts.append(tok)
            q_probs.append(q)
            feed = tok[:, None]
        return drafts, q_probs

    def _propose_with_features(self, st, alive, pending, cfg, n, gen, d_rope):
        """A feature draft's ``n`` proposals: catch up with the last verification's tokens
        and actor hidden states, then draft on its own hidden states. Afterwards the draft
        cache holds exactly the caught-up tokens (up to and including ``pending``)."""
        d_cache = st["d_cache"]
        count = torch.where(alive, st["catch_count"], 1)
        logits, hidden = forward_cached(self.draft, d_cache, st["catch_tokens"], d_rope,
                                        last_index=count - 1, features=st["catch_features"],
                                        return_features=True)
        d_cache.truncate(d_cache.lengths - st["catch_tokens"].shape[1] + count)
        caught_up = d_cache.lengths.clone()
        hidden = hidden[torch.arange(len(count), device=count.device), count - 1][:, None]  # [R, 1, h]
        drafts, q_probs = [], []
        for i in range(n):
            tok, q = sample(logits[:, -1], cfg, gen)
            drafts.append(tok)
            q_probs.append(q)
            if i + 1 < n:
                logits, hidden = forward_cached(self.draft, d_cache, tok[:, None], d_rope,
                                                features=hidden, return_features=True)
        d_cache.truncate(caught_up)
        return drafts, q_probs

    def _rollout(self, prompts, out: _Samples, stats: GenerationStats, dev) -> Rollout:
        b = len(prompts)
        t = max(len(x) for x in out.tokens)
        ids = torch.full((b, t), self.pad_id, dtype=torch.long)
        lps = torch.zeros(b, t)
        slps = torch.zeros(b, t)
        for i in range(b):
            m = len(out.tokens[i])
            ids[i, :m] = torch.tensor(out.tokens[i])
            lps[i, :m] = torch.tensor(out.logprobs[i])
            slps[i, :m] = torch.tensor(out.sampling_logprobs[i])
        lengths = torch.tensor([len(x) for x in out.tokens])
        stats.new_tokens = int(lengths.sum())
        return Rollout(prompt_ids=[list(p) for p in prompts], response_ids=ids,
                       response_logprobs=lps, sampling_logprobs=slps, lengths=lengths,
                       finish_reasons=list(out.reasons), stats=stats)
