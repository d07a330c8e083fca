"""DAPO's dynamic sampling (``--filter-groups``): train only on prompt groups with a signal.

A group whose scores are all equal (the reward function's, before the overlong penalty:
``ExperienceMaker.score``) tells right from wrong in none of its answers. Such groups are
dropped (:class:`GroupFilter`) and more prompts are drawn, round after round, until every
data-parallel rank holds its share or ``filter_max_tries`` rounds have run; a batch still
short is filled with dropped groups (counted). A group stays on the rank that
made it; every rank runs as many rounds as the slowest needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_rlhf import runtime
from megatron_rlhf.data import padding
from megatron_rlhf.generation.rollout import GenerationStats, Rollout


def informative_groups(scores: torch.Tensor, n: int) -> list[bool]:
    """Per group of ``n`` consecutive samples: whether its ``scores`` are not all equal."""
    # Judged before the overlong penalty, as DAPO: wrong answers of different lengths inside
    # the buffer differ in reward by length alone, and divided by their small std, their
    # advantages are as large as right against wrong ((n-1)/sqrt(n) for one of n: 1.5 at n=4).
    groups = scores.detach().float().cpu().view(-1, n)
    return (groups.max(dim=1).values > groups.min(dim=1).values).tolist()


def gather_rollout(parts: list[Rollout], picks: list[tuple[int, int]], pad_id: int) -> Rollout:
    """One rollout of the rows ``picks`` (``(part, row)`` pairs, in order) of ``parts``;
    its statistics are the sum of every part's (all of them were generated)."""
    rows = [(parts[p], i) for p, i in picks]
    lengths = [int(r.lengths[i]) for r, i in rows]
    dev = runtime.device()
    width = max([1] + lengths)

    def padded(name: str, fill, dtype) -> torch.Tensor:
        return padding.padded([getattr(r, name)[i, :n].tolist() for (r, i), n in zip(rows, lengths)],
                                      fill, dtype, dev, width)

    stats = GenerationStats()
    for part in parts:
        stats.add(part.stats)
    return Rollout(prompt_ids=[list(r.prompt_ids[i]) for r, i in rows],
                   response_ids=padded("response_ids", pad_id, torch.long),
                   response_logprobs=padded("response_logprobs", 0.0, torch.float32),
                   sampling_logprobs=padded("sampling_logprobs", 0.0, torch.float32),
                   lengths=torch.tensor(lengths, device=dev),
                   finish_reasons=[r.finish_reasons[i] for r, i in rows], stats=stats,
                   routes=[r.routes[i] for r, i in rows] if rows and rows[0][0].routes is not None else None)


@dataclass
class GroupFilter:
    """Collects ``need`` informative groups of ``n`` samples over generation rounds on one rank."""

    need: int
    n: int
    parts: list = field(default_factory=list)
    kept: list = field(default_factory=list)  # (part, first row, scores [n]) in the order found
    dropped: list = field(default_factory=list)
    columns: list = field(default_factory=list)  # per part: the columns given to add()
    rounds: int = 0

    def add(self, rollout: Rollout, scores: torch.Tensor, columns: tuple) -> None:
        """One round: its rollout, ``scores`` [B] (unshaped) and per-sample column lists (ids,
        texts, ...)."""
        part = len(self.parts)
        self.parts.append(rollout)
        self.columns.append(columns)
        self.rounds += 1
        for g, keep in enumerate(informative_groups(scores, self.n)):
            entry = (part, g * self.n, scores[g * self.n:(g + 1) * self.n])
            (self.kept if keep else self.dropped).append(entry)

    @property
    def short(self) -> int:
        """Informative groups still missing on this rank."""
        return max(self.need - len(self.kept), 0)

    def batch(self, pad_id: int):
        """``(rollout, scores [need*n], columns, metrics)``: the first ``need`` informative
        groups, topped up with dropped ones when short; metrics are this rank's counts."""
        chosen = self.kept[:self.need] + self.dropped[:self.short]
        picks = [(part, first + j) for part, first, _ in chosen for j in range(self.n)]
        rollout = gather_rollout(self.parts, picks, pad_id)
        columns = tuple([self.columns[part][c][row] for part, row in picks]
                        for c in range(len(self.columns[0])))
        scores = torch.cat([s for _, _, s in chosen])
        return rollout, scores, columns, {
            "filter_kept_groups": float(min(len(self.kept), self.need)),
            "filter_dropped_groups": float(len(self.dropped)),
            "filter_filled_groups": float(self.short),
        }
