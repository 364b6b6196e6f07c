"""The unmerged LoRA update of one matmul, for the rows of one adapter (shaders/lora.wgsl).

    out[t, col0_s : col0_s + cols_s] += B_s (A_s x[t])   for each segment s, for rows t with row_adapter[t] == slot

`pack_segments` lays an adapter's segments of one matmul out as the kernel's table and weights (f32 or f16); a
`LoraMatmul` binds them with the matmul's input and output and the forward's per-row adapter slots, and records one
dispatch of `rows` workgroups. Rows of other adapters or of none are untouched, so a forward runs one dispatch per
adapter it uses and none when no row uses one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from doppler_py.errors import AdapterError
from doppler_py.gpu.kernels import KernelRegistry
from doppler_py.gpu.recorder import Recorder
from doppler_py.gpu.tensor import Tensor
from doppler_py.ops.elementwise import require_f32, require_rows

SHADER = "lora"
FORMATS = {"f32": 0, "f16": 1}  # the FORMAT override
MAX_RANK = 256  # sum of a matmul's segment ranks (the shader's workgroup array)
MAX_SEGMENTS = 4  # Qwen 3.5's input projection: [qkv; z; b; a]
NO_ADAPTER = 0xFFFFFFFF  # a row_adapter value no slot has
WORKGROUP_SIZE = 64
_SEGMENT_WORDS = 5


@dataclass(frozen=True)
class Segment:
    """Part of one of our matmuls' update: out[:, col0 : col0 + cols] += (x @ a.T) @ b.T, cols = b.shape[0]."""

    col0: int
    a: np.ndarray  # float32 [r, in]
    b: np.ndarray  # float32 [cols, r]


def _words(values: np.ndarray, dtype: str) -> np.ndarray:
    """Flat float values as u32 words: f32 bits, or f16 pairs (low half first; an odd count padded with 0)."""
    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    if dtype == "f32":
        return flat.view(np.uint32)
    halves = flat.astype(np.float16)
    if halves.size % 2:
        halves = np.append(halves, np.float16(0))
    return halves.view(np.uint32)


def pack_segments(segments: Sequence[Segment], dtype: str) -> np.ndarray:
    """The kernel's buffer for one matmul's segments: the table (count; col0, cols, rank, A word, B word each), then
    every A and B, transposed, in `dtype` ("f32" or "f16")."""
    if dtype not in FORMATS:
        raise AdapterError(f"LoRA weights are kept in f32 or f16, got {dtype!r}")
    if not 1 <= len(segments) <= MAX_SEGMENTS:
        raise AdapterError(f"a matmul takes 1..{MAX_SEGMENTS} LoRA segments, got {len(segments)}")
    total_rank = sum(segment.a.shape[0] for segment in segments)
    if total_rank > MAX_RANK:
        raise AdapterError(
            f"LoRA ranks summing to {total_rank} on one matmul; at most {MAX_RANK} (e.g. q, k and v of rank 85)"
        )
    table = [len(segments)]
    blocks: list[np.ndarray] = []
    offset = 1 + _SEGMENT_WORDS * len(segments)
    for segment in segments:
        a, b = _words(segment.a.T, dtype), _words(segment.b.T, dtype)  # transposed: the kernel's lanes read in a row
        table += [segment.col0, segment.b.shape[0], segment.a.shape[0], offset, offset + a.size]
        blocks += [a, b]
        offset += a.size + b.size
    return np.concatenate([np.asarray(table, dtype=np.uint32), *blocks])


class LoraMatmul:
    """out[t, cols] += B (A x[t]) for the rows t < rows whose `row_adapter` entry is `slot` (see the module); with
    `norm_weight`, x[t] is RMS-normalised first (x[t] / rms(x[t]) * norm_weight, eps `eps`), as fused matmuls do."""

    def __init__(
        self,
        registry: KernelRegistry,
        packed: Tensor,
        dtype: str,
        x: Tensor,
        out: Tensor,
        row_adapter: Tensor,
        *,
        k: int,
        n_total: int,
        slot: int,
        max_rows: int,
        norm_weight: Tensor | None = None,
        eps: float = 0.0,
    ):
        require_f32(x, max_rows * k, "LoRA x")
        require_f32(out, max_rows * n_total, "LoRA out")
        if packed.dtype != "u32" or row_adapter.dtype != "u32" or row_adapter.numel < max_rows:
            raise ValueError("LoRA: the packed weights and the row slots must be u32, the slots one per row")
        self.max_rows = max_rows
        if norm_weight is not None:
            require_f32(norm_weight, k, "LoRA norm weight")
        kernel = registry.kernel(
            SHADER, FORMAT=FORMATS[dtype], WORKGROUP_SIZE=WORKGROUP_SIZE, RMS_NORM=norm_weight is not None
        )
        params = {"rows": 1, "k": k, "n_total": n_total, "adapter": slot, "eps": eps}
        gain = norm_weight if norm_weight is not None else registry.placeholder(4)
        self.bound = registry.bind(kernel, params, x=x, lora=packed, row_adapter=row_adapter, out=out, norm_weight=gain)

    def record(self, rec: Recorder, rows: int) -> None:
        require_rows(rows, self.max_rows, "LoRA")
        self.bound.params.set(rows=rows)
        rec.dispatch(self.bound, rows, 1)
