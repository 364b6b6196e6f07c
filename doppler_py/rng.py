"""mulberry32, the seeded generator the JS original (doppler-gpu) draws from, reproduced bit for bit.

Every draw is a pure 32-bit integer computation (JS `Math.imul` and `>>>` wrap modulo 2^32), so Python
integers masked to 32 bits give exactly the JS stream; `random()` divides by 2^32, which is exact in a double.
"""

from __future__ import annotations

import math
import numbers

from doppler_py.errors import GenerationOptionError

_MASK32 = 0xFFFFFFFF
_INCREMENT = 0x6D2B79F5  # also the state used in place of a zero seed


def seed_state(seed: float) -> int:
    """The starting state for `seed`, as JS computes it: `Math.floor(seed) >>> 0`, with 0 replaced.

    `>>> 0` reduces modulo 2^32, so -1 and 2^32 - 1 give the same stream, as do 0 and 2^32.
    """
    if not isinstance(seed, numbers.Integral) and not math.isfinite(seed):
        raise GenerationOptionError(f"random seed must be a finite number, got {seed!r}")
    state = math.floor(seed) & _MASK32
    return state or _INCREMENT


class Mulberry32:
    """A mulberry32 stream; `random()` returns floats in [0, 1) identical to the JS generator's."""

    def __init__(self, seed: float) -> None:
        self.state = seed_state(seed)

    def next_uint32(self) -> int:
        self.state = (self.state + _INCREMENT) & _MASK32
        s = self.state
        t = ((s ^ (s >> 15)) * (s | 1)) & _MASK32
        t = ((t + (((t ^ (t >> 7)) * (t | 61)) & _MASK32)) & _MASK32) ^ t
        return t ^ (t >> 14)

    def random(self) -> float:
        return self.next_uint32() / 4294967296.0
