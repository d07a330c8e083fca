"""The workload-aware drafting selector (RLHFSpec): a cost model, an acceptance estimate,
and before every round the choice of plain decoding or ``n`` draft tokens.

RLHF generation shrinks from a full batch to a long tail. Verifying ``n + 1`` tokens per
sample costs little more than one token at a small batch and much more at a large one (on
a CPU; on a GPU it is nearly free at any batch), while the tokens a round emits depend on
how often the actor accepts the draft. So before each round the selector picks the ``n``
(0: a plain step) with the most expected emitted tokens per second for the live batch::

    E[tokens | n] = 1 + sum_{j<n} prod_{i<=j} alpha_i      (alpha_i: acceptance at position i)
    time(b, n)    = draft(b, 2) + (n - 1) draft(b, 1) + actor(b, n + 1)   (n = 0: actor(b, 1))

- costs: by default :class:`OnlineCosts`, learned from the rounds as they run (no profile
  at the first call); with ``--cost-profile`` a :class:`CostTable` of one forward of the
  actor and of the draft by live batch and tokens per sample, profiled once
  (:func:`profile`) or loaded, which :class:`Selector` corrects from measured rounds (a
  factor per draft length and batch octave).
- :class:`Acceptance`: per draft source (the draft model, the history) and position, the
  decayed fraction of drafts the actor accepted (it follows the actor as it trains); a
  bonus for positions rarely tried keeps the selector exploring them. A history proposal
  is known before the round: each sample's expected tokens count its own proposal's
  length (:func:`expected_tokens_mixed`).
- A draft length must promise :data:`DRAFT_MARGIN` more tokens per second than a plain step.
- History drafts without a draft model, dynamic engine: rounds are ragged, and
  :meth:`Selector.choose_widths` picks each sample's own number of drafts (the drafts with
  the most expected tokens, priced by what drafts cost beyond a plain step).

Whatever it picks, each round is lossless: the choice only decides how many tokens the
draft proposes before the actor decides.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

DRAFT_MARGIN = 0.1
"""A draft length is chosen over a plain step only when it promises this much more: near
break-even the estimates' noise decides (a CPU's round times vary by ~10% from round to
round), and a wrong guess there loses what a right one gains. Measured on SmolLM2 with
history drafts on the CPU: without it the selector drafted at break-even and came out
6% slower than plain decoding in one epoch of three."""
EXPLORATION = 0.3
"""Acceptance bonus ``EXPLORATION / sqrt(1 + tried)`` of a position tried ``tried`` times."""


def _interp(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear in ``x``; flat below the first point, the last slope (>= 0) above."""
    if x <= xs[0] or len(xs) == 1:
        return ys[0] if x <= xs[0] else ys[-1]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return ys[i - 1] + w * (ys[i] - ys[i - 1])
    slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
    return ys[-1] + slope * (x - xs[-1])


