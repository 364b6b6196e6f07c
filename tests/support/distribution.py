"""One statistical criterion for "these samples follow p", shared by every sampler test.

A test draws n samples from the code under test, counts them over p's support and asks whether the counts
could come from p. Each check is sized so that a CORRECT sampler fails it with probability about
SIGNIFICANCE (1e-4), while a wrong one fails as soon as n is large enough to see the difference. Measured
over 20,000 exact multinomial histograms of each distribution in tests/test_distribution_helper.py (n = 3000),
all checks together failed 0 to 5 times: at most 2.5e-4.

* support: a sample where p == 0 is impossible, so it fails at once;
* Pearson's chi-square over cells pooled to an expected count >= 5 each, against the chi-square quantile;
* the total-variation distance against its expected size plus a concentration margin.

The chi-square quantile uses the Wilson-Hilferty approximation (no scipy needed): with z the standard normal
quantile at 1 - alpha and df degrees of freedom,

    chi2_{1-alpha}(df) ~= df * (1 - 2 / (9 df) + z * sqrt(2 / (9 df)))^3,

which at alpha = 1e-4 lies above the exact quantile by 7% at df 1, 1% at df 10 and under 0.1% from df 100
on: a little more lenient at small df, never stricter than the stated significance.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

SIGNIFICANCE = 1e-4
MIN_EXPECTED = 5.0  # the usual validity condition of the chi-square approximation, per pooled cell
DECADES = (10, 100, 1000, 10000, 100000)  # prefix sizes `assert_histograms_converge` checks
RANDOM_ALTERNATIVES = 200  # Dirichlet draws p must stand out from
CLOSER_THAN_RANDOM = 10.0  # how many times closer to p than to any random alternative the histogram must be


def chi_square_quantile(df: int, alpha: float = SIGNIFICANCE) -> float:
    """The chi-square(df) value exceeded with probability alpha (Wilson-Hilferty; see the module docstring)."""
    z = NormalDist().inv_cdf(1 - alpha)
    c = 2 / (9 * df)
    return df * (1 - c + z * math.sqrt(c)) ** 3


def total_variation(counts: np.ndarray, p: np.ndarray) -> float:
    """0.5 * sum |counts / n - p|: the largest difference in probability any event can have."""
    counts = np.asarray(counts, np.float64).reshape(-1)
    return 0.5 * float(np.abs(counts / counts.sum() - np.asarray(p, np.float64).reshape(-1)).sum())


def total_variation_bound(p: np.ndarray, n: int, alpha: float = SIGNIFICANCE) -> float:
    """A distance the histogram of n samples of p stays below with probability >= 1 - alpha.

    E|count_j / n - p_j| <= sqrt(p_j (1 - p_j) / n), so E TV <= sum_j sqrt(p_j (1 - p_j)) / (2 sqrt(n)). Moving
    one sample changes TV by at most 1/n, so by McDiarmid's inequality P(TV >= E TV + t) <= exp(-2 n t^2):
    t = sqrt(ln(1 / alpha) / (2 n)).
    """
    p = np.asarray(p, np.float64).reshape(-1)
    expected = float(np.sqrt(p * (1 - p)).sum()) / (2 * math.sqrt(n))
    return expected + math.sqrt(math.log(1 / alpha) / (2 * n))


def pooled_cells(observed: np.ndarray, expected: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(observed, expected) counts with rare cells merged, smallest first, until each has expected >= 5.

    A last pool still short of 5 joins the smallest cell that already had 5 (or the pool before it).
    """
    common = expected >= MIN_EXPECTED
    obs, exp = list(observed[common]), list(expected[common])
    pool_obs = pool_exp = 0.0
    pools: list[tuple[float, float]] = []
    for i in np.flatnonzero(~common)[np.argsort(expected[~common], kind="stable")]:
        pool_obs, pool_exp = pool_obs + observed[i], pool_exp + expected[i]
        if pool_exp >= MIN_EXPECTED:
            pools.append((pool_obs, pool_exp))
            pool_obs = pool_exp = 0.0
    if pool_exp > 0:
        if pools:
            pools[-1] = (pools[-1][0] + pool_obs, pools[-1][1] + pool_exp)
        elif exp:
            j = int(np.argmin(exp))
            obs[j], exp[j] = obs[j] + pool_obs, exp[j] + pool_exp
        else:  # fewer than 5 samples expected in all: a single cell
            pools.append((pool_obs, pool_exp))
    return np.array(obs + [o for o, _ in pools]), np.array(exp + [e for _, e in pools])


