"""Decode steps replayed from CUDA graphs: the generator at GPU speed, not launch speed.

Entry point: :class:`StepGraphs`, one per model: a KV cache store, RoPE table and buffers at
fixed addresses; a graph per batch bucket, length bucket and tokens fed, with no host read
inside and one packed copy to the host outside. A step attends over its length bucket, which
the caller derives from a bound on the rows' lengths that it keeps on the host.
``capture=False`` runs the same code eagerly (the CPU's check), as does a failed capture
(:mod:`~megatron_rlhf.generation.capture`). A store refuses a model whose weights moved.
"""

from __future__ import annotations

import logging
import time

import torch

from megatron_rlhf.generation import rng
from megatron_rlhf.generation.attention import default_backend
from megatron_rlhf.generation.capture import CaptureError, Captured, Eager, Fetch, describe
from megatron_rlhf.generation.cpu_numerics import ATTEND_ALIGN
from megatron_rlhf.generation.incremental import RopeTable, forward_cached, plain_layers
from megatron_rlhf.generation.kv_cache import KVCache
from megatron_rlhf.generation.sampling import STEP_COLUMNS, logprob_pair, sample, step_outputs
from megatron_rlhf.generation.speculative import verdict_from_matches

log = logging.getLogger(__name__)

ROW_STATE = ("sid", "pending", "emitted", "alive")  # row fields a graphed step advances in place
MAX_TOKENS = 8  # most tokens per sample one graph feeds (a verification of up to 7 drafts)
# Most tokens a draft's catch-up buffer holds (at this width the engine feeds the draft all
# but each row's last); also the widest catch-up a draft round's graph feeds, and the
# positions a draft's cache holds beyond the request's.
CATCH_UP_MAX = 32


def bucket(rows: int) -> int:
    """The batch a graph runs for ``rows`` live rows: the next power of two."""
    return 1 << max(rows - 1, 0).bit_length()


MIN_LENGTH_BUCKET = 32  # shortest attended length
# a length bucket is a multiple of this fraction of the next power of two: four per octave,
# each at most 1/4 longer than what it holds, a few graphs more per batch bucket
LENGTH_BUCKET_DIVISIONS = 8


