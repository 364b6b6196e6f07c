"""Causal GQA attention over the KV cache (shaders/attention.wgsl, attention_reduce.wgsl) vs numpy float64
(`doppler_py.testing.references.attention`), with and without a sliding window.

Tolerance: |gpu - reference| <= 1e-5 * max|v|. Each output is a convex combination of value rows, so its
error is the error of the weights times |v|. The kernel computes scores, exponentials and sums in f32
(relative error ~1e-7 per operation, a few hundred terms at most here) while the reference works in
float64 from the same f32 inputs; 1e-5 leaves a wide margin over that yet fails on any indexing, masking or
normalisation mistake, which moves outputs by ~1e-2 or more.
"""

from __future__ import annotations

import numpy as np
import pytest

from doppler_py.errors import DeviceLimitError
from doppler_py.gpu.tensor import Tensor
from doppler_py.ops import attention as attention_module
from doppler_py.ops.attention import STEP, WEBGPU_MIN_SUBGROUP, Attention, attention_entry
from doppler_py.ops.rope import rope_table
from doppler_py.ops.tree import MAX_TREE_ROWS, layout_words, row_depths
from doppler_py.testing import references
from doppler_py.testing.references import attention, tree_attention

TOLERANCE = 1e-5
SMOLLM2 = {"n_heads": 9, "n_kv_heads": 3, "head_dim": 64}
GEMMA4_GLOBAL = {"n_heads": 8, "n_kv_heads": 1, "head_dim": 512}  # Gemma 4 E2B's full-attention layers


class Case:
    """Random queries and a KV cache whose positions past start_pos + rows hold `garbage`. `tq`, `out`: query and
    output buffers shared with other cases (a batch of sequences); the case then reads its queries from `tq`."""

    def __init__(
        self,
        gpu,
        registry,
        rng,
        *,
        n_heads,
        n_kv_heads,
        head_dim,
        max_seq,
        max_rows,
        garbage=np.nan,
        window=0,
        scale=None,
        softcap=0.0,
        tq=None,
        out=None,
        bidirectional=False,
    ):
        self.window, self.scale, self.softcap, self.bidirectional = window, scale, softcap, bidirectional
        if tq is None:
            self.q = rng.standard_normal((max_rows, n_heads * head_dim)).astype(np.float32)
            tq = Tensor.from_numpy(gpu, self.q)
        else:
            self.q = tq.numpy().reshape(-1, n_heads * head_dim)
        self.k = rng.standard_normal((max_seq, n_kv_heads, head_dim)).astype(np.float32)
        self.v = rng.standard_normal((max_seq, n_kv_heads, head_dim)).astype(np.float32)
        self.garbage = garbage
        self.gpu = gpu
        self.tq = tq
        self.tk = Tensor.empty(gpu, self.k.shape)
        self.tv = Tensor.empty(gpu, self.v.shape)
        self.out = Tensor.from_numpy(gpu, np.full(self.q.shape, -7.0, np.float32)) if out is None else out
        self.op = Attention(
            registry,
            self.tq,
            self.tk,
            self.tv,
            self.out,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            max_seq=max_seq,
            max_rows=max_rows,
            window=window,
            scale=scale,
            softcap=softcap,
        )

    def upload_cache(self, used: int) -> None:
        for tensor, data in ((self.tk, self.k), (self.tv, self.v)):
            poisoned = data.copy()
            poisoned[used:] = self.garbage
            tensor.write(poisoned)

    def run(self, registry, rows, start_pos, splits=None):
        self.upload_cache(start_pos + rows)
        rec = registry.recorder()
        self.op.record(rec, rows, start_pos, splits=splits, bidirectional=self.bidirectional)
        rec.submit()
        return self.out.numpy()

    def expected(self, rows, start_pos, row0=0):
        return attention(
            self.q[row0 : row0 + rows],
            self.k,
            self.v,
            start_pos,
            window=self.window,
            scale=self.scale,
            softcap=self.softcap,
            bidirectional=self.bidirectional,
        )

    def check(self, got, rows, start_pos, row0=0):
        atol = TOLERANCE * np.abs(self.v).max()
        np.testing.assert_allclose(got[row0 : row0 + rows], self.expected(rows, start_pos, row0), rtol=0, atol=atol)


@pytest.mark.parametrize("rows", [1, 7, 20, 65])
def test_prefill_from_position_zero_matches_reference(gpu, registry, rng, rows):
    case = Case(gpu, registry, rng, **SMOLLM2, max_seq=96, max_rows=65)
    got = case.run(registry, rows, 0)
    case.check(got, rows, 0)
    assert np.all(got[rows:] == -7.0), "rows past `rows` must not be written"


@pytest.mark.parametrize(
    ("shape", "rows", "start_pos"),
    [
        (SMOLLM2, 13, 37),
        ({"n_heads": 8, "n_kv_heads": 2, "head_dim": 128}, 20, 45),
        ({"n_heads": 4, "n_kv_heads": 4, "head_dim": 64}, 33, 100),
    ],
)
def test_chunked_prefill_attends_to_the_cached_prefix(gpu, registry, rng, shape, rows, start_pos):
    case = Case(gpu, registry, rng, **shape, max_seq=160, max_rows=33)
    case.check(case.run(registry, rows, start_pos), rows, start_pos)


def test_decode_matches_reference_at_many_positions(gpu, registry, rng):
    case = Case(gpu, registry, rng, **SMOLLM2, max_seq=320, max_rows=1)
    for position in (0, 1, 63, 64, 65, 300):
        case.check(case.run(registry, 1, position), 1, position)


