"""Vocabulary scatter (a draft head's reduced logits row → a target-vocabulary row). A copy is exact, so the
result must equal numpy's scatter bit for bit, with -inf everywhere the draft vocabulary does not reach."""

from __future__ import annotations

import numpy as np
import pytest

from doppler_py.gpu.tensor import Tensor
from doppler_py.ops.vocab_scatter import VocabScatter


def _scatter(registry, src: np.ndarray, index: np.ndarray, vocab: int) -> np.ndarray:
    dst = Tensor.empty(registry.gpu, (vocab,))
    op = VocabScatter(registry, Tensor.from_numpy(registry.gpu, src), index, dst)
    rec = registry.recorder()
    op.record(rec)
    rec.submit()
    return dst.numpy()


@pytest.mark.parametrize(("n", "vocab"), [(1, 1), (1, 7), (257, 1000), (513, 513)])
def test_spreads_each_draft_logit_to_its_target_id_and_leaves_minus_inf_elsewhere(registry, rng, n, vocab):
    index = rng.permutation(vocab)[:n]
    src = rng.standard_normal(n).astype(np.float32)
    src[0] = -np.inf  # a masked draft logit stays masked
    expected = np.full(vocab, -np.inf, np.float32)
    expected[index] = src
    np.testing.assert_array_equal(_scatter(registry, src, index, vocab), expected)


def test_reads_only_the_first_n_entries_of_a_longer_source(registry, rng):
    src = rng.standard_normal(40).astype(np.float32)
    index = np.array([9, 0, 3])
    got = _scatter(registry, src, index, 10)
    expected = np.full(10, -np.inf, np.float32)
    expected[index] = src[:3]
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize(
    ("src_len", "index", "match"),
    [(2, [0, 1, 2], "src holds 2"), (3, [0, 0, 1], "distinct"), (3, [0, 1, 10], "distinct"), (3, [], "src")],
)
def test_rejects_short_sources_repeated_or_out_of_range_ids(registry, src_len, index, match):
    with pytest.raises(ValueError, match=match):
        VocabScatter(registry, Tensor.empty(registry.gpu, (src_len,)), np.array(index, dtype=np.int64),
                     Tensor.empty(registry.gpu, (10,)))  # fmt: skip
