"""Per-sample random numbers: every uniform is a hash of (seed, sample, position, stream).

Entry points: :func:`seed_key`, :func:`uniform`. Invariant: a sample's tokens do not depend
on its rank, the data-parallel size, its batch or migration: no stateful generator is
shared, and the hash (SplitMix64's finaliser in wrapping int64) is the same on every CPU
and GPU. A sample's random state is its global index and the tokens it has emitted.
"""

from __future__ import annotations

import torch

# Streams separate the uses at one position: the token drawn from the actor (plain steps, a
# verification's next token), a draft proposal, an acceptance test. Under exact verification
# a draft proposes with NEXT: the same uniform through a nearby distribution's inverse CDF
# mostly lands on the actor's token. A round at position m draws at m .. m+n and the next
# starts at m+k+1: uniforms past the first rejection are reused, but no emitted token
# depended on them, so they are still fresh.
NEXT, DRAFT, ACCEPT = 0, 1, 2

_MASK64 = (1 << 64) - 1


def _signed(x: int) -> int:  # a 64-bit constant as the int64 torch stores
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)
_GOLDEN = _signed(0x9E3779B97F4A7C15)
_POS = _signed(0xD6E8FEB86659FD93)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:  # logical right shift (torch's >> is arithmetic)
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:  # SplitMix64's finaliser, a bijection, wrapping int64
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
