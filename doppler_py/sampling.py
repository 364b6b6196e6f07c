"""Sampling options (`SamplingParams`): greedy, temperature, top-k, top-p and the seed of the host RNG.

What the GPU sampler does with them, exactly (ties, NaN, the top-p boundary), is the contract written in
`doppler_py/testing/sampling_reference.py`, next to the numpy reference the GPU is held to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

import numpy as np

from doppler_py.errors import GenerationOptionError

_F32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token: greedy when temperature is 0, else temperature / top-k / top-p sampling.

    `seed` seeds the host RNG whose draws become the sampler's `u` values; None means unseeded.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, Real) or not (0.0 <= t <= _F32_MAX):
            raise GenerationOptionError(
                f"temperature must be a number >= 0 and finite (0 = greedy, 1 = the model's distribution), got {t!r}"
            )
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, Integral) or k < 0:
            raise GenerationOptionError(f"top_k must be an integer >= 0 (0 = keep every token), got {k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, Real) or not (0.0 < p <= 1.0):
            raise GenerationOptionError(f"top_p must be a number in (0, 1] (1 = keep every token), got {p!r}")
        s = self.seed
        finite = isinstance(s, Integral) or (isinstance(s, Real) and math.isfinite(s))
        if s is not None and (isinstance(s, bool) or not finite):
            raise GenerationOptionError(f"seed must be an integer, or None for an unseeded run, got {s!r}")

    @property
    def greedy(self) -> bool:
        """True when the temperature is 0 in float32, which is what the GPU sees."""
        return np.float32(self.temperature) == 0
