"""A constraint's token mask (shaders/token_mask.wgsl) vs numpy: forbidden tokens become -inf, in place.

Exact: allowed entries keep their bits (-inf, +-0, extremes included) and forbidden ones are exactly -inf; rows
past the call are untouched. Masks are random bit patterns, all-zero and all-one words, over vocabularies that
are no multiple of 32 or of the workgroup size (1, 33, 1000, 49157).
"""

from __future__ import annotations

import numpy as np
import pytest

from doppler_py.gpu.tensor import Tensor
from doppler_py.ops import token_mask
from doppler_py.ops.token_mask import TokenMask, mask_words


def reference(logits: np.ndarray, mask: np.ndarray) -> np.ndarray:
    vocab = logits.shape[1]
    bits = (mask[:, np.arange(vocab) // 32] >> (np.arange(vocab) % 32).astype(np.uint32)) & 1
    return np.where(bits.astype(bool), logits, np.float32(-np.inf)).astype(np.float32)


def random_mask(rng, rows: int, vocab: int) -> np.ndarray:
    words = mask_words(vocab)
    mask = rng.integers(0, 2**32, size=(rows, words), dtype=np.uint64).astype(np.uint32)
    mask[0, 0] = 0  # a word that forbids all
    if words > 1:
        mask[-1, 1] = 0xFFFFFFFF  # and one that allows all
    return mask


def run(registry, gpu, logits: np.ndarray, mask: np.ndarray, rows: int) -> np.ndarray:
    tensor = Tensor.from_numpy(gpu, logits)
    op = TokenMask(registry, tensor, vocab=logits.shape[1], max_rows=logits.shape[0])
    op.write(mask)
    rec = registry.recorder()
    op.record(rec, rows)
    rec.submit()
    got = tensor.numpy().reshape(logits.shape)
    op.release(registry)
    registry.release_tensors(tensor)
    return got


@pytest.mark.parametrize(("rows", "vocab"), [(1, 1), (3, 33), (2, 1000), (5, 49157)])
def test_forbidden_tokens_become_minus_infinity_and_the_rest_keep_their_bits(gpu, registry, rng, rows, vocab):
    max_rows = rows + 1
    logits = (rng.standard_normal((max_rows, vocab)) * 5).astype(np.float32)
    logits[0, 0] = -np.inf
    if vocab > 4:
        logits[-1, 1:4] = [np.float32(3e38), np.float32(-0.0), np.float32(-3e38)]
    mask = random_mask(rng, max_rows, vocab)
    got = run(registry, gpu, logits, mask, rows)
    expected = reference(logits[:rows], mask[:rows])
    np.testing.assert_array_equal(got[:rows].view(np.uint32), expected.view(np.uint32))
    np.testing.assert_array_equal(got[rows:].view(np.uint32), logits[rows:].view(np.uint32))


def test_a_grid_smaller_than_the_logits_strides_over_all_of_them(gpu, registry, rng, monkeypatch):
    monkeypatch.setattr(token_mask, "MAX_MASK_WORKGROUPS", 2)
    logits = rng.standard_normal((3, 1001)).astype(np.float32)
    mask = random_mask(rng, 3, 1001)
    got = run(registry, gpu, logits, mask, 3)
    np.testing.assert_array_equal(got, reference(logits, mask))


def test_mask_rows_of_the_wrong_shape_are_refused(gpu, registry):
    tensor = Tensor.empty(gpu, (2, 40))
    op = TokenMask(registry, tensor, vocab=40, max_rows=2)
    with pytest.raises(ValueError, match="u32 rows of 2 words"):
        op.write(np.zeros((1, 1), np.uint32))
    op.release(registry)
    registry.release_tensors(tensor)
