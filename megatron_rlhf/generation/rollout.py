"""The typed result of generation: :class:`Rollout` and its :class:`GenerationStats`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class GenerationStats:
    """Work done and, under speculation, how much of the draft the actor accepted."""

    num_draft_tokens: int = 0  # Largest draft length a verification could take (0: plain decoding).
    mode: str = "plain"  # plain, fixed (one draft length) or auto (the selector's choice per round).
    # [N+1]: rounds run with n draft tokens (index 0: plain steps).
    rounds_by_draft_len: list[int] = field(default_factory=list)
    # [N]: sample-verifications whose draft reached position i (n > i).
    drafted_per_position: list[int] = field(default_factory=list)
    actor_steps: int = 0  # Actor forwards after prefill (decode steps or verifications).
    draft_steps: int = 0  # Draft forwards after prefill.
    verifications: int = 0  # Sample-verifications: one per live sample per actor step under speculation.
    # [n]: how many verifications accepted at least i+1 draft tokens.
    accepted_per_position: list[int] = field(default_factory=list)
    new_tokens: int = 0  # Tokens emitted over all samples.
    # Sample-verifications whose drafts came (also) from the rollout's history.
    history_verifications: int = 0
    history_drafted: int = 0  # Draft tokens the history proposed (live samples).
    history_accepted: int = 0  # Of those, the tokens the actor accepted.
    history_s: float = 0.0  # Wall time spent looking drafts up in the history.
    elapsed_s: float = 0.0  # Wall time of the whole call, prefill included.
    prefill_s: float = 0.0  # Wall time of the prefill (actor and draft).
    # how decode steps ran: the attention backend and cuda graphs, eager graph code or dynamic
    # (with the reason when a capture failed)
    decode: str = ""
    # wall time capturing CUDA graphs in this call (in elapsed_s; graphs are kept for the next call)
    graph_capture_s: float = 0.0
    graph_captures: int = 0  # graphs made in this call: 0 when every bucket's graph was kept
    migrated_out: int = 0  # Samples this rank sent to another data-parallel rank.
    migrated_in: int = 0  # Samples this rank received.
    migration_bytes: int = 0  # Bytes this rank sent or received when moving samples (KV caches included).
    migration_s: float = 0.0  # Wall time spent packing, moving and unpacking samples.
    sync_s: float = 0.0  # Wall time in the exchanges of live counts (waiting for the other ranks included).
    idle_s: float = 0.0  # Wall time with no live sample on this rank before the rollout ended everywhere.

    @property
    def accepted_tokens(self) -> int:
        return sum(self.accepted_per_position)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per sample-verification: accepted draft tokens + 1."""
        if not self.verifications:
            return 1.0
        return 1.0 + self.accepted_tokens / self.verifications

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.elapsed_s if self.elapsed_s else 0.0

    def add(self, other: "GenerationStats") -> None:
        """Accumulate ``other`` (another batch, or another rank's totals) into this one."""
        self.actor_steps += other.actor_steps
        self.draft_steps += other.draft_steps
        self.verifications += other.verifications
        self.new_tokens += other.new_tokens
        self.elapsed_s += other.elapsed_s
        self.prefill_s += other.prefill_s
        for name in ("migrated_out", "migrated_in", "migration_bytes", "migration_s", "sync_s",
                     "idle_s", "history_verifications", "history_drafted", "history_accepted", "history_s",
                     "graph_capture_s", "graph_captures"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("accepted_per_position", "drafted_per_position", "rounds_by_draft_len"):
            mine, theirs = getattr(self, name), getattr(other, name)
            width = max(len(mine), len(theirs))
            setattr(self, name, [(mine[i] if i < len(mine) else 0) + (theirs[i] if i < len(theirs) else 0)
                                 for i in range(width)])
        self.num_draft_tokens = max(self.num_draft_tokens, other.num_draft_tokens)
        if other.mode != "plain":
            self.mode = other.mode
        self.decode = self.decode or other.decode

    def count_accepted(self, accepted: list[int], n: int, widths: list[int] | None = None) -> None:
        """A verification of ``n`` drafts: ``accepted`` drafts per live sample (host ints);
        ``widths``: the drafts each of them verified (a ragged round; default ``n`` each)."""
        self.verifications += len(accepted)
        widths = [n] * len(accepted) if widths is None else widths
        for i in range(n):
            self.accepted_per_position[i] += sum(k > i for k in accepted)
            self.drafted_per_position[i] += sum(k >= i and w > i for k, w in zip(accepted, widths))

    @property
    def acceptance_per_position(self) -> list[float]:
        """Per draft position, the fraction of the drafts that reached it that were accepted."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def to_dict(self) -> dict:
        return {
            "num_draft_tokens": self.num_draft_tokens, "actor_steps": self.actor_steps,
            "draft_steps": self.draft_steps, "verifications": self.verifications,
            "accepted_per_position": self.accepted_per_position, "new_tokens": self.new_tokens,
            "elapsed_s": self.elapsed_s, "prefill_s": self.prefill_s,
            "mean_accepted_length": self.mean_accepted_length,
            "tokens_per_s": self.tokens_per_s, "mode": self.mode,
            "rounds_by_draft_len": self.rounds_by_draft_len,
            "drafted_per_position": self.drafted_per_position,
            "acceptance_per_position": self.acceptance_per_position,
            "migrated_out": self.migrated_out, "migrated_in": self.migrated_in,
            "migration_bytes": self.migration_bytes, "migration_s": self.migration_s,
            "sync_s": self.sync_s, "idle_s": self.idle_s,
        }


@dataclass
class Rollout:
    """Responses to a batch of prompts, with what PPO needs about them."""

    prompt_ids: list[list[int]]  # B prompts, unpadded.
    response_ids: torch.Tensor  # [B, T] generated tokens, right-padded with pad_id.
    # [B, T] log pi_actor(token) at temperature 1, unmodified distribution; 0 at padding.
    response_logprobs: torch.Tensor
    # [B, T] log-prob under the distribution actually sampled from; 0 at padding.
    sampling_logprobs: torch.Tensor
    lengths: torch.Tensor  # [B] response lengths (EOS included).
    finish_reasons: list[str]  # B of "eos" or "length".
    stats: GenerationStats  # Throughput and acceptance statistics.
    # An MoE actor's routes of each sample's fed tokens (prompt, then the response but its
    # last token, which a verification may have fed too): B of [n, layers, k] int16 on the
    # host (models.routing); None for a dense actor.
    routes: list | None = None

    def responses(self) -> list[list[int]]:
        return [self.response_ids[i, : int(n)].tolist() for i, n in enumerate(self.lengths)]
