"""Per-sample random numbers: every uniform is a hash of (seed, sample, position, stream).

A sample's tokens must not depend on which rank generates it, on the data-parallel size,
on which other samples share its batch, or on migration between ranks. So no random
number comes from a stateful generator shared by a batch: the uniform that decides a
draw is ``hash(seed, global sample index, response position, stream)``, computed in
int64 arithmetic that wraps identically on every CPU and GPU (SplitMix64's finaliser,
logical shifts emulated by masking). A sample's random state is then just its global
index and the number of tokens it has emitted, which migration carries anyway.

Streams separate the uses at one position: the token drawn from the actor (plain steps,
and the corrected or bonus token of a verification), the draft's proposal, and the
acceptance test of that proposal. Under exact verification a draft model proposes with the
actor's own stream (NEXT) instead: the same uniform through a nearby distribution's
inverse CDF mostly lands on the same token, which is what exact verification accepts. A speculative round at response position ``m`` uses
draft and accept uniforms at ``m .. m+n-1`` and the next-token uniform at ``m+k``; the
next round starts at ``m+k+1``. Uniforms of positions past the first rejection may be
used again by the next round: no emitted token depended on them, so they are still
fresh (independent of everything emitted so far).
"""

from __future__ import annotations

import torch

NEXT, DRAFT, ACCEPT = 0, 1, 2
"""Streams: the token drawn from the actor, a draft proposal, an acceptance test."""

_MASK64 = (1 << 64) - 1


def _signed(x: int) -> int:
    """A 64-bit constant as the int64 torch stores."""
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)
_GOLDEN = _signed(0x9E3779B97F4A7C15)
_POS = _signed(0xD6E8FEB86659FD93)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser (a bijection of 64-bit words), in wrapping int64."""
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def seed_key(seed: int) -> int:
    """The 64-bit key of a generation seed (python int, as int64)."""
    return int(_mix(torch.tensor(_signed(seed * 0x9E3779B97F4A7C15 + 1), device="cpu")))


def uniform(key: int, sample: torch.Tensor, position: torch.Tensor, stream: int) -> torch.Tensor:
    """Uniforms in ``[0, 1)`` (float32, 24 random bits, like ``torch.rand``), one per element
    of ``sample`` and ``position`` (broadcast; int64, on any device) for ``stream``."""
    z = _mix(sample.long() * _GOLDEN + key)
    z = _mix(z + position.long() * _POS + stream)
    return _shr(z, 40).float() * (1.0 / (1 << 24))
