"""Verification of a token tree on the GPU (`shaders/sample.wgsl`, entries `tree_*`): one readback per step.

After the target's forward over the tree's rows (`ops.tree`), each row decides which of its children it
accepts and which token it emits if the walk stops there; then one invocation walks from the root. Greedy: the
child equal to the row's argmax. Sampled (the drafts are deterministic, e.g. prompt lookup's branches):
recursive rejection over the children in row order, then the residual draw, so the emitted tokens follow the
target's own sampling exactly. The host reads one small vector:

    result[0] = accepted nodes     result[1] = the token emitted after them     result[2] = status bits
    result[3 + 2 i], result[4 + 2 i] = token and row of accepted node i

The numpy references are `doppler_py.testing.tree_reference.greedy_walk` and `sampled_walk`.
"""

from __future__ import annotations

from doppler_py.gpu.kernels import KernelRegistry
from doppler_py.gpu.recorder import Recorder
from doppler_py.gpu.tensor import Tensor
from doppler_py.ops.speculative import ROW_RESULT_WORDS
from doppler_py.ops.tree import MAX_TREE_ROWS
from doppler_py.sampling import SamplingParams


def result_words(rows: int) -> int:
    """u32 words of the result for a tree of `rows` rows (root included)."""
    return 3 + 2 * (rows - 1)


def random_words(rows: int) -> int:
    """f32 uniforms a tree step reads: one per node (randoms[row - 1] tests row `row`), then the final draw."""
    return rows


class TreeVerify:
    """Tree verification over `logits` f32 [>= rows, vocab], `tokens` u32 [>= rows] (row r's token; row 0's
    unread), `tree` u32 [>= rows, 2] (the layout) and `randoms` f32 [>= rows], into `result` u32
    [>= result_words(MAX_TREE_ROWS)]."""

    def __init__(
        self,
        registry: KernelRegistry,
        logits: Tensor,
        tokens: Tensor,
        tree: Tensor,
        randoms: Tensor,
        result: Tensor,
        *,
        vocab: int,
    ):
        if result.numel < result_words(MAX_TREE_ROWS):
            raise ValueError(f"TreeVerify: result needs {result_words(MAX_TREE_ROWS)} u32 words, got {result.numel}")
        self.vocab = vocab
        self.max_rows = min(MAX_TREE_ROWS, randoms.numel)
        self.row_results = Tensor.empty(registry.gpu, (MAX_TREE_ROWS, ROW_RESULT_WORDS), "u32", "tree row results")
        self.params = registry.uniform_slot(registry.kernel("sample", "tree_rows").uniform).set(vocab=vocab, onehot=1)
        # The residual's one-hot branch never reads draft_logits; the target's logits stand in for the binding.
        self.rows = registry.bind(
            registry.kernel("sample", "tree_rows"),
            self.params,
            logits=logits,
            draft_logits=logits,
            randoms=randoms,
            tokens=tokens,
            tree=tree,
            row_results=self.row_results,
        )
        self.finalize = registry.bind(
            registry.kernel("sample", "tree_finalize"),
            self.params,
            tokens=tokens,
            row_results=self.row_results,
            result=result,
        )

    def record(self, rec: Recorder, rows: int, params: SamplingParams) -> None:
        """Record the verification of a tree of `rows` rows (greedy when params.temperature is 0)."""
        if not 2 <= rows <= self.max_rows:
            raise ValueError(f"TreeVerify: a tree has 2..{self.max_rows} rows (root included), got {rows}")
        self.params.set(
            temperature=params.temperature,
            top_k=params.top_k if params.top_k < self.vocab else 0,
            top_p=params.top_p,
            k=rows - 1,
        )
        rec.dispatch(self.rows, rows)
        rec.dispatch(self.finalize, 1)

    def release(self, registry: KernelRegistry) -> None:
        registry.release_tensors(self.row_results)
        registry.release_slot(self.params)
