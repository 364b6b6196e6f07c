"""The LoRA adapters loaded on one `Transformer`, and their part of its forwards.

Each adapter gets a slot (a number never given again, so nothing recorded for a removed adapter can address a new
one) and, per layer and adapted matmul, its packed weights and a `LoraMatmul` bound to that matmul's input and output.
Which adapter a row uses comes from its sequence: a KV cache records the adapter its K/V were computed with
(`KVCache.adapter`), and a forward's segments are (cache, rows), so `place` writes each row's slot before the forward
is recorded and returns the slots in use. After a matmul the forward asks `record` for the updates of those slots:

    matmul (base) ─▶ out       then, only if some row's adapter adapts this matmul:
    the down projection's input as the base sees it: act(gate)·up (its GLU is fused) ─▶ act
    for each adapter slot in use:  out[rows of that slot] += B (A input)          (ops/lora.py; a fused norm
                                   of the base, rmsnorm(x), is computed by the update's kernel too)

A forward with no adapted row records nothing here and costs nothing more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from doppler_py.errors import AdapterError, UnknownAdapterError
from doppler_py.gpu.recorder import Recorder
from doppler_py.gpu.tensor import Tensor
from doppler_py.model.lora import LoraAdapter, adapter_segments, read_adapter
from doppler_py.ops.elementwise import SwiGLU
from doppler_py.ops.linear import Linear
from doppler_py.ops.lora import NO_ADAPTER, LoraMatmul, pack_segments

if TYPE_CHECKING:
    from doppler_py.model.transformer import Transformer


@dataclass
class _Loaded:
    slot: int
    adapter: LoraAdapter
    tensors: list[Tensor] = field(default_factory=list)
    ops: dict[tuple[int, str], LoraMatmul] = field(default_factory=dict)  # (layer, matmul) → its update


class Adapters:
    """The adapters of one model by name (see the module)."""

    def __init__(self, model: Transformer):
        self.model = model
        self._loaded: dict[str, _Loaded] = {}
        self._next_slot = 0
        self.row_slots: Tensor | None = None  # u32 [max_rows]: each row's slot in the forward being recorded
        # (layer, matmul) → the op writing its input as the base sees it (None: the update reads x itself)
        self._inputs: dict[tuple[int, str], SwiGLU | None] = {}

    @property
    def names(self) -> list[str]:
        return sorted(self._loaded)

    def __contains__(self, name: object) -> bool:
        return name in self._loaded

    def add(self, name: str, adapter: LoraAdapter | str | Path, dtype: str = "f32") -> LoraAdapter:
        """Load `adapter` (a PEFT folder or one already read) as `name`, its weights kept in `dtype` (f32 or f16)."""
        if not isinstance(name, str) or not name or ":" in name or name != name.strip():
            raise AdapterError(f"an adapter's name is a non-empty string without ':' or outer spaces, got {name!r}")
        if name in self._loaded:
            raise AdapterError(f"an adapter named {name!r} is loaded already: remove it first")
        if not isinstance(adapter, LoraAdapter):
            adapter = read_adapter(adapter)
        model = self.model
        segments = adapter_segments(adapter, model.config)
        if self.row_slots is None:
            self.row_slots = Tensor.from_numpy(
                model.gpu, np.full(model.max_rows, NO_ADAPTER, np.uint32), "u32", "LoRA row slots"
            )
        loaded = _Loaded(self._next_slot, adapter)
        try:
            for layer, matmuls in sorted(segments.items()):
                for matmul, parts in matmuls.items():
                    linear = self._linear(layer, matmul)
                    packed = Tensor.from_numpy(model.gpu, pack_segments(parts, dtype), "u32", f"LoRA {name} {layer}")
                    loaded.tensors.append(packed)
                    n, k = linear.weight.shape
                    norm = linear.norm  # the kernel normalises x itself, as the fused base matmul does
                    loaded.ops[(layer, matmul)] = LoraMatmul(
                        model.registry,
                        packed,
                        dtype,
                        self._input(layer, matmul, linear),
                        linear.tensors["out"],
                        self.row_slots,
                        k=k,
                        n_total=n,
                        slot=loaded.slot,
                        max_rows=model.max_rows,
                        norm_weight=norm.weight if norm is not None else None,
                        eps=norm.eps if norm is not None else 0.0,
                    )
        except BaseException:
            model.registry.release_tensors(*loaded.tensors)
            raise
        self._next_slot += 1
        self._loaded[name] = loaded
        model.forget_tapes()  # recorded without this adapter's dispatches
        return adapter

    def remove(self, name: str) -> None:
        """Unload `name`: a sequence still using it fails at its next forward (`UnknownAdapterError`)."""
        loaded = self._loaded.pop(self._known(name))
        self.model.forget_tapes()
        self.model.registry.release_tensors(*loaded.tensors)

    def adapter(self, name: str) -> LoraAdapter:
        """The adapter loaded as `name` (as read from its folder)."""
        return self._loaded[self._known(name)].adapter

    def _known(self, name: str) -> str:
        if name not in self._loaded:
            loaded = ", ".join(self.names) or "none"
            raise UnknownAdapterError(f"no LoRA adapter named {name!r} is loaded (loaded: {loaded})", option="adapter")
        return name

    def check(self, name: str | None) -> None:
        """Raise `UnknownAdapterError` unless `name` is None (the base model) or a loaded adapter."""
        if name is not None:
            self._known(name)

    def _linear(self, layer: int, matmul: str) -> Linear:
        linear = getattr(self.model.layers[layer], matmul, None)
        if not isinstance(linear, Linear):
            raise AdapterError(f"layer {layer} of the model has no {matmul} projection to adapt")
        return linear

    def _input(self, layer: int, matmul: str, linear: Linear) -> Tensor:
        """The tensor the update reads as the matmul's input: x itself (normalised by the update's kernel when the
        base fuses a norm), or for a fused gated activation its output, which a SwiGLU dispatch writes first (once per
        layer and matmul, shared by every adapter)."""
        glu, x = linear.glu, linear.tensors["x"]
        if glu is None:
            self._inputs.setdefault((layer, matmul), None)
            return x
        if (layer, matmul) not in self._inputs:
            rows, k = self.model.max_rows, linear.weight.shape[1]
            self._inputs[(layer, matmul)] = SwiGLU(
                self.model.registry, x, glu.scratch, ffn_dim=k, max_rows=rows, activation=glu.activation
            )
        return glu.scratch

    def place(self, segments: Sequence[tuple[int, int, str | None]]) -> tuple[int, ...]:
        """Write each row's slot for a forward of (row0, rows, adapter name or None) segments; the slots in use,
        sorted (empty: no row is adapted, and nothing is written)."""
        names = {name for _, _, name in segments if name is not None}
        if not names:
            return ()
        slots = {name: self._loaded[self._known(name)].slot for name in names}
        assert self.row_slots is not None
        end = max(row0 + rows for row0, rows, _ in segments)
        row_slots = np.full(end, NO_ADAPTER, np.uint32)
        for row0, rows, name in segments:
            if name is not None:
                row_slots[row0 : row0 + rows] = slots[name]
        self.row_slots.view((end,)).write(row_slots)
        return tuple(sorted(slots.values()))

    def record(self, rec: Recorder, layer: int, matmul: str, rows: int, slots: tuple[int, ...]) -> None:
        """After layer `layer`'s `matmul` ran over `rows` rows: the updates of the adapters in `slots` that adapt it."""
        if not slots:
            return
        ops = [
            loaded.ops[(layer, matmul)]
            for loaded in self._loaded.values()
            if loaded.slot in slots and (layer, matmul) in loaded.ops
        ]
        if not ops:
            return
        prepare = self._inputs[(layer, matmul)]
        if prepare is not None:
            prepare.record(rec, rows)  # act(gate)·up, as the base matmul computed it (fused) from gate_up
        for op in ops:
            op.record(rec, rows)  # out[rows of this adapter] += B (A input)

    def close(self) -> None:
        for name in list(self._loaded):
            self.remove(name)
        if self.row_slots is not None:
            self.model.registry.release_tensors(self.row_slots)
            self.row_slots = None
