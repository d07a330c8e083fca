"""The round kinds of the decode loop: plain, speculative, ragged and graphed.

Each takes the call and the live rows and advances them one round; dynamic rounds share
:func:`accept_and_emit`, graphed ones :func:`take_verified`. Invariant: the emitted tokens
are plain sampling's (exact or greedy verification), whatever was drafted; each round
raises ``call.high`` by the most tokens a row's cache gained. Speculative rounds return
``(accepted per live row, rows alive after or None)``.
"""

from __future__ import annotations

from typing import Callable

import torch

from megatron_rlhf.generation import drafting, graphs, rng, speculative
from megatron_rlhf.generation.call import Call
from megatron_rlhf.generation.incremental import forward_cached
from megatron_rlhf.generation.lookup import Lookup, count_history
from megatron_rlhf.generation.packing import packed_positions
from megatron_rlhf.generation.sampling import draw, logprob_lists, logprob_pair, probs_for_sampling, sample
from megatron_rlhf.generation.speculative import Verdict
from megatron_rlhf.generation.state import Rows


def plain_step(call: Call, rows: Rows) -> int:
    """One plain decode step (feed ``pending``, sample the next token); returns the rows
    alive after it. A drafting call's draft buffers the token (and its actor hidden state)."""
    gen, cfg = call.gen, call.cfg
    cache, alive = rows.caches["actor"], rows["alive"]
    feature = call.drafting and gen.feature_draft
    runner = call.runner("actor")
    if runner is not None and runner.serves(cache, 1):
        live = sampled_step(call, runner, rows, return_features=feature)
        if call.drafting:  # the draft catches up with the sampled token (and its hidden state)
            drafting.buffer(call, rows, rows["pending"], runner.hidden[:len(rows)] if feature else None)
        return live
    rows.harvest()  # (before their cache is reused)
    cache.lengths.mul_(alive)  # dead rows compute garbage at position 0
    feed = torch.where(alive, rows["pending"], gen.pad_id)[:, None]
    logits = call.forward("actor", gen.actor, cache, feed, call.rope, return_features=feature)
    hidden = None
    if feature:
        logits, hidden = logits
        hidden = hidden[:, 0]  # [R, h]: pairs with the token sampled now
    logits = logits[:, 0]  # [R, V]
    tok, probs = sample(logits, cfg, rng.uniform(call.key, rows["sid"], rows["emitted"], rng.NEXT))
    lp, slp = logprob_lists(logits, probs, tok, cfg)
    toks, sid = tok.tolist(), rows["sid"].tolist()
    live = 0
    for r in alive.nonzero()[:, 0].tolist():
        if call.emit(sid[r], [toks[r]], [lp[r]], [slp[r]]):
            alive[r] = False
        else:
            live += 1
    rows["pending"], rows["emitted"] = tok, rows["emitted"] + 1
    call.high += 1
    if call.drafting:
        drafting.buffer(call, rows, tok, hidden)
    return live


def sampled_step(call: Call, runner, rows: Rows, return_features: bool = False) -> int:
    """A plain step as one graph (:meth:`~megatron_rlhf.generation.graphs.StepGraphs.sample_step`):
    the rows advance on the device, the host reads one packed result. Returns the rows alive
    after it; raises RuntimeError when the graph and the host disagree on a finish."""
    return read_sampled(call, launch_sampled(call, runner, rows, return_features))[1]


def launch_sampled(call: Call, runner, rows: Rows, return_features: bool = False):
    """Launch a plain step's graph for ``rows``; returns its :class:`~megatron_rlhf.generation.
    capture.Fetch` (read by :func:`read_sampled`). Reads nothing from the device."""
    runner.bind(rows, call.key)
    out = call.out
    eos = call.gen.eos if out.stop_on_eos else None
    fetch = runner.sample_step(rows, call.cfg, out.max_new, eos, call.gen.pad_id, return_features,
                               call.attend(runner, 1))
    call.high += 1
    return fetch


def read_sampled(call: Call, fetch) -> tuple[int, int]:
    """Emit a launched plain step's tokens; returns the rows alive before and after it.
    Raises RuntimeError when the graph and the host disagree on a finish."""
    was, live = 0, 0
    for sid, tok, lp, slp, was_alive, done in fetch.result():
        if was_alive:
            if call.emit(int(sid), [int(tok)], [lp], [slp]) != bool(done):
                raise RuntimeError(f"sample {int(sid)}: the step graph and the host disagree on "
                                   "whether it finished")
            was += 1
            live += not done
    return was, live


