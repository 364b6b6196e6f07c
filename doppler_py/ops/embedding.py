"""Token embedding: out[t, :] = table[ids[t], :] * scale for t < rows (shaders/embedding.wgsl).

The table is a `Weight` in any format, so a tied model's embedding and LM head share one GPU copy. Ids at
or past the vocabulary size produce zero rows on the GPU (never an out-of-bounds read); the host validates
ids before they get here.
"""

from __future__ import annotations

from doppler_py.gpu.kernels import Bound, KernelRegistry, workgroups
from doppler_py.gpu.recorder import Recorder
from doppler_py.gpu.tensor import Tensor
from doppler_py.gpu.weights import Weight

SHADER = "embedding"
WORKGROUP_SIZE = 64


class Embedding:
    """Gathers rows of `table` [vocab, K] for `ids` (u32 [>= max_rows]) into `out` (f32 [>= max_rows, K]),
    times `scale` (Gemma multiplies its embeddings by sqrt(hidden_size))."""

    def __init__(
        self, registry: KernelRegistry, table: Weight, ids: Tensor, out: Tensor, *, max_rows: int, scale: float = 1.0
    ):
        vocab, k = table.shape
        if max_rows < 1:
            raise ValueError(f"Embedding: max_rows must be >= 1, got {max_rows}")
        if ids.dtype != "u32" or ids.numel < max_rows:
            raise ValueError(f"Embedding: ids must be u32 with >= {max_rows} elements, got {ids.dtype} {ids.shape}")
        if out.dtype != "f32" or out.numel < max_rows * k:
            raise ValueError(
                f"Embedding: out must be f32 with >= {max_rows} x {k} elements, got {out.dtype} {out.shape}"
            )
        self.table = table
        self.max_rows = max_rows
        self._k = k
        kernel = registry.kernel(SHADER, FORMAT=table.format_id)
        last = table.parts[-1]
        self._bound: list[Bound] = [
            registry.bind(
                kernel,
                {
                    "k": k,
                    "row_start": part.row_start,
                    "part_rows": part.rows,
                    "vocab": vocab,
                    "zero_missing": int(part is last),
                    "scale": scale,
                },
                ids=ids,
                weights=part.weights,
                scales=part.scales,
                out=out,
            )
            for part in table.parts
        ]

    def record(self, rec: Recorder, rows: int) -> None:
        if not 1 <= rows <= self.max_rows:
            raise ValueError(f"Embedding: rows must be in [1, {self.max_rows}], got {rows}")
        for bound in self._bound:
            bound.params.set(rows=rows)
            rec.dispatch(bound, workgroups(self._k // 4, WORKGROUP_SIZE), rows)
