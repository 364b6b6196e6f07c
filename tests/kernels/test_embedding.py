"""Embedding gather (shaders/embedding.wgsl) from tables in every weight format.

Tolerance: f32 and f16 rows are copied exactly. Block formats compute q * d + m (or (q - 8) * d, q * d) in
f32 on the GPU, possibly as one fused multiply-add, so each value may differ from numpy's two roundings by
one rounding of the result: |gpu - ref| <= 2^-23 * (|q d| + |m|).
"""

from __future__ import annotations

import numpy as np
import pytest

from doppler_py.gpu.tensor import Tensor
from doppler_py.gpu.weights import FORMATS, Weight, dequantize_blocks, quantize_blocks
from doppler_py.ops.embedding import Embedding


def _gather(
    gpu, registry, table: Weight, ids: np.ndarray, *, max_rows: int | None = None, fill=np.nan, scale: float = 1.0
):
    max_rows = max_rows or len(ids)
    ids_t = Tensor.from_numpy(gpu, np.resize(ids, max_rows).astype(np.uint32))
    out = Tensor.from_numpy(gpu, np.full((max_rows, table.shape[1]), fill, np.float32))
    emb = Embedding(registry, table, ids_t, out, max_rows=max_rows, scale=scale)
    rec = registry.recorder()
    emb.record(rec, len(ids))
    rec.submit()
    return out.numpy()


def _assert_rows(got: np.ndarray, table: np.ndarray) -> None:
    bound = 2.0**-23 * (np.abs(table) + np.abs(table).max(axis=1, keepdims=True))
    np.testing.assert_array_less(np.abs(got - table), bound + 1e-30)


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_match_the_dequantised_table(gpu, registry, rng, fmt):
    vocab, k = 29, 96  # vocab not a multiple of the 8-row groups; k = 3 blocks
    raw = quantize_blocks(rng.standard_normal((vocab, k)).astype(np.float32), fmt)
    table = dequantize_blocks(raw, fmt, (vocab, k))
    ids = rng.integers(0, vocab, 11)
    ids[:3] = [0, vocab - 1, ids[5]]  # first, last and a repeated id
    got = _gather(gpu, registry, Weight.from_gguf_blocks(gpu, raw, fmt, (vocab, k)), ids)
    _assert_rows(got, table[ids])


def test_ids_past_the_vocabulary_give_zero_rows(gpu, registry, rng):
    vocab, k = 20, 64
    w = rng.standard_normal((vocab, k)).astype(np.float32)
    ids = np.array([3, vocab, 0xFFFFFFFF, 19, vocab + 7], np.uint32)  # vocab..vocab+7 are padding rows on the GPU
    got = _gather(gpu, registry, Weight.from_numpy(gpu, w, "q8_0"), ids)
    table = dequantize_blocks(quantize_blocks(w, "q8_0"), "q8_0", w.shape)
    _assert_rows(got[[0, 3]], table[[3, 19]])
    np.testing.assert_array_equal(got[[1, 2, 4]], 0.0)


def test_a_table_split_into_parts_gathers_from_every_part(gpu, registry, rng):
    vocab, k = 45, 64
    w = rng.standard_normal((vocab, k)).astype(np.float32)
    table = Weight.from_numpy(gpu, w, "f16", max_part_bytes=16 * k * 2)  # parts of 16 rows: 16, 16, 13
    assert [p.rows for p in table.parts] == [16, 16, 13]
    ids = np.array([0, 15, 16, 31, 32, 44, 45, 1000, 20], np.uint32)
    got = _gather(gpu, registry, table, ids)
    expected = np.zeros((len(ids), k), np.float32)
    valid = ids < vocab
    expected[valid] = w.astype(np.float16).astype(np.float32)[ids[valid]]
    np.testing.assert_array_equal(got, expected)


def test_rows_past_the_count_are_left_untouched(gpu, registry, rng):
    w = rng.standard_normal((10, 32)).astype(np.float32)
    got = _gather(gpu, registry, Weight.from_numpy(gpu, w, "f32"), np.array([4, 2]), max_rows=5, fill=7.0)
    np.testing.assert_array_equal(got[:2], w[[4, 2]])
    np.testing.assert_array_equal(got[2:], 7.0)


def test_bad_tensors_and_row_counts_raise(gpu, registry):
    table = Weight.from_numpy(gpu, np.zeros((4, 32), np.float32), "f32")
    ids = Tensor.empty(gpu, 3, "u32")
    out = Tensor.empty(gpu, (3, 32))
    with pytest.raises(ValueError, match="ids must be u32"):
        Embedding(registry, table, Tensor.empty(gpu, 3, "i32"), out, max_rows=3)
    with pytest.raises(ValueError, match="out must be f32"):
        Embedding(registry, table, ids, Tensor.empty(gpu, (2, 32)), max_rows=3)
    emb = Embedding(registry, table, ids, out, max_rows=3)
    for rows in (0, 4):
        with pytest.raises(ValueError, match=r"rows must be in \[1, 3\]"):
            emb.record(registry.recorder(), rows)


def test_scale_multiplies_every_row_in_f32(gpu, registry, rng):
    """Gemma multiplies its embeddings by sqrt(hidden_size) rounded to f32: one f32 product per value."""
    vocab, k = 40, 64
    table = rng.standard_normal((vocab, k)).astype(np.float32)
    ids = rng.integers(0, vocab + 3, 9)  # a few past the vocabulary: still zero rows
    scale = float(np.float32(np.sqrt(640)))
    got = _gather(gpu, registry, Weight.from_numpy(gpu, table, "f32"), ids, scale=scale)
    expected = np.where((ids < vocab)[:, None], table[np.minimum(ids, vocab - 1)] * np.float32(scale), 0)
    np.testing.assert_array_equal(got, expected)
