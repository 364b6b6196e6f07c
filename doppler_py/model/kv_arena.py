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
ones drain; a slab is freed as soon as its last run is given back. Under a KV budget (`speculative.kv_budget`) the
slabs together never hold more positions than the budget (`limit_positions`), so the budget bounds the GPU memory
itself: a request that finds no run and no room for a new slab waits (`wait_for_room`) until runs are given back
(the budget's own reservation, which comes first, makes that wait short: what the running generations hold leaves
room for the request, only not in one run). A request alone in an empty arena always gets its slab.
"""

from __future__ import annotations

import threading
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

    @property
    def longest_run(self) -> int:
        return max((count for _, count in self._free), default=0)

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
        self._widest_block_bytes = 4 * BLOCK * max(heads * dim for heads, dim in self.layer_shapes)  # one tensor's
        self._block_bytes = 2 * 4 * BLOCK * sum(heads * dim for heads, dim in self.layer_shapes)  # all of them
        self._max_blocks = gpu.max_binding_bytes // self._widest_block_bytes  # one slab's
        self.limit_blocks = None if limit_positions is None else max(1, limit_positions // BLOCK)  # all slabs'
        self.slabs: list[KVSlab] = []
        self._room = threading.Condition()  # notified when runs are given back

    @property
    def nbytes(self) -> int:
        """GPU memory of the slabs."""
        return self._block_bytes * sum(slab.blocks for slab in list(self.slabs))

    @property
    def used_blocks(self) -> int:
        """Blocks the caches hold."""
        return sum(slab.used_blocks for slab in list(self.slabs))

    def _new_slab_blocks(self, count: int) -> int | None:
        """Blocks of the slab a request of `count` blocks would get next, None when the limit leaves no room."""
        largest = max((slab.blocks for slab in self.slabs), default=MIN_SLAB_BLOCKS // 2)
        held = sum(slab.blocks for slab in self.slabs)
        blocks = min(2 * largest, self._max_blocks)
        if self.limit_blocks is not None:
            blocks = min(blocks, self.limit_blocks - held)
        blocks = max(blocks, count)
        if self.limit_blocks is not None and self.slabs and held + blocks > self.limit_blocks:
            return None
        return blocks

    def has_room(self, positions: int) -> bool:
        """Whether `take(positions)` would succeed now."""
        count = blocks_for(positions)
        return any(slab.longest_run >= count for slab in self.slabs) or self._new_slab_blocks(count) is not None

    def wait_for_room(self, positions: int) -> None:
        """Wait until `has_room(positions)` (runs given back); callers then take under the lock that serialises
        taking (the model's `gpu_lock`), checking again."""
        with self._room:
            self._room.wait_for(lambda: self.has_room(positions))

    def take(self, positions: int) -> tuple[KVSlab, int, int]:
        """(slab, first block, block count) of a new run holding `positions` positions; `CapacityError` when the
        limit leaves no room now (check `has_room` first)."""
        count = blocks_for(positions)
        for slab in sorted(self.slabs, key=lambda s: -s.blocks):  # the largest first: generations gather there
            first = slab.take(count)
            if first is not None:
                return slab, first, count
        blocks = self._new_slab_blocks(count)
        if blocks is None:
            raise CapacityError(f"the KV arena has no run of {count} blocks free within its limit; wait_for_room")
        self.gpu.check_buffer_size(
            blocks * self._widest_block_bytes,
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
        with self._room:
            slab.give_back(first, count)
            emptied = not slab.used_blocks
            if emptied:
                self.slabs.remove(slab)
            self._room.notify_all()
        return emptied

    def close(self) -> None:
        for slab in self.slabs:
            slab.close()
        self.slabs.clear()
