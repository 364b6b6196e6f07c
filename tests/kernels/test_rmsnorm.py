"""RMSNorm kernel against HF LlamaRMSNorm (`doppler_py.testing.references.rmsnorm`, float64).

Tolerance: rtol 2e-6. The kernel rounds the sum of squares (a tree of f32 partial sums: relative error
~1e-7 for 8192 terms), inverseSqrt (WGSL allows 2 ulp) and two products, i.e. a handful of f32 ulps (6e-8).
"""

from __future__ import annotations

import numpy as np
import pytest

from doppler_py.gpu.tensor import Tensor
from doppler_py.ops.norms import HeadRMSNorm, RMSNorm
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


@pytest.mark.parametrize("out_scale", [1.0, 0.375])
def test_accumulate_adds_the_normalised_rows_to_out_then_scales_the_sum(gpu, registry, rng, out_scale):
    """Gemma's post-attention / post-MLP norms: x += rmsnorm(y); with Gemma 4's layer_scalar on a layer's last add,
    x = (x + rmsnorm(y)) * s, rounded in that order."""
    dim, rows = 96, 3
    y = rng.standard_normal((rows, dim)).astype(np.float32)
    weight = (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32)
    residual = rng.standard_normal((rows, dim)).astype(np.float32)
    out = Tensor.from_numpy(gpu, residual)
    op = RMSNorm(
        registry, Tensor.from_numpy(gpu, y), Tensor.from_numpy(gpu, weight), out, dim=dim, eps=EPS, max_rows=rows,
        accumulate=True, out_scale=out_scale,
    )  # fmt: skip
    rec = registry.recorder()
    op.record(rec, rows=2)
    rec.submit()
    got = out.numpy()
    expected = (residual[:2] + rmsnorm(y[:2], weight, EPS)) * out_scale
    np.testing.assert_allclose(got[:2], expected, rtol=2e-6, atol=1e-6)
    assert (got[2] == residual[2]).all()
    with pytest.raises(ValueError, match="accumulate"):
        RMSNorm(registry, Tensor.from_numpy(gpu, y), Tensor.from_numpy(gpu, weight), out, dim=dim, eps=EPS,
                max_rows=rows, out_scale=2.0)  # fmt: skip


@pytest.mark.parametrize(("q_heads", "k_heads", "head_dim"), [(4, 2, 32), (9, 3, 64), (2, 1, 256), (3, 3, 16)])
def test_head_norm_normalises_each_q_and_k_head_in_place(gpu, registry, rng, q_heads, k_heads, head_dim):
    """Qwen3 / Gemma 3 q_norm and k_norm over the fused [q | k | v] rows: q heads with the first weight, k heads
    with the second, v heads and rows past `rows` untouched."""
    rows, max_rows = 3, 4
    stride = (q_heads + 2 * k_heads) * head_dim
    qkv = (rng.standard_normal((max_rows, stride)) * 3).astype(np.float32)
    weight = (1 + 0.1 * rng.standard_normal(2 * head_dim)).astype(np.float32)
    t = Tensor.from_numpy(gpu, qkv)
    op = HeadRMSNorm(
        registry, t, Tensor.from_numpy(gpu, weight), q_heads=q_heads, k_heads=k_heads, head_dim=head_dim,
        row_stride=stride, eps=EPS, max_rows=max_rows,
    )  # fmt: skip
    rec = registry.recorder()
    op.record(rec, rows=rows)
    rec.submit()
    got = t.numpy()
    q_end, k_end = q_heads * head_dim, (q_heads + k_heads) * head_dim
    q = qkv[:rows, :q_end].reshape(rows, q_heads, head_dim)
    k = qkv[:rows, q_end:k_end].reshape(rows, k_heads, head_dim)
    expected_q = rmsnorm(q, weight[:head_dim], EPS).reshape(rows, -1)
    expected_k = rmsnorm(k, weight[head_dim:], EPS).reshape(rows, -1)
    np.testing.assert_allclose(got[:rows, :q_end], expected_q, rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(got[:rows, q_end:k_end], expected_k, rtol=2e-6, atol=1e-7)
    assert (got[:rows, k_end:] == qkv[:rows, k_end:]).all(), "v heads must be left alone"
    assert (got[rows:] == qkv[rows:]).all(), "rows past `rows` must be left alone"


@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim"), [(4, 1, 32), (8, 2, 64), (2, 2, 256)])
def test_head_norm_with_v_heads_gives_them_the_third_weight(gpu, registry, rng, q_heads, kv_heads, head_dim):
    """Gemma 4: q_norm, k_norm, then v_norm (weightless: its weight section is ones) over the whole row."""
    rows, max_rows = 3, 4
    stride = (q_heads + 2 * kv_heads) * head_dim
    qkv = (rng.standard_normal((max_rows, stride)) * 3).astype(np.float32)
    weight = np.concatenate([1 + 0.1 * rng.standard_normal(2 * head_dim), np.ones(head_dim)]).astype(np.float32)
    t = Tensor.from_numpy(gpu, qkv)
    op = HeadRMSNorm(
        registry, t, Tensor.from_numpy(gpu, weight), q_heads=q_heads, k_heads=kv_heads, v_heads=kv_heads,
        head_dim=head_dim, row_stride=stride, eps=EPS, max_rows=max_rows,
    )  # fmt: skip
    rec = registry.recorder()
    op.record(rec, rows=rows)
    rec.submit()
    heads = qkv[:rows].reshape(rows, -1, head_dim)
    sections = np.repeat([0, 1, 2], [q_heads, kv_heads, kv_heads])
    expected = np.stack([rmsnorm(heads[:, h], weight.reshape(3, head_dim)[s], EPS) for h, s in enumerate(sections)], 1)
    np.testing.assert_allclose(t.numpy()[:rows], expected.reshape(rows, -1), rtol=2e-6, atol=1e-7)
    assert (t.numpy()[rows:] == qkv[rows:]).all(), "rows past `rows` must be left alone"
