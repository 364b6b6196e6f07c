"""The unmerged LoRA update (shaders/lora.wgsl) against numpy in float64: out[t, seg] += B (A x[t]) for the rows of
the dispatched adapter only, at awkward sizes (rows past a workgroup's, rank 1 and 64, widths not multiples of 4,
several segments of one fused matmul), with f32 and f16 weights, and with the RMSNorm a fused matmul applies to x.

Tolerance: f32 weights, rtol 1e-5 + atol 1e-5 · scale of the sums (float32 dot products over k ≤ 577 and r ≤ 64 of
O(1) terms, whose rounding is ~sqrt(k)·6e-8 relative to the sum of |terms|); f16 weights are compared with numpy on
the same f16-rounded weights, so the bound is the same.
"""

from __future__ import annotations

import numpy as np
import pytest

from doppler_py.errors import AdapterError
from doppler_py.gpu.tensor import Tensor
from doppler_py.ops.lora import MAX_RANK, NO_ADAPTER, LoraMatmul, Segment, pack_segments


def make_segments(rng, k: int, layout: list[tuple[int, int, int]]) -> list[Segment]:
    """(col0, cols, rank) per segment."""
    return [
        Segment(
            col0,
            rng.standard_normal((rank, k)).astype(np.float32),
            rng.standard_normal((cols, rank)).astype(np.float32),
        )
        for col0, cols, rank in layout
    ]


def reference(x, out, segments, row_adapter, slot, dtype):
    expected = out.astype(np.float64)
    cast = np.float16 if dtype == "f16" else np.float32
    for t in np.flatnonzero(row_adapter == slot):
        for seg in segments:
            a, b = seg.a.astype(cast).astype(np.float64), seg.b.astype(cast).astype(np.float64)
            expected[t, seg.col0 : seg.col0 + b.shape[0]] += b @ (a @ x[t].astype(np.float64))
    return expected


def run(gpu, registry, x, out, segments, row_adapter, slot, dtype, rows, norm_weight=None, eps=0.0):
    k, n_total = x.shape[1], out.shape[1]
    packed = Tensor.from_numpy(gpu, pack_segments(segments, dtype), "u32")
    out_t = Tensor.from_numpy(gpu, out)
    op = LoraMatmul(
        registry,
        packed,
        dtype,
        Tensor.from_numpy(gpu, x),
        out_t,
        Tensor.from_numpy(gpu, row_adapter.astype(np.uint32), "u32"),
        k=k,
        n_total=n_total,
        slot=slot,
        max_rows=x.shape[0],
        norm_weight=None if norm_weight is None else Tensor.from_numpy(gpu, norm_weight),
        eps=eps,
    )
    rec = registry.recorder()
    op.record(rec, rows=rows)
    rec.submit()
    return out_t.numpy()


CASES = {
    # name: (rows, k, n_total, [(col0, cols, rank)])
    "qkv-like rank 8, 3 segments, 67 rows": (67, 37, 61, [(0, 29, 8), (29, 17, 8), (46, 15, 8)]),
    "rank 1, odd widths": (5, 13, 7, [(0, 7, 1)]),
    "rank 64, one row": (1, 577, 131, [(0, 131, 64)]),
    "partial columns, 4 segments of ranks 1..4": (9, 21, 50, [(2, 3, 1), (5, 11, 2), (20, 9, 3), (41, 9, 4)]),
}


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_update_matches_numpy_for_the_dispatched_adapters_rows_only(gpu, registry, rng, case, dtype):
    rows, k, n_total, layout = CASES[case]
    segments = make_segments(rng, k, layout)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    out = rng.standard_normal((rows, n_total)).astype(np.float32)
    # Rows of slot 3, of another slot and of none, interleaved.
    row_adapter = np.array([[3, NO_ADAPTER, 5][t % 3] for t in range(rows)], dtype=np.uint64)
    got = run(gpu, registry, x, out, segments, row_adapter, 3, dtype, rows)
    expected = reference(x, out, segments, row_adapter, 3, dtype)
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * scale)
    untouched = row_adapter != 3
    assert np.array_equal(got[untouched], out[untouched])


def test_a_fused_rms_norm_updates_from_the_normalised_rows(gpu, registry, rng):
    """x as the residual stream, normalised in the kernel as rmsnorm.wgsl does (a fused matmul's input)."""
    rows, k, eps = 7, 577, 1e-5
    segments = make_segments(rng, k, [(0, 33, 16), (33, 9, 3)])
    x = (rng.standard_normal((rows, k)) * 3).astype(np.float32)
    gain = rng.uniform(0.5, 1.5, k).astype(np.float32)
    out = rng.standard_normal((rows, 42)).astype(np.float32)
    row_adapter = np.array([0, 1, 0, NO_ADAPTER, 0, 0, 1], dtype=np.uint64)
    got = run(gpu, registry, x, out, segments, row_adapter, 0, "f32", rows, norm_weight=gain, eps=eps)
    x64 = x.astype(np.float64)
    normalised = x64 / np.sqrt((x64**2).mean(axis=1, keepdims=True) + eps) * gain
    expected = reference(normalised, out, segments, row_adapter, 0, "f32")
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * float(np.abs(expected).max()))


def test_rows_past_the_call_are_untouched(gpu, registry, rng):
    segments = make_segments(rng, 8, [(0, 6, 2)])
    x = rng.standard_normal((4, 8)).astype(np.float32)
    out = rng.standard_normal((4, 6)).astype(np.float32)
    got = run(gpu, registry, x, out, segments, np.zeros(4, np.uint64), 0, "f32", rows=2)
    assert np.array_equal(got[2:], out[2:])
    np.testing.assert_allclose(got[:2], reference(x, out, segments, np.array([0, 0, 1, 1]), 0, "f32")[:2], rtol=1e-5)


def test_packing_refuses_ranks_past_the_workgroup_array(rng):
    segments = make_segments(rng, 4, [(0, 2, MAX_RANK), (2, 2, 1)])
    with pytest.raises(AdapterError, match="ranks summing to 257"):
        pack_segments(segments, "f32")
