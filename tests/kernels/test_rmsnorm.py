"""RMSNorm kernel against HF LlamaRMSNorm (`doppler_py.testing.references.rmsnorm`, float64).

Tolerance: rtol 2e-6. The kernel rounds the sum of squares (a tree of f32 partial sums: relative error
~1e-7 for 8192 terms), inverseSqrt (WGSL allows 2 ulp) and two products, i.e. a handful of f32 ulps (6e-8).
"""

from __future__ import annotations

import numpy as np
import pytest

from doppler_py.gpu.tensor import Tensor
from doppler_py.ops.norms import RMSNorm
from doppler_py.testing.references import rmsnorm

EPS = 1e-5


def run_rmsnorm(gpu, registry, x, weight, *, rows, max_rows, eps=EPS, fill=0.0):
    dim = weight.size
    out = Tensor.from_numpy(gpu, np.full((max_rows, dim), fill, np.float32))
    op = RMSNorm(
        registry, Tensor.from_numpy(gpu, x), Tensor.from_numpy(gpu, weight), out, dim=dim, eps=eps, max_rows=max_rows
    )
    rec = registry.recorder()
    op.record(rec, rows=rows)
    rec.submit()
    return out.numpy()


@pytest.mark.parametrize("dim", [1, 7, 255, 257, 576, 8192])
def test_matches_hf_llama_rms_norm(gpu, registry, rng, dim):
    x = (rng.standard_normal((3, dim)) * 2).astype(np.float32)
    weight = rng.standard_normal(dim).astype(np.float32)
    out = run_rmsnorm(gpu, registry, x, weight, rows=3, max_rows=3)
    np.testing.assert_allclose(out, rmsnorm(x, weight, EPS), rtol=2e-6, atol=1e-7)


def test_only_the_recorded_rows_are_written(gpu, registry, rng):
    x = rng.standard_normal((5, 300)).astype(np.float32)
    weight = rng.standard_normal(300).astype(np.float32)
    out = run_rmsnorm(gpu, registry, x, weight, rows=2, max_rows=5, fill=-7.0)
    np.testing.assert_allclose(out[:2], rmsnorm(x[:2], weight, EPS), rtol=2e-6, atol=1e-7)
    assert (out[2:] == -7.0).all()


def test_eps_keeps_tiny_and_all_zero_rows_finite(gpu, registry, rng):
    x = np.zeros((3, 64), np.float32)
    x[1] = 1e-4 * rng.standard_normal(64)  # mean square ~1e-8, far below eps: eps dominates the scale
    x[2] = 1e-20  # squares underflow to 0 in f32, as they do in HF's f32 computation
    weight = rng.standard_normal(64).astype(np.float32)
    out = run_rmsnorm(gpu, registry, x, weight, rows=3, max_rows=3)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[:2], rmsnorm(x[:2], weight, EPS), rtol=2e-6, atol=1e-12)
    np.testing.assert_allclose(out[2], weight * 1e-20 / np.sqrt(EPS), rtol=2e-6)


def test_one_op_serves_decode_and_prefill_row_counts(gpu, registry, rng):
    dim, max_rows = 576, 9
    x = rng.standard_normal((max_rows, dim)).astype(np.float32)
    weight = rng.standard_normal(dim).astype(np.float32)
    x_t, out = Tensor.from_numpy(gpu, x), Tensor.empty(gpu, (max_rows, dim))
    op = RMSNorm(registry, x_t, Tensor.from_numpy(gpu, weight), out, dim=dim, eps=EPS, max_rows=max_rows)
    for rows in (max_rows, 1, 4):
        out.write(np.zeros((max_rows, dim), np.float32))
        rec = registry.recorder()
        op.record(rec, rows=rows)
        rec.submit()
        got = out.numpy()
        np.testing.assert_allclose(got[:rows], rmsnorm(x[:rows], weight, EPS), rtol=2e-6, atol=1e-7)
        assert (got[rows:] == 0).all()


def test_rejects_row_counts_and_tensors_that_do_not_fit(gpu, registry):
    x, weight, out = Tensor.empty(gpu, (2, 8)), Tensor.empty(gpu, 8), Tensor.empty(gpu, (2, 8))
    op = RMSNorm(registry, x, weight, out, dim=8, eps=EPS, max_rows=2)
    with pytest.raises(ValueError, match="rows"):
        op.record(registry.recorder(), rows=3)
    with pytest.raises(ValueError, match="at least 24"):
        RMSNorm(registry, x, weight, out, dim=8, eps=EPS, max_rows=3)
    with pytest.raises(ValueError, match="f32"):
        RMSNorm(registry, x, Tensor.empty(gpu, 8, "f16"), out, dim=8, eps=EPS, max_rows=2)