@dataclass
class CostTable:
    """Seconds per forward of the actor and the draft, by live batch and tokens per sample."""

    batches: list[int]
    """Profiled batch sizes, ascending."""
    actor: dict[int, list[float]]
    """Tokens per sample -> the actor's latency at each of ``batches``."""
    draft: dict[int, list[float]] = field(default_factory=dict)
    """Tokens per sample -> the draft's latency at each of ``batches``."""
    models: str = ""
    """What was profiled (models, TP, dtype, device): a profile of others is not reused."""

    def actor_s(self, batch: int, tokens: int) -> float:
        return self._lookup(self.actor, batch, tokens)

    def draft_s(self, batch: int, tokens: int) -> float:
        return self._lookup(self.draft, batch, tokens) if self.draft else 0.0

    def _lookup(self, table: dict[int, list[float]], batch: int, tokens: int) -> float:
        widths = sorted(table)
        t = min(widths, key=lambda w: (abs(w - tokens), w))
        base = _interp(self.batches, table[t], batch)
        if tokens > widths[-1]:  # wider than profiled: scale by the last step in width
            prev = _interp(self.batches, table[widths[-2]], batch) if len(widths) > 1 else 0.0
            base += (tokens - widths[-1]) * max(base - prev, 0.0)
        return base

    def round_s(self, batch: int, n: int) -> float:
        """Predicted latency of a round with ``n`` draft tokens (0: a plain step)."""
        if n == 0:
            return self.actor_s(batch, 1)
        return self.draft_s(batch, 2) + (n - 1) * self.draft_s(batch, 1) + self.actor_s(batch, n + 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["actor"] = {str(k): v for k, v in self.actor.items()}
        d["draft"] = {str(k): v for k, v in self.draft.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "CostTable":
        return cls(batches=list(d["batches"]), models=d.get("models", ""),
                   actor={int(k): list(v) for k, v in d["actor"].items()},
                   draft={int(k): list(v) for k, v in d.get("draft", {}).items()})

    def save(self, path: str | Path) -> None:
        """Write atomically (a temporary file, then rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> "CostTable":
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"cost profile {path} is unreadable ({e}); delete it to re-profile") from e


SPREAD = 0.2
"""An online cost line is trusted once its observations' ``x`` spread this much (standard
deviation over mean); before, costs are taken in proportion to ``x`` (no fixed part: the
pessimistic reading). A line fitted to batches of 19-24 alone once priced a verification
of 4 drafts at batch 19 like a plain step (203 ms); it took 565."""


class _Fit:
    """A decayed least-squares line ``y = a + b x`` (``a, b >= 0``) over observations;
    ``origin``: ``y = b x`` (what is 0 at ``x = 0`` by definition)."""

    def __init__(self, decay: float, origin: bool = False):
        self.decay, self.origin = decay, origin
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.w, self.sx, self.sy = d * self.w + 1, d * self.sx + x, d * self.sy + y
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * y

    def _moments(self) -> tuple[float, float, float]:
        """The observations' mean ``x``, mean ``y`` and variance of ``x``."""
        mx, my = self.sx / self.w, self.sy / self.w
        return mx, my, self.sxx / self.w - mx * mx

    @staticmethod
    def _spreads(mx: float, var: float) -> bool:
        return var > (SPREAD * mx) ** 2

    def spread(self) -> bool:
        """Whether the observations' ``x`` spread enough to tell the fixed part from the
        part per unit (:data:`SPREAD`)."""
        mx, _, var = self._moments()
        return self._spreads(mx, var)

    def predict(self, x: float) -> float | None:
        """None before any observation; a line through the origin (the mean's cost per
        unit) until the observations spread (:meth:`spread`); with ``origin`` always a line
        through the origin, its slope by least squares."""
        if self.w == 0:
            return None
        if self.origin:
            return self.sxy / self.sxx * x if self.sxx > 0 else 0.0
        mx, my, var = self._moments()
        if not self._spreads(mx, var):
            return my * x / mx if mx > 0 else my
        slope = min(max((self.sxy / self.w - mx * my) / var, 0.0), my / mx if mx > 0 else 0.0)
        return my + slope * (x - mx)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("w", "sx", "sy", "sxx", "sxy")}