def length_bucket(needed: int, max_len: int) -> int:
    """The cache positions a step attends over when its rows hold at most ``needed`` tokens
    (the step's included): ``needed`` rounded up to :data:`LENGTH_BUCKET_DIVISIONS` of its
    next power of two (a multiple of ``ATTEND_ALIGN``), from :data:`MIN_LENGTH_BUCKET`, at
    most ``max_len``."""
    top = 1 << max(needed - 1, 0).bit_length()
    step = max(ATTEND_ALIGN, top // LENGTH_BUCKET_DIVISIONS)
    return min(max(MIN_LENGTH_BUCKET, -(-needed // step) * step), max_len)


def width_bucket(n: int, room: int) -> int:
    """The drafts a verification graph feeds for a round of ``n``: the next of 1, 3, 7
    where the cache has ``room`` for it (and ``MAX_TOKENS``), else ``n`` itself."""
    wide = (1 << n.bit_length()) - 1
    return wide if wide <= min(room, MAX_TOKENS - 1) else n


def graphable(model) -> bool:
    """Whether ``model``'s decode step can be captured (the plain-layer path: no module that
    reseeds megatron's RNG tracker, which capture forbids)."""
    return plain_layers(model)


def _weights(model) -> tuple:
    return tuple(p.data_ptr() for p in model.parameters())


class StepGraphs:
    """Graphed forwards of ``model`` over the rows of one KV cache store. ``capture``: CUDA
    graphs (on a GPU), else the same static code run eagerly; ``backend``: the attention's;
    ``routes``: the store keeps an MoE actor's routes (a finished row's stay until compacted)."""

    def __init__(self, model, capacity: int, max_len: int, capture: bool, backend: str | None = None,
                 routes: bool = False):
        self.model, self.capture = model, capture
        self.backend = backend or default_backend(model.embedding.word_embeddings.weight.device)
        self.cache = KVCache.for_model(model, 0, max_len, capacity=bucket(capacity), routes=routes)
        self.rope = RopeTable(model, max_len)
        dev, cap = self.cache.store_lengths.device, self.cache.capacity
        self.tokens = torch.zeros(cap, MAX_TOKENS, dtype=torch.long, device=dev)
        weight, h = model.embedding.word_embeddings.weight, model.mrlhf_config.hidden_size
        self.features = None
        if getattr(model, "feature_fusion", None) is not None:
            self.features = torch.zeros(cap, MAX_TOKENS, h, dtype=weight.dtype, device=dev)
        # the rows' state for sampled steps (ROW_STATE; the engine's rows are views of these)
        self.sid, self.pending, self.emitted = (torch.zeros(cap, dtype=torch.long, device=dev) for _ in range(3))
        self.alive = torch.zeros(cap, dtype=torch.bool, device=dev)
        self.key = torch.zeros((), dtype=torch.long, device=dev)  # the generation seed's key
        self.limit = torch.zeros((), dtype=torch.long, device=dev)  # a verification's own n
        # what a step leaves for a feature draft: the final hidden states of a sampled
        # step's token [cap, h] and of a verification's fed tokens [cap, MAX_TOKENS, h]
        self.hidden = torch.zeros(cap, h, dtype=weight.dtype, device=dev)
        self.verified_hidden = torch.zeros(cap, MAX_TOKENS, h, dtype=weight.dtype, device=dev)
        # what a verification leaves for the next round: the drawn tokens, the accepted counts
        self.drawn = torch.zeros(cap, MAX_TOKENS, dtype=torch.long, device=dev)
        self.accepted = torch.zeros(cap, dtype=torch.long, device=dev)
        self.found = torch.zeros(cap, dtype=torch.long, device=dev)  # history drafts per row (both)
        self.draft_graphs: dict[tuple, object] = {}  # draft rounds (the key ends with the draft's store)
        # a draft's catch-up buffer, fed by the draft rounds
        self.catch_tokens = torch.zeros(cap, CATCH_UP_MAX, dtype=torch.long, device=dev)
        self.catch_count = torch.zeros(cap, dtype=torch.long, device=dev)
        self.catch_features = None
        if self.features is not None:
            self.catch_features = torch.zeros(cap, CATCH_UP_MAX, h, dtype=weight.dtype, device=dev)
        self._key_value: int | None = None
        # where the host reads a step's packed result (pinned: the copy runs asynchronously);
        # two, used in turn: a step's copy lands while the host parses the one before
        self.hosts = [torch.zeros(cap, max(len(STEP_COLUMNS), 4 + 3 * MAX_TOKENS), dtype=torch.float64,
                                  pin_memory=capture) for _ in range(2)]
        self._slot = 0
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.failed: str | None = None  # why a capture failed (every step then runs eagerly)
        self.graphs: dict[tuple, object] = {}
        self.weights = _weights(model)
        self._store = self.cache.store_keys[0]
        self.capture_s = 0.0  # seconds spent capturing (and warming up), all graphs so far
        self.captures = 0  # graphs made so far (captured, or their eager twins)

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    def fits(self, model, batch: int, max_len: int) -> bool:
        """Can serve a request of ``batch`` rows needing ``max_len`` cache positions."""
        return (model is self.model and batch <= self.capacity and max_len <= self.cache.max_len
                and self.cache.store_keys[0] is self._store and _weights(model) == self.weights)

    def attend(self, needed: int) -> int:
        """:func:`length_bucket` of ``needed`` tokens in this store."""
        return length_bucket(needed, self.cache.max_len)

    def new_cache(self, batch: int) -> KVCache:
        """The store's first ``batch`` rows, emptied: the cache of a new request."""
        self.cache.resize(batch)
        self.cache.lengths.zero_()
        return self.cache

    def serves(self, cache: KVCache, n: int) -> bool:
        """Whether a forward of ``n`` tokens per row of ``cache`` replays a graph."""
        return cache is self.cache and cache.store_keys[0] is self._store and 0 < n <= MAX_TOKENS \
            and cache.batch > 0

    def __call__(self, tokens: torch.Tensor, features: torch.Tensor | None = None,
                 return_features: bool = False, attend: int | None = None):
        """:func:`forward_cached` of ``tokens [R, n]`` from the graph of ``R``'s bucket: logits
        ``[R, n, V]`` (and hidden states ``[R, n, h]`` with ``return_features``). ``attend``:
        the attended length (:meth:`attend`; None: the whole cache)."""
        r, n = tokens.shape
        b = bucket(r)
        self.tokens[:r, :n].copy_(tokens)
        if features is not None:
            self.features[:r, :n].copy_(features)
        self.cache.store_lengths[r:b] = 0  # padding rows: garbage at position 0
        out = self._cached(self.graphs, (b, n, return_features, attend),
                           self._forward_step(b, n, return_features, attend)).run()
        if return_features:
            return out[0][:r].clone(), out[1][:r].clone()
        return out[:r].clone()  # the graph's output is overwritten by its next replay

    def bound(self, rows) -> bool:
        """Whether ``rows``' state fields (:data:`ROW_STATE`) are views of this store's buffers."""
        r = len(rows)
        return all(rows[f].data_ptr() == getattr(self, f).data_ptr() and rows[f].shape[0] == r
                   for f in ROW_STATE)

    def bind(self, rows, key: int) -> None:
        """Copy ``rows``' state into the static buffers and make the fields views of them (the
        steps advance the rows in place); ``key``: the seed's key."""
        if key != self._key_value:
            self.key.fill_(key)
            self._key_value = key
        if self.bound(rows):
            return
        r = len(rows)
        self.alive[r:].zero_()
        for f in ROW_STATE:
            buf = getattr(self, f)
            buf[:r].copy_(rows[f])
            rows[f] = buf[:r]

    def sample_step(self, rows, params, max_new: int, eos: int | None, pad_id: int,
                    return_features: bool = False, attend: int | None = None) -> "Fetch":
        """One plain decode step of bound ``rows`` from one graph, launched; its
        :meth:`Fetch.result` is per row the :data:`~megatron_rlhf.generation.sampling.STEP_COLUMNS`.
        ``return_features``: each fed token's final hidden state is left in :attr:`hidden`
        ``[R, h]``; ``attend`` as in :meth:`__call__`."""
        r = len(rows)
        b = bucket(r)
        sampling = (params.greedy, params.temperature, params.top_k, params.top_p)
        key = (b, 1, "sample", sampling, max_new, eos, pad_id, return_features, attend)

        def step():
            alive, emitted, lengths = self.alive[:b], self.emitted[:b], self.cache.store_lengths[:b]
            lengths.mul_(alive)  # finished and padding rows compute garbage at position 0
            feed = torch.where(alive, self.pending[:b], pad_id)[:, None]
            logits = forward_cached(self.model, self._rows(b), feed, self.rope, static=True,
                                    return_features=return_features, backend=self.backend, attend=attend)
            if return_features:
                logits, hidden = logits
                self.hidden[:b].copy_(hidden[:, 0])
            logits = logits[:, 0]
            u = None if params.greedy else rng.uniform(self.key, self.sid[:b], emitted, rng.NEXT)
            tok, done, packed = step_outputs(logits, params, u, self.sid[:b], alive, emitted, max_new, eos)
            self.pending[:b].copy_(tok)
            emitted.add_(1)
            alive.logical_and_(done.logical_not())
            return packed

        graph = self._cached(self.graphs, key, step, (self.pending, self.emitted, self.alive))
        return self._fetch(graph.run(), r)

    def verify_step(self, rows, drafts: torch.Tensor, n: int, width: int, params, max_new: int,
                    eos: int | None, pad_id: int, attend: int | None = None) -> list[list[float]]:
        """One exact verification of ``drafts [R, >= n]`` for bound ``rows`` from one graph of
        ``width >= n`` drafts (:func:`width_bucket`). Returns per row ``[sid, alive, done, k,
        token_0..token_width, lp_0.., slp_0..]``, of which the first ``k + 1`` are emitted."""
        r = len(rows)
        b = bucket(r)
        self.tokens[:r, 1:n + 1].copy_(drafts[:, :n])
        self.tokens[:r, n + 1:width + 1].fill_(pad_id)  # computed, never accepted
        self.limit.fill_(n)
        self.cache.store_lengths[r:b] = 0  # padding rows: garbage at position 0
        sampling = (params.greedy, params.temperature, params.top_k, params.top_p)
        key = (b, width + 1, "verify", sampling, max_new, eos, pad_id, attend)

        def step():
            return self._verify(b, self.tokens[:b, 1:width + 1], params, max_new, eos, pad_id, attend=attend)

        graph = self._cached(self.graphs, key, step, (self.pending, self.emitted, self.alive))
        return self._read(graph.run(), r)

    def _verify(self, b: int, drafted: torch.Tensor, params, max_new: int, eos: int | None,
                pad_id: int, return_features: bool = False, attend: int | None = None) -> torch.Tensor:
        """The verification a graph captures: feed ``[pending, drafted [b, w]]``, accept while
        each draft is plain sampling's token, never past :attr:`limit`; advance the rows and
        roll the cache back. Returns :meth:`verify_step`'s packed result; leaves :attr:`drawn`,
        :attr:`accepted` and (``return_features``) :attr:`verified_hidden`."""
        alive, emitted, lengths = self.alive[:b], self.emitted[:b], self.cache.store_lengths[:b]
        width = drafted.shape[1]
        was_alive = alive.clone()
        lengths.mul_(alive)  # finished and padding rows compute garbage at position 0
        base = lengths.clone()
        feed = torch.cat([torch.where(alive, self.pending[:b], pad_id)[:, None], drafted], 1)
        logits = forward_cached(self.model, self._rows(b), feed, self.rope, static=True,
                                return_features=return_features, backend=self.backend, attend=attend)
        if return_features:
            logits, hidden = logits
            self.verified_hidden[:b, :width + 1].copy_(hidden)
        steps = torch.arange(width + 1, device=feed.device)
        u = None if params.greedy else rng.uniform(self.key, self.sid[:b, None], emitted[:, None] + steps, rng.NEXT)
        drawn, probs = sample(logits, params, u)  # plain sampling's tokens at these positions
        verdict = verdict_from_matches((drafted == drawn[:, :-1]) & (steps[None, :-1] < self.limit), drawn)
        k = verdict.accepted  # [b] drafts accepted
        lp, slp = logprob_pair(logits, probs, drawn, params)
        stop = emitted[:, None] + steps + 1 >= max_new  # a position that ends its sample
        if eos is not None:
            stop = stop | (drawn == eos)
        done = (stop & (steps[None] <= k[:, None])).any(-1) & alive
        lengths.copy_(base + 1 + k)  # the cache keeps pending and the accepted drafts
        self.pending[:b].copy_(verdict.next_token)
        emitted.add_(k + 1)
        alive.logical_and_(done.logical_not())
        self.drawn[:b, :width + 1].copy_(drawn)
        self.accepted[:b].copy_(k)
        head = torch.stack([t.double() for t in (self.sid[:b], was_alive, done, k)], 1)
        return torch.cat([head, drawn.double(), lp.double(), slp.double()], 1)

    def draft_step(self, draft: "StepGraphs", rows, n: int, params, max_new: int,
                   eos: int | None, pad_id: int, history=None, attend: int | None = None) -> list[list[float]]:
        """A round of ``n`` drafts from a draft model (``draft``: its store, holding ``rows``'
        draft cache) as one graph: catch-up, proposals, exact verification. Returns what
        :meth:`verify_step` does; the next catch-up is the first ``accepted + 1`` of
        :attr:`drawn`. ``history``: ``(tokens [R, n], found [R])`` replacing a row's first
        ``found`` proposals. ``attend``: the actor's attended length (the draft's store is
        read whole: its model is small)."""
        # the catch-up is fed at a power-of-two width; each proposal is drawn with the
        # uniform plain sampling uses there, so a draft near the actor proposes its token
        r = len(rows)
        b = bucket(r)
        if history is not None:  # the history's tokens wait in the forward's token buffer
            self.tokens[:r, 1:n + 1].copy_(history[0])
            self.found[:r].copy_(history[1])
            if b > r:
                self.found[r:b] = 0
        feature = getattr(draft.model, "feature_fusion", None) is not None
        width = rows["catch_tokens"].shape[1]
        cw = bucket(width)
        draft.catch_tokens[:r, :width].copy_(rows["catch_tokens"])
        draft.catch_tokens[:r, width:cw].fill_(pad_id)
        draft.catch_count[:r].copy_(rows["catch_count"])
        if feature:
            draft.catch_features[:r, :width].copy_(rows["catch_features"])
            draft.catch_features[:r, width:cw].zero_()
        self.limit.fill_(n)
        self.cache.store_lengths[r:b] = 0  # padding rows: garbage at position 0
        draft.cache.store_lengths[r:b] = 0
        sampling = (params.greedy, params.temperature, params.top_k, params.top_p)
        key = (b, n + 1, "draft", cw, sampling, max_new, eos, pad_id, history is not None, attend, draft)
        if key not in self.draft_graphs:  # graphs of an earlier draft store hold it alive: drop them
            self.draft_graphs = {k: v for k, v in self.draft_graphs.items() if k[-1] is draft}

        def step():
            alive, sid, emitted = self.alive[:b], self.sid[:b], self.emitted[:b]
            d_len = draft.cache.store_lengths[:b]
            d_len.mul_(alive)
            count = torch.where(alive, draft.catch_count[:b], 1)
            caught = d_len + count  # what the draft holds once caught up
            feats = draft.catch_features[:b, :cw] if feature else None
            res = forward_cached(draft.model, draft._rows(b), draft.catch_tokens[:b, :cw], draft.rope,
                                 static=True, backend=draft.backend, last_index=count - 1, features=feats,
                                 return_features=feature)
            if feature:
                logits, hidden = res
                hidden = hidden[torch.arange(b, device=hidden.device), count - 1][:, None]
            else:
                logits, hidden = res, None
            d_len.copy_(caught)
            proposed = []
            for i in range(n):
                u = None if params.greedy else rng.uniform(self.key, sid, emitted + i, rng.NEXT)
                tok, _ = sample(logits[:, -1], params, u)
                if history is not None:
                    tok = torch.where(i < self.found[:b], self.tokens[:b, 1 + i], tok)
                proposed.append(tok)
                if i + 1 < n:
                    res = forward_cached(draft.model, draft._rows(b), tok[:, None], draft.rope, static=True,
                                         features=hidden, return_features=feature, backend=draft.backend)
                    logits, hidden = res if feature else (res, None)
            d_len.copy_(caught)
            return self._verify(b, torch.stack(proposed, 1), params, max_new, eos, pad_id,
                                return_features=feature, attend=attend)

        graph = self._cached(self.draft_graphs, key, step,
                             (self.pending, self.emitted, self.alive, draft.cache.store_lengths))
        return self._read(graph.run(), r)

    def _read(self, packed: torch.Tensor, r: int) -> list[list[float]]:
        """The first ``r`` rows of a step's packed result on the host (one pinned copy, one sync)."""
        return self._fetch(packed, r).result()

    def _fetch(self, packed: torch.Tensor, r: int) -> "Fetch":
        """Start copying the first ``r`` rows of ``packed`` into the next host buffer."""
        host = self.hosts[self._slot].view(-1)[:r * packed.shape[1]].view(r, packed.shape[1])
        self._slot ^= 1
        host.copy_(packed[:r], non_blocking=True)
        event = None
        if packed.is_cuda:
            event = torch.cuda.Event()
            event.record()
        return Fetch(host, event)

    def _forward_step(self, b: int, n: int, return_features: bool, attend: int | None = None):
        """The step of a plain forward's graph: ``n`` tokens for ``b`` rows from the buffers."""
        feats = None if self.features is None else self.features[:b, :n]

        def step():
            return forward_cached(self.model, self._rows(b), self.tokens[:b, :n], self.rope, features=feats,
                                  return_features=return_features, static=True, backend=self.backend,
                                  attend=attend)

        return step

    def _cached(self, table: dict, key: tuple, step, state: tuple[torch.Tensor, ...] = ()):
        """The graph of ``key`` in ``table``, made from ``step`` at its first use (timed)."""
        graph = table.get(key)
        if graph is None:
            start = time.perf_counter()
            graph = table[key] = self._graph(step, state)
            self.capture_s += time.perf_counter() - start
            self.captures += 1
        return graph

    def _graph(self, step, state: tuple[torch.Tensor, ...] = ()):
        """``step`` captured, or run eagerly (no capture, or a failed one: logged once per store)."""
        if not self.capture:
            return Eager(step)
        try:
            return Captured(step, self.pool, (self.cache.store_lengths, *state))
        except Exception as e:  # noqa: BLE001 (any capture failure: decode eagerly instead)
            self.capture, self.failed = False, str(e) if isinstance(e, CaptureError) else describe(e)
            log.warning("CUDA graph capture failed (%s); decoding runs eagerly from here on "
                        "(--no-cuda-graphs skips capture)", self.failed)
            return Eager(step)

    def _rows(self, b: int) -> KVCache:
        """The store's first ``b`` rows as a cache, lengths included (a graph advances them)."""
        view = KVCache.__new__(KVCache)
        view.store_keys, view.store_values = self.cache.store_keys, self.cache.store_values
        view.store_lengths, view.max_len = self.cache.store_lengths, self.cache.max_len
        view.keys = [k[:b] for k in self.cache.store_keys]
        view.values = [v[:b] for v in self.cache.store_values]
        view.lengths = self.cache.store_lengths[:b]
        view.store_routes = self.cache.store_routes
        view.routes = None if view.store_routes is None else view.store_routes[:b]
        return view


@torch.inference_mode()
def time_step(model, batch: int, n: int, context: int, repeats: int = 20,
              graphs: bool = True) -> float:
    """Median milliseconds of one forward of ``n`` tokens per sample after ``context`` cached
    tokens at ``batch`` samples, as the generator runs it (a CUDA graph on a GPU with ``graphs``)."""
    weight = model.embedding.word_embeddings.weight
    cuda, max_len = weight.is_cuda, context + n + 1
    tokens = torch.randint(0, model.mrlhf_config.vocab_size, (batch, n), device=weight.device)
    feats = None
    if getattr(model, "feature_fusion", None) is not None:
        feats = torch.zeros(batch, n, model.mrlhf_config.hidden_size, dtype=weight.dtype, device=weight.device)
    if graphs and cuda and graphable(model):
        runner = StepGraphs(model, batch, max_len, capture=True)
        cache = runner.new_cache(batch)
        run = lambda: runner(tokens, feats)  # noqa: E731
    else:
        cache, rope = KVCache.for_model(model, batch, max_len), RopeTable(model, max_len)
        run = lambda: forward_cached(model, cache, tokens, rope, features=feats)  # noqa: E731
    times = []
    for i in range(repeats + 2 if cuda else repeats + 1):
        cache.lengths.fill_(context)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize()
        if i >= (2 if cuda else 1):  # the first runs capture / warm up
            times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]
