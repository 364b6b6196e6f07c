"""Residual add (acc += delta in place). One f32 addition per element is exactly rounded, so results must
equal numpy's float32 addition bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from support.residual import Residual

from doppler_py.gpu.tensor import Tensor


def test_adds_delta_into_acc_for_the_recorded_rows_only(gpu, registry, rng):
    dim, max_rows, rows = 577, 4, 3
    acc0 = rng.standard_normal((max_rows, dim)).astype(np.float32)
    delta = rng.standard_normal((max_rows, dim)).astype(np.float32)
    acc = Tensor.from_numpy(gpu, acc0)
    op = Residual(registry, Tensor.from_numpy(gpu, delta), acc, dim=dim, max_rows=max_rows)
    rec = registry.recorder()
    op.record(rec, rows=rows)
    rec.submit()
    got = acc.numpy()
    np.testing.assert_array_equal(got[:rows], acc0[:rows] + delta[:rows])
    np.testing.assert_array_equal(got[rows:], acc0[rows:])


def test_attention_and_mlp_outputs_accumulate_in_order_within_one_submit(gpu, registry, rng):
    dim = 300
    hidden0 = rng.standard_normal((2, dim)).astype(np.float32)
    attn = rng.standard_normal((2, dim)).astype(np.float32)
    mlp = rng.standard_normal((2, dim)).astype(np.float32)
    hidden = Tensor.from_numpy(gpu, hidden0)
    add_attn = Residual(registry, Tensor.from_numpy(gpu, attn), hidden, dim=dim, max_rows=2)
    add_mlp = Residual(registry, Tensor.from_numpy(gpu, mlp), hidden, dim=dim, max_rows=2)
    rec = registry.recorder()
    add_attn.record(rec, rows=2)
    add_mlp.record(rec, rows=1)
    rec.submit()
    expected = hidden0 + attn
    expected[:1] += mlp[:1]
    np.testing.assert_array_equal(hidden.numpy(), expected)


def test_rejects_rows_beyond_max_rows_and_short_tensors(gpu, registry):
    t = Tensor.empty(gpu, (2, 16))
    op = Residual(registry, t, Tensor.empty(gpu, (2, 16)), dim=16, max_rows=2)
    with pytest.raises(ValueError, match="rows"):
        op.record(registry.recorder(), rows=3)
    with pytest.raises(ValueError, match="Residual acc"):
        Residual(registry, Tensor.empty(gpu, (4, 16)), t, dim=16, max_rows=4)
