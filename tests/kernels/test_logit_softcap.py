"""Gemma 2's final logit soft-capping (shaders/logit_softcap.wgsl) vs numpy: cap * tanh(x / cap).

Tolerance: atol 2e-6 * cap. The kernel evaluates tanh as 2 / (1 + exp(-2y)) - 1 in f32: exp's relative error
and the final subtraction (which cancels near y = 0) leave an absolute error of a few f32 ulps of 1, times cap;
a wrong formula or a missed element is off by far more. Infinite logits map to +-cap.
"""

from __future__ import annotations

import numpy as np
import pytest

from doppler_py.gpu.tensor import Tensor
from doppler_py.ops import elementwise
from doppler_py.ops.elementwise import LogitSoftCap


def capped(x: np.ndarray, cap: float) -> np.ndarray:
    return (cap * np.tanh(x.astype(np.float64) / cap)).astype(np.float32)


@pytest.mark.parametrize(("rows", "vocab"), [(1, 1), (3, 7), (2, 1000), (5, 49157)])
@pytest.mark.parametrize("cap", [0.5, 30.0])
def test_logits_are_capped_in_place_for_the_rows_asked(gpu, registry, rng, rows, vocab, cap):
    max_rows = rows + 1
    logits = (rng.standard_normal((max_rows, vocab)) * 3 * cap).astype(np.float32)
    tensor = Tensor.from_numpy(gpu, logits)
    op = LogitSoftCap(registry, tensor, vocab=vocab, max_rows=max_rows, cap=cap)
    rec = registry.recorder()
    op.record(rec, rows)
    rec.submit()
    got = tensor.numpy().reshape(max_rows, vocab)
    np.testing.assert_allclose(got[:rows], capped(logits[:rows], cap), rtol=0, atol=2e-6 * cap)
    np.testing.assert_array_equal(got[rows:], logits[rows:])  # rows past the call are untouched


def test_extreme_logits_stay_finite(gpu, registry):
    # (NaN is not checked: WGSL lets implementations assume no NaNs, so none may rely on how it propagates.)
    logits = np.array([[-np.inf, np.inf, 3e38, -3e38, 0.0, -0.0, 1e-30]], np.float32)
    tensor = Tensor.from_numpy(gpu, logits)
    op = LogitSoftCap(registry, tensor, vocab=7, max_rows=1, cap=30.0)
    rec = registry.recorder()
    op.record(rec, 1)
    rec.submit()
    np.testing.assert_allclose(tensor.numpy().reshape(-1), [-30, 30, 30, -30, 0, 0, 0], rtol=0, atol=1e-5)


def test_a_grid_smaller_than_the_logits_strides_over_all_of_them(gpu, registry, rng, monkeypatch):
    """Past 65535 workgroups (vocab x rows beyond ~16.7M) each invocation covers several elements."""
    monkeypatch.setattr(elementwise, "MAX_SOFTCAP_WORKGROUPS", 2)
    logits = rng.standard_normal((3, 1001)).astype(np.float32)
    tensor = Tensor.from_numpy(gpu, logits)
    op = LogitSoftCap(registry, tensor, vocab=1001, max_rows=3, cap=1.0)
    rec = registry.recorder()
    op.record(rec, 3)
    rec.submit()
    np.testing.assert_allclose(tensor.numpy().reshape(3, 1001), capped(logits, 1.0), rtol=0, atol=2e-6)


def test_a_cap_must_be_positive(registry, gpu):
    with pytest.raises(ValueError, match="cap must be positive"):
        LogitSoftCap(registry, Tensor.empty(gpu, 8), vocab=8, max_rows=1, cap=0.0)
