"""Lossless speculative verification as pure functions: each sample keeps its accepted
prefix of ``n`` drafts plus one corrected or bonus token. :func:`accept_sampling`: rejection
sampling (Leviathan et al. 2023); :func:`accept_exact`: a draft is accepted iff it is the
token plain sampling draws there, so the tokens are speculation off's; :func:`accept_greedy`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rlhf.generation.sampling import draw


@dataclass
class Verdict:
    """What one verification decided, per sample."""

    accepted: torch.Tensor  # [B] draft tokens accepted (0..n)
    next_token: torch.Tensor  # [B] the corrected token (after a rejection) or the bonus token


def accept_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Greedy verification: ``draft_tokens [B, n]``, ``target_logits [B, n+1, V]``."""
    target = target_logits.argmax(-1)  # [B, n+1]
    return verdict_from_matches(draft_tokens == target[:, :-1], target)


def accept_exact(draft_tokens: torch.Tensor, p_probs: torch.Tensor, u_next: torch.Tensor) -> Verdict:
    """Exact verification: ``draft_tokens [B, n]``, the actor's sampling distributions
    ``p_probs [B, n+1, V]`` and plain sampling's uniforms ``u_next [B, n+1]``."""
    drawn = draw(p_probs, u_next)  # [B, n+1]: plain sampling's tokens at these positions
    return accept_drawn(draft_tokens, drawn)


def accept_drawn(draft_tokens: torch.Tensor, drawn: torch.Tensor, widths: torch.Tensor | None = None) -> Verdict:
    """:func:`accept_exact` given plain sampling's tokens ``drawn [B, n+1]``; ``widths [B]``:
    row ``b`` verifies its first ``widths[b]`` drafts only (default all ``n``)."""
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
    """Rejection sampling of ``draft_tokens [B, n]`` under the draft's and the actor's sampling
    distributions ``q_probs [B, n, V]``, ``p_probs [B, n+1, V]``, with acceptance uniforms
    ``u_accept [B, n]`` and next-token uniforms ``u_next [B, n+1]``."""
    # x is accepted with probability min(1, p(x)/q(x)); one replacement per sample is drawn
    # from normalise(max(p - q, 0)) at its first rejection, or from p after all n (the bonus)
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
