"""Lossless speculative decoding as small pure functions, batch size > 1 from the start.

Per step the draft proposes ``n`` tokens per sample (a chain); the actor scores all
``n + 1`` positions in one forward; each sample keeps its accepted prefix plus one
corrected (on rejection) or bonus (all accepted) token. With ``p`` the actor's and ``q``
the draft's sampling distributions (same temperature/top-k/top-p), draft token ``x`` is
accepted with probability ``min(1, p(x)/q(x))``; on rejection the replacement is drawn
from ``normalise(max(p - q, 0))``. The emitted tokens are then distributed exactly as
plain sampling from ``p`` (Leviathan et al. 2023; Chen et al. 2023). Greedy decoding is
the special case of one-hot ``p`` and ``q``: accept while the draft equals the argmax.

:func:`accept_exact` is a stronger rule for a draft that proposes single tokens (a
history lookup, or a draft model's own draws): a drafted token is accepted iff it is the
token plain sampling would draw at that position with that position's keyed uniform, and
the first mismatch emits that drawn token. The emitted tokens are then those of
speculation off, token for token (given equal logits), not only equal in distribution;
the acceptance probability of a proposed ``x`` is ``p(x)``, as rejection sampling's is
for a deterministic proposal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rlhf.generation.sampling import draw


@dataclass
class Verdict:
    """What one verification decided, per sample."""

    accepted: torch.Tensor
    """``[B]`` number of draft tokens accepted (0..n)."""
    next_token: torch.Tensor
    """``[B]`` the corrected token (after a rejection) or the bonus token (all accepted)."""


def accept_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Greedy verification: ``draft_tokens [B, n]``, ``target_logits [B, n+1, V]``."""
    target = target_logits.argmax(-1)  # [B, n+1]
    return verdict_from_matches(draft_tokens == target[:, :-1], target)


def accept_exact(draft_tokens: torch.Tensor, p_probs: torch.Tensor, u_next: torch.Tensor) -> Verdict:
    """Exact verification: ``draft_tokens [B, n]``, ``p_probs [B, n+1, V]`` the actor's
    sampling distributions, ``u_next [B, n+1]`` the uniforms plain sampling draws each
    position's token with. Accept drafts while each equals the token drawn at its position;
    emit the drawn token at the first mismatch (or the bonus after all ``n``)."""
    drawn = draw(p_probs, u_next)  # [B, n+1]: plain sampling's tokens at these positions
    return accept_drawn(draft_tokens, drawn)


def accept_drawn(draft_tokens: torch.Tensor, drawn: torch.Tensor, widths: torch.Tensor | None = None) -> Verdict:
    """The rule of :func:`accept_exact` given the drawn tokens: ``draft_tokens [B, n]``,
    ``drawn [B, n+1]`` the token plain sampling draws at each position (the argmax when
    greedy). ``widths [B]``: the drafts row ``b`` verifies, its first ``widths[b]`` (a
    ragged round; the rest is padding, never accepted, and ``drawn`` there is not read);
    default all ``n``."""
    ok = draft_tokens == drawn[:, :-1]
    if widths is not None:
        ok &= torch.arange(ok.shape[1], device=ok.device) < widths[:, None]
    return verdict_from_matches(ok, drawn)


def verdict_from_matches(ok: torch.Tensor, replacement: torch.Tensor) -> Verdict:
    """``ok [B, n]`` per-position acceptance; ``replacement [B, n+1]`` token after each prefix."""
    accepted = ok.long().cumprod(-1).sum(-1)  # length of the all-accepted prefix
    next_token = replacement.gather(-1, accepted[:, None])[:, 0]
    return Verdict(accepted=accepted, next_token=next_token)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``normalise(max(p - q, 0))`` over the last dim; falls back to ``p`` where it is all zero."""
    r = (p - q).clamp(min=0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp(min=1e-30), p)


def accept_sampling(draft_tokens: torch.Tensor, q_probs: torch.Tensor, p_probs: torch.Tensor,
                    u_accept: torch.Tensor, u_next: torch.Tensor) -> Verdict:
    """Rejection sampling: ``draft_tokens [B, n]``, ``q_probs [B, n, V]``, ``p_probs [B, n+1, V]``.

    ``q_probs``/``p_probs`` are the draft's and actor's *sampling* distributions (after
    temperature, top-k, top-p: the draft's are those its tokens were drawn from).
    ``u_accept [B, n]``: the uniform of each position's acceptance test; ``u_next [B, n+1]``:
    the uniform of the token drawn after ``j`` accepted drafts. One replacement is drawn per
    sample, from the residual at its first rejected position (or from ``p`` after all ``n``
    accepted: the bonus token).
    """
    b, n = draft_tokens.shape
    p_x = p_probs[:, :n].gather(-1, draft_tokens[..., None])[..., 0]  # [B, n]
    q_x = q_probs.gather(-1, draft_tokens[..., None])[..., 0]
    ok = u_accept * q_x < p_x  # u < p/q without dividing; q(x) > 0 for any drafted x
    accepted = ok.long().cumprod(-1).sum(-1)  # [B]
    rows = torch.arange(b, device=p_x.device)
    p_row = p_probs[rows, accepted]  # [B, V]
    q_row = torch.cat([q_probs, torch.zeros_like(q_probs[:, :1])], 1)[rows, accepted]  # 0 after n
    u = u_next.gather(-1, accepted[:, None])[:, 0]
    return Verdict(accepted=accepted, next_token=draw(residual_distribution(p_row, q_row), u))
