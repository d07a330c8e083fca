"""What a round costs: the latency models the drafting selector prices rounds with.

:class:`OnlineCosts` (default) learns from the rounds as they run; :class:`CostTable` is a
profile (``--cost-profile``: :func:`load_or_profile`). Both answer ``round_s(batch, n)``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

# An online cost line is trusted once its observations' x spread this much (standard
# deviation over mean); before, costs are taken in proportion to x (no fixed part: the
# pessimistic reading). A line fitted to a narrow range of batches misprices the others.
SPREAD = 0.2


def _interp(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear in ``x``; flat below the first point, the last slope (>= 0) above."""
    if x <= xs[0] or len(xs) == 1:
        return ys[0] if x <= xs[0] else ys[-1]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return ys[i - 1] + w * (ys[i] - ys[i - 1])
    slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
    return ys[-1] + slope * (x - xs[-1])


@dataclass
class CostTable:
    """Seconds per forward of the actor and the draft, by live batch and tokens per sample."""

    batches: list[int]  # profiled batch sizes, ascending
    actor: dict[int, list[float]]  # tokens per sample -> the actor's latency at each of batches
    draft: dict[int, list[float]] = field(default_factory=dict)  # the same for the draft
    models: str = ""  # what was profiled (describe()): a profile of others is not reused

    def actor_s(self, batch: int, tokens: int) -> float:
        return self._lookup(self.actor, batch, tokens)

    def draft_s(self, batch: int, tokens: int) -> float:
        return self._lookup(self.draft, batch, tokens) if self.draft else 0.0

    def _lookup(self, table: dict[int, list[float]], batch: int, tokens: int) -> float:
        widths = sorted(table)
        t = min(widths, key=lambda w: (abs(w - tokens), w))
        base = _interp(self.batches, table[t], batch)
        if tokens > widths[-1]:  # wider than profiled: scale by the last step in width
            prev = _interp(self.batches, table[widths[-2]], batch) if len(widths) > 1 else 0.0
            base += (tokens - widths[-1]) * max(base - prev, 0.0)
        return base

    def round_s(self, batch: int, n: int) -> float:
        """Predicted latency of a round with ``n`` draft tokens (0: a plain step)."""
        if n == 0:
            return self.actor_s(batch, 1)
        # the draft's catch-up (2 tokens), its n - 1 further steps, the actor's verification
        return self.draft_s(batch, 2) + (n - 1) * self.draft_s(batch, 1) + self.actor_s(batch, n + 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["actor"] = {str(k): v for k, v in self.actor.items()}
        d["draft"] = {str(k): v for k, v in self.draft.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> CostTable:
        return cls(batches=list(d["batches"]), models=d.get("models", ""),
                   actor={int(k): list(v) for k, v in d["actor"].items()},
                   draft={int(k): list(v) for k, v in d.get("draft", {}).items()})

    def save(self, path: str | Path) -> None:
        """Write atomically (a temporary file, then rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> CostTable:
        """Raises ValueError when the file is unreadable."""
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"cost profile {path} is unreadable ({e}); delete it to re-profile") from e


class _Fit:
    """A decayed least-squares line ``y = a + b x`` (``a, b >= 0``); ``origin``: ``y = b x``."""

    def __init__(self, decay: float, origin: bool = False):
        self.decay, self.origin = decay, origin
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.w, self.sx, self.sy = d * self.w + 1, d * self.sx + x, d * self.sy + y
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * y

    def _moments(self) -> tuple[float, float, float]:
        mx, my = self.sx / self.w, self.sy / self.w  # mean x, mean y, variance of x
        return mx, my, self.sxx / self.w - mx * mx

    @staticmethod
    def _spreads(mx: float, var: float) -> bool:
        return var > (SPREAD * mx) ** 2

    def spread(self) -> bool:
        """Whether the observations' ``x`` spread enough to tell the fixed part (:data:`SPREAD`)."""
        mx, _, var = self._moments()
        return self._spreads(mx, var)

    def predict(self, x: float) -> float | None:
        """None before any observation; through the origin until the observations spread
        (always with ``origin``); the fitted line after."""
        if self.w == 0:
            return None
        if self.origin:
            return self.sxy / self.sxx * x if self.sxx > 0 else 0.0
        mx, my, var = self._moments()
        if not self._spreads(mx, var):
            return my * x / mx if mx > 0 else my
        slope = min(max((self.sxy / self.w - mx * my) / var, 0.0), my / mx if mx > 0 else 0.0)
        return my + slope * (x - mx)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("w", "sx", "sy", "sxx", "sxy")}


class OnlineCosts:
    """Round latencies learned from the rounds as they run (no profile at the first call)."""
    # Each round updates a decayed line per draft length n (seconds against the live batch)
    # and a prior over all rounds (seconds against the actor's tokens, batch * (n + 1)) for a
    # length not yet measured.

    models = "online"

    def __init__(self, decay: float = 0.95):
        self.decay = decay
        self.by_n: dict[int, _Fit] = {}
        self.tokens = _Fit(decay)
        # ragged verifications: seconds beyond a plain step at their batch against the drafts
        # verified, through the origin. A free intercept fitted to a few large first rounds
        # priced every later draft so high that no round drafted again to correct it.
        self.drafted = _Fit(decay, origin=True)

    def guessing(self) -> bool:
        """Whether drafting's cost is still a guess: no drafting round measured, and the prior
        read in proportion to tokens."""
        return not any(n for n in self.by_n) and not (self.tokens.w > 0 and self.tokens.spread())

    def observe(self, batch: int, n: int, seconds: float, drafts: int | None = None) -> None:
        """A round of ``n`` drafts at ``batch`` live samples took ``seconds``; ``drafts``: the
        drafts a ragged round verified in all (it teaches what drafts cost beyond a plain step)."""
        if drafts is not None and n > 0:
            plain = self.tokens_s(batch)
            self.drafted.add(drafts, max(seconds - (plain or 0.0), 0.0))
            return
        self.by_n.setdefault(n, _Fit(self.decay)).add(batch, seconds)
        self.tokens.add(batch * (n + 1), seconds)

    def tokens_s(self, tokens: int) -> float | None:
        """Predicted seconds of a plain step of ``tokens`` samples; None before any round."""
        return self.tokens.predict(tokens)

    def ragged_s(self, batch: int, drafts: int) -> float | None:
        """Predicted seconds of a ragged round verifying ``drafts`` among ``batch`` samples;
        None before a ragged round was measured."""
        plain, extra = self.tokens_s(batch), self.drafted.predict(drafts) if drafts else 0.0
        return None if plain is None or extra is None else plain + extra

    def round_s(self, batch: int, n: int) -> float:
        """Predicted seconds of a round of ``n`` drafts at ``batch`` live samples (before any
        measurement: 0 for a plain step, inf for drafting)."""
        fit = self.by_n.get(n)
        if fit is not None and fit.w >= 1:
            mx = fit.sx / fit.w
            if fit.spread():  # this length measured at batches far enough apart
                return fit.predict(batch)
            here, there = self.tokens.predict(batch * (n + 1)), self.tokens.predict(mx * (n + 1))
            return fit.sy / fit.w * (here / there if here and there else 1.0)
        prior = self.tokens.predict(batch * (n + 1))
        if prior is None:
            return 0.0 if n == 0 else math.inf
        return prior

    def to_dict(self) -> dict:
        return {"models": self.models, "tokens": self.tokens.to_dict(),
                "by_n": {str(n): f.to_dict() for n, f in sorted(self.by_n.items())}}


# ---------------------------------------------------------------------------- profiling
def profile_batches(max_batch: int) -> list[int]:
    """1, 4, 16, ... below ``max_batch``, and ``max_batch``."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 4
    return out + [max(max_batch, 1)]


def describe(actor, draft, graphs: bool = False) -> str:
    """What a profile depends on: the models' shapes, TP size, dtype, device, the decode
    attention backend and whether steps replay CUDA graphs."""
    from megatron_rlhf.generation.attention import default_backend

    def one(m):
        c = m.mrlhf_config
        w = m.embedding.word_embeddings.weight
        return (f"{c.num_layers}x{c.hidden_size}/{c.ffn_hidden_size} h{c.num_attention_heads}"
                f"/{c.num_query_groups} v{c.head_vocab_size or c.vocab_size}"
                f"{' feature' if c.feature_draft else ''} {w.dtype} {w.device.type}")

    tp = actor.pg_collection.tp.size()
    dev = actor.embedding.word_embeddings.weight.device
    return (f"actor {one(actor)}; draft {one(draft) if draft is not None else None}; tp {tp}"
            f"; {default_backend(dev)} attention" + ("; cuda graphs" if graphs else ""))


@torch.inference_mode()
def profile(actor, draft, max_n: int, max_batch: int, context: int = 64, repeats: int = 3,
            graphs: bool = False) -> CostTable:
    """Time one forward of the actor (``1..max_n+1`` tokens per sample) and of the draft (1, 2)
    at :func:`profile_batches`; every rank of a TP group calls this together."""
    from megatron_rlhf.generation.graphs import time_step

    batches = profile_batches(max_batch)
    table = CostTable(batches=batches, actor={}, draft={}, models=describe(actor, draft, graphs))
    for model, widths, out in ((actor, range(1, max_n + 2), table.actor), (draft, (1, 2), table.draft)):
        if model is None:
            continue
        for t in widths:
            out[t] = [time_step(model, b, t, context, repeats, graphs) / 1e3 for b in batches]
    return table


def load_or_profile(actor, draft, spec, max_batch: int, max_len: int, graphs: bool = False) -> CostTable:
    """``spec.cost_profile`` when it exists and describes these models; else a new profile
    (saved there by global rank 0 when a path is given)."""
    path = spec.cost_profile
    if path and Path(path).exists():
        table = CostTable.load(path)
        if table.models == describe(actor, draft, graphs):
            return table
    context = max(1, min(64, max_len - spec.max_draft_tokens - 2))
    table = profile(actor, draft, spec.max_draft_tokens, max_batch, context=context, graphs=graphs)
    if path and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
        table.save(path)
    return table