class OnlineCosts:
    """Round latencies learned from the rounds as they run: no profile at the first call
    (the profile took 19 s on SmolLM2 at batch 32 on one CPU core, as long as a rollout).

    Each round's measured seconds (what the selector observes: the whole round as it ran,
    drafting, graphs and sampling included) update two fits:

    - per draft length ``n``, seconds against the live batch (a decayed line);
    - over all rounds, seconds against the tokens the actor runs, ``batch * (n + 1)``: the
      prior for a length not yet measured (a verification of ``n + 1`` tokens costs what
      that many tokens cost in plain steps; while the batch has not changed, in
      proportion to its tokens).

    The first round is a plain step (nothing is known of drafting); the first drafting
    round is tried where it would pay at a plain step's cost (:meth:`Selector.choose`);
    from then on a length is chosen when its fit, or the prior, says it pays.
    """

    models = "online"

    def __init__(self, decay: float = 0.95):
        self.decay = decay
        self.by_n: dict[int, _Fit] = {}
        self.tokens = _Fit(decay)
        self.drafted = _Fit(decay, origin=True)
        """Ragged verifications: the seconds they took beyond a plain step at their batch
        (:meth:`tokens_s`), against the drafts they verified: a line through the origin (no
        drafts: a plain step). A free intercept, fitted to the first ragged rounds of a
        held-out evaluation (90-100 rows, 384-450 drafts), came out at 0.22 s: every
        later round of 1-16 rows priced a single draft at twice a plain step, no round
        drafted again, and so no round corrected it (``make demo`` drafted in none of its
        16 iterations)."""

    def guessing(self) -> bool:
        """Whether drafting's cost is still a guess: no drafting round (``n > 0``) measured,
        and the prior read in proportion to tokens (its rounds' tokens have not spread)."""
        return not any(n for n in self.by_n) and not (self.tokens.w > 0 and self.tokens.spread())

    def observe(self, batch: int, n: int, seconds: float, drafts: int | None = None) -> None:
        """A round of ``n`` drafts at ``batch`` live samples took ``seconds``; ``drafts``: the
        drafts it verified in all when the rows verified widths of their own (a ragged
        round: it teaches :attr:`drafted`, what its drafts cost beyond a plain step)."""
        if drafts is not None and n > 0:
            plain = self.tokens_s(batch)
            self.drafted.add(drafts, max(seconds - (plain or 0.0), 0.0))
            return
        self.by_n.setdefault(n, _Fit(self.decay)).add(batch, seconds)
        self.tokens.add(batch * (n + 1), seconds)

    def tokens_s(self, tokens: int) -> float | None:
        """Predicted seconds of a round in which the actor runs ``tokens`` tokens as one
        each (a plain step of that many samples); None before any round."""
        return self.tokens.predict(tokens)

    def ragged_s(self, batch: int, drafts: int) -> float | None:
        """Predicted seconds of a ragged round verifying ``drafts`` drafts among ``batch``
        samples: a plain step plus what drafts have cost beyond one (None: no ragged round
        measured yet; before their numbers spread, in proportion to the drafts)."""
        plain, extra = self.tokens_s(batch), self.drafted.predict(drafts) if drafts else 0.0
        return None if plain is None or extra is None else plain + extra

    def round_s(self, batch: int, n: int) -> float:
        """Predicted seconds of a round of ``n`` drafts at ``batch`` live samples (0 when
        nothing is measured yet for a plain step, inf for drafting: measure plain first)."""
        fit = self.by_n.get(n)
        if fit is not None and fit.w >= 1:
            mx = fit.sx / fit.w
            if fit.spread():  # this length measured at batches far enough apart
                return fit.predict(batch)
            here, there = self.tokens.predict(batch * (n + 1)), self.tokens.predict(mx * (n + 1))
            return fit.sy / fit.w * (here / there if here and there else 1.0)
        prior = self.tokens.predict(batch * (n + 1))
        if prior is None:
            return 0.0 if n == 0 else math.inf
        return prior

    def to_dict(self) -> dict:
        return {"models": self.models, "tokens": self.tokens.to_dict(),
                "by_n": {str(n): f.to_dict() for n, f in sorted(self.by_n.items())}}


def best_draft_length(round_s: list[float], expected_tokens: list[float]) -> int:
    """The ``n`` with the most expected tokens per second (ties: the smaller ``n``)."""
    rates = [e / max(s, 1e-12) for e, s in zip(expected_tokens, round_s)]
    return max(range(len(rates)), key=lambda n: (rates[n], -n))


