"""The streaming-read kernel (shaders/stream_read.wgsl) reads every element exactly once: each workgroup's sum
equals numpy's sum of the elements its span covers.

Tolerances: u32 loads sum modulo 2^32, exactly as numpy's uint32 sum, so they must be equal. f32 loads sum in
another order than numpy: with small integers every partial sum is exact (|sum| < 2^24), so those must be equal
too; with normal values the sum of a span must agree with numpy's float64 sum within 2e-6 of the sum of |values|
(float32 rounding over at most a few thousand additions, each off by at most 2^-24 of the running magnitude).
"""

from __future__ import annotations

import numpy as np
import pytest

from doppler_py.gpu.tensor import Tensor
from doppler_py.ops.stream_read import LOADS, PATTERNS, StreamRead, min_per_invocation


def span_sums(values: np.ndarray, span: int, dtype) -> np.ndarray:
    """Per workgroup: the sum of its span of elements (rows of `values` when they are vec4s)."""
    flat = values.reshape(len(values), -1)
    return np.array([flat[i : i + span].sum(dtype=dtype) for i in range(0, len(flat), span)], dtype=dtype)


def read(gpu, registry, values: np.ndarray, load: str, **shape) -> np.ndarray:
    op = StreamRead(registry, Tensor.from_numpy(gpu, values, LOADS[load].dtype), load, **shape)
    rec = registry.recorder()
    op.record(rec)
    rec.submit()
    partials = op.partials()
    op.release()
    return partials


def elements(rng, load: str, n: int) -> np.ndarray:
    """n elements of the load type: small integers (as f32) or any u32 words."""
    shape = (n,) if LOADS[load].lanes == 1 else (n, 4)
    if LOADS[load].dtype == "u32":
        return rng.integers(0, 2**32, size=shape, dtype=np.uint64).astype(np.uint32)
    return rng.integers(-8, 9, size=shape).astype(np.float32)


# Lengths: one element, fewer than a workgroup, a workgroup's span plus a few, several spans and a ragged tail.
@pytest.mark.parametrize("load", list(LOADS))
@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("workgroup_size", [16, 64, 48])
@pytest.mark.parametrize("unroll", [1, 4])
@pytest.mark.parametrize("n", [1, 5, 16 * 7 + 3, 4099])
def test_each_workgroup_sums_exactly_the_elements_of_its_span(
    gpu, registry, rng, load, pattern, workgroup_size, unroll, n
):
    per_invocation = 7  # with unroll 4: one round of 4 loads, then 3 one by one
    values = elements(rng, load, n)
    shape = {"workgroup_size": workgroup_size, "pattern": pattern, "per_invocation": per_invocation, "unroll": unroll}
    got = read(gpu, registry, values, load, **shape)
    span = workgroup_size * per_invocation
    dtype = np.uint32 if LOADS[load].dtype == "u32" else np.float32
    assert got.shape == (-(-n // span),)
    np.testing.assert_array_equal(got, span_sums(values, span, dtype))


@pytest.mark.parametrize("load", ["f32", "vec4<f32>"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("unroll", [1, 4])
def test_f32_sums_of_normal_values_agree_with_numpy_within_the_stated_tolerance(
    gpu, registry, rng, load, pattern, unroll
):
    n, workgroup_size, per_invocation = 10_001, 64, 33
    values = rng.standard_normal((n,) if load == "f32" else (n, 4)).astype(np.float32)
    shape = {"workgroup_size": workgroup_size, "pattern": pattern, "per_invocation": per_invocation, "unroll": unroll}
    got = read(gpu, registry, values, load, **shape)
    span = workgroup_size * per_invocation
    expected = span_sums(values.astype(np.float64), span, np.float64)
    magnitude = span_sums(np.abs(values).astype(np.float64), span, np.float64)
    assert np.all(np.abs(got - expected) <= 2e-6 * magnitude)


def test_one_invocation_workgroups_and_a_whole_buffer_in_one_invocation(gpu, registry, rng):
    values = elements(rng, "vec4<u32>", 1000)
    one_each = read(gpu, registry, values, "vec4<u32>", workgroup_size=1, per_invocation=1)
    np.testing.assert_array_equal(one_each, values.sum(axis=1, dtype=np.uint32))
    all_in_one = read(gpu, registry, values, "vec4<u32>", workgroup_size=1, per_invocation=1000)
    assert all_in_one.tolist() == [values.sum(dtype=np.uint32)]


def test_a_buffer_of_ones_sums_to_its_length_whatever_the_shape(gpu, registry):
    # What tools/bench_bandwidth.py checks after timing: every element read once, none past the end.
    ones = np.ones((3000, 4), np.float32)
    for workgroup_size, pattern, per_invocation, unroll in [
        (256, "interleaved", 2, 1),
        (256, "contiguous", 1, 4),
        (32, "contiguous", 100, 4),
        (16, "interleaved", 9, 4),
    ]:
        shape = {"workgroup_size": workgroup_size, "pattern": pattern, "per_invocation": per_invocation}
        sums = read(gpu, registry, ones, "vec4<f32>", **shape, unroll=unroll)
        assert sums.sum(dtype=np.float64) == ones.size


def test_rejects_shapes_the_kernel_cannot_run(gpu, registry):
    src = Tensor.from_numpy(gpu, np.zeros(10, np.float32))
    with pytest.raises(ValueError, match="whole"):
        StreamRead(registry, src, "vec4<f32>")  # 10 floats are not whole vec4s
    with pytest.raises(ValueError, match="u32"):
        StreamRead(registry, src, "u32")
    with pytest.raises(ValueError, match="workgroup_size"):
        StreamRead(registry, src, "f32", workgroup_size=512)
    with pytest.raises(ValueError, match="unroll"):
        StreamRead(registry, src, "f32", unroll=2)
    with pytest.raises(ValueError, match="pattern"):
        StreamRead(registry, src, "f32", pattern="random")
    big = Tensor.empty(gpu, 70_000, "u32")
    with pytest.raises(ValueError, match="per invocation"):
        StreamRead(registry, big, "u32", workgroup_size=1, per_invocation=1)
    assert min_per_invocation(70_000, 1, registry.max_workgroups) == 2
    StreamRead(registry, big, "u32", workgroup_size=1, per_invocation=2).release()