def accept_and_emit(call: Call, rows: Rows, drafts: torch.Tensor, verdict: Verdict, base: torch.Tensor,
                    logprobs: Callable) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The tail every dynamic verification shares: each live row emits its accepted drafts
    and the next token, the actor cache keeps ``pending`` and the accepted drafts (``base``:
    its lengths before the round), the rows advance. ``logprobs(emitted [R, n+1])`` gives
    per-row lists. Returns ``(emitted [R, n+1], live row indices, accepted per row)``."""
    alive, k = rows["alive"], verdict.accepted  # [R]
    emitted = torch.cat([drafts, drafts[:, :1]], 1)  # [R, n+1]; slot k <- next token
    emitted.scatter_(1, k[:, None], verdict.next_token[:, None])
    lp, slp = logprobs(emitted)
    live = alive.nonzero()[:, 0]
    ks, toks, sids = k.tolist(), emitted.tolist(), rows["sid"].tolist()
    call.high += 1 + max((ks[r] for r in live.tolist()), default=0)
    for r in live.tolist():
        kr = ks[r] + 1
        if call.emit(sids[r], toks[r][:kr], lp[r][:kr], slp[r][:kr]):
            alive[r] = False
    rows.caches["actor"].truncate(base + 1 + k)  # the actor keeps pending + accepted drafts
    rows["pending"], rows["emitted"] = verdict.next_token, rows["emitted"] + k + 1
    return emitted, live, ks


def spec_round(call: Call, rows: Rows, n: int, looked_up: Lookup | None = None):
    """One verification of ``n`` drafts per row: the draft model's, the history's
    (``looked_up``), or both (the history's where it found some)."""
    gen, cfg, stats = call.gen, call.cfg, call.stats
    runner = call.runner("actor")
    if runner is not None and gen.draft is None:  # history drafts: exact or greedy
        width = graphs.width_bucket(n, looked_up.room)
        if runner.serves(rows.caches["actor"], width + 1):
            return verified_round(call, runner, rows, n, width, looked_up)
    d_runner = call.runner("draft") if runner is not None else None
    if (d_runner is not None and (cfg.greedy or call.verify == "exact")
            and runner.serves(rows.caches["actor"], n + 1) and d_runner.serves(rows.caches["draft"], 1)
            and rows["catch_tokens"].shape[1] <= graphs.CATCH_UP_MAX):
        return drafted_round(call, runner, d_runner, rows, n, looked_up)
    cache, alive = rows.caches["actor"], rows["alive"]
    rows.harvest()  # (before their cache is reused)
    cache.lengths[~alive] = 0
    pending = torch.where(alive, rows["pending"], gen.pad_id)
    base = cache.lengths.clone()  # tokens in the actor cache before this round
    sid, emitted = rows["sid"][:, None], rows["emitted"][:, None]
    q_probs, history = None, None
    if looked_up is not None:
        history = looked_up.drafts(n)
        stats.history_verifications += int(alive.sum())
        stats.history_drafted += int(history[1][alive].sum())
    if gen.draft is not None:
        drafts, q_probs = drafting.propose(call, rows, n, history)
        stats.draft_steps += n
        drafts_t = torch.stack(drafts, 1)  # [R, n]
    else:
        drafts_t = history[0]
    # the actor verifies all n+1 positions in one forward
    a_logits = call.forward("actor", gen.actor, cache, torch.cat([pending[:, None], drafts_t], 1), call.rope,
                            return_features=gen.feature_draft)
    if gen.feature_draft:
        a_logits, a_hidden = a_logits  # hidden states the draft catches up with next round
    steps = torch.arange(n + 1, device=sid.device)
    if cfg.greedy:
        verdict, p_probs = speculative.accept_greedy(drafts_t, a_logits), None
    elif call.verify == "exact" or q_probs is None:
        p_probs = probs_for_sampling(a_logits, cfg)
        verdict = speculative.accept_exact(drafts_t, p_probs, rng.uniform(call.key, sid, emitted + steps, rng.NEXT))
    else:
        p_probs = probs_for_sampling(a_logits, cfg)
        verdict = call.accept_rule(drafts_t, torch.stack(q_probs, 1), p_probs,
                                   rng.uniform(call.key, sid, emitted + steps[:n], rng.ACCEPT),
                                   rng.uniform(call.key, sid, emitted + steps, rng.NEXT))
    k = verdict.accepted
    emitted_t, live, _ = accept_and_emit(call, rows, drafts_t, verdict, base,
                                         lambda toks: logprob_lists(a_logits, p_probs, toks, cfg))
    k_live = k[live]
    stats.count_accepted(k_live.tolist(), n)
    if history is not None:  # accepted drafts that came from the history
        stats.history_accepted += int(torch.minimum(k, history[1])[live].sum())
    if gen.draft is not None:
        # next round the draft reads d_1..d_k, next (with the actor's h at pending, d_1..d_k)
        rows["catch_tokens"], rows["catch_count"] = emitted_t, k + 1
        if gen.feature_draft:
            rows["catch_features"] = a_hidden
    return k_live, None


def ragged_round(call: Call, rows: Rows, widths: torch.Tensor, looked_up: Lookup):
    """One verification of history drafts in which row ``r`` verifies the first ``widths[r]``
    tokens of its proposal (0: a plain step), exact or greedy. Only real tokens reach the
    layers, the head and the draw: ``live + sum(widths)`` of them."""
    gen, cfg = call.gen, call.cfg
    cache, alive = rows.caches["actor"], rows["alive"]
    rows.harvest()  # (before their cache is reused)
    cache.lengths[~alive] = 0
    n = int(widths.max())
    pending = torch.where(alive, rows["pending"], gen.pad_id)
    base = cache.lengths.clone()
    drafts_t = looked_up.tokens[:, :n]
    valid = widths + 1
    logits = forward_cached(gen.actor, cache, torch.cat([pending[:, None], drafts_t], 1), call.rope,
                            valid=valid, packed_logits=True, backend=call.backend)  # [T, V]
    r_idx, j_idx = packed_positions(valid, n + 1)
    sid, emitted = rows["sid"], rows["emitted"]
    if cfg.greedy:
        probs, drawn = None, logits.argmax(-1)
    else:
        probs = probs_for_sampling(logits, cfg)
        drawn = draw(probs, rng.uniform(call.key, sid[r_idx], emitted[r_idx] + j_idx, rng.NEXT))
    drawn_grid = torch.full((len(rows), n + 1), -1, dtype=torch.long, device=drawn.device)
    drawn_grid[r_idx, j_idx] = drawn
    verdict = speculative.accept_drawn(drafts_t, drawn_grid, widths)

    def on_grid(packed: torch.Tensor) -> list[list[float]]:  # [T] -> per row [n+1]
        grid = torch.zeros(len(rows), n + 1, device=packed.device)
        grid[r_idx, j_idx] = packed
        return grid.tolist()

    def logprobs(toks: torch.Tensor):
        lp, slp = logprob_pair(logits, probs, toks[r_idx, j_idx], cfg)
        lps = on_grid(lp)
        return lps, (lps if slp is lp else on_grid(slp))

    _, live, ks = accept_and_emit(call, rows, drafts_t, verdict, base, logprobs)
    ws = widths.tolist()
    drafted = [r for r in live.tolist() if ws[r]]  # rows with width 0 took a plain step
    call.stats.count_accepted([ks[r] for r in drafted], n, [ws[r] for r in drafted])
    count_history(call.stats, [ks[r] for r in drafted], [ws[r] for r in drafted])
    return verdict.accepted[live], None


def verified_round(call: Call, runner, rows: Rows, n: int, width: int, looked_up: Lookup):
    """A round of history drafts as one graph (:meth:`~megatron_rlhf.generation.graphs.
    StepGraphs.verify_step`, ``width`` drafts computed, ``n`` verified)."""
    runner.bind(rows, call.key)
    out = call.out
    eos = call.gen.eos if out.stop_on_eos else None
    res = runner.verify_step(rows, looked_up.tokens, n, width, call.cfg, out.max_new, eos, call.gen.pad_id,
                             call.attend(runner, width + 1))
    ks, live = take_verified(call, res, n, width)
    count_history(call.stats, ks, [min(f, n) for f in looked_up.found_live])
    return torch.tensor(ks, dtype=torch.long), live


def drafted_round(call: Call, runner, d_runner, rows: Rows, n: int, looked_up: Lookup | None = None):
    """A round of the draft model's ``n`` drafts as one graph (:meth:`~megatron_rlhf.
    generation.graphs.StepGraphs.draft_step`), with the history's tokens where ``looked_up``
    found some. The draft's next catch-up is what the round emitted."""
    gen, out = call.gen, call.out
    runner.bind(rows, call.key)
    eos = gen.eos if out.stop_on_eos else None
    history = None if looked_up is None else looked_up.drafts(n)
    res = runner.draft_step(d_runner, rows, n, call.cfg, out.max_new, eos, gen.pad_id, history,
                            call.attend(runner, n + 1))
    ks, live = take_verified(call, res, n, n)
    if looked_up is not None:
        count_history(call.stats, ks, [min(f, n) for f in looked_up.found_live])
    call.stats.draft_steps += n
    r = len(rows)
    rows["catch_tokens"], rows["catch_count"] = runner.drawn[:r, :n + 1].clone(), runner.accepted[:r] + 1
    if gen.feature_draft:
        rows["catch_features"] = runner.verified_hidden[:r, :n + 1].clone()
    return torch.tensor(ks, dtype=torch.long), live


def take_verified(call: Call, res: list[list[float]], n: int, width: int) -> tuple[list[int], int]:
    """Emit a verification graph's packed result (``width`` drafts fed, ``n`` verified) per
    live row; returns the drafts each live row accepted and how many rows live on. Raises
    RuntimeError when the graph and the host disagree on a finish."""
    w = width + 1
    ks, live = [], 0
    for row in res:
        sid, was_alive, done, k = int(row[0]), row[1], row[2], int(row[3])
        if not was_alive:
            continue
        toks = [int(t) for t in row[4:5 + k]]
        if call.emit(sid, toks, row[4 + w:5 + w + k], row[4 + 2 * w:5 + 2 * w + k]) != bool(done):
            raise RuntimeError(f"sample {sid}: the verification graph and the host disagree on "
                               "whether it finished")
        ks.append(k)
        live += not done
    call.high += 1 + max(ks, default=0)
    call.stats.count_accepted(ks, n)
    return ks, live
