"""The numpy reference sampler (`doppler_py.testing.sampling_reference`) against brute-force restatements
of its contract."""

from __future__ import annotations

import math

import numpy as np
import pytest

from doppler_py.errors import GenerationOptionError
from doppler_py.sampling import SamplingParams
from doppler_py.testing.sampling_reference import filtered_probs, sample_reference

INF = np.inf


def brute_top_k(x: np.ndarray, k: int) -> set[int]:
    return set(sorted(range(x.size), key=lambda i: (-x[i], i))[:k])


def brute_top_p(x: np.ndarray, p: float) -> set[int]:
    """Add tokens largest first until the mass reaches p, then every token tied with the last one added."""
    probs = np.exp(x.astype(np.float64) - x.max())
    probs /= probs.sum()
    kept, mass = set(), 0.0
    for i in sorted(range(x.size), key=lambda i: -x[i]):
        if mass >= p and x[i] != x[max(kept, key=lambda j: -x[j])]:
            break
        kept.add(i)
        mass += probs[i]
    return kept


def support(probs: np.ndarray) -> set[int]:
    return set(np.flatnonzero(probs > 0).tolist())


def test_default_params_are_greedy_and_frozen():
    params = SamplingParams()
    assert params.greedy and params.top_k == 0 and params.top_p == 1.0 and params.seed is None
    with pytest.raises(AttributeError):
        params.temperature = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("option", "value", "allowed"),
    [
        ("temperature", -0.5, ">= 0"),
        ("temperature", math.nan, ">= 0"),
        ("temperature", math.inf, "finite"),
        ("temperature", 1e39, "finite"),
        ("top_p", 0.0, r"\(0, 1\]"),
        ("top_p", 1.5, r"\(0, 1\]"),
        ("top_p", math.nan, r"\(0, 1\]"),
        ("top_k", -1, ">= 0"),
        ("top_k", 2.5, "integer"),
        ("top_k", True, "integer"),
    ],
)
def test_out_of_range_options_raise_and_name_the_allowed_range(option, value, allowed):
    with pytest.raises(GenerationOptionError, match=allowed) as info:
        SamplingParams(**{option: value})
    assert option in str(info.value)
    assert isinstance(info.value, ValueError)


def test_a_temperature_that_is_zero_in_float32_is_greedy():
    assert SamplingParams(temperature=1e-46).greedy
    assert not SamplingParams(temperature=1e-30).greedy


def test_greedy_is_one_hot_at_the_lowest_index_of_the_maximum():
    x = np.array([1.0, 3.0, -2.0, 3.0], np.float32)
    np.testing.assert_array_equal(filtered_probs(x, SamplingParams()), [0, 1, 0, 0])


def test_nan_counts_as_minus_infinity():
    x = np.array([np.nan, -1.0, np.nan, -INF], np.float32)
    assert sample_reference(x, 0.3, SamplingParams()) == 1
    assert support(filtered_probs(x, SamplingParams(temperature=1.0))) == {1}


def test_a_row_without_finite_logits_is_token_0_when_greedy_and_uniform_when_sampling():
    x = np.array([-INF, np.nan, -INF, -INF], np.float32)
    assert sample_reference(x, 0.9, SamplingParams()) == 0
    np.testing.assert_allclose(filtered_probs(x, SamplingParams(temperature=0.7)), 0.25)
    assert support(filtered_probs(x, SamplingParams(temperature=0.7, top_k=2))) == {0, 1}


def test_plus_infinity_logits_share_all_the_mass():
    x = np.array([3.0, INF, 1e30, INF], np.float32)
    np.testing.assert_array_equal(filtered_probs(x, SamplingParams(temperature=1.0)), [0, 0.5, 0, 0.5])
    # A finite logit divided by a tiny temperature overflows to +inf and joins them.
    assert support(filtered_probs(x, SamplingParams(temperature=1e-10))) == {1, 2, 3}


def test_temperature_scales_logits_before_the_softmax(rng):
    x = (rng.standard_normal(300) * 4).astype(np.float32)
    for t in (0.25, 1.0, 3.0):
        s = (x / np.float32(t)).astype(np.float64)
        expected = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
        np.testing.assert_allclose(filtered_probs(x, SamplingParams(temperature=t)), expected, rtol=1e-12)


def test_top_k_keeps_exactly_k_tokens_with_boundary_ties_going_to_the_lowest_indices(rng):
    x = rng.integers(-3, 4, size=200).astype(np.float32)  # many ties at every value
    for k in (1, 5, 37, 199):
        probs = filtered_probs(x, SamplingParams(temperature=1.0, top_k=k))
        assert support(probs) == brute_top_k(x, k)
    assert support(filtered_probs(x, SamplingParams(temperature=1.0, top_k=200))) == set(range(200))


def test_top_p_keeps_the_smallest_top_set_reaching_the_mass_plus_ties_at_the_boundary(rng):
    for trial in range(20):
        x = rng.integers(-6, 6, size=60).astype(np.float32) if trial % 2 else rng.standard_normal(60).astype(np.float32)
        p = float(np.float32(rng.uniform(0.05, 0.99)))
        assert support(filtered_probs(x, SamplingParams(temperature=1.0, top_p=p))) == brute_top_p(x, p)


def test_top_p_of_one_keeps_everything_and_a_tiny_top_p_keeps_only_the_maximum(rng):
    x = rng.standard_normal(500).astype(np.float32)
    assert support(filtered_probs(x, SamplingParams(temperature=1.0, top_p=1.0))) == set(range(500))
    assert support(filtered_probs(x, SamplingParams(temperature=1.0, top_p=1e-9))) == {int(np.argmax(x))}


def test_top_p_uses_the_mass_renormalised_after_top_k():
    x = np.log(np.array([0.4, 0.3, 0.2, 0.1], np.float32))
    # Token 0 holds 0.4 of all four tokens' mass, short of 0.55, but 0.57 of the top-2's.
    assert support(filtered_probs(x, SamplingParams(temperature=1.0, top_p=0.55))) == {0, 1}
    assert support(filtered_probs(x, SamplingParams(temperature=1.0, top_k=2, top_p=0.55))) == {0}
    assert support(filtered_probs(x, SamplingParams(temperature=1.0, top_k=2, top_p=0.7))) == {0, 1}


def test_inverse_cdf_over_a_u_grid_reproduces_the_distribution(rng):
    x = rng.standard_normal(50).astype(np.float32)
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
    probs = filtered_probs(x, params)
    n = 20_000
    ids = [sample_reference(x, (j + 0.5) / n, params) for j in range(n)]
    counts = np.bincount(ids, minlength=x.size)
    # A grid of n points puts within one of n * p_i points in each token's CDF interval.
    assert np.abs(counts - n * probs).max() <= 1
    assert set(ids) <= support(probs)


def test_u_at_the_ends_of_the_interval_picks_the_first_and_last_kept_tokens():
    x = np.array([-INF, 1.0, 2.0, -INF, 0.5, -INF], np.float32)
    params = SamplingParams(temperature=1.0)
    assert sample_reference(x, 0.0, params) == 1
    assert sample_reference(x, float(np.nextafter(1.0, 0.0)), params) == 4
    assert sample_reference(x, 1.0, params) == 4  # a draw that rounded up to 1 in float32


def test_u_outside_zero_one_is_rejected():
    for u in (-0.1, 1.5, float("nan")):
        with pytest.raises(GenerationOptionError, match=r"\[0, 1\]"):
            sample_reference(np.zeros(3, np.float32), u, SamplingParams(temperature=1.0))