def assert_samples_follow(counts: np.ndarray, p: np.ndarray, *, rng: np.random.Generator | None = None) -> None:
    """Assert that `counts` (a histogram over the same support as p, any shape; both are flattened) could be
    n independent draws from p (which sums to 1): no count where p == 0, Pearson's chi-square over pooled
    cells below its 1 - SIGNIFICANCE quantile, and the total-variation distance below
    `total_variation_bound`. With `rng`, also check the test has power: p is CLOSER_THAN_RANDOM times closer
    to the histogram than any of RANDOM_ALTERNATIVES random distributions (flat Dirichlet draws over the same
    cells) are; a failure there means n is too small (or p too flat) to tell p from a wrong distribution."""
    counts = np.asarray(counts).reshape(-1)
    p = np.asarray(p, np.float64).reshape(-1)
    assert counts.shape == p.shape, f"counts cover {counts.size} cells, p {p.size}"
    assert abs(p.sum() - 1) < 1e-6 and (p >= 0).all(), f"p is not a distribution (sum {p.sum()})"
    n = int(counts.sum())
    assert n > 0, "no samples"
    outside = np.flatnonzero((p == 0) & (counts > 0))
    assert outside.size == 0, f"{int(counts[outside].sum())} samples in cells where p == 0: {outside[:10].tolist()}"

    observed, expected = pooled_cells(counts[p > 0].astype(np.float64), n * p[p > 0])
    df = observed.size - 1
    if df > 0:
        chi2 = float(((observed - expected) ** 2 / expected).sum())
        limit = chi_square_quantile(df)
        assert chi2 < limit, f"chi-square {chi2:.1f} >= {limit:.1f}, the 1 - {SIGNIFICANCE} quantile at df {df}"

    distance, limit = total_variation(counts, p), total_variation_bound(p, n)
    assert distance < limit, f"total variation {distance:.4g} >= {limit:.4g} for n = {n}"

    if rng is not None:
        others = rng.dirichlet(np.ones(p.size), size=RANDOM_ALTERNATIVES)
        nearest = min(total_variation(counts, other) for other in others)
        assert nearest > CLOSER_THAN_RANDOM * distance, (
            f"a random distribution is within {nearest:.3g} of the histogram, p within {distance:.3g}: "
            "too few samples to tell p from a wrong distribution"
        )


def assert_histograms_converge(samples: np.ndarray, p: np.ndarray, rng: np.random.Generator) -> None:
    """Assert that samples (cell indices into the flattened p, in the order they were drawn) converge to p:
    the histogram of every first 10, 100, 1000, ... samples is within `total_variation_bound` of p (so the
    distance shrinks like 1/sqrt(n) over the decades, from the first samples on), and all of them pass
    `assert_samples_follow` with its power check."""
    samples = np.asarray(samples).reshape(-1)
    p = np.asarray(p, np.float64).reshape(-1)
    assert ((samples >= 0) & (samples < p.size)).all(), f"samples outside the {p.size} cells of p"
    prefixes = [size for size in DECADES if size < samples.size]
    for size in prefixes:
        # Each prefix takes its share of the significance, so the whole test still fails a correct sampler
        # with probability <= SIGNIFICANCE per check of assert_samples_follow.
        distance = total_variation(np.bincount(samples[:size], minlength=p.size), p)
        limit = total_variation_bound(p, size, SIGNIFICANCE / len(prefixes))
        assert distance < limit, f"the first {size} samples are {distance:.4g} from p (limit {limit:.4g})"
    assert_samples_follow(np.bincount(samples, minlength=p.size), p, rng=rng)