@pytest.mark.parametrize(
    ("n_heads", "n_kv_heads"),
    [(9, 3), (4, 4), (8, 2)],
    ids=["gqa3", "mha", "gqa4"],
)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("rows", "start_pos"), [(1, 130), (5, 70)], ids=["decode", "verify5"])
def test_grouped_query_heads_read_their_shared_kv_head(
    gpu, registry, rng, n_heads, n_kv_heads, head_dim, rows, start_pos
):
    case = Case(gpu, registry, rng, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, max_seq=160, max_rows=8)
    case.check(case.run(registry, rows, start_pos), rows, start_pos)


@pytest.mark.parametrize("head_dim", [16, 32, 256, 512])
def test_other_head_dims(gpu, registry, rng, head_dim):
    case = Case(gpu, registry, rng, n_heads=4, n_kv_heads=2, head_dim=head_dim, max_seq=64, max_rows=9)
    for rows, start_pos in ((1, 50), (9, 21)):
        case.check(case.run(registry, rows, start_pos), rows, start_pos)


@pytest.mark.parametrize("splits", [2, 3, 5])
@pytest.mark.parametrize(("rows", "start_pos"), [(1, 300), (5, 200), (16, 90)])
def test_key_range_split_across_workgroups_matches_reference(gpu, registry, rng, splits, rows, start_pos):
    case = Case(gpu, registry, rng, **SMOLLM2, max_seq=320, max_rows=16)
    assert case.op.plan(rows, start_pos, splits)[2] == splits
    case.check(case.run(registry, rows, start_pos, splits=splits), rows, start_pos)


@pytest.mark.parametrize("garbage", [np.nan, np.inf, -3e38, 3e38], ids=["nan", "inf", "-huge", "huge"])
def test_cache_past_the_used_length_is_never_read(gpu, registry, rng, garbage):
    case = Case(gpu, registry, rng, **SMOLLM2, max_seq=512, max_rows=16, garbage=garbage)
    for rows, start_pos, splits in ((1, 40, None), (7, 100, None), (3, 150, 3)):
        got = case.run(registry, rows, start_pos, splits=splits)
        assert np.isfinite(got[:rows]).all()
        case.check(got, rows, start_pos)


def test_large_magnitude_scores_stay_finite_and_exact(gpu, registry, rng):
    # Integer q and k make every score exact in f32 (|q.k| < 2^24, scale 1/8), with scores in the thousands:
    # exp(score) overflows f32, so this only passes with the max subtracted first.
    case = Case(gpu, registry, rng, **SMOLLM2, max_seq=128, max_rows=6)
    case.q = rng.integers(-40, 41, case.q.shape).astype(np.float32)
    case.k = rng.integers(-40, 41, case.k.shape).astype(np.float32)
    case.tq.write(case.q)
    scores = np.abs(case.q[:1, :64] @ case.k[:, 0].T) / 8
    assert scores.max() > 1000
    for rows, start_pos, splits in ((6, 0, None), (1, 120, None), (1, 120, 2)):
        case.check(case.run(registry, rows, start_pos, splits=splits), rows, start_pos)


def test_decode_and_verification_ops_share_one_submit(gpu, registry, rng):
    # Two layers' worth of ops, one with split keys, recorded into one encoder: each keeps its own uniforms
    # and partial buffers.
    first = Case(gpu, registry, rng, **SMOLLM2, max_seq=320, max_rows=5)
    second = Case(gpu, registry, rng, n_heads=8, n_kv_heads=2, head_dim=128, max_seq=320, max_rows=5)
    first.upload_cache(301)
    second.upload_cache(205)
    rec = registry.recorder()
    first.op.record(rec, 1, 300, splits=3)
    second.op.record(rec, 5, 200)
    rec.submit()
    first.check(first.out.numpy(), 1, 300)
    second.check(second.out.numpy(), 5, 200)


def test_invalid_shapes_and_positions_are_rejected(gpu, registry, rng):
    case = Case(gpu, registry, rng, **SMOLLM2, max_seq=32, max_rows=4)
    tensors = (case.tq, case.tk, case.tv, case.out)
    rec = registry.recorder()
    with pytest.raises(DeviceLimitError, match="exceed the cache"):
        case.op.record(rec, 4, 30)
    with pytest.raises(ValueError, match="rows"):
        case.op.record(rec, 5, 0)
    with pytest.raises(ValueError, match="split"):
        Case(gpu, registry, rng, **SMOLLM2, max_seq=64, max_rows=20).op.record(rec, 20, 0, splits=2)
    with pytest.raises(ValueError, match="head_dim"):
        Attention(registry, *tensors, n_heads=9, n_kv_heads=3, head_dim=40, max_seq=32, max_rows=4)
    with pytest.raises(ValueError, match="multiple"):
        Attention(registry, *tensors, n_heads=9, n_kv_heads=2, head_dim=64, max_seq=32, max_rows=4)


