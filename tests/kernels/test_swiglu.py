"""SwiGLU over a fused [gate | up] matmul output, against silu(gate) * up in float64
(`doppler_py.testing.references.swiglu`).

Tolerance: rtol 2e-6 — exp (WGSL allows 3 + 2|x| ulp; |x| < 20 here), one division and two products.
"""

from __future__ import annotations

import numpy as np
import pytest

from doppler_py.gpu.tensor import Tensor
from doppler_py.ops.elementwise import PerLayerGate, SwiGLU
from doppler_py.testing.references import gelu_tanh, swiglu


def silu_times_up(gate_up: np.ndarray, ffn_dim: int) -> np.ndarray:
    return swiglu(gate_up[:, :ffn_dim], gate_up[:, ffn_dim:])


def run_swiglu(gpu, registry, gate_up, *, ffn_dim, rows, fill=0.0):
    max_rows = gate_up.shape[0]
    out = Tensor.from_numpy(gpu, np.full((max_rows, ffn_dim), fill, np.float32))
    op = SwiGLU(registry, Tensor.from_numpy(gpu, gate_up), out, ffn_dim=ffn_dim, max_rows=max_rows)
    rec = registry.recorder()
    op.record(rec, rows=rows)
    rec.submit()
    return out.numpy()


@pytest.mark.parametrize("ffn_dim", [1, 255, 1536, 1537])
def test_matches_silu_of_gate_times_up(gpu, registry, rng, ffn_dim):
    gate_up = (rng.standard_normal((3, 2 * ffn_dim)) * 4).astype(np.float32)
    out = run_swiglu(gpu, registry, gate_up, ffn_dim=ffn_dim, rows=3)
    np.testing.assert_allclose(out, silu_times_up(gate_up, ffn_dim), rtol=2e-6, atol=1e-30)


def test_silu_is_finite_and_accurate_for_extreme_gates(gpu, registry):
    gates = np.array([100, -100, 1e4, -1e4, 1e30, -1e30, 88, -88, 87, -87, 20, -20, 0, 1e-30], np.float32)
    gate_up = np.concatenate([gates, np.ones_like(gates)])[None, :]
    out = run_swiglu(gpu, registry, gate_up, ffn_dim=gates.size, rows=1)
    assert np.isfinite(out).all()
    # Large negative gates give |silu| < 1e-35 (kernel: exactly -0); everything else to 2e-6 relative.
    np.testing.assert_allclose(out, silu_times_up(gate_up, gates.size), rtol=2e-6, atol=1e-35)


def test_gate_is_the_first_half_and_up_the_second(gpu, registry):
    ffn_dim = 5
    gate = np.array([0, 0, 50, 50, -50], np.float32)
    up = np.array([3, -3, 2, -2, 7], np.float32)
    out = run_swiglu(gpu, registry, np.concatenate([gate, up])[None, :], ffn_dim=ffn_dim, rows=1)
    # silu(0) = 0 kills the up value; silu(50) = 50 passes it scaled; silu(-50) ~ -1e-20.
    np.testing.assert_allclose(out[0], [0, 0, 100, -100, 0], atol=1e-18)


def test_only_the_recorded_rows_are_written(gpu, registry, rng):
    gate_up = rng.standard_normal((4, 2 * 300)).astype(np.float32)
    out = run_swiglu(gpu, registry, gate_up, ffn_dim=300, rows=2, fill=9.0)
    np.testing.assert_allclose(out[:2], silu_times_up(gate_up[:2], 300), rtol=2e-6, atol=1e-30)
    assert (out[2:] == 9.0).all()


def test_gelu_tanh_variant_matches_torchs_tanh_approximation(gpu, registry, rng):
    """Gemma's GeGLU: gelu(gate, approximate="tanh") * up, including gates far in both tails."""
    ffn_dim = 300
    gate_up = (rng.standard_normal((2, 2 * ffn_dim)) * 4).astype(np.float32)
    gate_up[0, :8] = [100, -100, 1e4, -1e4, 30, -30, 0, 1e-30]
    out = Tensor.empty(gpu, (2, ffn_dim))
    op = SwiGLU(
        registry, Tensor.from_numpy(gpu, gate_up), out, ffn_dim=ffn_dim, max_rows=2, activation="gelu_pytorch_tanh"
    )
    rec = registry.recorder()
    op.record(rec, rows=2)
    rec.submit()
    got = out.numpy()
    assert np.isfinite(got).all()
    expected = gelu_tanh(gate_up[:, :ffn_dim]) * gate_up[:, ffn_dim:]
    # In the negative tail the result is tiny (x * sigmoid(z), z ~ -x^3 / 14) and 1 + tanh, as torch computes
    # it, cancels: there only an absolute bound means anything.
    np.testing.assert_allclose(got, expected, rtol=4e-6, atol=1e-9)


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("layer", [0, 2])
def test_per_layer_gate_multiplies_the_activated_gate_by_its_layer_s_inputs(gpu, registry, rng, activation, layer):
    """Gemma 4: gate = act(gate) * inputs[:, layer * width : (layer + 1) * width], in place, rows past `rows` kept."""
    width, n_layers, rows, max_rows = 288, 3, 3, 4
    gate = (rng.standard_normal((max_rows, width)) * 4).astype(np.float32)
    inputs = rng.standard_normal((max_rows, n_layers * width)).astype(np.float32)
    t = Tensor.from_numpy(gpu, gate)
    op = PerLayerGate(
        registry, Tensor.from_numpy(gpu, inputs), t, width=width, layer=layer, n_layers=n_layers, max_rows=max_rows,
        activation=activation,
    )  # fmt: skip
    rec = registry.recorder()
    op.record(rec, rows=rows)
    rec.submit()
    g = gate[:rows].astype(np.float64)
    act = g / (1 + np.exp(-g)) if activation == "silu" else gelu_tanh(g)
    expected = act * inputs[:rows, layer * width : (layer + 1) * width]
    # gelu's negative tail cancels in 1 + tanh (test_gelu_tanh_variant_matches_torchs_tanh_approximation)
    np.testing.assert_allclose(t.numpy()[:rows], expected, rtol=4e-6, atol=1e-9)
    assert (t.numpy()[rows:] == gate[rows:]).all()
