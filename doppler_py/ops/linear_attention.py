"""Qwen 3.5's Gated DeltaNet layers on the GPU (shaders/linear_attention.wgsl): the op of one layer over one
sequence's recurrent state, and that state.

A forward's rows read the committed state and write nothing to it, so a speculative step's rejected rows cost no
undo: each layer keeps its rows' inputs (the input projection's rows and the normalised convolution rows) beside
the state, and the next forward first commits the rows the sequence kept (`RecurrentState.rows_kept`), in the same
submit. A token tree's kept rows are its accepted path, in the order `RecurrentState.reorder` records.

Memory per sequence and linear layer: the state (value_heads × key_dim × value_dim floats), the conv window
((taps - 1) × channels) and, per row a forward may hold (the model's max_rows), mix_width + channels floats.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from doppler_py.errors import CapacityError
from doppler_py.gpu.device import Gpu
from doppler_py.gpu.kernels import KernelRegistry, workgroups
from doppler_py.gpu.recorder import Recorder
from doppler_py.gpu.tensor import Tensor
from doppler_py.model.config import LinearAttention
from doppler_py.ops.elementwise import require_rows
from doppler_py.ops.norms import HeadRMSNorm

L2_NORM_EPS = 1e-6  # transformers' l2norm of q and k in the gated delta rule


def l2_norm_weight(shape: LinearAttention) -> np.ndarray:
    """rmsnorm.wgsl's `heads` weights that turn its RMSNorm into the L2 norm of q and k (with eps L2_NORM_EPS /
    key_dim): x / sqrt(sum x² + eps) = rmsnorm(x) / sqrt(key_dim); q is also scaled by 1 / sqrt(key_dim)."""
    dk = shape.key_dim
    return np.concatenate([np.full(dk, 1.0 / dk), np.full(dk, dk**-0.5)]).astype(np.float32)


class LayerState:
    """One linear layer's state for one sequence, and the rows of its latest forward."""

    def __init__(self, gpu: Gpu, shape: LinearAttention, max_rows: int, label: str):
        window = max(shape.conv_taps - 1, 1)
        self.state = Tensor.empty(gpu, (shape.value_heads, shape.key_dim, shape.value_dim), "f32", f"{label}.state")
        self.conv_state = Tensor.empty(gpu, (window, shape.channels), "f32", f"{label}.conv")
        self.mix_rows = Tensor.empty(gpu, (max_rows, shape.mix_width), "f32", f"{label}.mix rows")
        self.conv_rows = Tensor.empty(gpu, (max_rows, shape.channels), "f32", f"{label}.conv rows")

    @property
    def tensors(self) -> list[Tensor]:
        return [self.state, self.conv_state, self.mix_rows, self.conv_rows]


def recurrent_bytes(shape: LinearAttention, layers: int, max_rows: int) -> int:
    """`RecurrentState(..., layers, max_rows).nbytes` before making one (a checkpoint's copies not included)."""
    per_layer = shape.value_heads * shape.key_dim * shape.value_dim + max(shape.conv_taps - 1, 1) * shape.channels
    per_layer += max_rows * (shape.mix_width + shape.channels)
    return 4 * (layers * per_layer + max_rows)


