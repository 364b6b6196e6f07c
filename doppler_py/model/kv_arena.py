"""KV memory shared by the concurrent generations of one model, so one attention dispatch can read all of them.

A batched forward (`Transformer.record_batch`) runs every matmul once over the rows of all its sequences; to run
attention once as well, the sequences' K/V must sit in the same buffers. The arena holds slabs: one K and one V
tensor per cache layer, `positions` positions each, handed out in blocks of BLOCK positions. A generation's cache
(`KVCache` made with an arena) is a run of consecutive blocks of one slab, viewed as an ordinary cache tensor per
layer, so prefill, tree compaction and prefix-cache copies address it as they address a cache of its own. The
batched attention reads each sequence's K/V through its block table (`KVCache.block_table`, here its run's block
ids), which the kernel takes in any order (`ops.attention.BatchedAttention`).

Runs are first fit within a slab. A slab that has no run of the size asked for leaves it to a new slab, twice the
largest slab's size (at least the request), so that the running generations soon share one slab again as the old
ones drain; a slab is freed as soon as its last run is given back. Under a KV budget (`speculative.kv_budget`) a
slab never holds more positions than the budget allows, unless one request alone needs more.
"""

from __future__ import annotations

from collections.abc import Sequence

from doppler_py.errors import CapacityError
from doppler_py.gpu.device import Gpu
from doppler_py.gpu.tensor import Tensor

BLOCK = 16  # positions per block: a block of any head shape (head_dim a multiple of 16) is 256-byte aligned
MIN_SLAB_BLOCKS = 64  # 1,024 positions: room for several short generations before a second slab is needed


def blocks_for(positions: int) -> int:
    return -(-positions // BLOCK)


class KVSlab:
    """K and V tensors of `blocks` blocks per cache layer, and the free runs of blocks among them."""

    def __init__(self, gpu: Gpu, layer_shapes: Sequence[tuple[int, int]], blocks: int, label: str):
        positions = blocks * BLOCK
        self.blocks = blocks
        self.layer_shapes = tuple(layer_shapes)
        self.keys = [
            Tensor.empty(gpu, (positions, *shape), "f32", f"{label}.k{i}") for i, shape in enumerate(layer_shapes)
        ]
        self.values = [
            Tensor.empty(gpu, (positions, *shape), "f32", f"{label}.v{i}") for i, shape in enumerate(layer_shapes)
        ]
        self._free: list[tuple[int, int]] = [(0, blocks)]  # (first block, count), in block order, never adjacent
        self.closed = False

    @property
    def positions(self) -> int:
        return self.blocks * BLOCK

    @property
    def used_blocks(self) -> int:
        return self.blocks - sum(count for _, count in self._free)

    def take(self, count: int) -> int | None:
        """The first block of a run of `count` free blocks, now taken (first fit); None when no run is that long."""
        for i, (first, free) in enumerate(self._free):
            if free >= count:
                if free == count:
                    del self._free[i]
                else:
                    self._free[i] = (first + count, free - count)
                return first
        return None

    def give_back(self, first: int, count: int) -> None:
        """Return blocks first..first+count-1, merged with the free runs beside them."""
        runs = sorted([*self._free, (first, count)])
        merged: list[tuple[int, int]] = []
        for start, n in runs:
            if merged and merged[-1][0] + merged[-1][1] > start:
                raise CapacityError(f"KV slab: blocks {first}..{first + count - 1} were given back twice")
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((start, n))
        self._free = merged

    def close(self) -> None:
        if not self.closed:
            for t in self.keys + self.values:
                t.destroy()
            self.closed = True


class KVArena:
    """The slabs of one model's concurrent generations (layer shapes as `KVCache`'s), within `limit_positions`
    per slab when a KV budget applies (None: only the device's binding size bounds a slab)."""

    def __init__(
        self,
        gpu: Gpu,
        layer_shapes: Sequence[tuple[int, int]],
        *,
        limit_positions: int | None = None,
        label: str = "kv-arena",
    ):
        self.gpu = gpu
        self.layer_shapes = tuple(layer_shapes)
        self.label = label
        row_bytes = 4 * max(heads * dim for heads, dim in self.layer_shapes)
        self._max_blocks = gpu.max_binding_bytes // (row_bytes * BLOCK)
        if limit_positions is not None:
            self._max_blocks = min(self._max_blocks, max(1, limit_positions // BLOCK))
        self.slabs: list[KVSlab] = []

    @property
    def nbytes(self) -> int:
        """GPU memory of the slabs."""
        per_block = 2 * 4 * BLOCK * sum(heads * dim for heads, dim in self.layer_shapes)
        return per_block * sum(slab.blocks for slab in list(self.slabs))

    @property
    def used_blocks(self) -> int:
        """Blocks the caches hold."""
        return sum(slab.used_blocks for slab in list(self.slabs))

    def take(self, positions: int) -> tuple[KVSlab, int, int]:
        """(slab, first block, block count) of a new run holding `positions` positions."""
        count = blocks_for(positions)
        for slab in sorted(self.slabs, key=lambda s: -s.blocks):  # the largest first: generations gather there
            first = slab.take(count)
            if first is not None:
                return slab, first, count
        largest = max((slab.blocks for slab in self.slabs), default=MIN_SLAB_BLOCKS // 2)
        blocks = max(count, min(2 * largest, self._max_blocks))
        self.gpu.check_buffer_size(
            4 * blocks * BLOCK * max(heads * dim for heads, dim in self.layer_shapes),
            f"a KV slab of {blocks * BLOCK} positions ({self.label})",
            advice="ask for fewer tokens",
        )
        slab = KVSlab(self.gpu, self.layer_shapes, blocks, f"{self.label}{len(self.slabs)}")
        self.slabs.append(slab)
        first = slab.take(count)
        assert first is not None
        return slab, first, count

    def give_back(self, slab: KVSlab, first: int, count: int) -> bool:
        """Return a run; True when that emptied its slab, which is then removed (the caller frees it)."""
        slab.give_back(first, count)
        if slab.used_blocks:
            return False
        self.slabs.remove(slab)
        return True

    def close(self) -> None:
        for slab in self.slabs:
            slab.close()
        self.slabs.clear()
