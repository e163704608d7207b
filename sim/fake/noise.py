"""Deterministic noise for the simulated host: 64-bit hashes of integers, and uniform numbers from them.

Every random-looking value of the simulation is a pure function of (seed, GPU, time slot, ...),
so a simulated host reads the same whatever the order or number of reads.
"""

from __future__ import annotations

_MASK = (1 << 64) - 1


def mix(*parts: int) -> int:
    """A deterministic 64-bit hash of integers (splitmix64 finalizer over a running sum)."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x + (p & _MASK) * 0xBF58476D1CE4E5B9 + 0x9E3779B97F4A7C15) & _MASK
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & _MASK
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & _MASK
        x ^= x >> 31
    return x


def uniform(*parts: int) -> float:
    """Uniform in [0, 1), a pure function of ``parts``."""
    return (mix(*parts) >> 11) / float(1 << 53)


def symmetric(*parts: int) -> float:
    """Uniform in [-1, 1)."""
    return 2.0 * uniform(*parts) - 1.0
