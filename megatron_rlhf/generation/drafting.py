"""The draft model's side of a round: its catch-up buffer and its proposals.

The draft cache lags the actor's; the tokens it lacks wait per row in ``catch_tokens``
(``pending`` last) and are fed at the next drafting round. Entry points: :func:`propose`,
:func:`buffer`. Invariant: after :func:`propose` the draft cache holds the caught-up tokens.
"""

from __future__ import annotations

import time

import torch

from megatron_rlhf.generation import rng
from megatron_rlhf.generation.graphs import CATCH_UP_MAX
from megatron_rlhf.generation.incremental import forward_cached
from megatron_rlhf.generation.sampling import sample
from megatron_rlhf.generation.state import Rows


def propose(call, rows: Rows, n: int, history=None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The draft's ``n`` proposals ``[R]`` each and their sampling distributions: catch up,
    then draft on its own outputs. ``history``: ``(tokens [R, n], found [R])``: the history's
    token replaces the draft's at a row's first ``found`` positions (and is what it reads)."""
    gen = call.gen
    d_cache = rows.caches["draft"]
    # exact verification: the draft draws with the uniform the actor's token at that
    # position is drawn with, so a draft near the actor proposes the actor's very token;
    # rejection sampling needs a uniform of its own
    stream = rng.NEXT if call.verify == "exact" else rng.DRAFT
    logits, hidden = catch_up(call, rows)
    caught_up = d_cache.lengths.clone()
    sid, emitted = rows["sid"], rows["emitted"]
    drafts, q_probs = [], []
    for i in range(n):
        tok, q = sample(logits[:, -1], call.cfg, rng.uniform(call.key, sid, emitted + i, stream))
        if history is not None:
            tok = torch.where(i < history[1], history[0][:, i], tok)
        drafts.append(tok)
        q_probs.append(q)
        if i + 1 < n:
            kw = dict(features=hidden, return_features=True) if gen.feature_draft else {}
            res = call.forward("draft", gen.draft, d_cache, tok[:, None], call.d_rope, **kw)
            logits, hidden = res if gen.feature_draft else (res, None)
    d_cache.truncate(caught_up)
    return drafts, q_probs


def buffer(call, rows: Rows, tok: torch.Tensor, hidden: torch.Tensor | None) -> None:
    """Append ``tok [R]`` (and its actor hidden state ``[R, h]``) to the catch-up buffer;
    at :data:`~megatron_rlhf.generation.graphs.CATCH_UP_MAX` columns, feed the draft all but the last."""
    count = rows["catch_count"]
    # every row's count fits its buffer: one more column holds the new token, with no host
    # read of the counts. The buffer may be wider than the counts need (a round's drafts,
    # rows compacted away), never past CATCH_UP_MAX: the draft cache has that many to spare.
    width = rows["catch_tokens"].shape[1] + 1
    r = torch.arange(len(count), device=count.device)
    for name, new in (("catch_tokens", tok), ("catch_features", hidden)):
        if name in rows:
            old = rows[name]
            grown = old.new_full((old.shape[0], width, *old.shape[2:]), call.gen.pad_id if new is tok else 0)
            grown[:, : old.shape[1]] = old
            grown[r, count] = new.to(grown.dtype)
            rows[name] = grown
    rows["catch_count"] = count + 1
    if width >= CATCH_UP_MAX:
        # the draft's upkeep costs the same whatever the selector picks: timed apart, so
        # that the plain step that happens to pay it is not judged by it
        start = time.perf_counter()
        catch_up(call, rows, keep_last=True)
        call.upkeep_s += time.perf_counter() - start


def catch_up(call, rows: Rows, keep_last: bool = False):
    """Feed the draft its buffered tokens (each row's own count, padded); returns its logits
    after the last of them ``[R, 1, V]`` and, for a feature draft, its hidden state there
    ``[R, 1, h]`` (else None). ``keep_last``: leave each row's last token buffered (returns None)."""
    gen = call.gen
    d_cache, alive = rows.caches["draft"], rows["alive"]
    d_cache.lengths[~alive] = 0
    count = torch.where(alive, rows["catch_count"], 1)
    fed = (count - 1).clamp(min=0) if keep_last else count
    tokens = rows["catch_tokens"]
    width = tokens.shape[1]
    kw = {}
    if gen.feature_draft:
        kw = dict(features=rows["catch_features"], return_features=True)
    last = (fed - 1).clamp(min=0)
    res = forward_cached(gen.draft, d_cache, tokens, call.d_rope, last_index=last,
                         valid=fed.clamp(min=1), backend=call.backend, **kw)
    d_cache.truncate(d_cache.lengths - width + fed)
    r = torch.arange(len(count), device=count.device)
    if keep_last:  # the buffer keeps each row's last token only
        for name in ("catch_tokens", "catch_features"):
            if name in rows:
                rows[name] = rows[name][r, (count - 1).clamp(min=0)][:, None]
        rows["catch_count"] = torch.where(count > 0, 1, 0)
        return None
    if gen.feature_draft:
        logits, hidden = res
        return logits, hidden[r, last][:, None]
    return res, None
