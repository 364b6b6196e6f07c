"""The KV arena of batched generations (model/kv_arena.py): runs of blocks handed out first fit and merged when given
back, slabs that double and are freed when empty, and caches that are views of their run (a forward over one gives
the logits of a forward over a cache of its own; copies between the two kinds land at the right offsets)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from doppler_py.errors import CapacityError
from doppler_py.model.kv_arena import BLOCK, MIN_SLAB_BLOCKS, KVArena, KVSlab

NAME = "llama-tied-gqa"
SHAPES = [(2, 16), (2, 16)]


@pytest.fixture
def model(tiny_model, named_folder):
    return tiny_model(named_folder(NAME), max_rows=16, max_positions=128)


def test_runs_are_taken_first_fit_and_merged_when_given_back(gpu):
    slab = KVSlab(gpu, SHAPES, 10, "test")
    try:
        assert [slab.take(3), slab.take(4), slab.take(2)] == [0, 3, 7]
        assert slab.take(2) is None  # one block left
        slab.give_back(3, 4)
        assert slab.take(5) is None  # 4 + 1 free, not adjacent
        slab.give_back(7, 2)  # 3..9 free now, one run
        assert slab.take(7) == 3
        assert slab.used_blocks == 10
        slab.give_back(0, 3)
        with pytest.raises(CapacityError, match="given back twice"):
            slab.give_back(1, 1)
    finally:
        slab.close()


def test_a_slab_without_room_leaves_the_request_to_a_doubled_one_and_empty_slabs_are_freed(gpu):
    arena = KVArena(gpu, SHAPES)
    try:
        first, a, count = arena.take(MIN_SLAB_BLOCKS * BLOCK - 5)  # rounds up to the whole first slab
        assert (first.blocks, a, count) == (MIN_SLAB_BLOCKS, 0, MIN_SLAB_BLOCKS)
        second, b, _ = arena.take(BLOCK + 1)
        assert second is not first and second.blocks == 2 * MIN_SLAB_BLOCKS and b == 0
        third, c, _ = arena.take(1)
        assert third is second and c == 2  # the largest slab first
        assert arena.give_back(first, a, count)  # emptied: the caller frees it
        assert arena.slabs == [second]
        assert not arena.give_back(second, b, 2)
        assert arena.give_back(second, c, 1) and arena.slabs == []
    finally:
        arena.close()


def test_a_limit_bounds_all_slabs_together_and_a_request_waits_for_runs_given_back(gpu):
    arena = KVArena(gpu, SHAPES, limit_positions=5 * BLOCK)
    try:
        slab = arena.take(1)[0]
        assert slab.blocks == 5  # the limit, not the doubling
        _, b, count = arena.take(4 * BLOCK)
        assert not arena.has_room(1)
        with pytest.raises(CapacityError, match="wait_for_room"):
            arena.take(1)
        waited = threading.Event()

        def wait() -> None:
            arena.wait_for_room(2 * BLOCK)
            waited.set()

        waiter = threading.Thread(target=wait)
        waiter.start()
        assert not waited.wait(0.2)
        arena.give_back(slab, b, count)
        waiter.join(5)
        assert waited.is_set() and arena.take(2 * BLOCK)[0] is slab
    finally:
        arena.close()
    lone = KVArena(gpu, SHAPES, limit_positions=3 * BLOCK)
    try:
        assert lone.take(5 * BLOCK)[0].blocks == 5  # alone in an empty arena, a request always gets its slab
    finally:
        lone.close()


def test_an_arena_cache_is_a_view_of_its_run_and_copies_use_the_offsets(model):
    arena = model.new_arena()
    try:
        first = model.new_cache(20, arena=arena)
        cache = model.new_cache(40, arena=arena)
        assert cache.block_table == (2, 3, 4)  # after the first cache's two blocks
        rows = np.arange(40 * 2 * 16, dtype=np.float32).reshape(40, 2, 16)
        cache.keys[1].write(rows)
        slab_rows = cache.slab.keys[1].numpy().reshape(-1, 2, 16)
        np.testing.assert_array_equal(slab_rows[2 * BLOCK : 2 * BLOCK + 40], rows)
        cache.length = 40
        own = model.new_cache(40)
        cache.copy_prefix(own, 30)
        np.testing.assert_array_equal(own.keys[1].numpy().reshape(40, 2, 16)[:30], rows[:30])
        own.copy_prefix(first, 10)  # into the slab's first run: the second one keeps its rows
        np.testing.assert_array_equal(first.keys[1].numpy().reshape(20, 2, 16)[:10], rows[:10])
        np.testing.assert_array_equal(cache.keys[1].numpy().reshape(40, 2, 16), rows)
        model.release_cache(own)
        model.release_cache(first)
        assert arena.slabs  # the second cache still holds blocks
        model.release_cache(cache)
        assert not arena.slabs
    finally:
        model.release_arena(arena)


def test_a_forward_over_an_arena_cache_gives_the_logits_of_a_cache_of_its_own(model):
    ids = [5, 9, 14, 3, 7, 21, 33, 2, 8, 19, 4]
    arena = model.new_arena()
    try:
        before = model.new_cache(24, arena=arena)  # so the cache under test starts past block 0
        cache = model.new_cache(40, arena=arena)
        assert cache.block_table[0] > 0
        got = [model.forward(ids, cache, logits="all"), model.forward([40, 41], cache, logits="all")]
        own = model.new_cache(40)
        expected = [model.forward(ids, own, logits="all"), model.forward([40, 41], own, logits="all")]
        for g, e in zip(got, expected, strict=True):
            np.testing.assert_array_equal(g, e)
        model.release_cache(own)
        model.release_cache(before)
        model.release_cache(cache)
    finally:
        model.release_arena(arena)
