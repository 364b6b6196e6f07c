"""Moving a token tree's accepted path into place in the KV cache (shaders/kv_compact.wgsl).

A tree's rows wrote their keys and values to slots start_pos + row; the accepted nodes must end up at
start_pos + 1, start_pos + 2, ... (their depths). `ops.tree.compaction_moves` lists the moves (none when the
accepted path is the tree's first chain); this op applies them to every layer: one dispatch per layer, no
readback, O(accepted) rows copied.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from doppler_py.gpu.kernels import KernelRegistry, workgroups
from doppler_py.gpu.recorder import Recorder
from doppler_py.gpu.tensor import Tensor
from doppler_py.ops.tree import MAX_TREE_ROWS


class KVCompact:
    """Applies (source row, destination row) moves, relative to start_pos, to each (k_cache, v_cache) pair."""

    def __init__(self, registry: KernelRegistry, caches: Sequence[tuple[Tensor, Tensor]], *, row_floats: int):
        if row_floats % 4:
            raise ValueError(f"KVCompact: a cache row must hold a multiple of 4 floats, got {row_floats}")
        self.row_vec4s = row_floats // 4
        self.moves = Tensor.empty(registry.gpu, (MAX_TREE_ROWS, 2), "u32", "kv compaction moves")
        kernel = registry.kernel("kv_compact")
        self.params = None
        self.bound = []
        for k_cache, v_cache in caches:
            bound = registry.bind(
                kernel,
                params=self.params or {"row_vec4s": self.row_vec4s},
                moves=self.moves,
                k_cache=k_cache,
                v_cache=v_cache,
            )
            self.params = self.params or bound.params
            self.bound.append(bound)

    def record(self, rec: Recorder, start_pos: int, moves: Sequence[tuple[int, int]]) -> None:
        """Record the moves (nothing when there are none); they are uploaded now, so one call per submit."""
        if not moves:
            return
        if len(moves) >= MAX_TREE_ROWS:
            raise ValueError(f"KVCompact: at most {MAX_TREE_ROWS - 1} moves, got {len(moves)}")
        self.moves.view((len(moves), 2)).write(np.asarray(moves, np.uint32))
        self.params.set(start_pos=start_pos, n_moves=len(moves))
        for bound in self.bound:
            rec.dispatch(bound, workgroups(self.row_vec4s, 64))

    def release(self, registry: KernelRegistry) -> None:
        registry.release_tensors(self.moves)
        registry.release_slot(self.params)
