"""Token sampling: greedy, temperature, top-k, top-p, and the log-probs PPO needs.

Entry points: :func:`sample`, :func:`draw` (inverse CDF with keyed uniforms) and
:func:`logprob_pair`, on logits ``[..., V]``. Invariant: the actor, the draft and every
verification draw from :func:`probs_for_sampling`, so speculation samples what plain
sampling would, and equal probabilities and uniforms draw equal tokens on every rank.
"""

from __future__ import annotations

import torch

from megatron_rlhf.config import GenerationConfig


def probs_for_sampling(logits: torch.Tensor, params: GenerationConfig) -> torch.Tensor:
    """The distribution tokens are drawn from, ``[..., V]`` in fp32 (one-hot when greedy)."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    if samples_actor(params, logits.shape[-1]):  # one pass: no fp32 copy of the logits first
        return torch.softmax(logits, -1, dtype=torch.float32)
    return sampling_logits(logits, params).softmax(-1)


def samples_actor(params: GenerationConfig, vocab: int) -> bool:
    """Whether the sampling distribution is the actor's own (temperature 1, no truncation)."""
    return (not params.greedy and params.temperature == 1.0 and params.top_p >= 1.0
            and not (params.top_k and params.top_k < vocab))


# draw() finds a token in two levels: the block (of this many tokens) that holds it, then
# the token inside it. One cumsum over the whole vocabulary is sequential per row; a
# block-sum pass and two short cumsums are not.
DRAW_BLOCK = 256


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs [..., V]`` by inverse CDF with uniforms ``u [...]`` in
    ``[0, 1)``; a zero-probability token is never drawn."""
    # float rounding at the top end falls back to the argmax
    flat = probs.reshape(-1, probs.shape[-1]).float()
    idx = inverse_cdf(flat, u.reshape(-1, 1).to(flat.device, torch.float32))
    bad = flat.gather(-1, idx) <= 0  # no host read (``bad.any()``): a graphed step draws too
    idx = torch.where(bad, flat.argmax(-1, keepdim=True), idx)
    return idx.reshape(probs.shape[:-1])


def inverse_cdf(flat: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``[R, 1]``: per row of unnormalised ``flat [R, V]`` the first token whose cumulative
    mass exceeds ``u [R, 1]`` times the row's total."""
    rows, vocab = flat.shape
    pad = (-vocab) % DRAW_BLOCK
    blocks = torch.nn.functional.pad(flat, (0, pad)) if pad else flat
    blocks = blocks.view(rows, -1, DRAW_BLOCK)  # [R, nb, block]
    upto = blocks.sum(-1).cumsum(-1)  # [R, nb] mass up to the end of each block
    target = u * upto[:, -1:]
    blk = torch.searchsorted(upto, target, right=True).clamp(max=upto.shape[1] - 1)  # [R, 1]
    before = torch.where(blk > 0, upto.gather(-1, (blk - 1).clamp(min=0)), 0.0)
    inside = blocks.gather(1, blk[:, :, None].expand(rows, 1, DRAW_BLOCK))[:, 0].cumsum(-1)
    pos = torch.searchsorted(inside, target - before, right=True).clamp(max=DRAW_BLOCK - 1)
    return (blk * DRAW_BLOCK + pos).clamp(max=vocab - 1)


def sample(logits: torch.Tensor, params: GenerationConfig, u: torch.Tensor | None):
    """Tokens ``[...]`` and the sampling distribution ``[..., V]`` (None when greedy);
    ``u [...]``: the uniforms of the draws (unused, may be None, when greedy)."""
    if params.greedy:
        return logits.argmax(-1), None
    probs = probs_for_sampling(logits, params)
    return draw(probs, u), probs


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log pi(token)`` under the unmodified distribution at temperature 1 (what PPO uses)."""
    logits = logits.float()
    return logits.gather(-1, tokens[..., None])[..., 0] - torch.logsumexp(logits, -1)


def logprob_pair(logits: torch.Tensor, probs: torch.Tensor | None, tokens: torch.Tensor,
                 params: GenerationConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token_logprobs, sampling_logprobs)`` of ``tokens``; one tensor twice when the
    tokens were drawn from the actor's own distribution (:func:`samples_actor`)."""
    if probs is not None and samples_actor(params, logits.shape[-1]):
        lp = probs.gather(-1, tokens[..., None])[..., 0].clamp(min=1e-30).log()
        return lp, lp
    return token_logprobs(logits, tokens), sampling_logprobs(probs, tokens)


def logprob_lists(logits: torch.Tensor, probs: torch.Tensor | None, tokens: torch.Tensor,
                  params: GenerationConfig) -> tuple[list, list]:
    """:func:`logprob_pair` as nested lists, the same list twice when both are one tensor."""
    lp, slp = logprob_pair(logits, probs, tokens, params)
    lps = lp.tolist()
    return lps, (lps if slp is lp else slp.tolist())


def sampling_logprobs(probs: torch.Tensor | None, tokens: torch.Tensor) -> torch.Tensor:
    """Log-prob of ``tokens`` under the sampling distribution (0 for greedy: ``probs`` None)."""
    if probs is None:
        return torch.zeros(tokens.shape, device=tokens.device)
    return probs.gather(-1, tokens[..., None])[..., 0].clamp(min=1e-30).log()


def sampling_logits(logits: torch.Tensor, params: GenerationConfig) -> torch.Tensor:
    """``[..., V]`` fp32 logits whose softmax is the sampling distribution (``-inf`` outside
    the top-k and top-p set; differentiable in the kept logits). Raises ValueError when greedy."""
    if params.greedy:
        raise ValueError("greedy decoding (temperature 0) samples the argmax; it has no "
                         "sampling logits: use a temperature > 0")
    logits = logits.float()
    if params.temperature != 1.0:
        logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits.detach(), params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits.detach(), dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum - sorted_logits.softmax(-1) >= params.top_p  # mass before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


# the columns of step_outputs' packed result, the one thing the host reads of a step
STEP_COLUMNS = ("sample", "token", "logprob", "sampling_logprob", "alive", "done")


def step_outputs(logits: torch.Tensor, params: GenerationConfig, u: torch.Tensor | None,
                 sid: torch.Tensor, alive: torch.Tensor, emitted: torch.Tensor, max_new: int,
                 eos: int | None):
    """What a plain step decides per row of ``logits [R, V]``, with no host read: the token
    drawn with ``u [R]``, its log-probs, and whether an ``alive`` sample finishes (``eos``,
    or ``max_new`` reached). Returns ``(tokens [R], done [R], packed [R, 6] float64)``,
    ``packed`` holding :data:`STEP_COLUMNS` exactly."""
    tok, probs = sample(logits, params, u)
    lp, slp = logprob_pair(logits, probs, tok, params)
    done = emitted + 1 >= max_new
    if eos is not None:
        done = done | (tok == eos)
    done = done & alive
    packed = torch.stack([t.double() for t in (sid, tok, lp, slp, alive, done)], 1)
    return tok, done, packed
