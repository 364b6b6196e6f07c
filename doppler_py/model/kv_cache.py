"""GPU-resident KV cache: preallocated per layer, O(1) truncation, prefix-copying fork.

Layout per layer: keys and values each `[max_seq, n_kv_heads, head_dim]` f32. The cache only tracks a
length; `truncate(n)` moves it back (rejected draft positions are overwritten by the next write), so
rolling back a speculative step costs nothing on the GPU. Layers may differ in shape (`layer_shapes`: Gemma 4's
full-attention layers have wider heads than its sliding ones).

A hybrid model (Qwen 3.5) keeps K/V for its attention layers only, and its linear-attention layers' recurrent
states in `recurrent` (ops/linear_attention.py), which the model's next forward brings to the truncated length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from doppler_py.errors import CapacityError, UnsupportedModelError
from doppler_py.gpu.device import Gpu
from doppler_py.gpu.tensor import Tensor
from doppler_py.model.kv_arena import BLOCK, KVArena, KVSlab

if TYPE_CHECKING:
    from doppler_py.ops.linear_attention import RecurrentState


class KVCache:
    """`layer_shapes`: (n_kv_heads, head_dim) of each layer when they differ; n_kv_heads and head_dim then
    describe layer 0. With `arena` the cache is a run of blocks of one of the arena's slabs (model/kv_arena.py),
    each layer's tensor a view of the slab's, which closing gives back."""

    def __init__(
        self,
        gpu: Gpu,
        num_layers: int,
        max_seq: int,
        n_kv_heads: int,
        head_dim: int,
        label: str = "kv",
        *,
        layer_shapes: Sequence[tuple[int, int]] | None = None,
        arena: KVArena | None = None,
    ):
        if max_seq < 1:
            raise CapacityError(f"KV cache needs at least one position, got max_seq={max_seq}")
        self.gpu = gpu
        self.max_seq = max_seq
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.layer_shapes = tuple(layer_shapes or [(n_kv_heads, head_dim)] * num_layers)
        if len(self.layer_shapes) != num_layers:
            raise ValueError(f"KVCache: {len(self.layer_shapes)} layer shapes for {num_layers} layers")
        shapes = [(max_seq, *shape) for shape in self.layer_shapes]
        self.arena = arena
        # The LoRA adapter (its name in `Transformer.adapters`) whose update computes this sequence's rows and so its
        # K/V; None: the base model.
        self.adapter: str | None = None
        self.slab: KVSlab | None = None
        self.first_block = self.block_count = 0
        if arena is not None:
            if arena.layer_shapes != self.layer_shapes:
                raise ValueError(f"KVCache: the arena's layer shapes {arena.layer_shapes} are not {self.layer_shapes}")
            self.slab, self.first_block, self.block_count = arena.take(max_seq)
            first = self.first_block * BLOCK  # the run's first position in the slab

            def run(slab_tensors: list[Tensor]) -> list[Tensor]:
                return [
                    t.view(shape, offset_bytes=first * (t.nbytes // t.shape[0]))
                    for t, shape in zip(slab_tensors, shapes, strict=True)
                ]

            self.keys, self.values = run(self.slab.keys), run(self.slab.values)
        else:
            widest = max(self.layer_shapes, key=lambda shape: shape[0] * shape[1])
            gpu.check_buffer_size(
                4 * max_seq * widest[0] * widest[1],
                f"a KV cache of {max_seq} positions ({label}.k{self.layer_shapes.index(widest)})",
                advice="load the model with a smaller max_seq",
            )
            self.keys = [Tensor.empty(gpu, shape, "f32", f"{label}.k{i}") for i, shape in enumerate(shapes)]
            self.values = [Tensor.empty(gpu, shape, "f32", f"{label}.v{i}") for i, shape in enumerate(shapes)]
        self.length = 0
        self.recurrent: RecurrentState | None = None
        self.closed = False

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def bytes_per_token(self) -> int:
        return 2 * 4 * sum(heads * dim for heads, dim in self.layer_shapes)

    @property
    def nbytes(self) -> int:
        return self.bytes_per_token * self.max_seq + (self.recurrent.nbytes if self.recurrent is not None else 0)

    @property
    def block_table(self) -> tuple[int, ...]:
        """The slab blocks that hold positions 0, BLOCK, 2 * BLOCK, ... (an arena's cache only)."""
        if self.slab is None:
            raise ValueError("KVCache: only a cache made in an arena has a block table")
        return tuple(range(self.first_block, self.first_block + self.block_count))

    @property
    def free(self) -> int:
        return self.max_seq - self.length

    def check_room(self, start_pos: int, new_tokens: int) -> None:
        """Raise `CapacityError` unless positions start_pos..start_pos+new_tokens-1 fit."""
        if start_pos > self.length:
            raise CapacityError(f"cannot write at position {start_pos}: the cache holds only {self.length} tokens")
        if start_pos + new_tokens > self.max_seq:
            raise CapacityError(
                f"{start_pos + new_tokens} tokens do not fit a KV cache of {self.max_seq} positions "
                f"({self.max_seq - start_pos} free after position {start_pos}); shorten the prompt or "
                "max_tokens, or load the model with a larger max_seq"
            )

    def advance_to(self, length: int) -> None:
        self.length = length

    def truncate(self, length: int) -> None:
        """Forget every position ≥ `length` (O(1): only the length changes)."""
        if not 0 <= length <= self.length:
            raise CapacityError(f"cannot truncate a cache of {self.length} tokens to {length}")
        self.length = length

    def fork(self) -> KVCache:
        """A second cache starting with this one's prefix (copied on the GPU; later writes are independent)."""
        if self.recurrent is not None:
            raise UnsupportedModelError(
                "a hybrid model's cache is not forked: its recurrent state has room for one sequence's rows"
            )
        other = self.empty_like(self.max_seq, "kv-fork")
        self.copy_prefix(other, self.length)
        return other

    def empty_like(self, max_seq: int, label: str) -> KVCache:
        """An empty cache of this one's layers and shapes holding `max_seq` positions (and, for a hybrid model,
        recurrent states with room for a copy of this one's, not for a forward's rows)."""
        other = KVCache(
            self.gpu, self.num_layers, max_seq, self.n_kv_heads, self.head_dim, label, layer_shapes=self.layer_shapes
        )
        if self.recurrent is not None:
            other.recurrent = self.recurrent.snapshot(self.gpu)
        other.adapter = self.adapter
        return other

    def copy_prefix(self, other: KVCache, length: int) -> None:
        """Positions 0..length-1 of every layer copied into `other` on the GPU (queued now), which then holds
        `length` positions."""
        other.check_room(0, length)
        if self.recurrent is not None and length != self.recurrent.length:
            raise UnsupportedModelError(
                f"a prefix of {length} positions of a hybrid model's cache cannot be copied: its linear-attention "
                f"state exists only at position {self.recurrent.length}"
            )
        if length:
            encoder = self.gpu.device.create_command_encoder()
            for src, dst in zip(self.keys + self.values, other.keys + other.values, strict=True):
                used = length * src.shape[1] * src.shape[2] * 4
                encoder.copy_buffer_to_buffer(src.buffer, src.offset, dst.buffer, dst.offset, used)
            if self.recurrent is not None and other.recurrent is not None:
                self.recurrent.copy_into(other.recurrent, encoder)
            self.gpu.queue.submit([encoder.finish()])
        other.length = length

    def close(self) -> KVSlab | None:
        """Free the cache; an arena's cache gives its blocks back, frees its slab when that emptied it, and returns
        that slab for the caller to forget what it built on it (`Transformer.release_cache`)."""
        emptied = None
        if not self.closed:
            if self.slab is not None and self.arena is not None:
                if self.arena.give_back(self.slab, self.first_block, self.block_count):
                    emptied = self.slab
                    emptied.close()
            else:
                for t in self.keys + self.values:
                    t.destroy()
            if self.recurrent is not None:
                self.recurrent.close()
            self.closed = True
        return emptied
