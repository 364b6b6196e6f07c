"""RoPE: the host cos/sin table against HF's documented formulas, and the fused kernel (RoPE + KV-cache write
over the [q | k | v] projection output) against HF's `apply_rotary_pos_emb` (q * cos + rotate_half(q) * sin),
both restated in numpy in `doppler_py.testing.references` (`rope_inv_freq`, `rope`).

Tolerances:
* inverse frequencies: the table reproduces HF's float32 arithmetic; against the same formula in float64 it
  may differ by the float32 roundings along the way (a few ulps): rtol 1e-6;
* rotated q and k: one rotation is two f32 products and a sum per element; with |inputs| < ~5 every
  intermediate is below 8, so each of the three roundings is at most 2.4e-7 (an FMA contraction only
  removes one): atol 1e-6, rtol 1e-6;
* v, and everything the kernel must not write: exact (copies and untouched memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from doppler_py.errors import UnsupportedModelError
from doppler_py.gpu.tensor import Tensor
from doppler_py.ops.rope import RoPE, rope_inv_freq, rope_table
from doppler_py.testing import references

K_FILL, V_FILL = -1.0, -2.0  # cache sentinels: positions the kernel must not write keep them

LLAMA_3_2_SCALING = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def rotated(x: np.ndarray, table: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """x [len(positions), heads * head_dim] rotated at `positions` with the cos/sin of the kernel's table."""
    return references.rope(x, table[positions, :, 0], table[positions, :, 1])


@dataclass
class Shape:
    n_heads: int
    n_kv_heads: int
    head_dim: int

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    def split(self, qkv: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size], qkv[:, -self.kv_size :]


