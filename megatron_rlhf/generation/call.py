"""One call of :meth:`~megatron_rlhf.generation.engine.Generator.generate`: its request and state.

:class:`Call` is built by ``generate()`` and passed whole to every round; the generator
keeps only what outlives a call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from megatron_rlhf.config import GenerationConfig, SpecConfig
from megatron_rlhf.generation.incremental import forward_cached
from megatron_rlhf.generation.kv_cache import KVCache
from megatron_rlhf.generation.rope import RopeTable
from megatron_rlhf.generation.rollout import GenerationStats
from megatron_rlhf.generation.state import Outputs


@dataclass
class Call:
    """A request's settings and the state its rounds share."""

    gen: object  # the Generator: models, history drafter, kept graph stores
    cfg: GenerationConfig
    spec: SpecConfig
    key: int  # the seed's key (rng.seed_key)
    backend: str  # the decode attention backend (attention.BACKENDS), chosen once
    out: Outputs
    stats: GenerationStats
    rope: RopeTable | None = None  # the actor's
    d_rope: RopeTable | None = None  # the draft model's (None: no draft model drafts)
    accept_rule: Callable | None = None  # the rejection rule under spec.verify == "rejection"
    mode: str | None = None  # graph mode: "cuda", "eager" or None (the dynamic step)
    capacity: int = 0  # rows the graph stores are sized for
    big_n: int = 0  # the widest round's drafts (0: no speculation)
    base_n: int = 0  # a round's drafts before long-running samples widen it
    selector: object = None  # the auto selector when it chooses this call's widths
    upkeep_s: float = 0.0  # this round's seconds spent keeping the draft current
    # no row of the actor's cache holds more tokens: kept on the host from what the rounds
    # return, it sizes the graphed steps' attention (graphs.length_bucket) without a device read
    high: int = 0

    @property
    def verify(self) -> str:
        """``exact`` or ``rejection`` (:class:`~megatron_rlhf.config.SpecConfig`)."""
        return self.spec.verify

    @property
    def drafting(self) -> bool:
        """Whether a draft model drafts in this call (its cache and catch-up are kept)."""
        return bool(self.big_n) and self.gen.draft is not None

    def runner(self, name: str):
        """The graph store of model ``name`` (``actor``, ``draft``) when this call uses graphs."""
        return self.gen._steps.get(name) if self.mode is not None else None

    def forward(self, name: str, model, cache: KVCache, tokens: torch.Tensor, rope, **kw):
        """One cached forward of ``model`` (``name``: actor or draft): a replayed graph where
        one serves this cache and shape, the dynamic step otherwise."""
        runner, n = self.runner(name), tokens.shape[1]
        if runner is not None and runner.serves(cache, n):
            attend = self.attend(runner, n) if name == "actor" else None
            return runner(tokens, kw.get("features"), kw.get("return_features", False), attend)
        return forward_cached(model, cache, tokens, rope, backend=self.backend, **kw)

    def attend(self, runner, n: int) -> int:
        """The actor's attended length for a graphed step of ``n`` tokens per row."""
        return runner.attend(self.high + n)

    def emit(self, sid: int, tokens: list[int], lps: list[float], slps: list[float]) -> bool:
        """Emit a sample's tokens (the history drafter reads them); True when it finished."""
        done = self.out.emit(sid, tokens, lps, slps)
        history = self.gen.history
        if history is not None:
            history.extend(sid, tokens)
            if done:
                history.finish(sid)
        return done
