"""History drafts of a round, looked up before its width is chosen.

Entry point: :func:`look_up` (one device-to-host copy of the rows' state) -> :class:`Lookup`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from megatron_rlhf.generation.rollout import GenerationStats
from megatron_rlhf.generation.state import Rows


@dataclass
class Lookup:
    """A round's history drafts, looked up before its width is chosen."""

    tokens: torch.Tensor  # [R, width] each row's proposal, padded (on the rows' device)
    found: list[int]  # per row, the tokens its proposal holds (0 for a finished row)
    alive: list[bool]  # per row, whether it was alive when looked up
    room: int  # drafts a round may feed every live row (its cache has room for them)
    remaining: list[float] | None = None  # per row, tokens its sample should still emit (None: unknown)

    def _of_live(self, per_row: list | None) -> list | None:
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
        """A round of ``n`` drafts' share of the history: ``tokens [R, n]`` and per row how
        many of them came from it (``found`` capped at ``n``, ``[R]``)."""
        found = torch.tensor([min(f, n) for f in self.found], dtype=torch.long, device=self.tokens.device)
        return self.tokens[:, :n], found


def count_history(stats: GenerationStats, ks: list[int], found: list[int]) -> None:
    """A round's history counts: ``ks`` drafts accepted per verifying row, of which those
    within the row's first ``found`` came from the history."""
    stats.history_verifications += len(ks)
    stats.history_drafted += sum(found)
    stats.history_accepted += sum(min(k, f) for k, f in zip(ks, found))


def look_up(call, rows: Rows) -> Lookup:
    """Each row's proposal of up to ``call.base_n`` tokens (a long-running sample's up to
    ``call.big_n``: :meth:`HistoryDrafter.max_tokens`), padded to ``big_n``. A narrower
    round verifies each proposal's head; the pad is verified like any draft."""
    n, width, out, pad_id = call.base_n, call.big_n, call.out, call.gen.pad_id
    start = time.perf_counter()
    history, cache = call.gen.history, rows.caches["actor"]
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
        tokens.append(prop + [pad_id] * (width - len(prop)))
        found.append(len(prop))
        remaining.append(left)
    call.stats.history_s += time.perf_counter() - start
    dev = rows["sid"].device
    return Lookup(torch.tensor(tokens, dtype=torch.long, device=dev).view(len(sids), width),
                  found, alive, max(room, n), remaining)
