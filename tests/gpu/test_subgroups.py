"""The subgroup size kernels may rely on (doppler_py/gpu/subgroups.py) and how Linear uses it."""

from __future__ import annotations

import numpy as np
import pytest

from doppler_py.gpu import subgroups
from doppler_py.gpu.subgroups import (
    WEBGPU_MIN_SUBGROUP_SIZE,
    probe_subgroup_sizes,
    simd_lanes,
    smallest_subgroup_size,
)
from doppler_py.gpu.tensor import Tensor
from doppler_py.gpu.weights import Weight
from doppler_py.ops.linear import Linear


def test_smallest_subgroup_size_is_a_valid_webgpu_subgroup_size(registry):
    size = smallest_subgroup_size(registry)
    if not registry.gpu.has_subgroups:
        assert size == 0
        return
    assert size >= WEBGPU_MIN_SUBGROUP_SIZE and size & (size - 1) == 0
    assert smallest_subgroup_size(registry) == size  # measured once, then remembered


def test_cpu_adapters_report_the_size_every_invocation_ran_with(registry):
    gpu = registry.gpu
    if not (gpu.has_subgroups and gpu.on_cpu):
        pytest.skip("only CPU adapters are measured; GPUs get WebGPU's minimum")
    measured = probe_subgroup_sizes(registry)
    assert np.all(measured == measured[0]), "a CPU adapter runs every invocation at one SIMD width"
    assert smallest_subgroup_size(registry) == max(WEBGPU_MIN_SUBGROUP_SIZE, int(measured[0]))


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_linear_is_correct_with_the_portable_and_the_measured_subgroup_size(registry, rng, rows):
    """SUBGROUP_MIN = 4 keeps the second x load for 4-lane subgroups; the measured size may drop it."""
    gpu = registry.gpu
    if not gpu.has_subgroups:
        pytest.skip("no subgroups on this device")
    n, k = 77, 96
    w = rng.standard_normal((n, k)).astype(np.float32)
    x_host = rng.standard_normal((rows, k)).astype(np.float32)
    want = x_host.astype(np.float64) @ w.T.astype(np.float64)
    x, weight = Tensor.from_numpy(gpu, x_host), Weight.from_numpy(gpu, w, "f32")
    for subgroup_min in sorted({WEBGPU_MIN_SUBGROUP_SIZE, smallest_subgroup_size(registry)}):
        out = Tensor.empty(gpu, (rows, n))
        linear = Linear(registry, weight, x, out, max_rows=rows)
        linear.device_flags = {**linear.device_flags, "SUBGROUP_MIN": subgroup_min}
        rec = registry.recorder()
        linear.record(rec, rows)
        rec.submit()
        got = out.numpy().reshape(rows, n)
        bound = k * 2.0**-23 * (np.abs(x_host) @ np.abs(w).T) + 1e-6
        assert np.all(np.abs(got - want) <= bound), f"SUBGROUP_MIN={subgroup_min}"


@pytest.mark.parametrize(("width", "lanes"), [("512", 16), ("256", 8), ("", 8), ("wide", 8)])
def test_without_subgroups_simd_lanes_follow_the_width_lavapipe_was_given(registry, monkeypatch, width, lanes):
    if not registry.gpu.on_cpu:
        assert simd_lanes(registry) == 1
        return
    monkeypatch.setattr(subgroups, "smallest_subgroup_size", lambda _registry: 0)
    monkeypatch.setenv("LP_NATIVE_VECTOR_WIDTH", width)
    assert simd_lanes(registry) == lanes


def test_cpu_adapters_spread_lanes_by_their_measured_width(registry):
    if not (registry.gpu.on_cpu and registry.gpu.has_subgroups):
        pytest.skip("the width is measured on CPU adapters with subgroups")
    assert simd_lanes(registry) == smallest_subgroup_size(registry)
