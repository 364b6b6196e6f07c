"""Greedy verification of a token tree on the GPU (shaders/tree_verify.wgsl): one readback per step.

After the target's forward over the tree's rows (`ops.tree`), the op finds each row's greedy token and walks
the tree from the root along the children that match it. The host reads one small vector:

    result[0] = accepted nodes     result[1] = the token emitted after them     result[2] = status bits
    result[3 + 2 i], result[4 + 2 i] = token and row of accepted node i

The numpy reference is `doppler_py.testing.tree_reference.greedy_walk`.
"""

from __future__ import annotations

import numpy as np

from doppler_py.gpu.kernels import KernelRegistry, Recorder
from doppler_py.gpu.tensor import Tensor
from doppler_py.ops.tree import MAX_TREE_ROWS


def result_words(rows: int) -> int:
    """u32 words of the result for a tree of `rows` rows (root included)."""
    return 3 + 2 * (rows - 1)


class TreeVerify:
    """Greedy tree verification over `logits` [>= rows, vocab], `tokens` u32 [>= rows] (row r's token; row 0's
    unread) and `tree` u32 [>= rows, 2] (the layout), into `result` u32 [>= result_words(MAX_TREE_ROWS)]."""

    def __init__(
        self, registry: KernelRegistry, logits: Tensor, tokens: Tensor, tree: Tensor, result: Tensor, *, vocab: int
    ):
        if result.numel < result_words(MAX_TREE_ROWS):
            raise ValueError(f"TreeVerify: result needs {result_words(MAX_TREE_ROWS)} u32 words, got {result.numel}")
        self.vocab = vocab
        self.best = Tensor.empty(registry.gpu, MAX_TREE_ROWS, "u32", "tree best tokens")
        self.flags = Tensor.from_numpy(registry.gpu, np.zeros(4, np.uint32), label="tree verify flags")
        self.argmax = registry.bind(
            registry.kernel("tree_verify", entry="row_argmax"),
            params={"vocab": vocab},
            logits=logits,
            best=self.best,
            flags=self.flags,
        )
        self.walk = registry.bind(
            registry.kernel("tree_verify", entry="walk"),
            params=self.argmax.params,
            tokens=tokens,
            tree=tree,
            best=self.best,
            flags=self.flags,
            result=result,
        )

    def record(self, rec: Recorder, rows: int) -> None:
        if not 2 <= rows <= MAX_TREE_ROWS:
            raise ValueError(f"TreeVerify: a tree has 2..{MAX_TREE_ROWS} rows (root included), got {rows}")
        self.argmax.params.set(rows=rows)
        rec.dispatch(self.argmax, rows)
        rec.dispatch(self.walk, 1)

    def release(self, registry: KernelRegistry) -> None:
        registry.release_tensors(self.best, self.flags)
        registry.release_slot(self.argmax.params)