def test_queries_are_read_from_fused_qkv_rows(gpu, registry, rng):
    """The model passes its [q | k | v] projection rows directly: q heads first, then k and v heads."""
    n_heads, n_kv_heads, head_dim, rows, start_pos = 9, 3, 64, 5, 40
    stride = (n_heads + 2 * n_kv_heads) * head_dim
    qkv = rng.standard_normal((rows, stride)).astype(np.float32)
    k = rng.standard_normal((64, n_kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((64, n_kv_heads, head_dim)).astype(np.float32)
    out = Tensor.empty(gpu, (rows, n_heads * head_dim))
    op = Attention(
        registry,
        Tensor.from_numpy(gpu, qkv),
        Tensor.from_numpy(gpu, k),
        Tensor.from_numpy(gpu, v),
        out,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        max_seq=64,
        max_rows=rows,
        q_row_stride=stride,
    )
    rec = registry.recorder()
    op.record(rec, rows, start_pos)
    rec.submit()
    expected = attention(qkv[:, : n_heads * head_dim], k, v, start_pos)
    np.testing.assert_allclose(out.numpy(), expected, rtol=0, atol=TOLERANCE * np.abs(v).max())


# (rows, start_pos, splits): prefill from 0 and after a prefix, decode (one and several key splits),
# verification of k + 1 rows, and a split count that leaves whole splits before a short window.
WINDOW_CALLS = [(37, 0, None), (13, 37, None), (1, 300, None), (1, 300, 3), (5, 70, None), (16, 90, 5), (3, 2, None)]


@pytest.mark.parametrize("window", [1, 5, 17, 50, 400])
@pytest.mark.parametrize(
    "shape",
    [SMOLLM2, {"n_heads": 4, "n_kv_heads": 2, "head_dim": 32}, {"n_heads": 6, "n_kv_heads": 1, "head_dim": 16}],
    ids=["gqa3-64", "gqa2-32", "mqa6-16"],
)
def test_sliding_window_sees_only_the_last_window_positions(gpu, registry, rng, shape, window):
    """A query at position p sees keys in (p - window, p]; windows shorter than the prompt, one key, and longer
    than the context (the same as no window)."""
    case = Case(gpu, registry, rng, **shape, max_seq=320, max_rows=37, window=window)
    for rows, start_pos, splits in WINDOW_CALLS:
        if splits and rows > 16:
            continue
        case.check(case.run(registry, rows, start_pos, splits=splits), rows, start_pos)


def test_sliding_window_after_a_rollback_reads_the_rewritten_positions(gpu, registry, rng):
    """Speculative rollback: positions past the accepted length are written again with other keys and values;
    a windowed query over them sees the new ones."""
    case = Case(gpu, registry, rng, **SMOLLM2, max_seq=96, max_rows=5, window=6)
    case.check(case.run(registry, 5, 40), 5, 40)  # verify 4 drafts + 1 at positions 40..44
    case.k[42:45] = rng.standard_normal(case.k[42:45].shape)  # 2 accepted, then rewritten from 42
    case.v[42:45] = rng.standard_normal(case.v[42:45].shape)
    case.check(case.run(registry, 3, 42), 3, 42)


def test_the_score_scale_is_a_parameter(gpu, registry, rng):
    """Gemma scales scores by query_pre_attn_scalar^-1/2 instead of head_dim^-1/2."""
    case = Case(gpu, registry, rng, n_heads=4, n_kv_heads=2, head_dim=32, max_seq=64, max_rows=9, scale=0.6)
    for rows, start_pos in ((9, 0), (1, 50)):
        case.check(case.run(registry, rows, start_pos), rows, start_pos)
    unscaled = attention(case.q[:1], case.k, case.v, 50)
    assert np.abs(case.expected(1, 50) - unscaled).max() > 1e-2, "the scale must change the result"


def test_a_short_window_is_not_split_across_workgroups(gpu, registry, rng):
    """Splits are sized by the keys a query sees: a 40-key window at position 2000 is one split whose lane
    groups take turns over the window alone."""
    case = Case(gpu, registry, rng, **SMOLLM2, max_seq=2048, max_rows=2, window=40)
    key_lanes, _, n_splits = case.op.plan(1, 2000)
    assert n_splits == 1 and key_lanes * STEP <= 40
    for rows, start_pos in ((1, 2000), (2, 1500)):
        case.check(case.run(registry, rows, start_pos), rows, start_pos)


# -- RoPE and the cache write inside (rope=) -----------------------------------------------------------------
class RopeCase:
    """[q | k | v] rows before RoPE over caches holding rotated keys and values before start_pos, sentinels
    from start_pos on: the op must rotate, attend and write the rows' keys and values."""

    K_FILL, V_FILL = -1.0, -2.0

    def __init__(
        self,
        gpu,
        registry,
        rng,
        *,
        n_heads,
        n_kv_heads,
        head_dim,
        max_seq,
        max_rows,
        window=0,
        mode="local",
        qkv=None,
        out=None,
        bidirectional=False,
    ):
        """`mode`: the path the op may take besides a rope dispatch, "local", "fused" or "rope-dispatch" (none);
        None: the adapter's default. `qkv`, `out`: buffers shared with other cases (a batch of sequences)."""
        self.tree = Tensor.empty(gpu, (MAX_TREE_ROWS, 2), "u32")
        self.shape = (n_heads, n_kv_heads, head_dim)
        self.q_size, self.kv_size = n_heads * head_dim, n_kv_heads * head_dim
        self.window, self.rng, self.max_rows, self.bidirectional = window, rng, max_rows, bidirectional
        self.table = rope_table(head_dim, max_seq + 3, 1e4)
        self.k = rng.standard_normal((max_seq, n_kv_heads, head_dim)).astype(np.float32)
        self.v = rng.standard_normal((max_seq, n_kv_heads, head_dim)).astype(np.float32)
        self.qkv = Tensor.empty(gpu, (max_rows, self.q_size + 2 * self.kv_size)) if qkv is None else qkv
        self.tk, self.tv = Tensor.empty(gpu, self.k.shape), Tensor.empty(gpu, self.v.shape)
        self.out = Tensor.empty(gpu, (max_rows, self.q_size)) if out is None else out
        self.op = Attention(
            registry,
            self.qkv,
            self.tk,
            self.tv,
            self.out,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            max_seq=max_seq,
            max_rows=max_rows,
            window=window,
            rope=Tensor.from_numpy(gpu, self.table),
            fuse_rope=None if mode is None else mode == "fused",
            local_rope=mode in (None, "local"),
            tree=self.tree,
        )

    def rotate(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        return references.rope(x, self.table[positions, :, 0], self.table[positions, :, 1]).astype(np.float32)

    def run_and_check(
        self, registry, rows: int, start_pos: int, splits: int | None = None, parents: list[int] | None = None
    ) -> None:
        """`parents`: the rows are a token tree of rows - 1 nodes (ops/tree.py), else a chain."""
        qkv = self.rng.standard_normal((self.max_rows, self.q_size + 2 * self.kv_size)).astype(np.float32)
        self.qkv.write(qkv)
        self.load_caches(start_pos, rows, parents)
        rec = registry.recorder()
        self.op.record(rec, rows, start_pos, splits=splits, tree=parents is not None, bidirectional=self.bidirectional)
        rec.submit()
        self.check(qkv, self.out.numpy(), rows, start_pos, parents)

    def load_caches(self, start_pos: int, rows: int, parents: list[int] | None = None) -> None:
        """Uploads the caches (rotated keys and values before start_pos, sentinels from it on) and the tree."""
        self.k_cache, self.v_cache = self.k.copy(), self.v.copy()
        self.k_cache[start_pos:], self.v_cache[start_pos:] = self.K_FILL, self.V_FILL
        self.tk.write(self.k_cache)
        self.tv.write(self.v_cache)
        if parents is not None:
            self.tree.view((rows, 2)).write(layout_words(parents))

    def check(
        self, qkv: np.ndarray, out: np.ndarray, rows: int, start_pos: int, parents: list[int] | None, row0: int = 0
    ) -> None:
        """The call's rows (rows row0.. of `qkv` as uploaded, of `out` as read back) and the caches after it
        against the reference over the caches of `load_caches`."""
        qkv = qkv[row0 : row0 + rows]
        k_cache, v_cache = self.k_cache.copy(), self.v_cache.copy()
        slots = np.arange(start_pos, start_pos + rows)
        positions = slots if parents is None else start_pos + np.array(row_depths(parents))
        q = self.rotate(qkv[:, : self.q_size], positions)
        new_k = self.rotate(qkv[:, self.q_size : self.q_size + self.kv_size], positions)
        new_v = qkv[:, self.q_size + self.kv_size :]
        k_cache[slots] = new_k.reshape(rows, *self.k.shape[1:])
        v_cache[slots] = new_v.reshape(rows, *self.v.shape[1:])
        if parents is None:
            expected = attention(q, k_cache, v_cache, start_pos, window=self.window, bidirectional=self.bidirectional)
        else:
            expected = tree_attention(q, k_cache, v_cache, start_pos, parents, window=self.window)
        got = out[row0 : row0 + rows]
        np.testing.assert_allclose(got, expected, rtol=0, atol=TOLERANCE * np.abs(v_cache[: start_pos + rows]).max())
        # The caches: the rows' keys rotated (test_rope.py's tolerance), values copied, nothing else written.
        got_k, got_v = self.tk.numpy().reshape(k_cache.shape), self.tv.numpy().reshape(v_cache.shape)
        np.testing.assert_allclose(got_k, k_cache, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(got_v, v_cache)


ROPE_SHAPES = [
    SMOLLM2,
    {"n_heads": 8, "n_kv_heads": 2, "head_dim": 128},
    {"n_heads": 6, "n_kv_heads": 1, "head_dim": 16},
]


@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=["gqa3-64", "gqa4-128", "mqa6-16"])
@pytest.mark.parametrize(
    ("rows", "start_pos", "splits"),
    [(1, 0, None), (1, 77, None), (1, 300, 3), (5, 70, None), (5, 200, 2), (16, 90, 5), (16, 0, None)],
    ids=["first", "decode", "decode-split", "verify5", "verify5-split", "16-split", "16-prefill"],
)
@pytest.mark.parametrize("mode", ["local", "fused", "rope-dispatch"])
def test_rope_inside_matches_rope_then_attention(gpu, registry, rng, shape, rows, start_pos, splits, mode):
    """Calls of up to 16 rows: with one workgroup per kv head, that workgroup writes the caches and attends
    ("local"); fused (GPUs), every workgroup rotates q and the new keys, attends, and one writes the caches;
    otherwise a rope.wgsl dispatch goes first. All give the same."""
    case = RopeCase(gpu, registry, rng, **shape, max_seq=320, max_rows=40, mode=mode)
    rec = registry.recorder()
    case.op.record(rec, rows, start_pos, splits=splits)
    grid = case.op.call(rows, start_pos, splits)[1]
    local = mode == "local" and grid[0] == 1 and grid[2] == 1
    if mode == "local" and rows == 1 and not splits:
        assert local, "a decode call without splits has one workgroup per kv head"
    assert rec.dispatches == (2 if splits else 1) + (mode == "rope-dispatch" or (mode == "local" and not local))
    case.run_and_check(registry, rows, start_pos, splits)


@pytest.mark.parametrize("entry", ["main", "main_subgroups"])
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=["gqa3-64", "gqa4-128", "mqa6-16"])
@pytest.mark.parametrize(
    ("rows", "start_pos", "splits", "mode"),
    [(1, 300, None, "local"), (5, 200, 2, "fused"), (16, 90, None, "local"), (40, 150, None, "rope-dispatch")],
    ids=["decode", "verify5-split-fused", "16-rows", "prefill"],
)
def test_both_entry_points_match_the_reference(
    gpu, registry, rng, monkeypatch, entry, shape, rows, start_pos, splits, mode
):
    """main (a group's partial scores summed in workgroup memory: GPUs) and main_subgroups (summed by subgroup
    shuffles: CPU adapters with subgroups) attend alike, whichever one this adapter would pick."""
    if entry == "main_subgroups" and not gpu.has_subgroups:
        pytest.skip("the adapter has no subgroups")
    if entry == "main_subgroups" and shape["head_dim"] > 16 * WEBGPU_MIN_SUBGROUP:
        pytest.skip("no device runs it: a group would not fit every device's subgroups (attention_entry)")
    monkeypatch.setattr(attention_module, "attention_entry", lambda registry, head_dim: entry)
    case = RopeCase(gpu, registry, rng, **shape, max_seq=320, max_rows=40, mode=mode)
    assert case.op.bound.kernel.entry == entry
    case.run_and_check(registry, rows, start_pos, splits)


def test_cpu_adapters_with_subgroups_sum_scores_in_subgroups(gpu, registry):
    """The subgroup entry needs a group's HEAD_DIM / 16 lanes, a power of two, inside one subgroup of any device
    (WebGPU's smallest: 4 lanes), so the pipeline computes the same wherever it is replayed."""
    if not (gpu.on_cpu and gpu.has_subgroups):
        assert attention_entry(registry, 64) == "main"
        return
    assert [attention_entry(registry, d) for d in (16, 32, 64)] == ["main_subgroups"] * 3
    assert attention_entry(registry, 128) == "main", "8 lanes: wider than a subgroup of SwiftShader's or a browser's"
    assert attention_entry(registry, 48) == "main", "3 lanes per group: the xor shuffles need a power of two"


@pytest.mark.parametrize(
    ("shape", "rows", "start_pos", "window", "heads"),
    [
        (SMOLLM2, 1, 100, 0, 3),  # decode: SmolLM2's 3 kv heads in one workgroup
        (SMOLLM2, 1, 300, 0, 1),  # PACK_MAX_KEYS keys or more: one kv head each
        (SMOLLM2, 1, 1000, 64, 3),  # a sliding window keeps the keys few at any context
        (SMOLLM2, 2, 50, 0, 2),  # k=1 verification, 2 blocks per head: rows of 2 heads and 1
        (SMOLLM2, 5, 50, 0, 1),  # 4 blocks per head: no room for another head's
        ({"n_heads": 10, "n_kv_heads": 5, "head_dim": 64}, 1, 40, 0, 4),  # the last row holds 1 head
        ({"n_heads": 8, "n_kv_heads": 2, "head_dim": 128}, 1, 40, 0, 2),
    ],
    ids=["decode", "long", "window", "verify2", "verify5", "last-row", "head128"],
)
def test_short_calls_on_cpu_adapters_pack_kv_heads_into_workgroups(
    gpu, registry, rng, shape, rows, start_pos, window, heads
):
    case = Case(gpu, registry, rng, **shape, max_seq=1100, max_rows=8, window=window)
    packed = heads if gpu.on_cpu else 1
    assert attention_module.call_heads(case.op, rows, start_pos) == packed
    assert case.op.call(rows, start_pos)[1] == (1, -(-shape["n_kv_heads"] // packed), 1)
    case.check(case.run(registry, rows, start_pos), rows, start_pos)
    # GPUs (pack_max_keys 0) keep a workgroup per kv head.
    assert attention_module.packed_heads(10, 1, 3, 16, 0) == 1


def test_the_fused_path_stays_off_cpu_adapters_unless_forced(gpu, registry, rng):
    """FUSED_ROPE measured slower on lavapipe (shaders/attention.wgsl): the default follows the adapter; the
    local path is on everywhere, so a decode step needs no rope dispatch on any adapter."""
    case = RopeCase(gpu, registry, rng, **SMOLLM2, max_seq=32, max_rows=4, mode=None)
    assert case.op.fuse_rope == (not gpu.on_cpu)
    assert case.op.rope_mode(1, case.op.call(1, 20)[1]) == "local"


@pytest.mark.parametrize("rows", [17, 40])
def test_long_calls_take_a_rope_dispatch_first(gpu, registry, rng, rows):
    case = RopeCase(gpu, registry, rng, **SMOLLM2, max_seq=128, max_rows=40, mode="fused")
    rec = registry.recorder()
    case.op.record(rec, rows, 20)
    assert rec.dispatches == 2  # rope, attention
    for start_pos in (0, 20):
        case.run_and_check(registry, rows, start_pos)


@pytest.mark.parametrize("window", [1, 4, 50])
def test_rope_inside_with_a_sliding_window(gpu, registry, rng, window):
    case = RopeCase(gpu, registry, rng, **SMOLLM2, max_seq=320, max_rows=16, window=window)
    for rows, start_pos, splits in ((1, 300, None), (1, 300, 3), (5, 70, None), (16, 2, None)):
        case.run_and_check(registry, rows, start_pos, splits)


def test_rope_inside_rejects_a_short_table_or_a_partial_row(gpu, registry, rng):
    case = RopeCase(gpu, registry, rng, **SMOLLM2, max_seq=32, max_rows=4)
    tensors = (case.qkv, case.tk, case.tv, case.out)
    with pytest.raises(ValueError, match="covers 16 positions, needs 32"):
        Attention(registry, *tensors, **SMOLLM2, max_seq=32, max_rows=4, rope=Tensor.from_numpy(gpu, case.table[:16]))
    with pytest.raises(ValueError, match=r"\[q \| k \| v\] rows"):
        Attention(
            registry,
            *tensors,
            **SMOLLM2,
            max_seq=32,
            max_rows=4,
            q_row_stride=576,
            rope=Tensor.from_numpy(gpu, case.table),
        )


@pytest.mark.parametrize("softcap", [0.7, 50.0])
def test_scores_are_soft_capped(gpu, registry, rng, softcap):
    """Gemma 2: every scaled score s becomes softcap * tanh(s / softcap) before the softmax; split, windowed and
    prefill calls alike. Integer q and k make scores in the thousands (exp overflows without the cap's care)."""
    case = Case(gpu, registry, rng, **SMOLLM2, max_seq=320, max_rows=16, window=50, softcap=softcap)
    case.q = rng.integers(-40, 41, case.q.shape).astype(np.float32)
    case.tq.write(case.q)
    for rows, start_pos, splits in ((16, 0, None), (1, 300, None), (1, 300, 3), (5, 70, None)):
        got = case.run(registry, rows, start_pos, splits=splits)
        assert np.isfinite(got[:rows]).all()
        case.check(got, rows, start_pos)
    uncapped = attention(case.q[:1], case.k, case.v, 300, window=50)
    assert np.abs(case.expected(1, 300) - uncapped).max() > 1e-2, "the cap must change the result"


# -- short prefills over a long cached context (a chat turn after the prefix cache) ---------------------------
# SmolLM2's 9/3 heads and 16 lane groups: 17, 23 and 29 rows are 13, 18 and 22 blocks per kv head, so the last
# workgroup is part-filled whatever key lanes the plan picks; the contexts are no multiple of STEP.
SHORT_PREFILLS = [(17, 301), (23, 300), (29, 517)]
# The plan's balance target (Attention.balance_workgroups): 0 leaves one key lane per block (GPUs), 8 is two
# cores' (CPU_WORKGROUPS_PER_CORE = 4), 1000 gives every block all the key lanes its keys allow.
BALANCES = {"one-key-lane": 0, "two-cores": 8, "most-key-lanes": 1000}


@pytest.mark.parametrize("balance", sorted(BALANCES))
@pytest.mark.parametrize(("rows", "start_pos"), SHORT_PREFILLS)
def test_short_prefill_over_a_long_context_matches_reference(gpu, registry, rng, balance, rows, start_pos):
    """Whatever key lanes the plan gives the blocks, and the shader the last workgroup's, each row sees exactly
    its causal keys."""
    case = Case(gpu, registry, rng, **SMOLLM2, max_seq=560, max_rows=32)
    case.op.balance_workgroups = BALANCES[balance]
    case.check(case.run(registry, rows, start_pos), rows, start_pos)


@pytest.mark.parametrize("balance", ["two-cores", "most-key-lanes"])
@pytest.mark.parametrize("window", [5, 20, 61])
def test_short_prefill_windows_cut_the_key_lanes_turns(gpu, registry, rng, balance, window):
    """Windows shorter than, about and longer than a key lane's turn (STEP keys, a row's window starting in the
    middle of one), over a context whose earliest keys no workgroup needs."""
    case = Case(gpu, registry, rng, **SMOLLM2, max_seq=560, max_rows=32, window=window)
    case.op.balance_workgroups = BALANCES[balance]
    for rows, start_pos in SHORT_PREFILLS:
        case.check(case.run(registry, rows, start_pos), rows, start_pos)


def test_short_prefills_take_more_key_lanes_and_verification_keeps_its_grid(gpu, registry, rng):
    """Under the balance target a short prefill's grid grows by key lanes; decode and verification calls keep
    one workgroup per kv head (their rope_mode "local" needs it), and a call too short for a turn per lane keeps
    one key lane."""
    case = Case(gpu, registry, rng, **SMOLLM2, max_seq=560, max_rows=32)
    case.op.balance_workgroups = 8
    key_lanes, _, _ = case.op.plan(23, 500)
    grid = case.op.call(23, 500)[1]
    assert key_lanes > 1 and grid[0] * grid[1] * grid[2] >= 8
    for rows in (1, 5, 16):
        assert case.op.call(rows, 500)[1][0] == 1
    assert case.op.plan(23, 0)[0] * STEP <= 23


# A 23-row token tree: rows past 16 take a rope dispatch and the short-prefill plan.
LONG_TREE = [-1, 0, 0, 1, 1, 2, 5, 6, -1, 8, 9, 3, 11, 12, 4, 14, 15, 7, 17, -1, 19, 20]


@pytest.mark.parametrize("balance", sorted(BALANCES))
@pytest.mark.parametrize("start_pos", [0, 290])
def test_a_long_tree_over_a_long_context_sees_its_ancestors(gpu, registry, rng, balance, start_pos):
    case = RopeCase(gpu, registry, rng, **SMOLLM2, max_seq=320, max_rows=MAX_TREE_ROWS, mode="rope-dispatch")
    case.op.balance_workgroups = BALANCES[balance]
    case.run_and_check(registry, len(LONG_TREE) + 1, start_pos, parents=LONG_TREE)


# -- token trees (tree=True) ---------------------------------------------------------------------------------
TREES = {
    "chain": [-1, 0, 1, 2],
    "star": [-1, -1, -1, -1, -1],
    "two-branches": [-1, 0, 1, -1, 3, 0, 5],
    "deep-and-wide": [-1, 0, 0, 1, 1, 2, 5, 6, -1, 8, 9, 3, 11, 12, 4],
}


@pytest.mark.parametrize("tree", sorted(TREES))
@pytest.mark.parametrize("mode", ["local", "fused", "rope-dispatch"])
@pytest.mark.parametrize(("start_pos", "splits"), [(0, None), (37, None), (290, 3)], ids=["empty", "mid", "split"])
def test_tree_rows_see_the_cache_and_their_ancestors_only(gpu, registry, rng, tree, mode, start_pos, splits):
    """Each tree row attends at start_pos + its depth to the cache and its own ancestors; its key is rotated for
    that position and written to slot start_pos + row (ops/tree.py's layout)."""
    case = RopeCase(gpu, registry, rng, **SMOLLM2, max_seq=320, max_rows=MAX_TREE_ROWS, mode=mode)
    parents = TREES[tree]
    case.run_and_check(registry, len(parents) + 1, start_pos, splits, parents=parents)


@pytest.mark.parametrize("window", [1, 3, 6])
def test_tree_rows_keep_the_window_by_depth(gpu, registry, rng, window):
    """A sliding window counts a tree key's depth, not its row: deep rows lose the root's oldest keys."""
    for mode in ("local", "fused", "rope-dispatch"):
        case = RopeCase(gpu, registry, rng, **SMOLLM2, max_seq=320, max_rows=MAX_TREE_ROWS, window=window, mode=mode)
        for start_pos in (2, 40):
            case.run_and_check(registry, 16, start_pos, parents=TREES["deep-and-wide"])


def test_a_chain_laid_out_as_a_tree_is_the_plain_call(gpu, registry, rng):
    case = RopeCase(gpu, registry, rng, n_heads=6, n_kv_heads=1, head_dim=16, max_seq=64, max_rows=8)
    case.run_and_check(registry, 5, 20, parents=TREES["chain"])
    case.run_and_check(registry, 5, 20)


def test_tree_calls_need_the_layout_tensor(gpu, registry, rng):
    case = Case(gpu, registry, rng, **SMOLLM2, max_seq=32, max_rows=4)
    with pytest.raises(ValueError, match="tree layout tensor"):
        case.op.record(registry.recorder(), 3, 5, tree=True)


# -- several sequences' rows in one forward (row0) -----------------------------------------------------------
# (max_seq, start_pos, rows, row0): each sequence has its own cache and op; their rows are stacked in one q and
# one out buffer with a row left free after each, which no call may write.
BATCH = [(48, 0, 1, 0), (64, 37, 3, 2), (160, 130, 5, 6)]
BATCH_ROWS = 12
SENTINEL = -7.0


def outside_the_batch(out: np.ndarray) -> np.ndarray:
    inside = np.zeros(len(out), bool)
    for _, _, rows, row0 in BATCH:
        inside[row0 : row0 + rows] = True
    return out[~inside]


@pytest.mark.parametrize("splits", [None, 3])
def test_sequences_stacked_in_one_buffer_each_attend_over_their_own_cache(gpu, registry, rng, splits):
    """Ragged rows of three sequences (one with a sliding window) in one submit: each call reads its queries
    from, and writes its outputs to, its own rows, with key splits merged there too."""
    width = SMOLLM2["n_heads"] * SMOLLM2["head_dim"]
    tq = Tensor.from_numpy(gpu, rng.standard_normal((BATCH_ROWS, width)).astype(np.float32))
    out = Tensor.from_numpy(gpu, np.full((BATCH_ROWS, width), SENTINEL, np.float32))
    cases = [
        Case(gpu, registry, rng, **SMOLLM2, max_seq=max_seq, max_rows=BATCH_ROWS, window=5 * (i == 1), tq=tq, out=out)
        for i, (max_seq, _, _, _) in enumerate(BATCH)
    ]
    rec = registry.recorder()
    for case, (_, start_pos, rows, row0) in zip(cases, BATCH, strict=True):
        case.upload_cache(start_pos + rows)
        case.op.record(rec, rows, start_pos, splits=splits, row0=row0)
    rec.submit()
    got = out.numpy()
    for case, (_, start_pos, rows, row0) in zip(cases, BATCH, strict=True):
        case.check(got, rows, start_pos, row0)
    assert np.all(outside_the_batch(got) == SENTINEL), "rows outside every call must not be written"


@pytest.mark.parametrize("splits", [None, 2])
@pytest.mark.parametrize("mode", ["local", "fused", "rope-dispatch"])
def test_stacked_sequences_with_rope_inside_write_their_own_caches(gpu, registry, rng, mode, splits):
    """The same with [q | k | v] rows: each call rotates its own rows' queries and keys and writes them to its
    own caches; the third sequence is a token tree (its layout indexed from its first row)."""
    n_heads, n_kv_heads, head_dim = SMOLLM2.values()
    width = (n_heads + 2 * n_kv_heads) * head_dim
    qkv = rng.standard_normal((BATCH_ROWS, width)).astype(np.float32)
    tqkv = Tensor.from_numpy(gpu, qkv)
    out = Tensor.from_numpy(gpu, np.full((BATCH_ROWS, n_heads * head_dim), SENTINEL, np.float32))
    trees = [None, None, [-1, 0, -1, 2]]
    cases = [
        RopeCase(
            gpu,
            registry,
            rng,
            **SMOLLM2,
            max_seq=max_seq,
            max_rows=BATCH_ROWS,
            window=5 * (i == 1),
            mode=mode,
            qkv=tqkv,
            out=out,
        )
        for i, (max_seq, _, _, _) in enumerate(BATCH)
    ]
    rec = registry.recorder()
    for case, parents, (_, start_pos, rows, row0) in zip(cases, trees, BATCH, strict=True):
        case.load_caches(start_pos, rows, parents)
        case.op.record(rec, rows, start_pos, splits=splits, tree=parents is not None, row0=row0)
    rec.submit()
    got = out.numpy()
    for case, parents, (_, start_pos, rows, row0) in zip(cases, trees, BATCH, strict=True):
        case.check(qkv, got, rows, start_pos, parents, row0)
    assert np.all(outside_the_batch(got) == SENTINEL), "rows outside every call must not be written"


def test_call_values_carry_row0_and_rows_must_lie_in_the_buffers(gpu, registry, rng):
    """`call`'s values are what a recorded forward replays, so they hold row0; a call past max_rows is refused."""
    case = RopeCase(gpu, registry, rng, **SMOLLM2, max_seq=32, max_rows=4, mode="rope-dispatch")
    values, _ = case.op.call(2, 5, row0=2)
    assert values["attention"]["row0"] == 2 and values["rope"]["row0"] == 2
    rec = registry.recorder()
    for rows, row0 in ((1, -1), (2, 3), (4, 1)):
        with pytest.raises(ValueError, match="row0"):
            case.op.record(rec, rows, 5, row0=row0)
        with pytest.raises(ValueError, match="row0"):
            case.op.rope.record(rec, rows, 5, row0=row0)
    assert rec.dispatches == 0


@pytest.mark.parametrize("mode", ["local", "fused", "rope-dispatch"])
def test_rope_inside_at_gemma4_s_global_head_dim(gpu, registry, rng, mode):
    """head_dim 512 (Gemma 4 E2B's full layers): two lane groups of 32 lanes per workgroup."""
    case = RopeCase(gpu, registry, rng, **GEMMA4_GLOBAL, max_seq=320, max_rows=20, mode=mode)
    for rows, start_pos, splits in ((1, 77, None), (5, 70, None), (16, 90, 5), (20, 0, None)):
        case.run_and_check(registry, rows, start_pos, splits)


# -- KV-shared layers (kv_shared=True) -------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [*ROPE_SHAPES, GEMMA4_GLOBAL], ids=["gqa3-64", "gqa4-128", "mqa6-16", "mqa8-512"])
@pytest.mark.parametrize(
    ("rows", "start_pos", "splits", "window"),
    [(1, 0, None, 0), (1, 77, None, 0), (1, 300, 3, 0), (5, 70, None, 8), (16, 90, 5, 0), (40, 3, None, 8)],
    ids=["first", "decode", "decode-split", "verify5-window", "16-split", "prefill-window"],
)
def test_kv_shared_layers_rotate_their_queries_and_only_read_the_caches(
    gpu, registry, rng, shape, rows, start_pos, splits, window
):
    """Gemma 4's last layers: q holds the layer's query rows only (not rotated); the keys and values of every
    position, the call's own included, are already in the caches, which the call must leave as they are."""
    n_heads, n_kv_heads, head_dim = shape["n_heads"], shape["n_kv_heads"], shape["head_dim"]
    max_seq, max_rows = 320, 40
    table = rope_table(head_dim, max_seq, 1e4)
    q = rng.standard_normal((max_rows, n_heads * head_dim)).astype(np.float32)
    k = rng.standard_normal((max_seq, n_kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((max_seq, n_kv_heads, head_dim)).astype(np.float32)
    k[start_pos + rows :], v[start_pos + rows :] = np.nan, np.nan  # never read
    tk, tv, out = (
        Tensor.from_numpy(gpu, k),
        Tensor.from_numpy(gpu, v),
        Tensor.empty(gpu, (max_rows, n_heads * head_dim)),
    )
    op = Attention(
        registry,
        Tensor.from_numpy(gpu, q),
        tk,
        tv,
        out,
        **shape,
        max_seq=max_seq,
        max_rows=max_rows,
        window=window,
        rope=Tensor.from_numpy(gpu, table),
        kv_shared=True,
    )
    rec = registry.recorder()
    op.record(rec, rows, start_pos, splits=splits)
    assert rec.dispatches == (2 if splits else 1), "no rope dispatch: the queries are rotated as they are loaded"
    rec.submit()
    positions = np.arange(start_pos, start_pos + rows)
    rotated = references.rope(q[:rows], table[positions, :, 0], table[positions, :, 1]).astype(np.float32)
    expected = attention(rotated, k, v, start_pos, window=window)
    got = out.numpy()[:rows]
    np.testing.assert_allclose(got, expected, rtol=0, atol=TOLERANCE * np.abs(v[: start_pos + rows]).max())
    np.testing.assert_array_equal(tk.numpy().reshape(k.shape), k)
    np.testing.assert_array_equal(tv.numpy().reshape(v.shape), v)
    op.release(registry)
