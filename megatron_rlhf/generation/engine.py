"""The batched, tensor-parallel generator with lossless speculative decoding, a
workload-aware drafting selector and sample migration between data-parallel ranks.

State per live sample is a row of :class:`~megatron_rlhf.generation.state.Rows`: the
actor cache holds every token of the sequence except ``pending`` (the newest token,
sampled but not yet fed). The draft cache lags behind: the tokens it lacks wait in a
per-row catch-up buffer (``pending`` last) and are fed at the start of the next round
that drafts, in one forward of variable length per row. A feature draft (EAGLE;
:class:`~megatron_rlhf.models.heads.FeatureFusion`) reads at position ``t`` the token
``x_t`` and the actor's final hidden state ``h_{t-1}``, so its buffer also holds the
actor's hidden state paired with each token.

Each round is either a plain step (feed ``pending``, sample the next token) or a
speculative round of ``n`` draft tokens: the draft catches up and proposes ``n`` tokens,
the actor verifies ``[pending, d1..dn]`` in one forward, a prefix is accepted per sample
(:mod:`megatron_rlhf.generation.speculative`), the actor cache is rolled back to what was
accepted and the emitted tokens (with their actor hidden states) become the draft's next
catch-up. ``n`` is fixed (``--num-draft-tokens N``) or chosen before every round by the
selector (:mod:`megatron_rlhf.generation.strategy`, ``auto``) from the live batch size,
the measured step latencies and the observed acceptance. Every choice is lossless. A round
of history drafts without a draft model is ragged in the dynamic engine: each row verifies
its own number of drafts (the selector's choice per sample, 0 for a plain step), and only
real tokens are computed (:meth:`Generator._ragged_round`); a graphed round verifies one
width for every row.

Drafts come from the draft model, from the rollout's own history
(:class:`~megatron_rlhf.generation.history.HistoryDrafter`: a sample's prompt and
response, its group's siblings and earlier responses to its prompt; no forward pass), or
from both (history where it matches, the model elsewhere). Verification is ``exact`` by
default (:func:`~megatron_rlhf.generation.speculative.accept_exact`: a draft is accepted
iff it is the token plain sampling draws there, so the emitted tokens are speculation
off's, whatever was drafted and however many), or rejection sampling (``rejection``, model
drafts only: lossless in distribution, but the tokens then depend on the drafting choices).

Random numbers are keyed per sample (:mod:`megatron_rlhf.generation.rng`): a sample's
tokens do not depend on its batch, its rank, the data-parallel size or migration (under
``rejection``, only with a fixed ``n``). With a :class:`~megatron_rlhf.generation.migration.Migrator`, the ranks of a
data-parallel group exchange live counts every few rounds and move unfinished samples,
caches included, from busy ranks to idle ones; results return to their owners at the end.

Finished rows stay in the batch (fed a pad token, results ignored) until a quarter of the
batch is dead, then the rows are compacted. Under TP every rank of the group runs this
loop on the same samples; logits are gathered over TP and the selector's choice is
broadcast from the group's first rank, so every rank draws the same tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rlhf.data.padding import padded
from megatron_rlhf.config import GenerationConfig, SpecConfig
from megatron_rlhf.generation import rng, speculative
from megatron_rlhf.generation.graphs import CATCH_UP_MAX
from megatron_rlhf.generation.history import HistoryDrafter
from megatron_rlhf.generation.incremental import (RopeTable, aligned_length, attention_backend, forward_cached,
                                                  packed_positions, pad_right, prefill)
from megatron_rlhf.generation.kv_cache import KVCache
from megatron_rlhf.generation.request import check_draft, check_request
from megatron_rlhf.generation.rollout import GenerationStats, Rollout
from megatron_rlhf.generation.sampling import draw, logprob_pair, probs_for_sampling, sample
from megatron_rlhf.generation.state import Outputs, Rows


@dataclass
class Lookup:
    """A round's history drafts, looked up before its width is chosen (:meth:`Generator._look_up`)."""

    tokens: torch.Tensor
    """``[R, width]`` each row's proposal, padded (on the rows' device)."""
    found: list[int]
    """Per row, the tokens its proposal holds (0 for a finished row)."""
    alive: list[bool]
    """Per row, whether it was alive when looked up."""
    room: int
    """Drafts a round may feed every live row (its cache has room for them)."""
    remaining: list[float] | None = None
    """Per row, the tokens its sample is expected to emit still (0 for a finished row;
    :meth:`HistoryDrafter.remaining`; None: not predicted)."""

    def _of_live(self, per_row: list | None) -> list | None:
        """``per_row``'s values of the live rows, in row order."""
        return None if per_row is None else [v for v, a in zip(per_row, self.alive) if a]

    @property
    def found_live(self) -> list[int]:
        """``found`` of the live rows, in row order."""
        return self._of_live(self.found)

    @property
    def remaining_live(self) -> list[float] | None:
        """``remaining`` of the live rows, in row order."""
        return self._of_live(self.remaining)

    def drafts(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A round of ``n`` drafts' share of the history: ``tokens [R, n]`` and per row the
        first of them that came from it (``found`` at most ``n``, ``[R]`` on the rows' device)."""
        found = torch.tensor([min(f, n) for f in self.found], dtype=torch.long, device=self.tokens.device)
        return self.tokens[:, :n], found


def _count_history(stats: GenerationStats, ks: list[int], found: list[int]) -> None:
    """A round's history counts: ``ks`` drafts accepted per verifying row, of which those
    within the row's first ``found`` came from the history."""
    stats.history_verifications += len(ks)
    stats.history_drafted += sum(found)
    stats.history_accepted += sum(min(k, f) for k, f in zip(ks, found))


def _logprob_pair(logits: torch.Tensor, probs: torch.Tensor | None, tokens: torch.Tensor,
                  cfg: GenerationConfig):
    """(log pi at T=1, log of the sampling distribution) of ``tokens [...]``; lists per row."""
    lp, slp = logprob_pair(logits, probs, tokens, cfg)
    lps = lp.tolist()
    return lps, (lps if slp is lp else slp.tolist())


def history_drafter(spec: SpecConfig) -> HistoryDrafter | None:
    """The history drafter ``spec`` asks for (None: drafts do not come from the history)."""
    if not spec.uses_history:
        return None
    return HistoryDrafter(max_responses=spec.history_responses, max_prompts=spec.history_prompts,
                          global_responses=spec.history_global)


class Generator:
    """Generates with ``actor`` (and ``draft``, when given) over their shared TP group.

    The ``auto`` selector (and its cost profile and acceptance estimate) lives as long as
    the generator: across the calls of an RLHF run it keeps following the actor.
    """

    def __init__(self, actor, draft=None, pad_id: int = 0, selector=None, graphs: str = "auto",
                 history: HistoryDrafter | None = None, ragged: bool = True):
        if graphs not in ("auto", "eager", "off"):
            raise ValueError(f"graphs must be auto, eager or off, got {graphs!r}")
        self.actor, self.draft, self.pad_id = actor, draft, pad_id
        self.history = history
        """The history drafter (None: drafts come from ``draft`` only); it lives as long as
        the generator, so an RLHF run's rollouts feed it (:mod:`~megatron_rlhf.generation.history`)."""
        self.ragged = ragged
        """History drafts without a draft model, dynamic engine: each row of a round verifies
        its own number of drafts and only real tokens are computed (:meth:`_ragged_round`);
        False: every row verifies the round's width, padded (the benchmarks' control)."""
        self.graphs = graphs
        """``auto``: decode steps replay CUDA graphs on a GPU (with ``cuda_graphs`` set in the
        request's :class:`GenerationConfig`), the dynamic step on the CPU; ``eager``: the
        graphed step's code without capture, anywhere (how the CPU tests it); ``off``."""
        self._steps: dict[str, object] = {}  # model name -> graphs.StepGraphs, kept across calls
        self._mode, self._capacity = None, 0  # this call's graph mode and batch
        self._upkeep_s = 0.0  # this round's seconds spent keeping the draft current
        if draft is not None:
            check_draft(actor.mrlhf_config, draft.mrlhf_config)
            if draft.pg_collection.tp.size() != actor.pg_collection.tp.size():
                raise ValueError("draft and actor must run under the same tensor-parallel group")
        self.eos = actor.mrlhf_config.eos_token_id
        self.feature_draft = draft is not None and draft.mrlhf_config.feature_draft
        self.selector = selector

    def check(self, prompts: list[list[int]], cfg: GenerationConfig, spec: SpecConfig,
              allow_empty: bool = False) -> int:
        """Raise before any collective if the request cannot run; returns the cache length."""
        if spec.verify == "rejection" and self.history is not None:
            raise ValueError("--spec-verify rejection needs a draft's distribution: history drafts "
                             "are single tokens, verified exactly (--spec-verify exact)")
        return check_request(prompts, cfg, spec, self.actor.mrlhf_config,
                             None if self.draft is None else self.draft.mrlhf_config, allow_empty,
                             history=self.history is not None)

    def selector_for(self, spec: SpecConfig, batch: int, max_len: int):
        """The ``auto`` selector, built at the first call: its costs are learned from the
        rounds as they run (:class:`~megatron_rlhf.generation.strategy.OnlineCosts`), or,
        with ``spec.cost_profile``, loaded from that file or profiled now (and saved there)."""
        from megatron_rlhf.generation import strategy

        if self.selector is None or self.selector.max_n != spec.max_draft_tokens:
            costs = (strategy.OnlineCosts() if spec.cost_profile is None else
                     strategy.load_or_profile(self.actor, self.draft, spec, batch, max_len,
                                              graphs=self._mode == "cuda"))
            widest = spec.max_tokens(self.draft is not None)

            def acceptance():
                return strategy.Acceptance(widest, spec.acceptance_decay)

            self.selector = strategy.Selector(costs, spec.max_draft_tokens,
                                              acceptance() if self.draft is not None else None,
                                              acceptance() if self.history is not None else None)
        return self.selector

    # ------------------------------------------------------------------ main loop
    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], cfg: GenerationConfig,
                 spec: SpecConfig | None = None, seed: int = 0,
                 sample_ids: list[int] | None = None, migrator=None, accept_rule=None) -> Rollout:
        """Responses to ``prompts``; ``sample_ids``: each prompt's global sample index (the
        key of its random numbers; default ``0..B-1``). With ``migrator`` every rank of its
        data-parallel group must call this together (it may hold no prompts).
        ``accept_rule``: a rejection rule in place of
        :func:`~megatron_rlhf.generation.speculative.accept_sampling` under ``rejection``
        (tests)."""
        spec = spec or SpecConfig()
        max_len = self.check(prompts, cfg, spec, allow_empty=migrator is not None)
        t0 = time.perf_counter()
        big_n = spec.max_tokens(self.draft is not None or self.history is not None)  # the widest round
        base_n = spec.base_tokens(self.draft is not None or self.history is not None)
        if accept_rule is not None and spec.verify != "rejection":
            raise ValueError("accept_rule replaces rejection sampling: pass a SpecConfig with verify='rejection'")
        self._verify = spec.verify
        self._accept_rule = accept_rule or speculative.accept_sampling
        batch = max(len(prompts), 1)
        if migrator is not None:
            max_len, batch = migrator.agree(max_len, batch)
        max_len = aligned_length(max_len)  # the attention reads whole multiples of ATTEND_ALIGN
        for m in (self.actor, self.draft):
            if m is not None:
                m.eval()
        dev = self.actor.embedding.word_embeddings.weight.device
        self._mode, self._capacity = self._graph_mode(cfg, dev), batch
        sids = list(range(len(prompts))) if sample_ids is None else [int(i) for i in sample_ids]
        if len(sids) != len(prompts) or len(set(sids)) != len(sids):
            raise ValueError("sample_ids must give one distinct index per prompt")
        selector = self.selector_for(spec, batch, max_len) if spec.auto and big_n else None
        # history rounds of the dynamic engine verify each row's own proposal (a graphed
        # round has fixed shapes: every row verifies the round's width, padded)
        ragged = self.ragged and self.history is not None and self.draft is None and self._mode is None
        capture_before = self._capture_s()
        stats = GenerationStats(num_draft_tokens=big_n,
                                mode="auto" if selector else ("fixed" if big_n else "plain"),
                                accepted_per_position=[0] * big_n, drafted_per_position=[0] * big_n,
                                rounds_by_draft_len=[0] * (big_n + 1))
        out = Outputs(cfg.max_new_tokens, cfg.stop_on_eos, self.eos)
        key = rng.seed_key(seed)
        rope = RopeTable(self.actor, max_len)
        # the draft's cache has room for a padded catch-up past the longest sample (the
        # actor's has none to spare: attention may read a whole cache, CPU bf16 does)
        d_rope = RopeTable(self.draft, max_len + CATCH_UP_MAX) if big_n and self.draft is not None else None
        rows = self._prefill(prompts, sids, cfg, key, max_len, big_n, rope, d_rope, out, dev)
        stats.prefill_s = time.perf_counter() - t0

        if migrator is not None:
            migrator.start()
        live = None  # rows alive, when the host knows it without reading the device
        while True:
            if migrator is not None and migrator.poll(rows, out, stats):
                break
            if live is None or migrator is not None:  # migration moves rows in and out
                live = int(rows["alive"].sum())
            if live == 0:
                if migrator is None:
                    break
                continue
            dead = len(rows) - live
            if dead and dead * 4 >= len(rows):
                rows.compact()
            start, self._upkeep_s, captured = time.perf_counter(), 0.0, self._capture_s()
            looked_up = self._look_up(rows, out, base_n, big_n, stats) if big_n and self.history is not None else None
            widths = self._widths(selector, looked_up) if looked_up is not None and ragged else None
            n = int(widths.max()) if widths is not None else self._choose(selector, live, base_n, looked_up)
            if n and widths is not None:
                k, after = self._ragged_round(rows, out, cfg, widths, key, rope, stats, looked_up)
            elif n:
                k, after = self._spec_round(rows, out, cfg, n, key, rope, d_rope, stats, looked_up)
            else:
                after = self._plain_step(rows, out, cfg, key, rope, d_rope, big_n > 0 and self.draft is not None)
                k = None
            stats.actor_steps += 1
            stats.rounds_by_draft_len[n] += 1
            if selector is not None:  # the draft's upkeep is no round's own cost
                found = drafts = None  # per live row, the drafts that came from the history
                if widths is not None:  # a ragged round: what each row verified, and in all
                    found = widths[torch.tensor(looked_up.alive, device=widths.device)]
                    drafts = int(found.sum())
                elif looked_up is not None and n:
                    found = torch.tensor(looked_up.found_live, device=k.device).clamp(max=n)
                # neither the draft's upkeep nor a graph's first capture is a round's own cost
                spent = time.perf_counter() - start - self._upkeep_s - max(self._capture_s() - captured, 0.0)
                selector.observe(live, n, spent, k, found if n else None, drafts=drafts)
            live = after
        if migrator is not None:
            migrator.return_results(out, sids)
        if self.history is not None:  # what finished elsewhere (migrated away) joins too, whole
            for s in sids:
                self.history.finish(s, out.tokens[s])
            self.history.drop_live()  # samples that passed through here and finished elsewhere
        stats.elapsed_s = time.perf_counter() - t0
        stats.graph_capture_s = self._capture_s() - capture_before
        stats.decode = self._decode_mode(dev)
        return self._rollout(prompts, sids, out, stats, dev)

    # ------------------------------------------------------------------ graphed steps
    def _capture_s(self) -> float:
        """Seconds spent capturing graphs so far, by the stores kept now."""
        return sum(g.capture_s for g in self._steps.values())

    def _graph_mode(self, cfg: GenerationConfig, dev) -> str | None:
        if self.graphs == "eager":
            return "eager"
        if self.graphs == "auto" and cfg.cuda_graphs and dev.type == "cuda":
            return "cuda"
        return None

    def _decode_mode(self, dev) -> str:
        """:attr:`GenerationStats.decode` for this call."""
        runner = self._steps.get("actor") if self._mode is not None else None
        if runner is None:
            how = "dynamic"
        elif runner.failed:
            how = f"eager graph code (capture failed: {runner.failed})"
        else:
            how = "cuda graphs" if runner.capture else "eager graph code"
        return f"{attention_backend(dev)} attention, {how}"

    def release(self) -> None:
        """Free the KV cache stores and graphs kept for the next call (between rollouts,
        when training needs the memory); the next call captures its graphs again."""
        held = bool(self._steps)
        self._steps.clear()
        if held and torch.cuda.is_available():
            torch.cuda.empty_cache()  # graph pools hand their memory back

    def _new_cache(self, name: str, model, batch: int, max_len: int) -> KVCache:
        """A cache for ``batch`` rows: the rows of the model's graphed store when this call
        uses graphs (a new store, and new graphs, when the request does not fit the kept
        one or the weights moved), else a cache of its own."""
        from megatron_rlhf.generation import graphs

        if self._mode is None or not graphs.graphable(model):
            return KVCache.for_model(model, batch, max_len)
        runner = self._steps.get(name)
        if runner is None or not runner.fits(model, max(batch, self._capacity), max_len):
            self._steps.pop(name, None)  # free the old store before allocating the new one
            if runner is not None:
                max_len = max(max_len, runner.cache.max_len) if runner.model is model else max_len
            runner = self._steps[name] = graphs.StepGraphs(
                model, max(batch, self._capacity), max_len, capture=self._mode == "cuda")
        return runner.new_cache(batch)

    def _forward(self, name: str, model, cache: KVCache, tokens: torch.Tensor, rope, **kw):
        """One cached forward of ``model`` (``name``: actor or draft): a replayed graph where
        one serves this cache and shape, the dynamic step otherwise."""
        runner = self._steps.get(name) if self._mode is not None else None
        if runner is not None and runner.serves(cache, tokens.shape[1]):
            return runner(tokens, kw.get("features"), kw.get("return_features", False))
        return forward_cached(model, cache, tokens, rope, **kw)

    def _choose(self, selector, live: int, base_n: int, looked_up=None) -> int:
        """This round's draft length (the same on every TP rank): fixed, or the selector's.
        With history drafts (``looked_up``: :meth:`_look_up`) it is known before the round
        what each sample's history proposes: a round without a model draft is no wider than
        the longest proposal (none: a plain step), and the selector weighs each sample's
        proposal with the history's acceptance."""
        found = looked_up.found_live if looked_up is not None else None
        history_only = found is not None and self.draft is None
        widest = max(found, default=0) if history_only else None
        if selector is None:
            return widest if history_only else base_n
        n = selector.choose(live, found, widest)
        tp = self.actor.pg_collection.tp
        if tp.size() > 1:
            t = torch.tensor([n], device=self.actor.embedding.word_embeddings.weight.device)
            dist.broadcast(t, src=dist.get_global_rank(tp, 0), group=tp)
            n = int(t)
        return n

    def _widths(self, selector, looked_up: Lookup) -> torch.Tensor:
        """Per row, the drafts of its proposal a ragged round verifies ``[R]`` (the same on
        every TP rank): under a fixed ``n`` its whole proposal, under ``auto`` the selector's
        choice per sample (:meth:`~megatron_rlhf.generation.strategy.Selector.choose_widths`);
        0 for a finished row. All 0: a plain step."""
        widths = looked_up.found
        if selector is not None:
            chosen = iter(selector.choose_widths(looked_up.found_live, looked_up.remaining_live))
            widths = [next(chosen) if a else 0 for a in looked_up.alive]
        t = torch.tensor(widths, dtype=torch.long, device=looked_up.tokens.device)
        tp = self.actor.pg_collection.tp
        if tp.size() > 1:
            dist.broadcast(t, src=dist.get_global_rank(tp, 0), group=tp)
        return t

    def _prefill(self, prompts, sids, cfg, key, max_len, big_n, rope, d_rope, out: Outputs,
                 dev) -> Rows:
        """Prefill the actor (and draft) caches; emit every sample's first token."""
        b = len(prompts)
        # cache rows in prompt-length order (prefill pads each run of rows to its own longest)
        order = sorted(range(b), key=lambda i: len(prompts[i]))
        ordered = [prompts[i] for i in order]
        sid = torch.tensor([sids[i] for i in order], dtype=torch.long, device=dev)
        cache = self._new_cache("actor", self.actor, b, max_len)
        modeled = bool(big_n) and self.draft is not None  # a draft model drafts
        feature = modeled and self.feature_draft
        fields = {"sid": sid, "emitted": torch.zeros(b, dtype=torch.long, device=dev),
                  "alive": torch.ones(b, dtype=torch.bool, device=dev)}
        if self.history is not None:  # a migrated sample's drafting state is rebuilt from these
            fields["prompt"] = pad_right(ordered, self.pad_id, dev) if b else torch.zeros(0, 1, dtype=torch.long, device=dev)
            fields["prompt_len"] = torch.tensor([len(p) for p in ordered], dtype=torch.long, device=dev)
            for s, p in zip(sid.tolist(), ordered):
                self.history.begin(s, p)
        caches = {"actor": cache}
        if modeled:
            caches["draft"] = self._new_cache("draft", self.draft, b, max_len + CATCH_UP_MAX)
        for s in sids:
            out.open(s)
        if not b:
            fields["pending"] = torch.zeros(0, dtype=torch.long, device=dev)
            if modeled:
                fields.update(catch_tokens=torch.zeros(0, 0, dtype=torch.long, device=dev),
                              catch_count=torch.zeros(0, dtype=torch.long, device=dev))
                if feature:
                    h = self.actor.mrlhf_config.hidden_size
                    fields["catch_features"] = torch.zeros(0, 0, h, device=dev,
                                                           dtype=self.actor.embedding.word_embeddings.weight.dtype)
            return Rows(fields, caches)
        logits = prefill(self.actor, cache, ordered, rope, self.pad_id, return_features=feature)
        if feature:
            logits, hidden = logits  # [B, V], [B, P, h]
        first, probs = sample(logits, cfg, rng.uniform(key, sid, fields["emitted"], rng.NEXT))
        lp, slp = _logprob_pair(logits, probs, first, cfg)
        for r, (s, tok) in enumerate(zip(sid.tolist(), first.tolist())):
            if self._emit(out, s, [tok], [lp[r]], [slp[r]]):
                fields["alive"][r] = False
        fields["pending"], fields["emitted"] = first, fields["emitted"] + 1
        if feature:  # catch up with the prompt and the first token: h_{-1} = 0
            fields["catch_tokens"] = pad_right([p + [t] for p, t in zip(ordered, first.tolist())],
                                               self.pad_id, dev)
            fields["catch_features"] = torch.cat([torch.zeros_like(hidden[:, :1]), hidden], 1)
            fields["catch_count"] = torch.tensor([len(p) + 1 for p in ordered], device=dev)
        elif modeled:
            prefill(self.draft, caches["draft"], ordered, d_rope, self.pad_id)
            fields["catch_tokens"], fields["catch_count"] = first[:, None], torch.ones_like(first)
        return Rows(fields, caches)

    def _plain_step(self, rows: Rows, out: Outputs, cfg, key, rope, d_rope, drafting: bool) -> int:
        """One plain decode step; returns how many rows are still alive."""
        cache, alive = rows.caches["actor"], rows["alive"]
        runner = self._steps.get("actor") if self._mode is not None else None
        if runner is not None and runner.serves(cache, 1):
            feature = drafting and self.feature_draft
            live = self._sampled_step(runner, rows, out, cfg, key, return_features=feature)
            if drafting:  # the draft catches up with the sampled token (and its hidden state)
                self._buffer(rows, rows["pending"], runner.hidden[:len(rows)] if feature else None, d_rope)
            return live
        cache.lengths.mul_(alive)  # dead rows compute garbage at position 0
        feed = torch.where(alive, rows["pending"], self.pad_id)[:, None]
        feature = drafting and self.feature_draft
        logits = self._forward("actor", self.actor, cache, feed, rope, return_features=feature)
        hidden = None
        if feature:
            logits, hidden = logits
            hidden = hidden[:, 0]  # [R, h]: pairs with the token sampled now
        logits = logits[:, 0]  # [R, V]
        tok, probs = sample(logits, cfg, rng.uniform(key, rows["sid"], rows["emitted"], rng.NEXT))
        lp, slp = _logprob_pair(logits, probs, tok, cfg)
        toks, sid = tok.tolist(), rows["sid"].tolist()
        live = 0
        for r in alive.nonzero()[:, 0].tolist():
            if self._emit(out, sid[r], [toks[r]], [lp[r]], [slp[r]]):
                alive[r] = False
            else:
                live += 1
        rows["pending"], rows["emitted"] = tok, rows["emitted"] + 1
        if drafting:
            self._buffer(rows, tok, hidden, d_rope)
        return live

    def _sampled_step(self, runner, rows: Rows, out: Outputs, cfg, key, return_features: bool = False) -> int:
        """A plain step as one graph (:meth:`~megatron_rlhf.generation.graphs.StepGraphs.
        sample_step`): the rows' state advances on the device; the host reads one packed
        result and keeps the outputs (no other host read, no other device op)."""
        runner.bind(rows, key)
        eos = self.eos if out.stop_on_eos else None
        live = 0
        for sid, tok, lp, slp, was_alive, done in runner.sample_step(rows, cfg, out.max_new, eos, self.pad_id,
                                                                     return_features):
            if was_alive:
                if self._emit(out, int(sid), [int(tok)], [lp], [slp]) != bool(done):
                    raise RuntimeError(f"sample {int(sid)}: the step graph and the host disagree on "
                                       "whether it finished")
                live += not done
        return live

    def _emit(self, out: Outputs, sid: int, tokens: list[int], lps: list[float], slps: list[float]) -> bool:
        """Emit a sample's tokens (the history drafter reads them); True when it finished."""
        done = out.emit(sid, tokens, lps, slps)
        if self.history is not None:
            self.history.extend(sid, tokens)
            if done:
                self.history.finish(sid)
        return done

    def _look_up(self, rows: Rows, out: Outputs, n: int, width: int, stats) -> Lookup:
        """History drafts for this round, before its width is chosen (:class:`Lookup`): each
        row's proposal of up to ``n`` tokens (a long-running sample's up to ``width``:
        :meth:`HistoryDrafter.max_tokens`) padded to ``width``. A round narrower than
        ``width`` verifies each proposal's head; the pad is verified like any draft token
        (and almost never accepted). Reads the rows' state with one device-to-host copy."""
        start = time.perf_counter()
        history, cache = self.history, rows.caches["actor"]
        state = torch.stack([rows["alive"].long(), rows["sid"], cache.lengths]).tolist()
        alive, sids = [bool(a) for a in state[0]], state[1]
        # the cache keeps room for n drafts (check_request); a longer one must fit every row
        filled = max((length for length, a in zip(state[2], alive) if a), default=0)
        room = cache.max_len - filled - 1
        cap = max(min(width, room), n)
        tokens, found, remaining = [], [], []
        for r, s in enumerate(sids):
            prop, left = [], 0.0
            if alive[r]:
                if history.emitted(s) != len(out.tokens[s]):  # arrived by migration: rebuild its drafting state
                    plen = int(rows["prompt_len"][r])
                    history.begin(s, rows["prompt"][r, :plen].tolist(), out.tokens.get(s, []))
                prop = history.propose(s, min(history.max_tokens(s, n), cap))
                left = history.remaining(s, out.max_new - len(out.tokens[s]))
            tokens.append(prop + [self.pad_id] * (width - len(prop)))
            found.append(len(prop))
            remaining.append(left)
        stats.history_s += time.perf_counter() - start
        dev = rows["sid"].device
        return Lookup(torch.tensor(tokens, dtype=torch.long, device=dev).view(len(sids), width),
                      found, alive, max(room, n), remaining)

    def _buffer(self, rows: Rows, tok: torch.Tensor, hidden: torch.Tensor | None, d_rope) -> None:
        """Append ``tok [R]`` (and its actor hidden state ``[R, h]``) to the draft's catch-up
        buffer; past :data:`CATCH_UP_MAX` columns, feed the draft all but the last."""
        count = rows["catch_count"]
        # every row's count fits its buffer (count <= width): one more column holds the new
        # token, with no host read of the counts (a stop of the host per step on a GPU). The
        # buffer may be wider than the counts need (by a round's drafts, or rows compacted
        # away), never past CATCH_UP_MAX: the draft's cache has that many positions to spare.
        width = rows["catch_tokens"].shape[1] + 1
        r = torch.arange(len(count), device=count.device)
        for name, new in (("catch_tokens", tok), ("catch_features", hidden)):
            if name in rows:
                old = rows[name]
                grown = old.new_full((old.shape[0], width, *old.shape[2:]), self.pad_id if new is tok else 0)
                grown[:, : old.shape[1]] = old
                grown[r, count] = new.to(grown.dtype)
                rows[name] = grown
        rows["catch_count"] = count + 1
        if width >= CATCH_UP_MAX:
            # keeping the draft current costs the same whatever the selector picks: timed
            # apart, so that a plain step that happens to pay it is not judged by it
            start = time.perf_counter()
            self._catch_up(rows, d_rope, keep_last=True)
            self._upkeep_s += time.perf_counter() - start

    def _catch_up(self, rows: Rows, d_rope, keep_last: bool = False):
        """Feed the draft its buffered tokens (each row's own number, padded); returns its
        logits after the last of them ``[R, 1, V]`` (and, for a feature draft, its hidden
        state there ``[R, 1, h]``). ``keep_last``: leave each row's last token buffered."""
        d_cache, alive = rows.caches["draft"], rows["alive"]
        d_cache.lengths[~alive] = 0
        count = torch.where(alive, rows["catch_count"], 1)
        fed = (count - 1).clamp(min=0) if keep_last else count
        tokens = rows["catch_tokens"]
        width = tokens.shape[1]
        kw = {}
        if self.feature_draft:
            kw = dict(features=rows["catch_features"], return_features=True)
        last = (fed - 1).clamp(min=0)
        res = forward_cached(self.draft, d_cache, tokens, d_rope, last_index=last,
                             valid=fed.clamp(min=1), **kw)
        d_cache.truncate(d_cache.lengths - width + fed)
        r = torch.arange(len(count), device=count.device)
        if keep_last:  # the buffer keeps each row's last token only
            for name in ("catch_tokens", "catch_features"):
                if name in rows:
                    rows[name] = rows[name][r, (count - 1).clamp(min=0)][:, None]
            rows["catch_count"] = torch.where(count > 0, 1, 0)
            return None
        if self.feature_draft:
            logits, hidden = res
            return logits, hidden[r, last][:, None]
        return res, None

    def _spec_round(self, rows: Rows, out: Outputs, cfg, n, key, rope, d_rope, stats, looked_up=None):
        """One verification of ``n`` drafts per row: the draft model's, the history's
        (``looked_up``: :meth:`_look_up`), or both (the history's where it found some).
        Returns the drafts accepted per live row ``[live]`` and the rows alive after it
        (None: not known on the host)."""
        from megatron_rlhf.generation import graphs

        runner = self._steps.get("actor") if self._mode is not None else None
        if runner is not None and self.draft is None:  # history drafts: exact or greedy
            width = graphs.width_bucket(n, looked_up.room)
            if runner.serves(rows.caches["actor"], width + 1):
                return self._verified_round(runner, rows, out, cfg, n, width, key, stats, looked_up)
        d_runner = self._steps.get("draft") if runner is not None else None
        if (d_runner is not None and (cfg.greedy or self._verify == "exact")
                and runner.serves(rows.caches["actor"], n + 1) and d_runner.serves(rows.caches["draft"], 1)
                and rows["catch_tokens"].shape[1] <= CATCH_UP_MAX):
            return self._drafted_round(runner, d_runner, rows, out, cfg, n, key, stats, looked_up)
        cache, alive = rows.caches["actor"], rows["alive"]
        cache.lengths[~alive] = 0
        pending = torch.where(alive, rows["pending"], self.pad_id)
        base = cache.lengths.clone()  # tokens in the actor cache before this round
        sid, emitted = rows["sid"][:, None], rows["emitted"][:, None]
        q_probs, history = None, None
        if looked_up is not None:
            history = looked_up.drafts(n)
            stats.history_verifications += int(alive.sum())
            stats.history_drafted += int(history[1][alive].sum())
        if self.draft is not None:
            drafts, q_probs = self._propose(rows, cfg, n, key, d_rope, history)
            stats.draft_steps += n
            drafts_t = torch.stack(drafts, 1)  # [R, n]
        else:
            drafts_t = history[0]

        # actor: verify all n+1 positions in one forward
        a_logits = self._forward("actor", self.actor, cache, torch.cat([pending[:, None], drafts_t], 1), rope,
                                  return_features=self.feature_draft)
        if self.feature_draft:
            a_logits, a_hidden = a_logits  # hidden states the draft catches up with next round
        steps = torch.arange(n + 1, device=sid.device)
        if cfg.greedy:
            verdict, p_probs = speculative.accept_greedy(drafts_t, a_logits), None
        elif self._verify == "exact" or q_probs is None:
            p_probs = probs_for_sampling(a_logits, cfg)
            verdict = speculative.accept_exact(drafts_t, p_probs, rng.uniform(key, sid, emitted + steps, rng.NEXT))
        else:
            p_probs = probs_for_sampling(a_logits, cfg)
            verdict = self._accept_rule(drafts_t, torch.stack(q_probs, 1), p_probs,
                                        rng.uniform(key, sid, emitted + steps[:n], rng.ACCEPT),
                                        rng.uniform(key, sid, emitted + steps, rng.NEXT))
        k = verdict.accepted  # [R]
        emitted_t = torch.cat([drafts_t, drafts_t[:, :1]], 1)  # [R, n+1]; slot k <- next token
        emitted_t.scatter_(1, k[:, None], verdict.next_token[:, None])
        lp, slp = _logprob_pair(a_logits, p_probs, emitted_t, cfg)  # lists of [n+1]

        live = alive.nonzero()[:, 0]
        k_live = k[live]
        stats.count_accepted(k_live.tolist(), n)
        if history is not None:  # accepted drafts that came from the history
            stats.history_accepted += int(torch.minimum(k, history[1])[live].sum())
        ks, toks, sids = k.tolist(), emitted_t.tolist(), rows["sid"].tolist()
        for r in live.tolist():
            kr = ks[r] + 1
            if self._emit(out, sids[r], toks[r][:kr], lp[r][:kr], slp[r][:kr]):
                alive[r] = False

        cache.truncate(base + 1 + k)  # the actor keeps pending + accepted drafts
        if self.draft is not None:
            # next round the draft reads d_1..d_k, next (with the actor's h at pending, d_1..d_k)
            rows["catch_tokens"], rows["catch_count"] = emitted_t, k + 1
            if self.feature_draft:
                rows["catch_features"] = a_hidden
        rows["pending"], rows["emitted"] = verdict.next_token, rows["emitted"] + k + 1
        return k_live, None

    def _ragged_round(self, rows: Rows, out: Outputs, cfg, widths: torch.Tensor, key, rope, stats,
                      looked_up: Lookup):
        """One verification of history drafts in which row ``r`` verifies the first
        ``widths[r]`` tokens of its proposal (0: the row takes a plain step; the dynamic
        engine, no draft model). Only the real tokens are computed: the linear layers,
        the LM head, the softmax and the draw run on ``live + sum(widths)`` tokens, not on
        ``rows x (max width + 1)``. Exact (or greedy) verification, so the emitted tokens
        are plain decoding's whatever the widths. Returns what :meth:`_spec_round` does."""
        cache, alive = rows.caches["actor"], rows["alive"]
        cache.lengths[~alive] = 0
        n = int(widths.max())
        pending = torch.where(alive, rows["pending"], self.pad_id)
        base = cache.lengths.clone()
        drafts_t = looked_up.tokens[:, :n]
        valid = widths + 1
        logits = forward_cached(self.actor, cache, torch.cat([pending[:, None], drafts_t], 1), rope,
                                valid=valid, packed_logits=True)  # [T, V]
        r_idx, j_idx = packed_positions(valid, n + 1)
        sid, emitted = rows["sid"], rows["emitted"]
        if cfg.greedy:
            probs, drawn = None, logits.argmax(-1)
        else:
            probs = probs_for_sampling(logits, cfg)
            drawn = draw(probs, rng.uniform(key, sid[r_idx], emitted[r_idx] + j_idx, rng.NEXT))
        drawn_grid = torch.full((len(rows), n + 1), -1, dtype=torch.long, device=drawn.device)
        drawn_grid[r_idx, j_idx] = drawn
        verdict = speculative.accept_drawn(drafts_t, drawn_grid, widths)
        k = verdict.accepted  # [R]
        emitted_t = torch.cat([drafts_t, drafts_t[:, :1]], 1)  # [R, n+1]; slot k <- next token
        emitted_t.scatter_(1, k[:, None], verdict.next_token[:, None])
        lp_packed, slp_packed = logprob_pair(logits, probs, emitted_t[r_idx, j_idx], cfg)

        def on_grid(packed: torch.Tensor) -> list[list[float]]:  # [T] -> per row [n+1]
            grid = torch.zeros(len(rows), n + 1, device=packed.device)
            grid[r_idx, j_idx] = packed
            return grid.tolist()

        lp = on_grid(lp_packed)
        slp = lp if slp_packed is lp_packed else on_grid(slp_packed)

        live = alive.nonzero()[:, 0]
        ks, ws, toks, sids = k.tolist(), widths.tolist(), emitted_t.tolist(), sid.tolist()
        drafted = [r for r in live.tolist() if ws[r]]  # rows with widths 0 took a plain step
        stats.count_accepted([ks[r] for r in drafted], n, [ws[r] for r in drafted])
        _count_history(stats, [ks[r] for r in drafted], [ws[r] for r in drafted])
        for r in live.tolist():
            kr = ks[r] + 1
            if self._emit(out, sids[r], toks[r][:kr], lp[r][:kr], slp[r][:kr]):
                alive[r] = False
        cache.truncate(base + 1 + k)  # the actor keeps pending + accepted drafts
        rows["pending"], rows["emitted"] = verdict.next_token, emitted + k + 1
        return k[live], None

    def _verified_round(self, runner, rows: Rows, out: Outputs, cfg, n: int, width: int, key,
                        stats, looked_up: Lookup):
        """A round of history drafts as one graph (:meth:`~megatron_rlhf.generation.graphs.
        StepGraphs.verify_step`, ``width`` drafts computed, ``n`` verified): the rows' state
        advances on the device; the host reads one packed result and keeps the outputs.
        Returns what :meth:`_spec_round` does."""
        runner.bind(rows, key)
        eos = self.eos if out.stop_on_eos else None
        res = runner.verify_step(rows, looked_up.tokens, n, width, cfg, out.max_new, eos, self.pad_id)
        ks, live = self._take_verified(res, n, width, out, stats)
        _count_history(stats, ks, [min(f, n) for f in looked_up.found_live])
        return torch.tensor(ks, dtype=torch.long), live

    def _drafted_round(self, runner, d_runner, rows: Rows, out: Outputs, cfg, n: int, key, stats,
                       looked_up: Lookup | None = None):
        """A round of the draft model's ``n`` drafts as one graph (:meth:`~megatron_rlhf.
        generation.graphs.StepGraphs.draft_step`: catch-up, proposals, exact verification);
        with ``looked_up`` (``--draft-source both``) the history's tokens where it found
        some. The draft's next catch-up is what the round emitted. Returns what
        :meth:`_spec_round` does."""
        runner.bind(rows, key)
        eos = self.eos if out.stop_on_eos else None
        history = None if looked_up is None else looked_up.drafts(n)
        res = runner.draft_step(d_runner, rows, n, cfg, out.max_new, eos, self.pad_id, history)
        ks, live = self._take_verified(res, n, n, out, stats)
        if looked_up is not None:
            _count_history(stats, ks, [min(f, n) for f in looked_up.found_live])
        stats.draft_steps += n
        r = len(rows)
        rows["catch_tokens"], rows["catch_count"] = runner.drawn[:r, :n + 1].clone(), runner.accepted[:r] + 1
        if self.feature_draft:
            rows["catch_features"] = runner.verified_hidden[:r, :n + 1].clone()
        return torch.tensor(ks, dtype=torch.long), live

    def _take_verified(self, res: list[list[float]], n: int, width: int, out: Outputs, stats):
        """Emit a verification graph's packed result (``width`` drafts fed, ``n`` verified)
        per live row; returns the drafts each live row accepted and how many rows live on."""
        w = width + 1
        ks, live = [], 0
        for row in res:
            sid, was_alive, done, k = int(row[0]), row[1], row[2], int(row[3])
            if not was_alive:
                continue
            toks = [int(t) for t in row[4:5 + k]]
            if self._emit(out, sid, toks, row[4 + w:5 + w + k], row[4 + 2 * w:5 + 2 * w + k]) != bool(done):
                raise RuntimeError(f"sample {sid}: the verification graph and the host disagree on "
                                   "whether it finished")
            ks.append(k)
            live += not done
        stats.count_accepted(ks, n)
        return ks, live

    def _propose(self, rows: Rows, cfg, n, key, d_rope, history=None):
        """The draft's ``n`` proposals (and their sampling distributions): catch up with the
        buffered tokens, then draft on its own outputs (a feature draft on its own hidden
        states). ``history``: ``(tokens [R, n], found [R])``: the history's token replaces
        the draft's at the first ``found`` positions of a row and is what the draft reads
        next (``--draft-source both``). Afterwards the draft cache holds exactly the
        caught-up tokens."""
        d_cache = rows.caches["draft"]
        # exact verification: the draft draws with the uniform the actor's token at that
        # position is drawn with, so a draft near the actor proposes the actor's very token
        # (p == q: always); rejection sampling needs a uniform of its own
        stream = rng.NEXT if self._verify == "exact" else rng.DRAFT
        logits, hidden = self._catch_up(rows, d_rope)
        caught_up = d_cache.lengths.clone()
        sid, emitted = rows["sid"], rows["emitted"]
        drafts, q_probs = [], []
        for i in range(n):
            tok, q = sample(logits[:, -1], cfg, rng.uniform(key, sid, emitted + i, stream))
            if history is not None:
                tok = torch.where(i < history[1], history[0][:, i], tok)
            drafts.append(tok)
            q_probs.append(q)
            if i + 1 < n:
                kw = dict(features=hidden, return_features=True) if self.feature_draft else {}
                res = self._forward("draft", self.draft, d_cache, tok[:, None], d_rope, **kw)
                logits, hidden = res if self.feature_draft else (res, None)
        d_cache.truncate(caught_up)
        return drafts, q_probs

    def _rollout(self, prompts, sids, out: Outputs, stats: GenerationStats, dev) -> Rollout:
        lengths = torch.tensor([len(out.tokens[s]) for s in sids], dtype=torch.long, device=dev)
        stats.new_tokens = sum(len(out.tokens[s]) for s in sids)
        return Rollout(prompt_ids=[list(p) for p in prompts],
                       response_ids=padded([out.tokens[s] for s in sids], self.pad_id,
                                                    torch.long, dev),
                       response_logprobs=padded([out.logprobs[s] for s in sids], 0.0,
                                                         torch.float32, dev),
                       sampling_logprobs=padded([out.sampling_logprobs[s] for s in sids],
                                                         0.0, torch.float32, dev),
                       lengths=lengths, finish_reasons=[out.reasons[s] for s in sids],
                       stats=stats)
