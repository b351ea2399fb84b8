"""splitmix64, the counter-based generator behind sampling's noise: its constants and one mixing round.

Shared by the torch race (ops/sampling.py) and the Triton one (ops/cuda/sampling.py), so both draw the same
noise from the same key."""
from __future__ import annotations

MASK64 = (1 << 64) - 1
GOLDEN, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def mix(z: int) -> int:
    """One splitmix64 step on a Python int (wrapping 64-bit arithmetic)."""
    z = (z + GOLDEN) & MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def signed64(c: int) -> int:
    """A 64-bit pattern as the int64 holding it (torch has no uint64 arithmetic)."""
    return c - (1 << 64) if c >= 1 << 63 else c