class RecurrentState:
    """A sequence's Gated DeltaNet states (zero at creation, as WebGPU buffers are), committed up to `length`,
    and the rows of its latest forward waiting for the next one to say how many were kept (`pending`)."""

    def __init__(self, gpu: Gpu, shape: LinearAttention, layers: int, max_rows: int, label: str = "kv"):
        self.shape = shape
        self.layers = [LayerState(gpu, shape, max_rows, f"{label}.linear{i}") for i in range(layers)]
        self.order = Tensor.empty(gpu, max_rows, "u32", f"{label}.kept order")
        self.max_rows = max_rows
        self.length = 0
        self.pending: tuple[int, int] | None = None  # (start position, rows) of the latest forward
        self.pending_layers: int | None = None  # the linear layers that forward ran (None: all)
        self.ordered = False
        self._saved: list[tuple[Tensor, Tensor]] | None = None  # `checkpoint`'s copies, made on first use
        self._saved_length = 0

    @property
    def tensors(self) -> list[Tensor]:
        saved = [t for pair in self._saved or [] for t in pair]
        return [t for layer in self.layers for t in layer.tensors] + [self.order, *saved]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def rows_kept(self, start_pos: int) -> int:
        """How many of the latest forward's rows a forward at `start_pos` keeps (the cache was truncated to
        start_pos since); a position the state cannot reach is refused."""
        if self.pending is None:
            if start_pos != self.length:
                raise CapacityError(
                    f"a forward at position {start_pos}: the linear-attention state is at position {self.length} "
                    "and cannot move back (a recurrent state keeps no history)"
                )
            return 0
        start, rows = self.pending
        if not start <= start_pos <= start + rows:
            raise CapacityError(
                f"a forward at position {start_pos}: the linear-attention state can only keep 0..{rows} rows of "
                f"the forward at {start} (a recurrent state keeps no history before it)"
            )
        return start_pos - start

    def reorder(self, moves: Sequence[tuple[int, int]]) -> None:
        """The latest forward was a token tree whose accepted path's rows go to rows 1, 2, ... by `moves` (source,
        destination): the commit reads the kept rows in that order."""
        order = np.arange(self.max_rows, dtype=np.uint32)
        for src, dst in moves:
            order[dst] = src
        self.order.write(order)
        self.ordered = True

    def snapshot(self, gpu: Gpu) -> RecurrentState:
        """An empty state of the same shape with room for no forward rows (one), to hold a copy (`copy_into`)."""
        return RecurrentState(gpu, self.shape, len(self.layers), 1, "snapshot")

    def copy_into(self, other: RecurrentState, encoder) -> None:
        """Record copies of the committed states into `other` (same shape), which is then at this one's length;
        only a state with no rows waiting (`pending`) is whole."""
        if self.pending is not None:
            raise CapacityError("a recurrent state with uncommitted rows cannot be copied: settle it first")
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            for src, dst in ((mine.state, theirs.state), (mine.conv_state, theirs.conv_state)):
                encoder.copy_buffer_to_buffer(src.buffer, 0, dst.buffer, 0, src.nbytes)
        other.committed(self.length)

    def checkpoint(self, gpu: Gpu) -> None:
        """Keep a copy of the committed states (no rows may be waiting), to come back to with `rollback`: drafting
        runs ahead on a model's own states and commits its drafts as it goes."""
        if self.pending is not None:
            raise CapacityError("a recurrent state with uncommitted rows cannot be checkpointed: settle it first")
        if self._saved is None:
            self._saved = [
                (Tensor.empty(gpu, layer.state.shape, "f32"), Tensor.empty(gpu, layer.conv_state.shape, "f32"))
                for layer in self.layers
            ]
        self._copy(gpu, [(mine, saved) for mine, saved in zip(self._pairs(), self._saved, strict=True)])
        self._saved_length = self.length

    def rollback(self, gpu: Gpu) -> int:
        """Back to the last `checkpoint` (its states, its position, nothing waiting); returns that position."""
        if self._saved is None:
            raise CapacityError("no checkpoint to roll the recurrent state back to")
        self._copy(gpu, [(saved, mine) for mine, saved in zip(self._pairs(), self._saved, strict=True)])
        self.committed(self._saved_length)
        return self._saved_length

    def _pairs(self) -> list[tuple[Tensor, Tensor]]:
        return [(layer.state, layer.conv_state) for layer in self.layers]

    @staticmethod
    def _copy(gpu: Gpu, moves: list[tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]]) -> None:
        encoder = gpu.device.create_command_encoder()
        for source, destination in moves:
            for src, dst in zip(source, destination, strict=True):
                encoder.copy_buffer_to_buffer(src.buffer, 0, dst.buffer, 0, src.nbytes)
        gpu.queue.submit([encoder.finish()])

    def committed(self, start_pos: int) -> None:
        self.length, self.pending, self.pending_layers, self.ordered = start_pos, None, None, False

    def ran(self, start_pos: int, rows: int, layers: int | None = None) -> None:
        """A forward of `rows` at start_pos ran the linear layers among the model's first `layers` (None: all)."""
        self.pending, self.pending_layers = (start_pos, rows), layers

    def close(self) -> None:
        for t in self.tensors:
            t.destroy()