class Acceptance:
    """Decayed per-position acceptance of the draft: ``alpha_i`` = accepted / tried at
    draft position ``i``, over recent rounds (every round multiplies old counts by
    ``decay``); starts from ``prior`` with the weight of ``prior_weight`` verifications."""

    def __init__(self, max_n: int, decay: float, prior: float = 0.5, prior_weight: float = 2.0):
        self.decay = decay
        self.tried = [prior_weight] * max_n
        self.passed = [prior * prior_weight] * max_n

    def observe(self, accepted: torch.Tensor | None, n: int, lo: torch.Tensor | None = None,
                hi: torch.Tensor | None = None) -> None:
        """A round: ``accepted [live]`` draft tokens accepted per sample (None: a plain step).
        ``lo``/``hi [live]``: the positions ``lo <= i < hi`` of each sample that this source
        drafted (default: all ``n``); the others came from another source, or were padding."""
        self.tried = [t * self.decay for t in self.tried]
        self.passed = [p * self.decay for p in self.passed]
        if accepted is None or not n:
            return
        for i in range(min(n, len(self.tried))):
            mine = accepted >= i
            if lo is not None:
                mine = mine & (lo <= i)
            if hi is not None:
                mine = mine & (hi > i)
            self.tried[i] += float(mine.sum())
            self.passed[i] += float((mine & (accepted > i)).sum())

    def rates(self, explore: bool = True) -> list[float]:
        out = []
        for t, p in zip(self.tried, self.passed):
            a = p / t if t > 0 else 0.0
            out.append(min(1.0, a + (EXPLORATION / math.sqrt(1.0 + t) if explore else 0.0)))
        return out

    def expected_tokens(self, n: int, explore: bool = True) -> float:
        """Tokens a round of ``n`` drafts emits per sample: accepted drafts + 1."""
        rates = self.rates(explore)
        n = min(n, len(rates))
        return expected_tokens_mixed(n, [n], rates, None)


def expected_tokens_mixed(n: int, found: list[int], history: list[float],
                          model: list[float] | None) -> float:
    """Mean tokens a round of width ``n`` emits per sample when sample ``r``'s first
    ``found[r]`` drafts come from the history (acceptance ``history[i]`` at position ``i``)
    and the rest from the draft model (``model``; None: no model, the rest is padding that
    is never counted on)."""
    if not found:
        return 1.0
    by_found: dict[int, int] = {}
    for f in found:
        f = min(f, n)
        by_found[f] = by_found.get(f, 0) + 1
    total = 0.0
    for f, count in by_found.items():
        tokens, reach = 1.0, 1.0
        for i in range(n):
            rates = history if i < f else model
            if rates is None:
                break
            reach *= rates[min(i, len(rates) - 1)]
            tokens += reach
        total += count * tokens
    return total / len(found)


