"""Model-free drafts from the rollout's own history (SuffixDecoding, DAS, SPEC-RL).

Entry point: :class:`HistoryDrafter`: a draft continues a sample's latest tokens as they
occurred in its prompt, its siblings and earlier answers (by the longest n-gram match of an
:class:`NgramIndex`). Invariant: under exact verification it changes no token.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from megatron_rlhf.config import HISTORY_LONG_BOOST

LENGTHS_KEPT = 1024  # response lengths (any prompt) kept for HistoryDrafter.remaining


class NgramIndex:
    """Continuation counts of the n-grams (1..``max_match`` tokens) of a set of documents:
    ``table[ngram] = [total, {token: count}]``. Raises ValueError when ``max_match < 1``."""

    def __init__(self, max_match: int):
        if max_match < 1:
            raise ValueError(f"max_match must be >= 1, got {max_match}")
        self.max_match = max_match
        self.table: dict[tuple, list] = {}

    def add(self, doc: list[int], start: int = 0, sign: int = 1) -> None:
        """Count the continuations ``doc[i]`` for ``i >= start`` (``sign`` -1: forget them)."""
        k_max, table = self.max_match, self.table
        for i in range(max(start, 1), len(doc)):
            tok = doc[i]
            for k in range(1, min(k_max, i) + 1):
                key = tuple(doc[i - k:i])
                entry = table.get(key)
                if entry is None:
                    if sign < 0:
                        continue
                    entry = table[key] = [0, {}]
                counts = entry[1]
                c = counts.get(tok, 0) + sign
                if c > 0:
                    counts[tok] = c
                else:
                    counts.pop(tok, None)
                entry[0] += sign
                if entry[0] <= 0:
                    del table[key]

    def next_token(self, context: list[int]) -> tuple[int, float, int] | None:
        """``(token, frequency, match length)`` continuing the longest held n-gram ending
        ``context`` (ties: the smaller token), or None."""
        table = self.table
        for k in range(min(self.max_match, len(context)), 0, -1):
            entry = table.get(tuple(context[-k:]))
            if entry is not None:
                total, counts = entry
                tok, c = min(counts.items(), key=lambda kv: (-kv[1], kv[0]))
                return tok, c / total, k
        return None

    def __len__(self) -> int:
        return len(self.table)


@dataclass
class _Live:
    """A sample being generated: its document (prompt, then response), indexed up to ``indexed``."""

    history: "_PromptHistory"
    doc: list[int]
    indexed: int


class _PromptHistory:
    """One prompt's index: the prompt, its earlier responses and this rollout's."""

    def __init__(self, prompt: tuple[int, ...], max_match: int):
        self.prompt = prompt
        self.index = NgramIndex(max_match)
        self.index.add(list(prompt))
        self.responses: deque[list[int]] = deque()  # finished prompt + response documents, oldest first

    def lengths(self) -> list[int]:  # the kept responses' lengths after the prompt
        return [len(doc) - len(self.prompt) for doc in self.responses]


class HistoryDrafter:
    """Drafts for a generator's live samples from the history of their prompts: the
    generator calls :meth:`begin`, :meth:`extend`, :meth:`propose` and :meth:`finish`.
    Raises ValueError on an out-of-range setting."""

    def __init__(self, max_match: int = 8, max_responses: int = 16, max_prompts: int = 4096,
                 min_confidence: float = 0.3, long_boost: int = HISTORY_LONG_BOOST, long_after: int = 256,
                 global_responses: int = 0, global_min_match: int = 3):
        for name, v in (("max_match", max_match), ("max_responses", max_responses),
                        ("max_prompts", max_prompts), ("global_min_match", global_min_match)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if global_responses < 0:
            raise ValueError(f"global_responses must be >= 0, got {global_responses}")
        self.global_responses, self.global_min_match = global_responses, global_min_match
        # continuations in the newest global_responses responses to any prompt (None: off)
        self.global_index = NgramIndex(max_match) if global_responses else None
        self.global_docs: deque[list[int]] = deque()
        if not 0 <= min_confidence <= 1:
            raise ValueError(f"min_confidence must lie in [0, 1], got {min_confidence}")
        self.max_match, self.max_responses, self.max_prompts = max_match, max_responses, max_prompts
        self.min_confidence, self.long_boost, self.long_after = min_confidence, long_boost, long_after
        self.prompts: OrderedDict[tuple, _PromptHistory] = OrderedDict()
        self.live: dict[int, _Live] = {}
        self.lengths: deque[int] = deque(maxlen=LENGTHS_KEPT)  # newest responses' lengths, any prompt

    # ------------------------------------------------------------------ samples
    def begin(self, sample: int, prompt: list[int], response: list[int] = ()) -> None:
        """Start drafting for global sample ``sample`` answering ``prompt``; a migrated sample
        arrives with its ``response`` so far (what was held of it before is forgotten)."""
        self.drop(sample)
        key = tuple(prompt)
        history = self.prompts.get(key)
        if history is None:
            history = self.prompts[key] = _PromptHistory(key, self.max_match)
        else:
            self.prompts.move_to_end(key)
        doc = list(prompt) + list(response)
        self.live[sample] = _Live(history, doc, len(prompt))
        self._index(self.live[sample])
        self._trim_prompts()

    def emitted(self, sample: int) -> int | None:
        """The tokens of ``sample``'s response this drafter holds (None: not live here)."""
        live = self.live.get(sample)
        return None if live is None else len(live.doc) - len(live.history.prompt)

    def drop(self, sample: int) -> None:
        """Forget a live ``sample`` without keeping its response (it finished elsewhere)."""
        live = self.live.pop(sample, None)
        if live is not None:
            live.history.index.add(live.doc[:live.indexed], start=len(live.history.prompt), sign=-1)

    def drop_live(self) -> None:
        """:meth:`drop` every live sample (what a finished rollout left behind)."""
        for sample in list(self.live):
            self.drop(sample)

    def _index(self, live: _Live) -> None:
        if live.indexed < len(live.doc):
            live.history.index.add(live.doc, start=live.indexed)
            live.indexed = len(live.doc)

    def extend(self, sample: int, tokens: list[int]) -> None:
        """``sample`` emitted ``tokens`` (indexed now: its siblings draft from them)."""
        live = self.live.get(sample)
        if live is not None:
            live.doc.extend(tokens)
            self._index(live)

    def finish(self, sample: int, response: list[int] | None = None) -> None:
        """``sample`` is done: its response joins its prompt's history (beyond ``max_responses``
        the oldest is forgotten). ``response``: the whole of it, when only its start was seen here."""
        if response is not None and sample in self.live:
            live = self.live[sample]
            start = len(live.history.prompt)
            if list(response[:len(live.doc) - start]) != live.doc[start:]:  # not what it held: anew
                self.begin(sample, list(live.history.prompt))
            self.extend(sample, list(response[self.emitted(sample):]))
        live = self.live.pop(sample, None)
        if live is None:
            return
        history = live.history
        self._index(live)
        history.responses.append(live.doc)
        self.lengths.append(len(live.doc) - len(history.prompt))
        while len(history.responses) > self.max_responses:  # forget what the oldest added
            history.index.add(history.responses.popleft(), start=len(history.prompt), sign=-1)
        if self.global_index is not None:
            response = live.doc[len(history.prompt):]
            self.global_index.add(response)
            self.global_docs.append(response)
            while len(self.global_docs) > self.global_responses:
                self.global_index.add(self.global_docs.popleft(), sign=-1)
        self._trim_prompts()

    def _trim_prompts(self) -> None:
        # forget the least recently used prompts beyond max_prompts (not one in use)
        in_use = {id(live.history) for live in self.live.values()}
        for key in list(self.prompts):
            if len(self.prompts) <= self.max_prompts:
                break
            if id(self.prompts[key]) not in in_use:
                del self.prompts[key]

    # ------------------------------------------------------------------ drafting
    def max_tokens(self, sample: int, n: int) -> int:
        """The most tokens ``sample`` may draft in a round of width ``n`` (DAS: more when it runs long)."""
        return n * self.long_boost if self.emitted(sample) >= self.long_after else n

    def remaining(self, sample: int, limit: int) -> float:
        """The tokens ``sample`` is expected to emit still, at most ``limit``."""
        # the mean excess of its prompt's earlier responses that ran longer, else of any
        # prompt's newest; a sample longer than all of them is expected to run as long again
        emitted = self.emitted(sample)
        for pool in (self.live[sample].history.lengths(), self.lengths):
            longer = [n - emitted for n in pool if n > emitted]
            if longer:
                return float(min(sum(longer) / len(longer), limit))
        return float(min(max(emitted, 1), limit))

    def propose(self, sample: int, n: int) -> list[int]:
        """Up to ``n`` draft tokens continuing ``sample``'s document (fewer where not confident)."""
        live = self.live[sample]
        self._index(live)
        index = live.history.index
        context = live.doc[-self.max_match:]
        out: list[int] = []
        confidence = 1.0
        while len(out) < n:
            found = index.next_token(context)
            if self.global_index is not None:  # the longer match of the two (ties: the prompt's)
                other = self.global_index.next_token(context)
                if other is not None and other[2] >= self.global_min_match and (found is None or other[2] > found[2]):
                    found = other
            if found is None:
                break
            tok, freq, _ = found
            confidence *= freq
            if confidence < self.min_confidence:
                break
            out.append(tok)
            context = (context + [tok])[-self.max_match:]
        return out

    def stats(self) -> dict:
        """The history's size: prompts, responses and n-grams held."""
        return {"prompts": len(self.prompts),
                "responses": sum(len(h.responses) for h in self.prompts.values()),
                "ngrams": sum(len(h.index) for h in self.prompts.values()),
                "global_responses": len(self.global_docs),
                "global_ngrams": len(self.global_index) if self.global_index is not None else 0}
