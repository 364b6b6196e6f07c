"""numpy reference of the GPU sampler (`shaders/sample.wgsl`, `doppler_py.ops.sampling.Sampler`).

The definition below is the contract both implementations follow, for one row of `vocab` f32 logits and one
uniform random number `u` in [0, 1) (1.0 is accepted too, since a draw just below 1 may round up to it in
float32, and picks the last kept token):

1. Cleaning. NaN logits count as -inf. -0.0 equals +0.0. Orders and ties are decided on these logit
   values, never on rounded intermediate results, so the GPU and numpy agree on every kept SET exactly.
2. Greedy. A temperature that is 0 as float32 returns the argmax; ties go to the lowest index. A row
   of only -inf/NaN returns 0.
3. Temperature. Otherwise s = logit / temperature in float32 and each token weighs w = exp(s - max s),
   except that the tokens whose s equals max s weigh exactly 1 (so +inf logits share all the mass and a
   row of only -inf/NaN is uniform over the kept tokens) and -inf tokens weigh 0 when anything is finite.
4. Top-k (0 < top_k < vocab). Keep EXACTLY k tokens: the k largest logits, ties at the boundary going to
   the lowest indices.
5. Top-p (top_p < 1 as float32). Among the tokens top-k kept, W = their total weight. Keep the tokens
   whose logit is >= v, for the largest v such that the weight of those tokens is >= top_p * W. That is
   the smallest set of highest-probability tokens reaching the mass, except that tokens tied at the
   boundary logit are all kept (the set depends only on the values, not on their order in the row).
6. Pick. With the kept weights in token-index order and their running sum c_i, return the first token
   with c_i > u * total. The strict test means a zero-weight token is never picked. If rounding leaves
   no such token, return the last kept token of positive weight.

The GPU sums in float32 (and WGSL's `exp` and division may be a few ulp off) where this reference uses
float64, so the kept sets of top-p and the final pick can differ only when a running mass lies within float
rounding of its target (`top_p * W` or `u * total`).
"""

from __future__ import annotations

import numpy as np

from doppler_py.errors import GenerationOptionError
from doppler_py.sampling import SamplingParams


def clean_logits(logits: np.ndarray) -> np.ndarray:
    """The row as float32 with NaN replaced by -inf (and -0.0 by +0.0, for exact-bit comparisons)."""
    x = np.array(logits, dtype=np.float32).reshape(-1)
    x[np.isnan(x)] = -np.inf
    return x + np.float32(0.0)


def scaled_weights(x: np.ndarray, temperature: float) -> np.ndarray:
    """Unnormalised float64 weights exp(s - max s) of a cleaned row, with s = x / temperature in float32."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        s = x / np.float32(temperature)
        top = s.max()
        w = np.exp(s.astype(np.float64) - np.float64(top))
    w[s == top] = 1.0
    return w


def top_k_mask(x: np.ndarray, k: int) -> np.ndarray:
    """Boolean mask of the k largest values of a cleaned row; ties at the boundary go to the lowest index."""
    if k <= 0 or k >= x.size:
        return np.ones(x.size, dtype=bool)
    order = np.lexsort((np.arange(x.size), -x.astype(np.float64)))  # by value desc, then index asc
    mask = np.zeros(x.size, dtype=bool)
    mask[order[:k]] = True
    return mask


def mass_by_value(x: np.ndarray, weights: np.ndarray, kept: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct logits of the kept tokens, largest first, and the kept weight at or above each."""
    order = np.argsort(-x[kept], kind="stable")
    values = x[kept][order]
    cumulative = np.cumsum(weights[kept][order])
    group_end = np.append(values[1:] != values[:-1], True)
    return values[group_end], cumulative[group_end]


def top_p_mask(x: np.ndarray, weights: np.ndarray, kept: np.ndarray, top_p: float) -> np.ndarray:
    """Subset of `kept`: tokens with logit >= v for the largest v whose kept mass reaches top_p (float32)."""
    p = np.float32(top_p)
    if p >= 1:
        return kept.copy()
    values, masses = mass_by_value(x, weights, kept)
    # The last mass is the total, which p < 1 always reaches.
    threshold = values[int(np.argmax(masses >= np.float64(p) * masses[-1]))]
    return kept & (x >= threshold)


def filtered_weights(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Unnormalised float64 weights after temperature, top-k and top-p (0 outside the kept set)."""
    x = clean_logits(logits)
    if params.greedy:
        w = np.zeros(x.size)
        w[int(np.argmax(x))] = 1.0
        return w
    weights = scaled_weights(x, params.temperature)
    kept = top_p_mask(x, weights, top_k_mask(x, params.top_k), params.top_p)
    return np.where(kept, weights, 0.0)


def filtered_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """float64 probabilities of each token after temperature / top-k / top-p (one-hot when greedy)."""
    w = filtered_weights(logits, params)
    return w / w.sum()


def inverse_cdf(weights: np.ndarray, u: float) -> int:
    """Step 6: the first index whose running sum of `weights` exceeds u * total; the last positive one if none
    does."""
    cdf = np.cumsum(weights)
    index = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    if index < weights.size:
        return index
    return int(np.flatnonzero(weights > 0)[-1])


def sample_reference(logits: np.ndarray, u: float, params: SamplingParams) -> int:
    """The token the GPU sampler returns for this row and uniform draw `u` (see the module docstring)."""
    if not 0.0 <= u <= 1.0:
        raise GenerationOptionError(f"u must be a uniform draw in [0, 1], got {u!r}")
    return inverse_cdf(filtered_weights(logits, params), u)