class Selector:
    """Chooses each round's draft length from a :class:`CostTable` and the acceptance of
    each draft source: ``acceptance`` the draft model's (None: no draft model), ``history``
    the history drafter's (None: no history drafts)."""

    def __init__(self, costs: CostTable, max_n: int, acceptance: Acceptance | None,
                 history: Acceptance | None = None):
        if acceptance is None and history is None:
            raise ValueError("a selector needs a draft source: a draft model's acceptance or the history's")
        self.costs, self.max_n, self.acceptance, self.history = costs, max_n, acceptance, history
        self.correction: dict[tuple[int, int], float] = {}

    @staticmethod
    def _octave(batch: int) -> int:
        return int(round(math.log2(max(batch, 1))))

    def round_s(self, batch: int, n: int) -> float:
        """Predicted round latency: learned online (:class:`OnlineCosts`), or the profile
        corrected by the rounds measured most like it."""
        if isinstance(self.costs, OnlineCosts):
            return self.costs.round_s(batch, n)
        return self.costs.round_s(batch, n) * self.factor(n, self._octave(batch))

    def factor(self, n: int, octave: int) -> float:
        """The measured/profiled ratio for ``n`` drafts at ``octave``. Where it was never
        measured: the same ``n`` at the nearest octave measured; else rounds of the same
        kind (plain, or drafting: their overheads differ) at this octave; else 1 (the
        profile as is, so the length gets tried and measured)."""
        if (n, octave) in self.correction:
            return self.correction[(n, octave)]
        same_n = [(abs(o - octave), f) for (m, o), f in self.correction.items() if m == n]
        if same_n:
            return min(same_n)[1]
        kind = [f for (m, o), f in self.correction.items() if o == octave and (m > 0) == (n > 0)]
        return sum(kind) / len(kind) if kind else 1.0

    def expected_tokens(self, n: int, found: list[int] | None = None) -> float:
        """Tokens per sample a round of ``n`` drafts is expected to emit. ``found``: per
        live sample, the drafts its history proposes (known before the round: the history
        drafts first, the model fills the rest when there is one)."""
        if found is None or self.history is None:
            return self.acceptance.expected_tokens(n)
        model = self.acceptance.rates() if self.acceptance is not None else None
        return expected_tokens_mixed(n, found, self.history.rates(), model)

    def choose(self, batch: int, found: list[int] | None = None, widest: int | None = None) -> int:
        """The draft length (0: a plain step) with the most expected tokens per second for
        ``batch`` live samples; ``found`` as in :meth:`expected_tokens`; ``widest``: the
        largest length to consider (default ``max_n``)."""
        widths = range((self.max_n if widest is None else widest) + 1)
        seconds = [self.round_s(batch, n) for n in widths]
        tokens = [self.expected_tokens(n, found) for n in widths]
        if isinstance(self.costs, OnlineCosts) and seconds[0] > 0 and self.costs.guessing():
            # No drafting round measured, and the prior still prices a verification of n + 1
            # tokens like n + 1 plain steps (the batch has not changed): right on a CPU, 3-5x
            # too high on a GPU, where decoding is memory-bound, and the selector would then
            # never try one. So the first drafting round is tried at the length that would pay
            # if it cost a plain step; it teaches the costs what drafting costs here.
            n = best_draft_length([seconds[0]] * len(widths), tokens)
            if n and tokens[n] >= (1 + DRAFT_MARGIN) * tokens[0]:
                return n
        n = best_draft_length(seconds, tokens)
        if n and tokens[n] * seconds[0] < (1 + DRAFT_MARGIN) * tokens[0] * seconds[n]:
            return 0  # within the margin of a plain step (DRAFT_MARGIN)
        return n

    def choose_widths(self, found: list[int], remaining: list[float] | None = None) -> list[int]:
        """Per live sample, how many of its ``found`` history drafts a ragged round verifies
        (all 0: a plain step). Draft ``i`` of a sample adds ``prod_{j<=i} alpha_j``
        expected tokens (the history's acceptance by position), weighted by how much the
        sample decides when the rollout ends: ``remaining`` (the tokens each sample is
        expected to emit still) over the most any live sample has left (DAS's length-aware
        budget: a token gained by the sample that finishes last shortens the rollout, one
        gained by a sample about to finish does not; None: every sample weighs 1). The
        drafts are taken in order of that gain, as many as give the most weighted tokens
        per second, when that beats a plain step's by :data:`DRAFT_MARGIN`. A round costs a plain step at
        its batch plus what drafts have cost beyond one (:meth:`OnlineCosts.ragged_s`: the
        drafting rows' later positions and the round's own overhead). A sample's drafts
        are taken in order (a prefix), and samples with short or no proposals cost nothing
        extra. While no ragged round is measured, one is tried as if it cost a plain step.
        With a profiled cost table: the longest-proposal choice of :meth:`choose`, each
        sample verifying at most that many."""
        batch = len(found)
        if not isinstance(self.costs, OnlineCosts):
            n = self.choose(batch, found, max(found, default=0))
            return [min(f, n) for f in found]
        plain = self.costs.tokens_s(batch)
        if not plain or self.history is None:
            return [0] * batch  # measure a plain step first
        rates = self.history.rates()
        weights = _weights(remaining, batch)
        gains = []  # (weighted expected tokens added, position, sample)
        for r, f in enumerate(found):
            reach = weights[r]
            for i in range(f):
                reach *= rates[min(i, len(rates) - 1)]
                gains.append((reach, i, r))
        gains.sort(key=lambda g: (-g[0], g[1], g[2]))  # a sample's drafts stay in order
        plain_tokens = sum(weights)
        best, best_rate, tokens = 0, plain_tokens / plain, plain_tokens
        for k, (gain, _, _) in enumerate(gains, 1):
            tokens += gain
            # no ragged round measured yet: try one as if it cost a plain step
            seconds = self.costs.ragged_s(batch, k) or plain
            if tokens / seconds > best_rate:
                best, best_rate = k, tokens / seconds
        if best and best_rate < (1 + DRAFT_MARGIN) * plain_tokens / plain:
            best = 0  # within the margin of a plain step
        widths = [0] * batch
        for _, i, r in gains[:best]:
            widths[r] = max(widths[r], i + 1)
        return widths

    def observe(self, batch: int, n: int, seconds: float, accepted: torch.Tensor | None,
                found: torch.Tensor | None = None, drafts: int | None = None) -> None:
        """A measured round: refresh the latency correction and each source's acceptance
        (``found [live]``: the drafts of each sample that came from the history; ``drafts``:
        the drafts a ragged round verified in all, :meth:`choose_widths`)."""
        if isinstance(self.costs, OnlineCosts):  # the costs are the rounds: nothing to correct
            self.costs.observe(batch, n, seconds, drafts)
        elif (predicted := self.costs.round_s(batch, n)) > 0:
            key = (n, self._octave(batch))
            ratio = seconds / predicted
            old = self.correction.get(key)
            self.correction[key] = ratio if old is None else 0.7 * old + 0.3 * ratio
        if self.history is not None:
            self.history.observe(accepted if found is not None else None, n, hi=found)
        if self.acceptance is not None:
            self.acceptance.observe(accepted, n, lo=found)


