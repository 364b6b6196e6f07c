"""Token-tree verification and KV compaction on the GPU (shaders/tree_verify.wgsl, kv_compact.wgsl) against
their numpy references (doppler_py/testing/tree_reference.py). Both are exact: token ids and copied floats."""

from __future__ import annotations

import numpy as np
import pytest

from doppler_py.gpu.tensor import Tensor
from doppler_py.ops.kv_compact import KVCompact
from doppler_py.ops.speculative import STATUS_TARGET_NONFINITE
from doppler_py.ops.tree import MAX_TREE_ROWS, compaction_moves, layout_words, path_rows
from doppler_py.ops.tree_verify import TreeVerify, result_words
from doppler_py.testing.tree_reference import apply_moves, greedy_walk

TREES = {
    "one-node": [-1],
    "chain": [-1, 0, 1, 2],
    "star": [-1, -1, -1, -1, -1],
    "two-branches": [-1, 0, 1, -1, 3, 0, 5],
    "deep-and-wide": [-1, 0, 0, 1, 1, 2, 5, 6, -1, 8, 9, 3, 11, 12, 4],
    "widest": [-1] * (MAX_TREE_ROWS - 1),
}


class Verifier:
    def __init__(self, gpu, registry, vocab: int):
        self.vocab = vocab
        self.logits = Tensor.empty(gpu, (MAX_TREE_ROWS, vocab))
        self.tokens = Tensor.empty(gpu, MAX_TREE_ROWS, "u32")
        self.tree = Tensor.empty(gpu, (MAX_TREE_ROWS, 2), "u32")
        self.result = Tensor.empty(gpu, result_words(MAX_TREE_ROWS), "u32")
        self.op = TreeVerify(registry, self.logits, self.tokens, self.tree, self.result, vocab=vocab)

    def run(self, registry, logits: np.ndarray, tokens: list[int], parents: list[int]):
        rows = len(parents) + 1
        self.logits.view(logits.shape).write(logits.astype(np.float32))
        self.tokens.view((rows,)).write(np.asarray(tokens, np.uint32))
        self.tree.view((rows, 2)).write(layout_words(parents))
        rec = registry.recorder()
        self.op.record(rec, rows)
        rec.submit()
        out = self.result.numpy()[: result_words(rows)].tolist()
        n = out[0]
        return out[3 : 3 + 2 * n : 2], out[4 : 4 + 2 * n : 2], out[1], out[2]


def matching_tokens(rng, logits: np.ndarray, parents: list[int], hit_rate: float) -> list[int]:
    """Node tokens: the parent row's argmax with probability hit_rate (siblings kept distinct), else random."""
    vocab = logits.shape[1]
    tokens = [int(rng.integers(vocab))]  # row 0's token is never read
    for i, parent in enumerate(parents):
        siblings = {tokens[j + 1] for j in range(i) if parents[j] == parent}
        want = int(np.argmax(logits[parent + 1]))
        token = want if rng.random() < hit_rate and want not in siblings else int(rng.integers(vocab))
        tokens.append(token)
    return tokens


@pytest.mark.parametrize("vocab", [1, 63, 1000, 4099])
@pytest.mark.parametrize("tree", sorted(TREES))
def test_greedy_walk_matches_the_reference(gpu, registry, rng, vocab, tree):
    verifier = Verifier(gpu, registry, vocab)
    parents = TREES[tree]
    for hit_rate in (0.0, 0.5, 0.9, 1.0):
        logits = rng.standard_normal((len(parents) + 1, vocab))
        tokens = matching_tokens(rng, logits, parents, hit_rate)
        accepted, rows, final, status = verifier.run(registry, logits, tokens, parents)
        assert (accepted, rows, final) == greedy_walk(logits.astype(np.float32), tokens, parents)
        assert status == 0
        assert rows == path_rows(parents, rows[-1]) if rows else True


def test_ties_pick_the_lowest_index_and_minus_infinity_is_a_value(gpu, registry, rng):
    verifier = Verifier(gpu, registry, 300)
    logits = np.full((3, 300), -np.inf, np.float32)
    logits[0, [7, 150, 299]] = 2.0  # tie: 7
    logits[1, 40:] = 1.0  # tie over 260 entries: 40
    tokens, parents = [0, 7, 40], [-1, 0]
    accepted, rows, final, status = verifier.run(registry, logits, tokens, parents)
    assert (accepted, rows, final, status) == ([7, 40], [1, 2], 0, 0)  # row 2 all -inf: index 0


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_logits_set_the_status_and_clear_for_the_next_step(gpu, registry, rng, bad):
    verifier = Verifier(gpu, registry, 64)
    logits = rng.standard_normal((3, 64)).astype(np.float32)
    logits[2, 5] = bad
    assert verifier.run(registry, logits, [0, 1, 2], [-1, -1])[3] == STATUS_TARGET_NONFINITE
    logits[2, 5] = 0.0
    assert verifier.run(registry, logits, [0, 1, 2], [-1, -1])[3] == 0


def test_rows_outside_a_tree_are_refused(gpu, registry):
    verifier = Verifier(gpu, registry, 8)
    for rows in (1, MAX_TREE_ROWS + 1):
        with pytest.raises(ValueError, match="rows"):
            verifier.op.record(registry.recorder(), rows)


@pytest.mark.parametrize("tree", ["two-branches", "deep-and-wide", "widest"])
@pytest.mark.parametrize("row_floats", [4, 192, 260])
def test_compaction_moves_every_layers_accepted_rows_into_place(gpu, registry, rng, tree, row_floats):
    parents = TREES[tree]
    layers, max_seq, start_pos = 3, 80, 41
    data = [rng.standard_normal((2, max_seq, row_floats)).astype(np.float32) for _ in range(layers)]
    caches = [(Tensor.from_numpy(gpu, d[0]), Tensor.from_numpy(gpu, d[1])) for d in data]
    op = KVCompact(registry, caches, row_floats=row_floats)
    for leaf in range(1, len(parents) + 1):
        for (k, v), d in zip(caches, data, strict=True):
            k.write(d[0])
            v.write(d[1])
        moves = compaction_moves(path_rows(parents, leaf))
        rec = registry.recorder()
        op.record(rec, start_pos, moves)
        rec.submit()
        for (k, v), d in zip(caches, data, strict=True):
            np.testing.assert_array_equal(k.numpy(), apply_moves(d[0], start_pos, moves))
            np.testing.assert_array_equal(v.numpy(), apply_moves(d[1], start_pos, moves))
    op.release(registry)


def test_a_path_along_the_first_chain_needs_no_move():
    assert compaction_moves([1, 2, 3]) == []
    assert compaction_moves([1, 4, 5]) == [(4, 2), (5, 3)]
