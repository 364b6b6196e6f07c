"""The shared distribution criterion (tests/support/distribution.py): it accepts exact multinomial samples
and rejects samples of a wrong distribution, outside the support, or too few to tell p from noise."""

from __future__ import annotations

import numpy as np
import pytest
from support.distribution import (
    assert_histograms_converge,
    assert_samples_follow,
    chi_square_quantile,
    pooled_cells,
)


def peaked(cells: int, spread: float = 1.5, seed: int = 0) -> np.ndarray:
    logits = np.random.default_rng(seed).standard_normal(cells) * spread
    p = np.exp(logits - logits.max())
    return p / p.sum()


def with_zeros(p: np.ndarray, every: int) -> np.ndarray:
    p = p.copy()
    p[::every] = 0
    return p / p.sum()


DISTRIBUTIONS = {
    "uniform-10": np.full(10, 0.1),
    "two-cells": np.array([0.3, 0.7]),
    "one-cell": np.array([0.0, 1.0, 0.0]),
    "peaked-24": peaked(24),
    "zeros-40": with_zeros(peaked(40, seed=1), 3),
    "rare-tail-2000": peaked(2000, spread=3.0, seed=2),  # most cells expect < 5 samples: pooled
    "joint-8x8": np.outer(peaked(8, seed=3), peaked(8, seed=4)),  # a 2-D histogram, flattened by the helper
}


@pytest.mark.parametrize("name", DISTRIBUTIONS)
@pytest.mark.parametrize("n", [200, 5000, 1_000_000])
def test_exact_multinomial_samples_pass(name, n):
    p = DISTRIBUTIONS[name]
    for seed in range(20):
        counts = np.random.default_rng(seed).multinomial(n, p.reshape(-1)).reshape(p.shape)
        assert_samples_follow(counts, p)


@pytest.mark.parametrize("name", ["peaked-24", "zeros-40", "joint-8x8"])
def test_samples_in_drawing_order_converge(name):
    p = DISTRIBUTIONS[name].reshape(-1)
    for seed in range(5):
        rng = np.random.default_rng(seed)
        assert_histograms_converge(rng.choice(p.size, size=20_000, p=p), p, rng)


def test_a_slightly_wrong_distribution_fails_with_enough_samples():
    p = peaked(20)
    q = p.copy()
    top, second = np.argsort(-p)[:2]
    q[top], q[second] = q[top] - 0.02, q[second] + 0.02  # total variation 0.02
    rng = np.random.default_rng(0)
    assert_samples_follow(rng.multinomial(2_000, q), p)  # too few samples to see it...
    with pytest.raises(AssertionError, match="chi-square"):
        assert_samples_follow(rng.multinomial(200_000, q), p)  # ...enough here


def test_a_sample_outside_the_support_fails():
    p = DISTRIBUTIONS["zeros-40"]
    counts = np.random.default_rng(0).multinomial(100_000, p)
    counts[3] += 1  # p[3] == 0
    with pytest.raises(AssertionError, match=r"1 samples in cells where p == 0: \[3\]"):
        assert_samples_follow(counts, p)
    with pytest.raises(AssertionError, match="outside"):
        assert_histograms_converge(np.array([0, 1, 40]), p, np.random.default_rng(0))


def test_uniform_samples_fail_against_a_peaked_distribution():
    counts = np.random.default_rng(0).multinomial(1000, np.full(24, 1 / 24))
    with pytest.raises(AssertionError):
        assert_samples_follow(counts, DISTRIBUTIONS["peaked-24"])


def test_a_sampler_that_starts_wrong_fails_the_convergence_check():
    p = DISTRIBUTIONS["peaked-24"]
    rng = np.random.default_rng(0)
    early = rng.choice(p.size, size=1000)  # uniform, not p
    later = rng.choice(p.size, size=200_000, p=p)
    with pytest.raises(AssertionError, match=r"the first \d+ samples are"):
        assert_histograms_converge(np.concatenate([early, later]), p, rng)


def test_the_power_check_rejects_too_few_samples():
    p = np.full(50, 1 / 50)
    rng = np.random.default_rng(0)
    counts = rng.multinomial(30, p)
    assert_samples_follow(counts, p)  # nothing contradicts p...
    with pytest.raises(AssertionError, match="too few samples"):
        assert_samples_follow(counts, p, rng=rng)  # ...but nothing singles it out either


# Exact 1 - 1e-4 quantiles of chi-square(df) (mpmath, regularised upper incomplete gamma).
EXACT_QUANTILES = {1: 15.1367, 2: 18.4207, 5: 25.7448, 10: 35.5640, 100: 161.3187, 1000: 1174.9335}


@pytest.mark.parametrize(("df", "exact"), EXACT_QUANTILES.items())
def test_wilson_hilferty_quantile_is_close_and_never_below_the_exact_one(df, exact):
    approx = chi_square_quantile(df, 1e-4)
    assert exact <= approx <= exact * (1.075 if df == 1 else 1.05)


def test_rare_cells_are_pooled_smallest_first_until_each_expects_five():
    expected = np.array([10.0, 1.0, 0.5, 20.0, 2.0, 3.0, 1.0])
    observed = np.arange(7.0)
    obs, exp = pooled_cells(observed, expected)
    # 0.5 + 1 + 1 + 2 = 4.5 is short of 5, so 3 joins them.
    np.testing.assert_array_equal(exp, [10.0, 20.0, 7.5])
    np.testing.assert_array_equal(obs, [0.0, 3.0, 2 + 1 + 6 + 4 + 5])
    # A remainder below 5 joins the pool before it; with no pool, the smallest common cell.
    np.testing.assert_array_equal(pooled_cells(np.ones(4), np.array([3.0, 3.0, 1.0, 9.0]))[1], [9.0, 7.0])
    np.testing.assert_array_equal(pooled_cells(np.ones(3), np.array([6.0, 1.0, 9.0]))[1], [7.0, 9.0])