def _weights(remaining: list[float] | None, batch: int) -> list[float]:
    """Per live sample, its ``remaining`` tokens over the most any has left (1 for all when
    nothing is predicted)."""
    top = max(remaining, default=0.0) if remaining is not None else 0.0
    if top <= 0:
        return [1.0] * batch
    return [max(m, 0.0) / top for m in remaining]


# ---------------------------------------------------------------------------- profiling
def profile_batches(max_batch: int) -> list[int]:
    """1, 4, 16, ... below ``max_batch``, and ``max_batch``."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 4
    return out + [max(max_batch, 1)]


def describe(actor, draft, graphs: bool = False) -> str:
    """What a profile depends on: the models' shapes, TP size, dtype and device, the decode
    attention backend and whether steps replay CUDA graphs."""
    def one(m):
        c = m.mrlhf_config
        w = m.embedding.word_embeddings.weight
        return (f"{c.num_layers}x{c.hidden_size}/{c.ffn_hidden_size} h{c.num_attention_heads}"
                f"/{c.num_query_groups} v{c.head_vocab_size or c.vocab_size}"
                f"{' feature' if c.feature_draft else ''} {w.dtype} {w.device.type}")
    from megatron_rlhf.generation.attention import default_backend

    tp = actor.pg_collection.tp.size()
    dev = actor.embedding.word_embeddings.weight.device
    return (f"actor {one(actor)}; draft {one(draft) if draft is not None else None}; tp {tp}"
            f"; {default_backend(dev)} attention" + ("; cuda graphs" if graphs else ""))


@torch.inference_mode()
def profile(actor, draft, max_n: int, max_batch: int, context: int = 64, repeats: int = 3,
            graphs: bool = False) -> CostTable:
    """Time one forward of the actor (``1..max_n+1`` tokens per sample) and of the draft
    (1 and 2) after ``context`` cached tokens, at :func:`profile_batches` ``(max_batch)``,
    the way the generator runs them (``graphs``: replayed CUDA graphs).
    Every rank of a TP group must call this together (the forwards all-reduce)."""
    from megatron_rlhf.generation.graphs import time_step

    batches = profile_batches(max_batch)
    table = CostTable(batches=batches, actor={}, draft={}, models=describe(actor, draft, graphs))
    for model, widths, out in ((actor, range(1, max_n + 2), table.actor), (draft, (1, 2), table.draft)):
        if model is None:
            continue
        for t in widths:
            out[t] = [time_step(model, b, t, context, repeats, graphs) / 1e3 for b in batches]
    return table


def load_or_profile(actor, draft, spec, max_batch: int, max_len: int, graphs: bool = False) -> CostTable:
    """``spec.cost_profile`` when it exists and describes these models; else a new profile
    (saved there by global rank 0 when a path is given)."""
    path = spec.cost_profile
    if path and Path(path).exists():
        table = CostTable.load(path)
        if table.models == describe(actor, draft, graphs):
            return table
    context = max(1, min(64, max_len - spec.max_draft_tokens - 2))
    table = profile(actor, draft, spec.max_draft_tokens, max_batch, context=context, graphs=graphs)
    if path and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
        table.save(path)
    return table
