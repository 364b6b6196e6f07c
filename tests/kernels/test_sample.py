"""GPU sampler (`shaders/sample.wgsl`) against the numpy reference in `doppler_py.testing.sampling_reference`.

Greedy picks and top-k sets are decided on integer keys of the logits, so they must match exactly. Top-p's
cut and the inverse-CDF pick compare float sums with a target: the GPU sums f32 weights in order (<= 192
per invocation, then <= 256 partial sums), whose rounding error is ~1e-6 of the total for random-signed
rounding, and WGSL lets `exp` and division be a few ulp off. So where a running mass lies within
MARGIN = 1e-5 of the total from its target (top_p * total, or u * total), the GPU may land on either side,
and `allowed_picks` accepts both answers. Tests also check such near-ties are rare, so they stay strict.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.distribution import assert_histograms_converge

from doppler_py.errors import GenerationOptionError
from doppler_py.gpu.tensor import Tensor
from doppler_py.ops.sampling import Sampler
from doppler_py.sampling import SamplingParams
from doppler_py.testing.sampling_reference import (
    clean_logits,
    filtered_probs,
    mass_by_value,
    sample_reference,
    scaled_weights,
    top_k_mask,
)

INF = np.inf
MARGIN = 1e-5  # relative to the total mass; see the module docstring


def gpu_sample(gpu, registry, logits: np.ndarray, us, **options) -> np.ndarray:
    logits = np.atleast_2d(np.asarray(logits, np.float32))
    rows, vocab = logits.shape
    out = Tensor.empty(gpu, rows, "u32")
    sampler = Sampler(
        registry,
        Tensor.from_numpy(gpu, logits),
        Tensor.from_numpy(gpu, np.asarray(us, np.float32).reshape(rows)),
        out,
        vocab=vocab,
        max_rows=rows,
    )
    rec = registry.recorder()
    sampler.record(rec, rows, **options)
    rec.submit()
    return out.numpy()


def u_grid(n: int) -> np.ndarray:
    return ((np.arange(n) + 0.5) / n).astype(np.float32)


def allowed_picks(logits: np.ndarray, u: float, params: SamplingParams) -> set[int]:
    """The reference pick, plus the picks float rounding of width MARGIN could lead to instead."""
    x = clean_logits(logits)
    if params.greedy:
        return {sample_reference(x, u, params)}
    weights = scaled_weights(x, params.temperature)
    kept = top_k_mask(x, params.top_k)
    thresholds = {-INF}
    if np.float32(params.top_p) < 1:
        values, masses = mass_by_value(x, weights, kept)
        needed = np.float64(np.float32(params.top_p)) * masses[-1]
        thresholds = {values[int(np.argmax(masses >= needed))]}
        for j in np.flatnonzero(np.abs(masses - needed) < MARGIN * masses[-1]):
            thresholds |= {values[j], values[min(j + 1, len(values) - 1)]}
    picks = set()
    for threshold in thresholds:
        w = np.where(kept & (x >= threshold), weights, 0.0)
        cdf = np.cumsum(w)
        last = int(np.flatnonzero(w > 0)[-1])
        for goal in (max(u - MARGIN, 0.0), u, u + MARGIN):
            picks.add(min(int(np.searchsorted(cdf, goal * cdf[-1], side="right")), last))
    return picks


def assert_matches_reference(logits_rows: np.ndarray, us, ids: np.ndarray, params: SamplingParams) -> int:
    """Every id is an allowed pick; returns how many rows had more than one (near-ties of float sums)."""
    near_ties = 0
    for row, (u, got) in enumerate(zip(us, ids, strict=True)):
        allowed = allowed_picks(logits_rows[row], float(u), params)
        assert got in allowed, (row, float(u), got, allowed)
        near_ties += len(allowed) > 1
    return near_ties


# -- greedy --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("vocab", [1, 7, 257, 1000, 4099, 49152])
def test_greedy_returns_the_argmax_with_ties_to_the_lowest_index(gpu, registry, rng, vocab):
    rows = 4
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    for row in range(rows):  # the maximum appears several times in each row
        logits[row, rng.choice(vocab, size=min(vocab, 3), replace=False)] = 10.0 + row
    ids = gpu_sample(gpu, registry, logits, np.zeros(rows), temperature=0.0)
    np.testing.assert_array_equal(ids, np.argmax(logits, axis=1))


def test_greedy_treats_nan_as_minus_infinity_and_never_leaves_the_vocabulary(gpu, registry):
    rows = np.array(
        [
            [-INF, -INF, -INF, -INF, -INF],  # nothing finite: token 0
            [np.nan, np.nan, np.nan, np.nan, np.nan],
            [np.nan, -INF, -3.0, np.nan, -INF],
            [-1.0, INF, 2.0, INF, np.nan],  # +inf is the maximum
            [-0.0, 0.0, -1.0, 0.0, -0.0],  # -0 ties with +0
            [-3.4e38, -3.4e38, -INF, np.nan, -3.4e38],
        ],
        np.float32,
    )
    ids = gpu_sample(gpu, registry, rows, np.zeros(len(rows)), temperature=0.0)
    np.testing.assert_array_equal(ids, [0, 0, 2, 1, 0, 0])


# -- sampling against the reference on a grid of u ---------------------------------------------------------
SAMPLING_CASES = [
    {"temperature": 1.0},
    {"temperature": 0.7, "top_k": 50},
    {"temperature": 0.7, "top_p": 0.9},
    {"temperature": 1.3, "top_k": 100, "top_p": 0.8},
    {"temperature": 0.5, "top_p": 1.0},
]


@pytest.mark.parametrize("options", SAMPLING_CASES, ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
def test_each_u_of_a_grid_gets_the_reference_token_and_the_histogram_matches(gpu, registry, rng, options):
    vocab, n = 1000, 512
    logits = (rng.standard_normal(vocab) * 2).astype(np.float32)
    params = SamplingParams(**options)
    us = u_grid(n)
    ids = gpu_sample(gpu, registry, np.tile(logits, (n, 1)), us, **options)
    probs = filtered_probs(logits, params)
    near_ties = assert_matches_reference(np.tile(logits, (n, 1)), us, ids, params)
    assert near_ties <= n // 20  # ~vocab * 2 * MARGIN of the u range lies near a boundary
    # A grid of n points puts within one of n * p_i points into each token's CDF interval.
    counts = np.bincount(ids, minlength=vocab)
    assert np.abs(counts - n * probs).max() <= 1 + near_ties


def test_random_u_gives_tokens_that_follow_the_filtered_distribution(gpu, registry, rng):
    # What generation does: one uniform draw per row. The grid test above pins each u's token; this one checks
    # the statistical consequence with the criterion every sampler test shares.
    vocab, n = 64, 8192
    options = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
    logits = (rng.standard_normal(vocab) * 2).astype(np.float32)
    ids = gpu_sample(gpu, registry, np.tile(logits, (n, 1)), rng.random(n), **options)
    assert_histograms_converge(ids, filtered_probs(logits, SamplingParams(**options)), rng)


def test_top_k_keeps_exactly_k_tokens_with_boundary_ties_to_the_lowest_indices(gpu, registry, rng):
    vocab, k, n = 4099, 20, 400
    logits = rng.uniform(-5.0, 0.9, vocab).astype(np.float32)
    top = rng.choice(vocab, size=12 + 15, replace=False)
    logits[top[:12]] = rng.uniform(2.0, 3.0, 12)
    logits[top[12:]] = 1.0  # 15 tokens tied at the boundary; only the 8 lowest indices fit in k = 20
    expected = set(top[:12].tolist()) | set(np.sort(top[12:])[:8].tolist())
    # A huge temperature flattens the kept tokens to ~1/k each, so a grid of n >> k visits every one.
    ids = gpu_sample(gpu, registry, np.tile(logits, (n, 1)), u_grid(n), temperature=1e4, top_k=k)
    assert set(ids.tolist()) == expected


def test_top_p_keeps_every_token_tied_at_the_threshold(gpu, registry):
    vocab, n = 1000, 400
    logits = np.full(vocab, -10.0, np.float32)
    logits[700] = 3.0
    ties = [3, 250, 251, 600, 998, 999]
    logits[ties] = 2.0
    # Token 700 plus three of the six tied tokens already pass 0.65 of the mass; all six are kept.
    params = SamplingParams(temperature=1.0, top_p=0.65)
    ids = gpu_sample(gpu, registry, np.tile(logits, (n, 1)), u_grid(n), temperature=1.0, top_p=0.65)
    assert set(ids.tolist()) == {700, *ties}
    assert_matches_reference(np.tile(logits, (n, 1)), u_grid(n), ids, params)


def test_a_tiny_top_p_returns_the_argmax(gpu, registry, rng):
    rows, vocab = 64, 4099
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    ids = gpu_sample(gpu, registry, logits, rng.random(rows), temperature=1.0, top_p=1e-6)
    np.testing.assert_array_equal(ids, np.argmax(logits, axis=1))


def test_rows_in_one_dispatch_sample_independently_with_their_own_u(gpu, registry, rng):
    rows, vocab = 37, 4099
    logits = (rng.standard_normal((rows, vocab)) * rng.uniform(0.5, 4.0, (rows, 1))).astype(np.float32)
    us = rng.random(rows).astype(np.float32)
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.85)
    ids = gpu_sample(gpu, registry, logits, us, temperature=0.9, top_k=40, top_p=0.85)
    assert assert_matches_reference(logits, us, ids, params) <= 1
    assert len(set(ids.tolist())) > rows // 2  # rows did not all read the same row or the same u


@pytest.mark.parametrize(
    "options", [{"temperature": 0.0}, {"temperature": 0.8, "top_k": 50}, {"temperature": 0.8, "top_p": 0.9}]
)
def test_a_49152_token_vocabulary_matches_the_reference(gpu, registry, rng, options):
    rows, vocab = 4, 49152
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    us = rng.random(rows).astype(np.float32)
    params = SamplingParams(**options)
    assert assert_matches_reference(logits, us, gpu_sample(gpu, registry, logits, us, **options), params) <= 1


# -- degenerate rows ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options",
    [{"temperature": 0.0}, {"temperature": 1.0}, {"temperature": 0.5, "top_k": 1}, {"temperature": 2.0, "top_p": 0.1}],
)
def test_a_vocabulary_of_one_always_returns_token_0(gpu, registry, options):
    logits = np.array([[0.5], [-INF], [np.nan], [INF]], np.float32)
    ids = gpu_sample(gpu, registry, logits, [0.0, 0.3, 0.6, 0.99], **options)
    np.testing.assert_array_equal(ids, 0)


def test_rows_without_finite_logits_are_sampled_uniformly_over_the_kept_tokens(gpu, registry):
    n = 64
    row = np.array([-INF, np.nan, -INF, -INF, np.nan, -INF, -INF], np.float32)
    ids = gpu_sample(gpu, registry, np.tile(row, (n, 1)), u_grid(n), temperature=1.0, top_k=4)
    np.testing.assert_array_equal(np.bincount(ids, minlength=7), [16, 16, 16, 16, 0, 0, 0])


def test_nan_and_minus_infinity_tokens_are_never_sampled(gpu, registry, rng):
    vocab, n = 300, 256
    logits = rng.standard_normal(vocab).astype(np.float32)
    bad = rng.choice(vocab, size=100, replace=False)
    logits[bad[:50]] = np.nan
    logits[bad[50:]] = -INF
    ids = gpu_sample(gpu, registry, np.tile(logits, (n, 1)), u_grid(n), temperature=5.0)
    assert not set(ids.tolist()) & set(bad.tolist())


def test_infinite_and_overflowing_scaled_logits_take_all_the_mass(gpu, registry):
    n = 64
    row = np.array([3.0, 1e30, -INF, INF, np.nan, 1e30, -1e30], np.float32)
    plus_inf = gpu_sample(gpu, registry, np.tile(row, (n, 1)), u_grid(n), temperature=1.0)
    assert set(plus_inf.tolist()) == {3}
    # 1e30 / 1e-10 overflows float32 to +inf, so those tokens join token 3 in an even three-way split.
    overflow = gpu_sample(gpu, registry, np.tile(row, (n, 1)), u_grid(n), temperature=1e-10)
    assert np.bincount(overflow, minlength=7)[[1, 3, 5]].tolist() == [21, 22, 21]


def test_u_at_the_ends_of_the_interval_picks_the_first_and_last_kept_tokens(gpu, registry, rng):
    vocab = 4099
    logits = rng.standard_normal(vocab).astype(np.float32)
    logits[[0, -1]] = 4.0
    last_u = np.nextafter(np.float32(1.0), np.float32(0.0))
    # u = 1 is outside the contract's [0, 1) but a draw just below 1 can round up to it in float32.
    ids = gpu_sample(gpu, registry, np.tile(logits, (3, 1)), [0.0, last_u, 1.0], temperature=1.0)
    np.testing.assert_array_equal(ids, [0, vocab - 1, vocab - 1])


# -- the op's interface ------------------------------------------------------------------------------------
def test_record_validates_rows_and_options(gpu, registry):
    sampler = Sampler(
        registry,
        Tensor.empty(gpu, (2, 10)),
        Tensor.empty(gpu, 2),
        Tensor.empty(gpu, 2, "u32"),
        vocab=10,
        max_rows=2,
    )
    rec = registry.recorder()
    with pytest.raises(ValueError, match="rows"):
        sampler.record(rec, 3, temperature=0.0)
    with pytest.raises(GenerationOptionError, match="top_p"):
        sampler.record(rec, 1, temperature=1.0, top_p=0.0)
    with pytest.raises(GenerationOptionError, match="temperature"):
        sampler.record(rec, 1, temperature=-1.0)
    assert rec.dispatches == 0


def test_tensors_of_the_wrong_dtype_or_size_are_rejected(gpu, registry):
    logits, randoms, ids = Tensor.empty(gpu, (2, 10)), Tensor.empty(gpu, 2), Tensor.empty(gpu, 2, "u32")
    with pytest.raises(ValueError, match="out_ids"):
        Sampler(registry, logits, randoms, Tensor.empty(gpu, 2, "i32"), vocab=10, max_rows=2)
    with pytest.raises(ValueError, match="logits"):
        Sampler(registry, logits, randoms, ids, vocab=11, max_rows=2)


def test_one_sampler_records_new_options_each_submit(gpu, registry, rng):
    vocab = 1000
    logits = rng.standard_normal((2, vocab)).astype(np.float32)
    us = np.array([0.3, 0.8], np.float32)
    out = Tensor.empty(gpu, 2, "u32")
    sampler = Sampler(
        registry, Tensor.from_numpy(gpu, logits), Tensor.from_numpy(gpu, us), out, vocab=vocab, max_rows=2
    )
    for options in ({"temperature": 0.0}, {"temperature": 1.0, "top_k": 1}, {"temperature": 1.0, "top_p": 0.5}):
        rec = registry.recorder()
        sampler.record(rec, 2, **options)
        rec.submit()
        assert_matches_reference(logits, us, out.numpy(), SamplingParams(**options))
