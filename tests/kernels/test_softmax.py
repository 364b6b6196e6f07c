"""Softmax / log-softmax with temperature (`doppler_py.ops.softmax.Softmax`) against the float64 references in
`doppler_py.testing.references`.

Tolerances: probabilities rtol 1e-5 (WGSL allows exp an error of 3 + 2|x| ulp, ~4e-6 relative at
|x| = 30; the f32 sum over 49152 columns adds ~1e-6), atol 1e-12 for the far tail; log-probabilities
atol 2e-5 + rtol 1e-6 (the f32 difference x - max rounds at ~|x| * 6e-8, log(sum) to a few ulps).
"""

from __future__ import annotations

import numpy as np
import pytest

from doppler_py.errors import GenerationOptionError
from doppler_py.gpu.tensor import Tensor
from doppler_py.ops.softmax import Softmax
from doppler_py.testing.references import log_softmax, softmax


def reference(logits: np.ndarray, temperature: float, log: bool) -> np.ndarray:
    return (log_softmax if log else softmax)(logits, temperature)


def run_softmax(gpu, registry, logits, *, log, temperature=1.0, rows=None):
    rows = rows or logits.shape[0]
    out = Tensor.from_numpy(gpu, np.full(logits.shape, 5.0, np.float32))
    op = Softmax(registry, Tensor.from_numpy(gpu, logits), out, cols=logits.shape[1], max_rows=logits.shape[0], log=log)
    rec = registry.recorder()
    op.record(rec, rows=rows, temperature=temperature)
    rec.submit()
    return out.numpy()


def assert_matches(out: np.ndarray, expected: np.ndarray, log: bool) -> None:
    assert not np.isnan(out).any()
    np.testing.assert_array_equal(np.isneginf(out), np.isneginf(expected))
    finite = np.isfinite(expected)
    if log:
        np.testing.assert_allclose(out[finite], expected[finite], rtol=1e-6, atol=2e-5)
    else:
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("cols", [1, 7, 255, 257, 1000, 49152])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_reference_for_awkward_sizes(gpu, registry, rng, cols, log, temperature):
    logits = (rng.standard_normal((3, cols)) * 4).astype(np.float32)
    out = run_softmax(gpu, registry, logits, log=log, temperature=temperature)
    assert_matches(out, reference(logits, temperature, log), log)


def test_vocab_sized_probabilities_sum_to_one(gpu, registry, rng):
    logits = (rng.standard_normal((2, 49152)) * 3).astype(np.float32)
    probs = run_softmax(gpu, registry, logits, log=False, temperature=0.5)
    np.testing.assert_allclose(probs.astype(np.float64).sum(axis=1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_huge_logits_neither_overflow_nor_underflow_the_rest(gpu, registry, rng, log):
    logits = rng.standard_normal((3, 300)).astype(np.float32)
    logits[0, [3, 200]] = 1e30  # two tied giants share the mass
    logits[1, :] = -1e30
    logits[1, 17] = 1e30
    logits[2, :] += 1e30  # all giant and close: same distribution as without the offset up to f32 rounding
    out = run_softmax(gpu, registry, logits, log=log, temperature=0.5)
    expected = reference(logits, 0.5, log)
    assert_matches(out, expected, log)
    if not log:
        np.testing.assert_array_equal(out[0, [3, 200]], [0.5, 0.5])
        assert out[1, 17] == 1.0


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_minus_inf_entries_are_masked_out(gpu, registry, rng, log):
    logits = rng.standard_normal((2, 517)).astype(np.float32)
    logits[0, ::3] = -np.inf
    logits[1, :-1] = -np.inf  # only the last column survives
    out = run_softmax(gpu, registry, logits, log=log)
    assert_matches(out, reference(logits, 1.0, log), log)
    if log:
        assert np.isneginf(out[0, ::3]).all() and out[1, -1] == 0.0
    else:
        assert (out[0, ::3] == 0).all() and out[1, -1] == 1.0


def test_a_row_of_only_minus_inf_has_zero_mass_and_minus_inf_log_probs(gpu, registry, rng):
    logits = rng.standard_normal((3, 300)).astype(np.float32)
    logits[1] = -np.inf
    probs = run_softmax(gpu, registry, logits, log=False)
    log_probs = run_softmax(gpu, registry, logits, log=True)
    assert (probs[1] == 0).all() and np.isneginf(log_probs[1]).all()
    # The neighbouring rows are unaffected.
    assert_matches(probs[[0, 2]], reference(logits[[0, 2]], 1.0, False), False)
    assert_matches(log_probs[[0, 2]], reference(logits[[0, 2]], 1.0, True), True)


def test_single_column_rows_are_certain(gpu, registry):
    logits = np.array([[3.0], [-1e30], [-np.inf]], np.float32)
    np.testing.assert_array_equal(run_softmax(gpu, registry, logits, log=False)[:, 0], [1.0, 1.0, 0.0])
    np.testing.assert_array_equal(run_softmax(gpu, registry, logits, log=True)[:, 0], [0.0, 0.0, -np.inf])


def test_only_the_recorded_rows_are_written(gpu, registry, rng):
    logits = rng.standard_normal((4, 100)).astype(np.float32)
    out = run_softmax(gpu, registry, logits, log=False, rows=2)
    assert_matches(out[:2], reference(logits[:2], 1.0, False), False)
    assert (out[2:] == 5.0).all()


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("inf"), float("nan")])
def test_temperature_must_be_positive_and_finite(gpu, registry, temperature):
    t = Tensor.empty(gpu, (1, 8))
    op = Softmax(registry, t, Tensor.empty(gpu, (1, 8)), cols=8, max_rows=1)
    with pytest.raises(GenerationOptionError, match="temperature"):
        op.record(registry.recorder(), rows=1, temperature=temperature)
