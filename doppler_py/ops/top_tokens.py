"""The k largest logits of each row, in order, on the GPU (`shaders/sample.wgsl`, entry `top_tokens`).

A greedy drafter's branches: its chain takes each row's best token, and a token tree adds the next best as
sibling leaves (`speculative.drafters.draft_model`). Ties go to the lowest index and NaN ranks as -inf, the sampler's
greedy order; a row with fewer than k tokens is padded with `vocab`. The numpy reference is
`doppler_py.testing.tree_reference.top_tokens`.
"""

from __future__ import annotations

from doppler_py.gpu.kernels import KernelRegistry
from doppler_py.gpu.recorder import Recorder
from doppler_py.gpu.tensor import Tensor
from doppler_py.ops.sampling import MAX_VOCAB

MAX_TOP_TOKENS = 32  # the shader's exclusion list


class TopTokens:
    """Writes the `count` best token ids of each of up to `max_rows` rows of `logits` (f32 [>= max_rows, vocab])
    into `out_ids` (u32 [>= max_rows * count], row-major)."""

    def __init__(
        self, registry: KernelRegistry, logits: Tensor, out_ids: Tensor, *, vocab: int, max_rows: int, count: int
    ):
        if not 1 <= vocab <= MAX_VOCAB:
            raise ValueError(f"vocab must be in [1, {MAX_VOCAB}], got {vocab}")
        if not 1 <= count <= MAX_TOP_TOKENS:
            raise ValueError(f"TopTokens: count must be in 1..{MAX_TOP_TOKENS}, got {count}")
        for name, tensor, dtype, needed in (
            ("logits", logits, "f32", max_rows * vocab),
            ("out_ids", out_ids, "u32", max_rows * count),
        ):
            if tensor.dtype != dtype or tensor.numel < needed:
                raise ValueError(
                    f"TopTokens {name}: need a {dtype} tensor of >= {needed} elements, "
                    f"got {tensor.dtype} {tensor.shape}"
                )
        self.max_rows = max_rows
        self.bound = registry.bind(
            registry.kernel("sample", "top_tokens"), params={"vocab": vocab, "k": count}, logits=logits, out_ids=out_ids
        )

    def record(self, rec: Recorder, rows: int) -> None:
        if not 1 <= rows <= self.max_rows:
            raise ValueError(f"TopTokens.record: rows must be in 1..{self.max_rows}, got {rows}")
        rec.dispatch(self.bound, rows)

    def release(self, registry: KernelRegistry) -> None:
        registry.release_slot(self.bound.params)
