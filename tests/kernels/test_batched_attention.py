"""One attention dispatch over several sequences' rows, K/V read through block tables (BatchedAttention, the PAGED
variant of shaders/attention.wgsl) vs numpy float64 (`doppler_py.testing.references`) and vs the solo kernel.

Each case stacks ragged segments in one q/out buffer (a free row after each, which no workgroup may write) and
scatters each sequence's cache slots over pool blocks in a scrambled order, with spare blocks that no table
names. Pool positions no segment uses hold NaN: a read of one would poison the outputs. Besides the outputs,
the pools after the dispatch are compared with what it must write (rope "local": the rows' rotated keys and
their values at the table's positions; "shared": nothing).

The solo kernel (`Attention`, each sequence its own contiguous cache) runs the same rows: its outputs and cache
writes must equal the batched ones bit for bit, since a segment's workgroup does the same arithmetic in the same
order (the same key lanes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from test_attention import SMOLLM2, TOLERANCE

from doppler_py.gpu.tensor import Tensor
from doppler_py.ops.attention import (
    Attention,
    BatchedAttention,
    PagedSegment,
    paged_layout_capacity,
    paged_layout_words,
    paged_max_rows,
)
from doppler_py.ops.rope import rope_table
from doppler_py.ops.tree import MAX_TREE_ROWS, layout_words, row_depths
from doppler_py.testing import references
from doppler_py.testing.references import attention, tree_attention

SENTINEL = -7.0
MAX_SEQ = 320  # positions of the rope table and of the solo caches
HEAD128 = {"n_heads": 8, "n_kv_heads": 2, "head_dim": 128}


@dataclass(frozen=True)
class Seq:
    """A sequence of the batch: `rows` new rows at cache slots start_pos.. (a token tree when `parents`)."""

    rows: int
    start_pos: int
    parents: tuple[int, ...] | None = None


# The brief's ragged batch: a first token, a verification of 5, and 2 rows far into a context.
RAGGED = [Seq(1, 0), Seq(5, 37), Seq(2, 300)]


class Batch:
    """Sequences' rows stacked in one qkv/out buffer, their caches in pools of `block`-position blocks."""

    def __init__(
        self,
        gpu,
        registry,
        rng,
        seqs,
        *,
        n_heads,
        n_kv_heads,
        head_dim,
        block=16,
        spare_blocks=5,
        window=0,
        softcap=0.0,
        kv_shared=False,
    ):
        self.gpu, self.registry, self.seqs = gpu, registry, seqs
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.window, self.softcap, self.kv_shared, self.block = window, softcap, kv_shared, block
        self.q_size, self.kv_size = n_heads * head_dim, n_kv_heads * head_dim
        self.width = self.q_size if kv_shared else self.q_size + 2 * self.kv_size
        self.table = rope_table(head_dim, MAX_SEQ, 1e4)
        self.rope = Tensor.from_numpy(gpu, self.table)
        # Rows: each sequence's, then one free row.
        self.row0s = list(np.cumsum([0] + [s.rows + 1 for s in seqs[:-1]]))
        self.n_rows = self.row0s[-1] + seqs[-1].rows + 1
        self.qkv = rng.standard_normal((self.n_rows, self.width)).astype(np.float32)
        # Every sequence's logical cache, rotated keys as the pools hold them: [MAX_SEQ, n_kv, hd] each.
        kv_shape = (MAX_SEQ, n_kv_heads, head_dim)
        self.k = [rng.standard_normal(kv_shape).astype(np.float32) for _ in seqs]
        self.v = [rng.standard_normal(kv_shape).astype(np.float32) for _ in seqs]
        # Tables: the blocks in a scrambled order, spare ones left over.
        needed = [-(-(s.start_pos + s.rows) // block) for s in seqs]
        order = rng.permutation(sum(needed) + spare_blocks)
        self.tables = [tuple(int(b) for b in order[sum(needed[:i]) : sum(needed[: i + 1])]) for i in range(len(seqs))]
        self.pool_positions = len(order) * block
        self.k_pool, self.v_pool = (np.full((self.pool_positions, *kv_shape[1:]), np.nan, np.float32) for _ in "kv")
        for i, seq in enumerate(seqs):
            # The cache before the call: slots before start_pos (kv_shared: every slot of the call too).
            cached = seq.start_pos + seq.rows if kv_shared else seq.start_pos
            at = self.positions(i, cached)
            self.k_pool[at], self.v_pool[at] = self.k[i][:cached], self.v[i][:cached]
        self.segments = [
            PagedSegment(
                int(row0),
                seq.rows,
                seq.start_pos,
                self.tables[i],
                None if seq.parents is None else layout_words(seq.parents),
            )
            for i, (seq, row0) in enumerate(zip(seqs, self.row0s, strict=True))
        ]
        capacity = paged_layout_capacity(len(seqs), max(s.rows for s in seqs), max(needed))
        self.layout = Tensor.empty(gpu, capacity, "u32")
        self.tk_pool, self.tv_pool = Tensor.from_numpy(gpu, self.k_pool), Tensor.from_numpy(gpu, self.v_pool)
        self.tqkv = Tensor.from_numpy(gpu, self.qkv)
        self.out = Tensor.from_numpy(gpu, np.full((self.n_rows, self.q_size), SENTINEL, np.float32))
        self.op = BatchedAttention(
            registry,
            self.tqkv,
            self.tk_pool,
            self.tv_pool,
            self.out,
            self.layout,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            pool_positions=self.pool_positions,
            block=block,
            max_rows=self.n_rows,
            rope=self.rope,
            window=window,
            softcap=softcap,
            kv_shared=kv_shared,
        )

    def positions(self, i: int, slots: int) -> np.ndarray:
        """Pool positions of sequence i's cache slots 0..slots-1."""
        j = np.arange(slots)
        return np.array(self.tables[i])[j // self.block] * self.block + j % self.block

    def run(self) -> np.ndarray:
        words = self.op.layout_words(self.segments)
        self.layout.view((len(words),)).write(words)
        rec = self.registry.recorder()
        self.op.record(rec, self.segments)
        assert rec.dispatches == 1
        rec.submit()
        return self.out.numpy()

    def rotate(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        return references.rope(x, self.table[positions, :, 0], self.table[positions, :, 1]).astype(np.float32)

    def expected(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Sequence i's outputs by the reference, and its whole cache (keys, values) after the call."""
        seq, row0 = self.seqs[i], self.row0s[i]
        rows = self.qkv[row0 : row0 + seq.rows]
        depths = np.arange(seq.rows) if seq.parents is None else np.array(row_depths(seq.parents))
        positions = seq.start_pos + depths
        k, v = self.k[i].copy(), self.v[i].copy()
        if not self.kv_shared:
            new_k = self.rotate(rows[:, self.q_size : self.q_size + self.kv_size], positions)
            k[seq.start_pos : seq.start_pos + seq.rows] = new_k.reshape(seq.rows, *k.shape[1:])
            v[seq.start_pos : seq.start_pos + seq.rows] = rows[:, self.q_size + self.kv_size :].reshape(
                seq.rows, *v.shape[1:]
            )
        q = self.rotate(rows[:, : self.q_size], positions)
        options = {"window": self.window, "softcap": self.softcap}
        if seq.parents is None:
            out = attention(q, k, v, seq.start_pos, **options)
        else:
            out = tree_attention(q, k, v, seq.start_pos, list(seq.parents), **options)
        return out, k, v

    def solo(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Sequence i through the solo kernel over its own contiguous cache: (outputs, keys, values after)."""
        seq, row0 = self.seqs[i], self.row0s[i]
        cached = seq.start_pos + seq.rows if self.kv_shared else seq.start_pos
        k, v = (np.full_like(x, np.nan) for x in (self.k[i], self.v[i]))
        k[:cached], v[:cached] = self.k[i][:cached], self.v[i][:cached]
        tk, tv = Tensor.from_numpy(self.gpu, k), Tensor.from_numpy(self.gpu, v)
        out = Tensor.from_numpy(self.gpu, np.full((self.n_rows, self.q_size), SENTINEL, np.float32))
        tree = Tensor.empty(self.gpu, (MAX_TREE_ROWS, 2), "u32")
        if seq.parents is not None:
            tree.view((seq.rows, 2)).write(layout_words(seq.parents))
        op = Attention(
            self.registry,
            self.tqkv,
            tk,
            tv,
            out,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            max_seq=MAX_SEQ,
            max_rows=self.n_rows,
            window=self.window,
            softcap=self.softcap,
            rope=self.rope,
            tree=tree,
            kv_shared=self.kv_shared,
        )
        # One workgroup per kv head, its key lanes grown by the shader alone, as a segment's: without this a CPU
        # adapter's plan would give a long segment's blocks more key lanes (another summation order).
        op.balance_workgroups = 0
        rec = self.registry.recorder()
        op.record(rec, seq.rows, seq.start_pos, splits=1, tree=seq.parents is not None, row0=row0)
        rec.submit()
        got = out.numpy()[row0 : row0 + seq.rows], tk.numpy().reshape(k.shape), tv.numpy().reshape(v.shape)
        op.release(self.registry)
        self.registry.release_tensors(tk, tv, out, tree)
        return got

    def check(self, got: np.ndarray) -> None:
        """Every sequence's outputs against the reference and the solo kernel; the pools against what the call
        must write; rows outside every segment still the sentinel."""
        k_pool, v_pool = self.k_pool.copy(), self.v_pool.copy()
        inside = np.zeros(self.n_rows, bool)
        for i, (seq, row0) in enumerate(zip(self.seqs, self.row0s, strict=True)):
            rows = slice(row0, row0 + seq.rows)
            inside[rows] = True
            expected, k, v = self.expected(i)
            context = seq.start_pos + seq.rows
            atol = TOLERANCE * np.abs(v[:context]).max()
            np.testing.assert_allclose(got[rows], expected, rtol=0, atol=atol, err_msg=f"sequence {i}")
            solo_out, solo_k, solo_v = self.solo(i)
            np.testing.assert_array_equal(got[rows], solo_out, err_msg=f"sequence {i}: batched != solo")
            # The rows' slots of the pools hold what the solo kernel wrote to its cache.
            written = self.positions(i, context)[seq.start_pos :]
            k_pool[written] = solo_k[seq.start_pos : context]
            v_pool[written] = solo_v[seq.start_pos : context]
            np.testing.assert_allclose(solo_k[:context], k[:context], rtol=1e-6, atol=1e-6)
            np.testing.assert_array_equal(solo_v[:context], v[:context])
        np.testing.assert_array_equal(self.tk_pool.numpy().reshape(k_pool.shape), k_pool)
        np.testing.assert_array_equal(self.tv_pool.numpy().reshape(v_pool.shape), v_pool)
        assert np.all(got[~inside] == SENTINEL), "rows outside every segment must not be written"

    def release(self) -> None:
        self.op.release(self.registry)
        self.registry.release_tensors(self.tk_pool, self.tv_pool, self.tqkv, self.out, self.layout, self.rope)


@pytest.fixture
def batch(gpu, registry, rng):
    made = []

    def make(seqs, **options) -> Batch:
        made.append(Batch(gpu, registry, rng, seqs, **options))
        return made[-1]

    yield make
    for b in made:
        b.release()


@pytest.mark.parametrize("shape", [SMOLLM2, HEAD128], ids=["gqa3-64", "gqa4-128"])
def test_ragged_segments_read_and_write_their_caches_through_scrambled_tables(batch, shape):
    """Rows 1, 5 and 2 at positions 0, 37 and 300 (no multiple of the block): one dispatch rotates each segment's
    rows, writes their keys and values to its blocks and attends over its own cache only."""
    b = batch(RAGGED, **shape)
    b.check(b.run())


@pytest.mark.parametrize("block", [1, 8, 64])
def test_any_power_of_two_block(batch, block):
    """A block of one position (every slot its own table entry) up to blocks longer than some contexts."""
    b = batch(RAGGED, **SMOLLM2, block=block)
    b.check(b.run())


@pytest.mark.parametrize(("window", "softcap"), [(20, 0.0), (1, 0.0), (0, 0.7), (50, 30.0)])
def test_windows_and_the_softcap_hold_for_every_segment(batch, window, softcap):
    """Windows shorter than some segments' contexts (and of one key), the Gemma 2 cap, both."""
    b = batch([Seq(1, 0), Seq(5, 37), Seq(3, 300), Seq(1, 70)], **SMOLLM2, window=window, softcap=softcap)
    b.check(b.run())


@pytest.mark.parametrize("window", [0, 3])
def test_a_tree_a_chain_and_a_decode_row_in_one_batch(batch, window):
    """A token tree's rows sit at start_pos + depth and see their ancestors; its keys go to slots start_pos + row
    through its table, next to a chain and a decode row."""
    seqs = [Seq(5, 37, (-1, 0, 0, 1)), Seq(3, 120), Seq(1, 299), Seq(8, 200, (-1, 0, 1, -1, 3, 0, 5))]
    b = batch(seqs, **SMOLLM2, window=window)
    b.check(b.run())


@pytest.mark.parametrize("shape", [SMOLLM2, HEAD128], ids=["gqa3-64", "gqa4-128"])
def test_kv_shared_layers_only_read_the_pools(batch, shape):
    """rope "shared" (Gemma 4's KV-shared layers): q holds query rows only; every key, the rows' own included,
    is in the pools already, which the dispatch leaves as they are."""
    b = batch([Seq(1, 0), Seq(5, 37), Seq(1, 300), Seq(4, 100, (-1, 0, 0))], **shape, window=40, kv_shared=True)
    b.check(b.run())


def test_a_kv_shared_layer_reads_what_an_earlier_layer_wrote_in_the_same_submit(batch, gpu, registry, rng):
    """Gemma 4: a layer writes its rows' keys and values to the pools, a later KV-shared layer of the same forward
    attends over them; both layers' ops read the one layout the caller wrote for the forward."""
    b = batch([Seq(1, 12), Seq(4, 100, (-1, 0, 1)), Seq(2, 250)], **SMOLLM2)
    queries = rng.standard_normal((b.n_rows, b.q_size)).astype(np.float32)
    tq, out = Tensor.from_numpy(gpu, queries), Tensor.empty(gpu, (b.n_rows, b.q_size))
    shared = BatchedAttention(
        registry,
        tq,
        b.tk_pool,
        b.tv_pool,
        out,
        b.layout,
        **SMOLLM2,
        pool_positions=b.pool_positions,
        block=b.block,
        max_rows=b.n_rows,
        rope=b.rope,
        kv_shared=True,
    )
    words = b.op.layout_words(b.segments)
    b.layout.view((len(words),)).write(words)
    rec = registry.recorder()
    b.op.record(rec, b.segments)
    shared.record(rec, b.segments)
    rec.submit()
    got = out.numpy()
    for i, (seq, row0) in enumerate(zip(b.seqs, b.row0s, strict=True)):
        _, k, v = b.expected(i)
        depths = np.arange(seq.rows) if seq.parents is None else np.array(row_depths(seq.parents))
        q = b.rotate(queries[row0 : row0 + seq.rows], seq.start_pos + depths)
        if seq.parents is None:
            expected = attention(q, k, v, seq.start_pos)
        else:
            expected = tree_attention(q, k, v, seq.start_pos, list(seq.parents))
        atol = TOLERANCE * np.abs(v[: seq.start_pos + seq.rows]).max()
        np.testing.assert_allclose(got[row0 : row0 + seq.rows], expected, rtol=0, atol=atol, err_msg=f"sequence {i}")
    b.check(b.out.numpy())
    shared.release(registry)
    registry.release_tensors(tq, out)


@pytest.mark.parametrize("shape", [SMOLLM2, HEAD128, {"n_heads": 4, "n_kv_heads": 4, "head_dim": 16}])
def test_a_segment_of_paged_max_rows_fills_its_workgroup(batch, shape):
    """The largest segment a workgroup holds (SmolLM2: 21 rows = 16 blocks of 4 queries), beside a decode row."""
    rows = paged_max_rows(**shape)
    b = batch([Seq(1, 290), Seq(rows, 31)], **shape)
    b.check(b.run())


def test_the_layout_words():
    """Headers (row0, rows, start_pos, tree_at, table_at, 0, 0, 0), then each segment's tree and table."""
    tree = layout_words([-1, 0])
    segments = [PagedSegment(0, 3, 5, (7, 2), tree), PagedSegment(4, 1, 0, (3, 9))]
    words = paged_layout_words(segments, 4)
    chain = 0xFFFFFFFF
    assert words[:16].tolist() == [0, 3, 5, 16, 22, 0, 0, 0, 4, 1, 0, chain, 24, 0, 0, 0]
    assert words[16:].tolist() == [*tree.reshape(-1).tolist(), 7, 2, 3]  # tables cut to the slots used
    assert len(words) <= paged_layout_capacity(2, 3, 2)


def test_bad_segments_and_shapes_are_refused(batch, gpu, registry):
    b = batch(RAGGED, **SMOLLM2)
    table = b.tables[1]
    ok = PagedSegment(0, 1, 0, b.tables[0])
    cases = [
        ([ok, PagedSegment(0, 2, 37, table)], "overlap"),
        ([PagedSegment(0, 5, 60, table)], "table has 3 blocks"),
        ([PagedSegment(0, 5, 37, (table[0], table[0], table[1]))], "repeated"),
        ([PagedSegment(0, 1, 0, (b.pool_positions // 16,))], "the pools hold"),
        ([PagedSegment(0, 22, 0, table)], "above paged_max_rows=21"),
        ([PagedSegment(b.n_rows - 1, 2, 0, table)], "past max_rows"),
        ([PagedSegment(0, 1, MAX_SEQ, tuple(range(21)))], "the rope table covers"),
        ([PagedSegment(0, 3, 0, table, layout_words([-1]))], "tree layout of 2 rows for 3"),
        ([ok, PagedSegment(2, 1, 1, (b.tables[0][0],))], "segment 0 writes pool positions that segment 1 reads"),
    ]
    for segments, message in cases:
        with pytest.raises(ValueError, match=message):
            b.op.layout_words(segments)
    with pytest.raises(ValueError, match="power of two"):
        paged_layout_words([ok], 12)
    tensors = (b.tqkv, b.tk_pool, b.tv_pool, b.out, b.layout)
    shape = {**SMOLLM2, "max_rows": b.n_rows, "rope": b.rope}
    with pytest.raises(ValueError, match="power of two"):
        BatchedAttention(registry, *tensors, **shape, pool_positions=48, block=24)
    with pytest.raises(ValueError, match="k_pool: need"):
        BatchedAttention(registry, *tensors, **shape, pool_positions=b.pool_positions + 16, block=16)
    with pytest.raises(ValueError, match="multiple of block"):
        BatchedAttention(registry, *tensors, **shape, pool_positions=40, block=16)
    with pytest.raises(ValueError, match="segments=0"):
        b.op.record(registry.recorder(), [])
