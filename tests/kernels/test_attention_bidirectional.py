"""Bidirectional attention (shaders/attention.wgsl with Params.bidirectional, `Attention.record(bidirectional=True)`):
every row sees the cached keys before start_pos and the keys of all of the call's rows, later ones included; in a
sliding window, the keys less than `window` positions away either way. Against numpy float64
(`doppler_py.testing.references.attention(bidirectional=True)`).

Tolerance: test_attention.py's, |gpu - reference| <= 1e-5 * max|v| (each output is a convex combination of value
rows; a key masked or seen by mistake moves an output by ~1e-2 or more). The sizes are awkward on purpose: row counts
that fill no whole workgroup of 4-query blocks, one row, head dims 16 to 256, grouped-query heads (group 3, 4, 6),
keys past start_pos + rows poisoned with NaN (never read).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_attention import SMOLLM2, TOLERANCE, Case, RopeCase

from doppler_py.ops import attention as attention_module
from doppler_py.ops.attention import WEBGPU_MIN_SUBGROUP
from doppler_py.testing.references import attention

SHAPES = {
    "gqa3-64": SMOLLM2,
    "gqa4-128": {"n_heads": 8, "n_kv_heads": 2, "head_dim": 128},
    "mqa6-16": {"n_heads": 6, "n_kv_heads": 1, "head_dim": 16},
    "mha2-256": {"n_heads": 2, "n_kv_heads": 2, "head_dim": 256},
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize(("rows", "start_pos"), [(1, 0), (7, 0), (23, 0), (65, 0), (13, 37)])
def test_every_row_sees_every_row_of_the_call(gpu, registry, rng, shape, rows, start_pos):
    case = Case(gpu, registry, rng, **SHAPES[shape], max_seq=112, max_rows=65, bidirectional=True)
    got = case.run(registry, rows, start_pos)
    case.check(got, rows, start_pos)
    assert np.all(got[rows:] == -7.0), "rows past `rows` must not be written"
    if rows > 1:  # the causal answer is far from it: the test tells the two apart
        both_ways = case.expected(rows, start_pos)
        case.bidirectional = False
        assert np.abs(both_ways - case.expected(rows, start_pos)).max() > 100 * TOLERANCE * np.abs(case.v).max()


@pytest.mark.parametrize("window", [1, 5, 17, 200])
@pytest.mark.parametrize(("rows", "start_pos"), [(40, 0), (9, 30)])
def test_a_sliding_window_reaches_both_ways(gpu, registry, rng, window, rows, start_pos):
    """transformers' Gemma 3 bidirectional sliding layers: key j is seen from position p when |p - j| < window."""
    case = Case(gpu, registry, rng, **SHAPES["gqa4-128"], max_seq=64, max_rows=40, window=window, bidirectional=True)
    case.check(case.run(registry, rows, start_pos), rows, start_pos)


@pytest.mark.parametrize("mode", ["local", "fused", "rope-dispatch"])
@pytest.mark.parametrize(("rows", "start_pos"), [(1, 0), (5, 70), (16, 0), (40, 9)])
def test_rope_inside_and_the_cache_write_hold_for_every_path(gpu, registry, rng, mode, rows, start_pos):
    """[q | k | v] rows before RoPE: the later rows' keys the earlier rows see are rotated and written alike on the
    "local" (cache written before the key loop), "fused" (new keys read from q) and rope-dispatch paths."""
    case = RopeCase(gpu, registry, rng, **SMOLLM2, max_seq=96, max_rows=40, mode=mode, bidirectional=True)
    case.run_and_check(registry, rows, start_pos)


@pytest.mark.parametrize("entry", ["main", "main_subgroups"])
def test_both_entry_points_attend_both_ways(gpu, registry, rng, monkeypatch, entry):
    if entry == "main_subgroups" and not gpu.has_subgroups:
        pytest.skip("the adapter has no subgroups")
    shape = SHAPES["gqa3-64"]
    assert shape["head_dim"] <= 16 * WEBGPU_MIN_SUBGROUP
    monkeypatch.setattr(attention_module, "attention_entry", lambda registry, head_dim: entry)
    case = RopeCase(gpu, registry, rng, **shape, max_seq=96, max_rows=40, mode="local", bidirectional=True)
    assert case.op.bound.kernel.entry == entry
    case.run_and_check(registry, 30, 11)


