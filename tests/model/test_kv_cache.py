"""The GPU-resident KV cache: O(1) truncation, prefix-sharing fork, capacity errors, memory report."""

from __future__ import annotations

import numpy as np
import pytest

from doppler_py.errors import CapacityError
from doppler_py.testing.tiny import TINY_SPECS

NAME = "llama-tied-gqa"


@pytest.fixture
def model(tiny_model, named_folder):
    return tiny_model(named_folder(NAME), max_rows=16, max_positions=64)


def test_truncate_only_moves_the_length_and_later_writes_overwrite(model):
    ids = [5, 9, 14, 3, 7, 21]
    cache = model.new_cache(32)
    model.forward(ids, cache)
    model.forward([40, 41], cache)  # positions 6, 7: a rejected draft, say
    cache.truncate(6)
    assert cache.length == 6
    rolled = model.forward([11], cache)
    fresh = model.new_cache(32)
    expected = model.forward([*ids, 11], fresh)
    np.testing.assert_allclose(rolled, expected, atol=1e-5)


def test_a_fork_continues_independently_from_the_shared_prefix(model):
    prefix = [3, 17, 5, 9, 30]
    cache = model.new_cache(32)
    model.forward(prefix, cache)
    other = cache.fork()
    assert other.length == cache.length == len(prefix)
    a = model.forward([1, 2], cache)
    b = model.forward([8], other)
    np.testing.assert_allclose(a, model.forward([*prefix, 1, 2], model.new_cache(32)), atol=1e-5)
    np.testing.assert_allclose(b, model.forward([*prefix, 8], model.new_cache(32)), atol=1e-5)
    model.release_cache(other)


def test_capacity_errors_say_how_much_fits(model):
    cache = model.new_cache(8)
    model.forward([1, 2, 3, 4, 5], cache)
    with pytest.raises(CapacityError, match=r"3 free"):
        model.forward([6, 7, 8, 9], cache)
    assert cache.length == 5, "a refused forward must not change the cache"
    with pytest.raises(CapacityError):
        cache.truncate(6)


def test_the_cache_size_counts_keys_and_values_of_every_layer(model):
    spec = TINY_SPECS[NAME]
    cache = model.new_cache(20)
    model.forward([1, 2, 3], cache)
    per_token = 2 * spec.num_hidden_layers * spec.num_key_value_heads * spec.head_dim * 4
    assert (cache.bytes_per_token, cache.nbytes, cache.max_seq, cache.length) == (per_token, 20 * per_token, 20, 3)
    assert sum(t.nbytes for t in cache.keys + cache.values) == cache.nbytes
