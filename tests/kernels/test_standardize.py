"""An EAGLE head's feature standardisation, (x - mean) / std per column in place, against float64.

Tolerance: rtol 1e-6 (one subtraction and one division in f32, each within 0.5 ulp, rounded once more to f32).
"""

from __future__ import annotations

import numpy as np
import pytest

from doppler_py.gpu.tensor import Tensor
from doppler_py.ops.elementwise import Standardize


def run(gpu, registry, x, mean, std, rows):
    out = Tensor.from_numpy(gpu, x)
    op = Standardize(registry, Tensor.from_numpy(gpu, mean), Tensor.from_numpy(gpu, std), out, max_rows=x.shape[0])
    rec = registry.recorder()
    op.record(rec, rows=rows)
    rec.submit()
    return out.numpy()


def reference(x, mean, std):
    return ((x.astype(np.float64) - mean) / std).astype(np.float32)


@pytest.mark.parametrize("width", [1, 255, 576, 1025])
def test_standardises_every_column_of_the_recorded_rows(gpu, registry, rng, width):
    # SmolLM2-like features: a few massive dimensions in the thousands beside ordinary ones.
    x = rng.standard_normal((5, width)).astype(np.float32)
    x[:, :: max(width // 7, 1)] *= 3000
    mean = (rng.standard_normal(width) * 500).astype(np.float32)
    std = rng.uniform(0.01, 4000, width).astype(np.float32)
    out = run(gpu, registry, x.copy(), mean, std, rows=3)
    np.testing.assert_allclose(out[:3], reference(x[:3], mean, std), rtol=1e-6, atol=1e-12)
    assert (out[3:] == x[3:]).all()  # rows past the recorded ones untouched


def test_a_column_at_its_mean_is_exactly_zero_and_infinities_stay_infinite(gpu, registry):
    x = np.array([[1e4, -2.5, np.inf, 0.0]], np.float32)
    mean = np.array([1e4, -2.5, 0.0, 0.0], np.float32)
    std = np.array([3.0, 1e-3, 2.0, 7.0], np.float32)
    out = run(gpu, registry, x, mean, std, rows=1)
    assert out[0, 0] == 0.0 and out[0, 1] == 0.0 and out[0, 2] == np.inf and out[0, 3] == 0.0


def test_refuses_rows_past_its_max_and_tensors_too_small(gpu, registry):
    width = 8
    x = Tensor.from_numpy(gpu, np.zeros((2, width), np.float32))
    ones = Tensor.from_numpy(gpu, np.ones(width, np.float32))
    op = Standardize(registry, ones, ones, x, max_rows=2)
    with pytest.raises(ValueError, match=r"rows must be in 1\.\.2"):
        op.record(registry.recorder(), rows=3)
    with pytest.raises(ValueError, match="Standardize x holds 16 elements"):
        Standardize(registry, ones, ones, x, max_rows=3)