class FusedRope:
    """A RoPE op over a qkv buffer of `max_rows` rows and sentinel-filled caches of `capacity` positions (the op
    may write the first `max_seq`), with `expected_*` tracking what the buffers must hold."""

    def __init__(self, gpu, registry, shape: Shape, table: np.ndarray, *, max_seq, max_rows, capacity=None):
        capacity = capacity or max_seq
        self.registry, self.shape, self.table, self.max_rows = registry, shape, table, max_rows
        self.qkv = Tensor.empty(gpu, (max_rows, shape.q_size + 2 * shape.kv_size))
        self.expected_k = np.full((capacity, shape.kv_size), K_FILL, np.float32)
        self.expected_v = np.full((capacity, shape.kv_size), V_FILL, np.float32)
        self.k_cache = Tensor.from_numpy(gpu, self.expected_k)
        self.v_cache = Tensor.from_numpy(gpu, self.expected_v)
        kw = dict(n_heads=shape.n_heads, n_kv_heads=shape.n_kv_heads, head_dim=shape.head_dim)
        self.op = RoPE(
            registry,
            self.qkv,
            Tensor.from_numpy(gpu, table),
            self.k_cache,
            self.v_cache,
            max_seq=max_seq,
            max_rows=max_rows,
            **kw,
        )

    def assert_rotates_q_in_place(self, rng, *, rows: int, start_pos: int, written_rows: int | None = None) -> None:
        """Record the op over random qkv rows (all max_rows uploaded) and check q: the first `written_rows` rows
        (default: all `rows`) rotated at their positions, nothing else changed. Those rows are also the ones
        expected to reach the cache."""
        written_rows = rows if written_rows is None else written_rows
        qkv = rng.standard_normal((self.max_rows, self.shape.q_size + 2 * self.shape.kv_size)).astype(np.float32)
        self.qkv.write(qkv)
        rec = self.registry.recorder()
        self.op.record(rec, rows=rows, start_pos=start_pos)
        rec.submit()
        positions = np.arange(start_pos, start_pos + written_rows)
        assert_q_rotated_in_place(self.shape, qkv, self.qkv.numpy(), self.table, positions)
        _, k, v = self.shape.split(qkv[:written_rows])
        self.expected_k[positions] = rotated(k, self.table, positions)
        self.expected_v[positions] = v

    def assert_caches_as_expected(self) -> None:
        k_cache = self.k_cache.numpy().reshape(self.expected_k.shape)
        v_cache = self.v_cache.numpy().reshape(self.expected_v.shape)
        np.testing.assert_allclose(k_cache, self.expected_k, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(k_cache == K_FILL, self.expected_k == K_FILL)
        np.testing.assert_array_equal(v_cache, self.expected_v)


def assert_q_rotated_in_place(shape: Shape, before, after, table, positions) -> None:
    """Rows 0..len(positions)-1 have q rotated and k, v unchanged; later rows are untouched entirely."""
    n = len(positions)
    q_before, _, _ = shape.split(before[:n])
    q_after, _, _ = shape.split(after[:n])
    expected_q = rotated(q_before, table, positions)
    np.testing.assert_allclose(q_after, expected_q, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(after[:n, shape.q_size :], before[:n, shape.q_size :])
    np.testing.assert_array_equal(after[n:], before[n:])


# -- the host table ------------------------------------------------------------------------------------
@pytest.mark.parametrize("head_dim, theta", [(64, 1e5), (128, 5e5), (6, 1e4)])
def test_inverse_frequencies_follow_the_default_formula(head_dim, theta):
    inv_freq = rope_inv_freq(head_dim, theta)
    assert inv_freq.dtype == np.float32 and inv_freq.shape == (head_dim // 2,)
    np.testing.assert_allclose(inv_freq, references.rope_inv_freq(head_dim, theta), rtol=1e-6)


def test_llama_3_2_scaling_follows_hf_llama3_formula():
    inv_freq = rope_inv_freq(64, 5e5, LLAMA_3_2_SCALING)
    np.testing.assert_allclose(inv_freq, references.rope_inv_freq(64, 5e5, LLAMA_3_2_SCALING), rtol=1e-6)
    # All three regimes occur for head_dim 64: kept, divided by 32 (exactly: a power of two), and blended.
    default = rope_inv_freq(64, 5e5)
    wavelen = 2 * np.pi / default.astype(np.float64)
    kept, divided = wavelen < 8192 / 4, wavelen > 8192 / 1
    blended = ~kept & ~divided
    assert kept.any() and divided.any() and blended.any()
    np.testing.assert_array_equal(inv_freq[kept], default[kept])
    np.testing.assert_array_equal(inv_freq[divided], default[divided] / np.float32(32))
    assert ((inv_freq[blended] < default[blended]) & (inv_freq[blended] > default[blended] / 32)).all()


def test_linear_scaling_divides_every_frequency_by_the_factor():
    scaling = {"type": "linear", "factor": 4.0}  # the pre-"rope_type" key spelling is accepted too
    np.testing.assert_array_equal(rope_inv_freq(96, 1e4, scaling), rope_inv_freq(96, 1e4) / np.float32(4))


def test_proportional_rope_rotates_only_the_first_pairs_at_the_default_frequencies():
    """Gemma 4's full layers: a quarter of the pairs keep the default frequencies over the whole head_dim; the
    rest have frequency 0, so cos 1 and sin 0 leave their dims unrotated at every position."""
    scaling = {"rope_type": "proportional", "partial_rotary_factor": 0.25, "factor": 1.0}
    inv_freq = rope_inv_freq(512, 1e6, scaling)
    np.testing.assert_array_equal(inv_freq[:64], rope_inv_freq(512, 1e6)[:64])
    assert not inv_freq[64:].any()
    table = rope_table(512, 100, 1e6, scaling)
    assert (table[:, 64:, 0] == 1).all() and (table[:, 64:, 1] == 0).all()
    np.testing.assert_array_equal(
        rope_inv_freq(64, 1e6, {**scaling, "factor": 2.0}), rope_inv_freq(64, 1e6, scaling) / 2
    )


def test_default_rope_type_equals_no_scaling():
    np.testing.assert_array_equal(rope_inv_freq(64, 1e5, {"rope_type": "default"}), rope_inv_freq(64, 1e5))


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope", "su"])
def test_unknown_scaling_types_are_refused(rope_type):
    with pytest.raises(UnsupportedModelError, match=rope_type):
        rope_table(64, 16, 1e4, {"rope_type": rope_type, "factor": 2.0})


def test_table_holds_cos_and_sin_of_float32_angles():
    table = rope_table(64, 9000, 5e5, LLAMA_3_2_SCALING)
    assert table.dtype == np.float32 and table.shape == (9000, 32, 2)
    # HF forms the angle as float32(position) * inv_freq in float32, then takes cos/sin.
    angles = (np.arange(9000, dtype=np.float32)[:, None] * rope_inv_freq(64, 5e5, LLAMA_3_2_SCALING)).astype(np.float64)
    np.testing.assert_allclose(table[..., 0], np.cos(angles), rtol=0, atol=6e-8)
    np.testing.assert_allclose(table[..., 1], np.sin(angles), rtol=0, atol=6e-8)
    np.testing.assert_array_equal(table[0], np.stack([np.ones(32), np.zeros(32)], axis=-1))


# -- the kernel ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "n_heads, n_kv_heads, head_dim, rows, start_pos, max_seq",
    [
        (9, 3, 64, 5, 3, 20),  # SmolLM2's heads, a verify-sized batch mid-sequence
        (4, 2, 128, 37, 0, 40),  # a prefill
        (1, 1, 6, 1, 0, 4),  # a single decode row, head_dim 6 (half = 3)
        (9, 3, 6, 37, 3, 40),  # the batch ends exactly at max_seq
        (4, 2, 64, 1, 39, 40),  # decode into the last position
        (1, 1, 128, 5, 35, 40),  # a batch filling the cache up to max_seq
    ],
)
def test_rotates_q_in_place_and_writes_rotated_k_and_copied_v_to_the_cache(
    gpu, registry, rng, n_heads, n_kv_heads, head_dim, rows, start_pos, max_seq
):
    shape, table = Shape(n_heads, n_kv_heads, head_dim), rope_table(head_dim, max_seq, 1e4)
    rope = FusedRope(gpu, registry, shape, table, max_seq=max_seq, max_rows=rows + 2)
    rope.assert_rotates_q_in_place(rng, rows=rows, start_pos=start_pos)
    rope.assert_caches_as_expected()


def test_llama_3_2_positions_around_the_original_context(gpu, registry, rng):
    shape, table = Shape(4, 2, 64), rope_table(64, 8200, 5e5, LLAMA_3_2_SCALING)
    rope = FusedRope(gpu, registry, shape, table, max_seq=8200, max_rows=6)
    rope.assert_rotates_q_in_place(rng, rows=6, start_pos=8189)
    rope.assert_caches_as_expected()


def test_prefill_then_decode_then_overwrite_after_truncation(gpu, registry, rng):
    shape = Shape(9, 3, 6)
    table = rope_table(6, 16, 1e4)
    rope = FusedRope(gpu, registry, shape, table, max_seq=16, max_rows=5)
    # Prefill 5, decode 1, verify 3 drafts at 6..8, then a rejection truncates to 7 and position 7 is rewritten.
    for start_pos, rows in [(0, 5), (5, 1), (6, 3), (7, 1)]:
        rope.assert_rotates_q_in_place(rng, rows=rows, start_pos=start_pos)
    rope.assert_caches_as_expected()


def test_rows_past_the_table_write_nothing(gpu, registry, rng):
    shape, table = Shape(2, 1, 8), rope_table(8, 6, 1e4)
    rope = FusedRope(gpu, registry, shape, table, max_seq=10, max_rows=4)
    rope.assert_rotates_q_in_place(rng, rows=4, start_pos=4, written_rows=2)
    rope.assert_caches_as_expected()


@pytest.mark.parametrize("start_pos", [14, 16, 100])
def test_rows_at_or_past_max_seq_write_nothing(gpu, registry, rng, start_pos):
    # The cache buffers hold 4 spare positions past max_seq (and the table covers them): they keep their sentinel.
    shape, table, max_seq = Shape(4, 2, 8), rope_table(8, 128, 1e4), 16
    rope = FusedRope(gpu, registry, shape, table, max_seq=max_seq, max_rows=4, capacity=max_seq + 4)
    fits = max(0, min(4, max_seq - start_pos))
    rope.assert_rotates_q_in_place(rng, rows=4, start_pos=start_pos, written_rows=fits)
    rope.assert_caches_as_expected()


def test_rows_beyond_the_recorded_count_are_left_untouched(gpu, registry, rng):
    shape, table = Shape(3, 1, 16), rope_table(16, 32, 1e4)
    rope = FusedRope(gpu, registry, shape, table, max_seq=32, max_rows=5)
    rope.assert_rotates_q_in_place(rng, rows=2, start_pos=0)
    rope.assert_caches_as_expected()


def test_rejects_negative_start_and_too_many_rows(gpu, registry):
    rope = FusedRope(gpu, registry, Shape(1, 1, 4), rope_table(4, 8, 1e4), max_seq=8, max_rows=2)
    with pytest.raises(ValueError, match="start_pos"):
        rope.op.record(registry.recorder(), rows=1, start_pos=-1)
    with pytest.raises(ValueError, match="rows"):
        rope.op.record(registry.recorder(), rows=3, start_pos=0)


def test_rejects_odd_head_dim_and_caches_smaller_than_max_seq(gpu, registry):
    table = Tensor.from_numpy(gpu, rope_table(4, 8, 1e4))
    qkv = Tensor.empty(gpu, (2, 3 * 4))
    small, full = Tensor.empty(gpu, (7, 4)), Tensor.empty(gpu, (8, 4))
    kw = dict(n_heads=1, n_kv_heads=1, max_seq=8, max_rows=2)
    with pytest.raises(ValueError, match="head_dim"):
        RoPE(registry, qkv, table, full, full, head_dim=5, **kw)
    with pytest.raises(ValueError, match="v_cache"):
        RoPE(registry, qkv, table, full, small, head_dim=4, **kw)
