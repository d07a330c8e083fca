"""The workload-aware drafting selector (RLHFSpec): before every round, plain decoding or
``n`` drafts, whichever promises the most emitted tokens per second for the live batch,
``E[tokens | n] = 1 + sum_{j<n} prod_{i<=j} alpha_i``. Entry point: :class:`Selector`.
Invariant: whatever it picks a round is lossless; it only sets how many tokens are proposed.
"""

from __future__ import annotations

import math

import torch

from megatron_rlhf.generation.costs import CostTable, OnlineCosts, load_or_profile, profile

__all__ = ["Acceptance", "CostTable", "OnlineCosts", "Selector", "best_draft_length", "expected_tokens_mixed",
           "load_or_profile", "profile"]  # the cost names: imported from here by tests

# A draft length must promise this much more than a plain step: near break-even the
# estimates' noise (round times vary from round to round) decides, and a wrong guess there
# loses what a right one gains (docs/benchmarks.md: the selector's margin)
DRAFT_MARGIN = 0.1
EXPLORATION = 0.3  # acceptance bonus EXPLORATION / sqrt(1 + tried) of a position tried that often


def best_draft_length(round_s: list[float], expected_tokens: list[float]) -> int:
    """The ``n`` with the most expected tokens per second (ties: the smaller ``n``)."""
    rates = [e / max(s, 1e-12) for e, s in zip(expected_tokens, round_s)]
    return max(range(len(rates)), key=lambda n: (rates[n], -n))


class Acceptance:
    """Per draft position ``i``, ``alpha_i`` = accepted / tried over recent rounds (decayed
    by ``decay`` a round), starting from ``prior`` weighted as ``prior_weight`` verifications."""

    def __init__(self, max_n: int, decay: float, prior: float = 0.5, prior_weight: float = 2.0):
        self.decay = decay
        self.tried = [prior_weight] * max_n
        self.passed = [prior * prior_weight] * max_n

    def observe(self, accepted: torch.Tensor | None, n: int, lo: torch.Tensor | None = None,
                hi: torch.Tensor | None = None) -> None:
        """A round: ``accepted [live]`` drafts accepted per sample (None: a plain step);
        this source drafted positions ``lo <= i < hi [live]`` of each (default: all ``n``)."""
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
    ``found[r]`` drafts come from the history (acceptance ``history``) and the rest from the
    draft model (acceptance ``model``; None: padding, never counted on)."""
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
    """Chooses each round's draft length from ``costs`` and each source's acceptance:
    ``acceptance`` the draft model's, ``history`` the history's (None: no such source)."""

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
        """Predicted round latency: online, or the profile corrected by the most alike rounds."""
        if isinstance(self.costs, OnlineCosts):
            return self.costs.round_s(batch, n)
        return self.costs.round_s(batch, n) * self.factor(n, self._octave(batch))

    def factor(self, n: int, octave: int) -> float:
        """The measured/profiled ratio for ``n`` drafts at ``octave``, else at the nearest
        octave, else of rounds of the same kind (plain or drafting) at ``octave``, else 1."""
        if (n, octave) in self.correction:
            return self.correction[(n, octave)]
        same_n = [(abs(o - octave), f) for (m, o), f in self.correction.items() if m == n]
        if same_n:
            return min(same_n)[1]
        kind = [f for (m, o), f in self.correction.items() if o == octave and (m > 0) == (n > 0)]
        return sum(kind) / len(kind) if kind else 1.0

    def expected_tokens(self, n: int, found: list[int] | None = None) -> float:
        """Tokens per sample a round of ``n`` drafts is expected to emit; ``found``: per live
        sample, the drafts its history proposes (the model fills the rest, if any)."""
        if found is None or self.history is None:
            return self.acceptance.expected_tokens(n)
        model = self.acceptance.rates() if self.acceptance is not None else None
        return expected_tokens_mixed(n, found, self.history.rates(), model)

    def choose(self, batch: int, found: list[int] | None = None, widest: int | None = None) -> int:
        """The draft length (0: a plain step) with the most expected tokens per second for
        ``batch`` live samples, at most ``widest`` (default ``max_n``)."""
        widths = range((self.max_n if widest is None else widest) + 1)
        seconds = [self.round_s(batch, n) for n in widths]
        tokens = [self.expected_tokens(n, found) for n in widths]
        if isinstance(self.costs, OnlineCosts) and seconds[0] > 0 and self.costs.guessing():
            # No drafting round measured, and the prior prices a verification of n + 1 tokens
            # like n + 1 plain steps: right on a CPU, far too high on a memory-bound GPU, where
            # the selector would then never try one. So the first drafting round is tried as if
            # it cost a plain step; it teaches the costs what drafting costs here.
            n = best_draft_length([seconds[0]] * len(widths), tokens)
            if n and tokens[n] >= (1 + DRAFT_MARGIN) * tokens[0]:
                return n
        n = best_draft_length(seconds, tokens)
        if n and tokens[n] * seconds[0] < (1 + DRAFT_MARGIN) * tokens[0] * seconds[n]:
            return 0  # within the margin of a plain step (DRAFT_MARGIN)
        return n

    def choose_widths(self, found: list[int], remaining: list[float] | None = None) -> list[int]:
        """Per live sample, how many of its ``found`` history drafts a ragged round verifies
        (all 0: a plain step). ``remaining``: the tokens each sample should still emit (None:
        all weigh 1). With a profiled table: :meth:`choose`'s length, capped per sample."""
        # Draft i of a sample adds prod_{j<=i} alpha_j expected tokens, weighted by the
        # sample's remaining tokens over the most any has left (DAS's length-aware budget:
        # a token gained by the sample that finishes last shortens the rollout). Drafts are
        # taken in order of gain, as many as give the most weighted tokens per second, priced
        # as a plain step plus what drafts have cost beyond one (OnlineCosts.ragged_s).
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
        (``found [live]``: each sample's drafts from the history; ``drafts``: a ragged round's total)."""
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
    """Per live sample, its ``remaining`` tokens over the most any has left (None: all 1)."""
    top = max(remaining, default=0.0) if remaining is not None else 0.0
    if top <= 0:
        return [1.0] * batch
    return [max(m, 0.0) / top for m in remaining]
