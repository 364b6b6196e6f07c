"""Which answers float rounding lets a float32 GPU kernel give where a float64 numpy reference gives one.

The sampler and verification kernels compare float quantities with thresholds: a weight over a sum against a
uniform draw, a running mass against a goal, a kept mass against top-p's target. Each is off by ~1e-6
relatively on the GPU (WGSL's `exp` and division are a few ulp off), so a comparison within MARGIN = 1e-5
(relative) of its boundary may be decided either way. These helpers list every answer those margins allow; the
kernel tests accept any of them and count the cases with more than one, which must stay rare.
"""

from __future__ import annotations

import numpy as np

from doppler_py.sampling import SamplingParams
from doppler_py.testing.sampling_reference import clean_logits, inverse_cdf, mass_by_value, scaled_weights, top_k_mask

MARGIN = 1e-5
# The option sets the verification tests sweep: greedy, plain temperatures, top-k, top-p and both.
SWEPT_OPTIONS = [
    {"temperature": 0.0},
    {"temperature": 0.5},
    {"temperature": 1.0},
    {"temperature": 2.0},
    {"temperature": 1.0, "top_k": 5},
    {"temperature": 0.5, "top_p": 0.8},
    {"temperature": 2.0, "top_k": 40, "top_p": 0.9},
]
# A weight exp(s - max s) below ~1e-38 is 0 in float32 but not in the float64 reference.
F32_UNDERFLOW = 1e-37


def top_p_near_tie(logits: np.ndarray, params: SamplingParams) -> bool:
    """Whether top-p's kept mass lies within MARGIN of its target for some cut (the kept set is then unsure)."""
    if params.greedy or np.float32(params.top_p) >= 1:
        return False
    x = clean_logits(logits)
    _, masses = mass_by_value(x, scaled_weights(x, params.temperature), top_k_mask(x, params.top_k))
    needed = np.float64(np.float32(params.top_p)) * masses[-1]
    return bool(np.any(np.abs(masses - needed) < MARGIN * masses[-1]))


def less_than_decisions(lhs: float, rhs: float) -> set[bool]:
    """The answers to lhs < rhs (both >= 0) within MARGIN, or where one side underflows float32."""
    larger = max(lhs, rhs)
    if larger > 0 and (abs(lhs - rhs) <= MARGIN * larger or larger < F32_UNDERFLOW):
        return {True, False}
    return {lhs < rhs}


def draws(weights: np.ndarray, u: float) -> set[int]:
    """inverse_cdf's answers for goals within MARGIN (in probability) of u * mass."""
    mass = weights.sum()
    return {inverse_cdf(weights, min(max(g, 0.0), 1.0)) for g in (u - MARGIN / mass, u, u + MARGIN / mass)}