class GatedDeltaNet:
    """One Gated DeltaNet layer over one sequence (`LayerState`): a forward's rows of `mix` (the input
    projection's [q | k | v | z | b | a]) → `out` ([rows, value_width], gated and normalised per value head)."""

    def __init__(
        self,
        registry: KernelRegistry,
        shape: LinearAttention,
        layer: LayerState,
        order: Tensor,
        *,
        mix: Tensor,
        out: Tensor,
        conv: Tensor,
        gates: Tensor,
        l2_weight: Tensor,
        tree: Tensor,
        eps: float,
        max_rows: int,
    ):
        self.shape = shape
        self.layer = layer
        self.max_rows = max_rows
        self.mix = mix
        values = {
            "channels": shape.channels,
            "mix_stride": shape.mix_width,
            "taps": shape.conv_taps,
            "n_k": shape.key_heads,
            "n_v": shape.value_heads,
            "dk": shape.key_dim,
            "dv": shape.value_dim,
            "eps": eps,
        }
        self.conv = registry.bind(
            registry.kernel("linear_attention", entry="conv"),
            values,
            mix=mix,
            conv_w=conv,
            conv_state=layer.conv_state,
            conv_rows=layer.conv_rows,
            order=tree,
        )
        self.delta = registry.bind(
            registry.kernel("linear_attention", entry="delta"),
            self.conv.params,
            mix=mix,
            conv_rows=layer.conv_rows,
            gates=gates,
            state=layer.state,
            out=out,
            order=tree,
        )
        self.norm = HeadRMSNorm(
            registry,
            layer.conv_rows,
            l2_weight,
            q_heads=shape.key_heads,
            k_heads=shape.key_heads,
            head_dim=shape.key_dim,
            row_stride=shape.channels,
            eps=L2_NORM_EPS / shape.key_dim,
            max_rows=max_rows,
        )
        self.commit_state = registry.bind(
            registry.kernel("linear_attention", entry="commit_state"),
            values,
            mix=layer.mix_rows,
            conv_rows=layer.conv_rows,
            gates=gates,
            state=layer.state,
            order=order,
        )
        self.commit_conv = registry.bind(
            registry.kernel("linear_attention", entry="commit_conv"),
            self.commit_state.params,
            mix=layer.mix_rows,
            conv_state=layer.conv_state,
            order=order,
        )

    def record(self, rec: Recorder, rows: int, tree: bool = False, row0: int = 0) -> None:
        """The forward's rows, rows row0 .. row0 + rows - 1 of mix and out (a sequence's segment of a batched
        forward)."""
        require_rows(row0 + rows, self.max_rows, "GatedDeltaNet")
        self.conv.params.set(rows=rows, tree=int(tree), row0=row0)
        rec.dispatch(self.conv, workgroups(self.shape.channels, 64), rows)
        row_bytes = self.shape.mix_width * 4
        rec.copy(self.mix, self.layer.mix_rows, rows * row_bytes, src_offset=row0 * row_bytes)
        self.norm.record(rec, rows)
        rec.dispatch(self.delta, self.shape.value_heads)

    def record_commit(self, rec: Recorder, kept: int, ordered: bool) -> None:
        """Advance the state and the conv window by the latest forward's first `kept` rows (in `order` when
        `ordered`)."""
        require_rows(kept, self.max_rows, "GatedDeltaNet commit")
        self.commit_state.params.set(rows=kept, ordered=int(ordered))
        rec.dispatch(self.commit_state, self.shape.value_heads)
        rec.dispatch(self.commit_conv, workgroups(self.shape.channels, 64))

    def release(self, registry: KernelRegistry) -> None:
        registry.release_slot(self.conv.params)
        registry.release_slot(self.commit_state.params)
        self.norm.release(registry)
