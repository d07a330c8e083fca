"""The batched, tensor-parallel generator: lossless speculative decoding, a drafting
selector and sample migration between data-parallel ranks.

Entry point: :meth:`Generator.generate`, which builds one :class:`~megatron_rlhf.generation.call.Call`
and runs rounds (:mod:`~megatron_rlhf.generation.rounds`). Invariant: a sample's tokens depend
only on its key (:mod:`~megatron_rlhf.generation.rng`), not on its batch, rank, drafts or migration.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megatron_rlhf.config import GenerationConfig, SpecConfig
from megatron_rlhf.data.padding import padded
from megatron_rlhf.generation import graphs, lookup, rng, rounds, speculative
from megatron_rlhf.generation.attention import check_backend, default_backend
from megatron_rlhf.generation.call import Call
from megatron_rlhf.generation.cpu_numerics import aligned_length
from megatron_rlhf.generation.graphs import CATCH_UP_MAX
from megatron_rlhf.generation.history import HistoryDrafter
from megatron_rlhf.generation.incremental import prefill
from megatron_rlhf.generation.kv_cache import KVCache
from megatron_rlhf.generation.lookup import Lookup
from megatron_rlhf.generation.packing import pad_right
from megatron_rlhf.generation.request import check_draft, check_request
from megatron_rlhf.generation.rollout import GenerationStats, Rollout
from megatron_rlhf.generation.rope import RopeTable
from megatron_rlhf.generation.sampling import logprob_lists, sample
from megatron_rlhf.generation.state import Outputs, Rows
from megatron_rlhf.models.moe import has_experts

__all__ = ["Generator", "Lookup", "check_draft", "history_drafter"]  # Lookup, check_draft: tests import them here


def history_drafter(spec: SpecConfig) -> HistoryDrafter | None:
    """The history drafter ``spec`` asks for (None: drafts do not come from the history)."""
    if not spec.uses_history:
        return None
    return HistoryDrafter(max_responses=spec.history_responses, max_prompts=spec.history_prompts,
                          global_responses=spec.history_global)


class Generator:
    """Generates with ``actor`` (and ``draft``) over their shared TP group; keeps what outlives
    a call (models, history drafter, graph stores, the ``auto`` selector). ``ragged``: history
    rounds verify each row's own width; ``graphs``: ``auto``, ``eager`` or ``off``;
    ``attention``: the decode backend (None: the device's default)."""

    def __init__(self, actor, draft=None, pad_id: int = 0, selector=None, graphs: str = "auto",
                 history: HistoryDrafter | None = None, ragged: bool = True, attention: str | None = None):
        if graphs not in ("auto", "eager", "off"):
            raise ValueError(f"graphs must be auto, eager or off, got {graphs!r}")
        self.actor, self.draft, self.pad_id = actor, draft, pad_id
        self.history, self.ragged, self.graphs = history, ragged, graphs
        self.attention = None if attention is None else check_backend(attention)
        self._steps: dict[str, graphs.StepGraphs] = {}  # model name -> graph store, kept across calls
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

    def selector_for(self, spec: SpecConfig, batch: int, max_len: int, graphed: bool = False):
        """The ``auto`` selector, built at the first call: costs learned online, or with
        ``spec.cost_profile`` loaded from that file or profiled now (``graphed``: CUDA graphs)."""
        from megatron_rlhf.generation import strategy

        if self.selector is None or self.selector.max_n != spec.max_draft_tokens:
            costs = (strategy.OnlineCosts() if spec.cost_profile is None else
                     strategy.load_or_profile(self.actor, self.draft, spec, batch, max_len, graphs=graphed))
            widest = spec.max_tokens(self.draft is not None)

            def acceptance():
                return strategy.Acceptance(widest, spec.acceptance_decay)

            self.selector = strategy.Selector(costs, spec.max_draft_tokens,
                                              acceptance() if self.draft is not None else None,
                                              acceptance() if self.history is not None else None)
        return self.selector

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], cfg: GenerationConfig,
                 spec: SpecConfig | None = None, seed: int = 0,
                 sample_ids: list[int] | None = None, migrator=None, accept_rule=None) -> Rollout:
        """Responses to ``prompts``. ``sample_ids``: each prompt's global index, the key of its
        random numbers (default ``0..B-1``). With ``migrator`` every rank of its data-parallel
        group calls this together (it may hold no prompts). ``accept_rule``: replaces
        :func:`~megatron_rlhf.generation.speculative.accept_sampling` under ``rejection``
        (tests). Raises ValueError on a request that cannot run, before any collective."""
        spec = spec or SpecConfig()
        max_len = self.check(prompts, cfg, spec, allow_empty=migrator is not None)
        t0 = time.perf_counter()
        drafts = self.draft is not None or self.history is not None
        if accept_rule is not None and spec.verify != "rejection":
            raise ValueError("accept_rule replaces rejection sampling: pass a SpecConfig with verify='rejection'")
        batch = max(len(prompts), 1)
        if migrator is not None:
            max_len, batch = migrator.agree(max_len, batch)
        max_len = aligned_length(max_len)  # the attention reads whole multiples of ATTEND_ALIGN
        for m in (self.actor, self.draft):
            if m is not None:
                m.eval()
        dev = self.actor.embedding.word_embeddings.weight.device
        sids = list(range(len(prompts))) if sample_ids is None else [int(i) for i in sample_ids]
        if len(sids) != len(prompts) or len(set(sids)) != len(sids):
            raise ValueError("sample_ids must give one distinct index per prompt")
        big_n = spec.max_tokens(drafts)  # the widest round
        call = Call(self, cfg, spec, rng.seed_key(seed), self.attention or default_backend(dev),
                    Outputs(cfg.max_new_tokens, cfg.stop_on_eos, self.eos),
                    GenerationStats(num_draft_tokens=big_n, accepted_per_position=[0] * big_n,
                                    drafted_per_position=[0] * big_n, rounds_by_draft_len=[0] * (big_n + 1)),
                    accept_rule=accept_rule or speculative.accept_sampling, mode=self._graph_mode(cfg, dev),
                    capacity=batch, big_n=big_n, base_n=spec.base_tokens(drafts))
        if spec.auto and big_n:
            call.selector = self.selector_for(spec, batch, max_len, graphed=call.mode == "cuda")
        call.stats.mode = "auto" if call.selector else ("fixed" if big_n else "plain")
        capture_before, captures_before = self._capture_s(), self._captures()
        call.rope = RopeTable(self.actor, max_len)
        # the draft's cache has room for a padded catch-up past the longest sample (the
        # actor's has none to spare: attention may read a whole cache, CPU bf16 does)
        if call.drafting:
            call.d_rope = RopeTable(self.draft, max_len + CATCH_UP_MAX)
        rows = self._prefill(call, prompts, sids, max_len, dev)
        call.stats.prefill_s = time.perf_counter() - t0
        self._decode(call, rows, migrator)
        rows.harvest()  # (every row left has finished)
        if migrator is not None:
            migrator.return_results(call.out, sids)
        if self.history is not None:  # what finished elsewhere (migrated away) joins too, whole
            for s in sids:
                self.history.finish(s, call.out.tokens[s])
            self.history.drop_live()  # samples that passed through here and finished elsewhere
        call.stats.elapsed_s = time.perf_counter() - t0
        call.stats.graph_capture_s = self._capture_s() - capture_before
        call.stats.graph_captures = self._captures() - captures_before
        call.stats.decode = self._decode_mode(call)
        return self._rollout(prompts, sids, call.out, call.stats, dev)

    def _decode(self, call: Call, rows: Rows, migrator) -> None:
        """Run rounds until every row finished (and, with ``migrator``, every rank agreed)."""
        stats, selector = call.stats, call.selector
        runner = call.runner("actor")
        if migrator is None and not call.big_n and runner is not None and runner.serves(rows.caches["actor"], 1):
            return self._overlapped(call, rows)
        # history rounds of the dynamic engine verify each row's own proposal (a graphed
        # round has fixed shapes: every row verifies the round's width, padded)
        ragged = self.ragged and self.history is not None and self.draft is None and call.mode is None
        if migrator is not None:
            migrator.start()
        live = None  # rows alive, when the host knows it without reading the device
        graphed = runner is not None
        while True:
            if migrator is not None and migrator.poll(rows, call.out, stats):
                break
            if live is None or migrator is not None:  # migration moves rows in and out
                live, call.high = _live_and_longest(rows)
            if live == 0:
                if migrator is None:
                    break
                continue
            if _compacts(len(rows), live, graphed):
                rows.compact({"actor": call.high})
            start, call.upkeep_s, captured = time.perf_counter(), 0.0, self._capture_s()
            looked_up = lookup.look_up(call, rows) if call.big_n and self.history is not None else None
            widths = self._widths(selector, looked_up) if looked_up is not None and ragged else None
            n = int(widths.max()) if widths is not None else self._choose(selector, live, call.base_n, looked_up)
            if n and widths is not None:
                k, after = self._ragged_round(call, rows, widths, looked_up)
            elif n:
                k, after = self._spec_round(call, rows, n, looked_up)
            else:
                after, k = self._plain_step(call, rows), None
            stats.actor_steps += 1
            stats.rounds_by_draft_len[n] += 1
            if selector is not None:
                found = drafts = None  # per live row, the drafts that came from the history
                if widths is not None:  # a ragged round: what each row verified, and in all
                    found = widths[torch.tensor(looked_up.alive, device=widths.device)]
                    drafts = int(found.sum())
                elif looked_up is not None and n:
                    found = torch.tensor(looked_up.found_live, device=k.device).clamp(max=n)
                # neither the draft's upkeep nor a graph's first capture is a round's own cost
                spent = time.perf_counter() - start - call.upkeep_s - max(self._capture_s() - captured, 0.0)
                selector.observe(live, n, spent, k, found if n else None, drafts=drafts)
            live = after

    def _overlapped(self, call: Call, rows: Rows) -> None:
        """Plain graphed decoding with each step's host read overlapped: step t+1 is launched
        before step t's result is parsed (what a step feeds stays on the device). The step
        launched after the last row finished computes dead rows only, and is not counted."""
        stats, runner = call.stats, call.runner("actor")
        live, call.high = _live_and_longest(rows)
        inflight = None
        while live or inflight is not None:
            launched = None
            if live:  # rows alive after the step before the one in flight: one more may run idle
                if _compacts(len(rows), live, True):
                    rows.compact({"actor": call.high})
                launched = rounds.launch_sampled(call, runner, rows)
            if inflight is not None:
                was, live = rounds.read_sampled(call, inflight)
                stats.actor_steps += bool(was)
                stats.rounds_by_draft_len[0] += bool(was)
            inflight = launched

    # the round kinds (rounds.py) as methods, which the benchmarks' clocks wrap per generator
    def _plain_step(self, call: Call, rows: Rows) -> int:
        return rounds.plain_step(call, rows)

    def _spec_round(self, call: Call, rows: Rows, n: int, looked_up: Lookup | None):
        return rounds.spec_round(call, rows, n, looked_up)

    def _ragged_round(self, call: Call, rows: Rows, widths: torch.Tensor, looked_up: Lookup):
        return rounds.ragged_round(call, rows, widths, looked_up)

    def _choose(self, selector, live: int, base_n: int, looked_up: Lookup | None = None) -> int:
        """This round's draft length, the same on every TP rank: fixed, or the selector's;
        without a draft model no wider than the longest live proposal."""
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
        """Per row, the drafts a ragged round verifies ``[R]`` (0: a plain step for that row),
        the same on every TP rank: the whole proposal, or the selector's choice under ``auto``."""
        widths = looked_up.found
        if selector is not None:
            chosen = iter(selector.choose_widths(looked_up.found_live, looked_up.remaining_live))
            widths = [next(chosen) if a else 0 for a in looked_up.alive]
        t = torch.tensor(widths, dtype=torch.long, device=looked_up.tokens.device)
        tp = self.actor.pg_collection.tp
        if tp.size() > 1:
            dist.broadcast(t, src=dist.get_global_rank(tp, 0), group=tp)
        return t

    # ------------------------------------------------------------------ graph stores
    def _capture_s(self) -> float:
        """Seconds spent capturing graphs so far, by the stores kept now."""
        return sum(g.capture_s for g in self._steps.values())

    def _captures(self) -> int:
        """Graphs made so far by the stores kept now."""
        return sum(g.captures for g in self._steps.values())

    def _graph_mode(self, cfg: GenerationConfig, dev) -> str | None:
        if self.graphs == "eager":
            return "eager"
        if self.graphs == "auto" and dev.type == "cuda":  # without capture: the same steps, eager
            return "cuda" if cfg.cuda_graphs else "eager"
        return None

    def _decode_mode(self, call: Call) -> str:
        """:attr:`GenerationStats.decode` for this call."""
        runner = call.runner("actor")
        if runner is None:
            how = "dynamic"
        elif runner.failed:
            how = f"eager graph code (capture failed: {runner.failed})"
        else:
            how = "cuda graphs" if runner.capture else "eager graph code"
        return f"{call.backend} attention, {how}"

    def release(self) -> None:
        """Free the KV cache stores and graphs kept for the next call (between rollouts, when
        training needs the memory); the next call captures its graphs again."""
        held = bool(self._steps)
        self._steps.clear()
        if held and torch.cuda.is_available():
            torch.cuda.empty_cache()  # graph pools hand their memory back

    def _new_cache(self, call: Call, name: str, model, batch: int, max_len: int) -> KVCache:
        """A cache for ``batch`` rows: the model's graph store's when the call uses graphs."""
        routes = name == "actor" and has_experts(model)
        if call.mode is None or not graphs.graphable(model):
            return KVCache.for_model(model, batch, max_len, routes=routes)
        runner = self._steps.get(name)
        if (runner is None or runner.backend != call.backend
                or not runner.fits(model, max(batch, call.capacity), max_len)):
            self._steps.pop(name, None)  # free the old store before allocating the new one
            if runner is not None:
                max_len = max(max_len, runner.cache.max_len) if runner.model is model else max_len
            runner = self._steps[name] = graphs.StepGraphs(
                model, max(batch, call.capacity), max_len, capture=call.mode == "cuda", backend=call.backend,
                routes=routes)
        return runner.new_cache(batch)

    # ------------------------------------------------------------------ first and last
    def _prefill(self, call: Call, prompts: list[list[int]], sids: list[int], max_len: int, dev) -> Rows:
        """Prefill the actor (and draft) caches and emit every sample's first token; returns
        the live rows, in prompt-length order (prefill pads each run of rows to its longest)."""
        b, cfg = len(prompts), call.cfg
        order = sorted(range(b), key=lambda i: len(prompts[i]))
        ordered = [prompts[i] for i in order]
        sid = torch.tensor([sids[i] for i in order], dtype=torch.long, device=dev)
        cache = self._new_cache(call, "actor", self.actor, b, max_len)
        feature = call.drafting and self.feature_draft
        fields = {"sid": sid, "emitted": torch.zeros(b, dtype=torch.long, device=dev),
                  "alive": torch.ones(b, dtype=torch.bool, device=dev)}
        if self.history is not None:  # a migrated sample's drafting state is rebuilt from these
            fields["prompt"] = (pad_right(ordered, self.pad_id, dev) if b
                                else torch.zeros(0, 1, dtype=torch.long, device=dev))
            fields["prompt_len"] = torch.tensor([len(p) for p in ordered], dtype=torch.long, device=dev)
            for s, p in zip(sid.tolist(), ordered):
                self.history.begin(s, p)
        caches = {"actor": cache}
        if call.drafting:
            caches["draft"] = self._new_cache(call, "draft", self.draft, b, max_len + CATCH_UP_MAX)
        for s in sids:
            call.out.open(s)
        if not b:
            fields["pending"] = torch.zeros(0, dtype=torch.long, device=dev)
            if call.drafting:
                fields.update(catch_tokens=torch.zeros(0, 0, dtype=torch.long, device=dev),
                              catch_count=torch.zeros(0, dtype=torch.long, device=dev))
                if feature:
                    h = self.actor.mrlhf_config.hidden_size
                    fields["catch_features"] = torch.zeros(0, 0, h, device=dev,
                                                           dtype=self.actor.embedding.word_embeddings.weight.dtype)
            return Rows(fields, caches, call.out.routes)
        logits = prefill(self.actor, cache, ordered, call.rope, self.pad_id, return_features=feature,
                         backend=call.backend)
        if feature:
            logits, hidden = logits  # [B, V], [B, P, h]
        first, probs = sample(logits, cfg, rng.uniform(call.key, sid, fields["emitted"], rng.NEXT))
        lp, slp = logprob_lists(logits, probs, first, cfg)
        for r, (s, tok) in enumerate(zip(sid.tolist(), first.tolist())):
            if call.emit(s, [tok], [lp[r]], [slp[r]]):
                fields["alive"][r] = False
        fields["pending"], fields["emitted"] = first, fields["emitted"] + 1
        if feature:  # catch up with the prompt and the first token: h_{-1} = 0
            fields["catch_tokens"] = pad_right([p + [t] for p, t in zip(ordered, first.tolist())],
                                               self.pad_id, dev)
            fields["catch_features"] = torch.cat([torch.zeros_like(hidden[:, :1]), hidden], 1)
            fields["catch_count"] = torch.tensor([len(p) + 1 for p in ordered], device=dev)
        elif call.drafting:
            prefill(self.draft, caches["draft"], ordered, call.d_rope, self.pad_id, backend=call.backend)
            fields["catch_tokens"], fields["catch_count"] = first[:, None], torch.ones_like(first)
        return Rows(fields, caches, call.out.routes)

    def _rollout(self, prompts, sids, out: Outputs, stats: GenerationStats, dev) -> Rollout:
        """The call's result: each prompt's response, log-probs and finish reason, in prompt order."""
        lengths = torch.tensor([len(out.tokens[s]) for s in sids], dtype=torch.long, device=dev)
        stats.new_tokens = sum(len(out.tokens[s]) for s in sids)
        return Rollout(prompt_ids=[list(p) for p in prompts],
                       response_ids=padded([out.tokens[s] for s in sids], self.pad_id, torch.long, dev),
                       response_logprobs=padded([out.logprobs[s] for s in sids], 0.0, torch.float32, dev),
                       sampling_logprobs=padded([out.sampling_logprobs[s] for s in sids], 0.0,
                                                torch.float32, dev),
                       lengths=lengths, finish_reasons=[out.reasons[s] for s in sids],
                       stats=stats, routes=_routes(prompts, sids, out))


def _routes(prompts: list[list[int]], sids: list[int], out: Outputs) -> list | None:
    """Each sample's routes over its fed tokens: the prompt and the response but its last
    token (which a verification that ended the sample may have fed too); None where none
    were kept."""
    if not out.routes:
        return None
    return [out.routes[s][: len(p) + len(out.tokens[s]) - 1].clone() for p, s in zip(prompts, sids)]


def _live_and_longest(rows: Rows) -> tuple[int, int]:
    """Rows alive, and the most tokens a row of the actor's cache holds (one host read)."""
    if not len(rows):
        return 0, 0
    alive, longest = torch.stack([rows["alive"].sum(), rows.caches["actor"].lengths.max()]).tolist()
    return int(alive), int(longest)


def _compacts(rows: int, live: int, graphed: bool) -> bool:
    """Whether to drop the finished rows before a round: graphed, when the batch bucket
    shrinks (a graph runs its bucket's rows, dead ones masked, so a copy saves nothing before);
    dynamic, when a quarter of the rows are dead."""
    if live == rows:
        return False
    return graphs.bucket(live) < graphs.bucket(rows) if graphed else (rows - live) * 4 >= rows