def test_a_causal_call_after_a_bidirectional_one_is_causal_again(gpu, registry, rng):
    """The flag is a per-call uniform: the next call of the same op without it looks back only."""
    case = Case(gpu, registry, rng, **SMOLLM2, max_seq=64, max_rows=20, bidirectional=True)
    case.check(case.run(registry, 20, 3), 20, 3)
    case.bidirectional = False
    case.check(case.run(registry, 20, 3), 20, 3)


def test_splits_and_trees_are_refused(gpu, registry, rng):
    case = Case(gpu, registry, rng, **SMOLLM2, max_seq=600, max_rows=4)
    assert case.op.call(1, 500, bidirectional=True)[1][2] == 1, "a long decode-sized call is not split"
    with pytest.raises(ValueError, match="not split"):
        case.op.call(1, 500, 3, bidirectional=True)
    with pytest.raises(ValueError, match="tree and bidirectional"):
        case.op.call(2, 0, tree=True, bidirectional=True)


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize(("rows", "start_pos", "key_end"), [(1, 0, 70), (7, 64, 90), (23, 20, 150), (40, 100, 157)])
def test_a_call_with_key_end_sees_the_later_keys_in_the_caches(gpu, registry, rng, window, rows, start_pos, key_end):
    """`key_end`: the rows see every key before it (an input longer than one call: its later chunks' keys, in the
    caches already), and none after it (NaN there)."""
    case = Case(gpu, registry, rng, **SHAPES["gqa4-128"], max_seq=160, max_rows=40, window=window)
    case.upload_cache(key_end)
    rec = registry.recorder()
    case.op.record(rec, rows, start_pos, bidirectional=True, key_end=key_end)
    rec.submit()
    expected = attention(case.q[:rows], case.k, case.v, start_pos, window=window, bidirectional=True, key_end=key_end)
    atol = TOLERANCE * np.abs(case.v).max()
    np.testing.assert_allclose(case.out.numpy()[:rows], expected, rtol=0, atol=atol)
    own_rows_only = attention(case.q[:rows], case.k, case.v, start_pos, window=window, bidirectional=True)
    assert np.abs(expected - own_rows_only).max() > 100 * atol  # the later keys are within reach: the test tells
    with pytest.raises(ValueError, match="key_end"):
        case.op.call(rows, start_pos, bidirectional=True, key_end=start_pos + rows - 1)
    with pytest.raises(ValueError, match="key_end"):
        case.op.call(rows, start_pos, key_end=key_end)


@pytest.mark.parametrize("window", [0, 9])
def test_write_keys_then_calls_with_key_end_attend_over_a_whole_long_input(gpu, registry, rng, window):
    """An input of 45 rows in chunks of 16 (`Transformer.run_bidirectional`'s two steps): every chunk's keys and
    values written by `write_keys` first (queries rotated in place), then each chunk's call over all 45 keys equals
    the bidirectional reference over the whole input."""
    n, chunk = 45, 16
    case = RopeCase(gpu, registry, rng, **SMOLLM2, max_seq=64, max_rows=chunk, window=window, mode="rope-dispatch")
    width = case.q_size + 2 * case.kv_size
    qkv = rng.standard_normal((n, width)).astype(np.float32)
    case.load_caches(0, n)
    chunks = [(p, min(chunk, n - p)) for p in range(0, n, chunk)]
    rotated = np.empty_like(qkv)
    for p, r in chunks:
        case.qkv.view((r, width)).write(qkv[p : p + r])
        rec = registry.recorder()
        case.op.write_keys(rec, r, p)
        rec.submit()
        rotated[p : p + r] = case.qkv.numpy().reshape(-1, width)[:r]
    got = np.empty((n, case.q_size), np.float32)
    for p, r in chunks:
        case.qkv.view((r, width)).write(rotated[p : p + r])
        rec = registry.recorder()
        case.op.record(rec, r, p, bidirectional=True, key_end=n)
        rec.submit()
        got[p : p + r] = case.out.numpy().reshape(-1, case.q_size)[:r]
    positions = np.arange(n)
    q = case.rotate(qkv[:, : case.q_size], positions)
    k = case.rotate(qkv[:, case.q_size : case.q_size + case.kv_size], positions).reshape(n, *case.k.shape[1:])
    v = qkv[:, case.q_size + case.kv_size :].reshape(n, *case.v.shape[1:])
    expected = attention(q, k, v, 0, window=window, bidirectional=True)
    np.testing.assert_allclose(got, expected, rtol=0, atol=TOLERANCE * np.abs(v).max())
    np.testing.assert_allclose(case.tk.numpy().reshape(case.k.shape)[:n], k, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(case.tv.numpy().reshape(case.v.shape)[:n], v)
