"""Uniform values: a uniform struct's layout, and its slots in shared arenas uploaded once per submit.

Uniform values live in a `UniformSlot` inside a shared arena (one buffer per 64 KiB of slots). Setting a
value only touches host memory; `Recorder.submit()` uploads the dirty arenas once, so a forward pass with
hundreds of dispatches costs a handful of `write_buffer` calls. A slot holds ONE set of values per submit:
a call site that records the same dispatch twice with different uniforms needs two slots. `Recorder.dispatch`
enforces this: a slot dispatched again in the same recorder with different bytes raises `InternalError`.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass

import numpy as np

from doppler_py.gpu.device import Gpu

_SCALAR_FORMATS = {"u32": "I", "i32": "i", "f32": "f"}


@dataclass(frozen=True)
class UniformLayout:
    """Field names and scalar types of a uniform struct, in declaration order."""

    struct_name: str
    fields: tuple[tuple[str, str], ...]

    @property
    def size(self) -> int:
        return 4 * len(self.fields)

    @functools.cached_property
    def _packers(self) -> dict[str, tuple[int, struct.Struct]]:
        """Each field's byte offset and packer: `pack` runs for most dispatches, so nothing is looked up twice."""
        return {name: (4 * i, struct.Struct("<" + _SCALAR_FORMATS[kind])) for i, (name, kind) in enumerate(self.fields)}

    def pack(self, values: dict[str, float | int], into: memoryview) -> None:
        packers = self._packers
        for name, value in values.items():
            entry = packers.get(name)
            if entry is None:
                unknown = sorted(set(values) - packers.keys())
                raise KeyError(f"{self.struct_name} has no field(s) {unknown}")
            entry[1].pack_into(into, entry[0], value)


class UniformSlot:
    """A uniform struct's bytes at a fixed offset of an arena buffer (bind groups reference it forever)."""

    def __init__(self, arena: _UniformArena, offset: int, layout: UniformLayout):
        self.arena = arena
        self.offset = offset
        self.layout = layout
        # Built once: `Recorder.dispatch` reads both for every dispatch, so they must cost nothing there.
        self.view = arena.host_view(offset, layout.size)
        self.key = (id(arena), offset)

    def set(self, **values: float | int) -> UniformSlot:
        self.layout.pack(values, self.view)
        self.arena.dirty = True
        return self

    def values(self, data: bytes | None = None) -> dict[str, float | int]:
        """The fields decoded from `data` (the slot's current bytes by default)."""
        raw = self.view.tobytes() if data is None else data
        return {
            name: struct.unpack_from("<" + _SCALAR_FORMATS[kind], raw, 4 * i)[0]
            for i, (name, kind) in enumerate(self.layout.fields)
        }


class _UniformArena:
    SIZE = 65_536

    def __init__(self, gpu: Gpu):
        self.gpu = gpu
        self.buffer = gpu.device.create_buffer(
            size=self.SIZE, usage=gpu.api.BufferUsage.UNIFORM | gpu.api.BufferUsage.COPY_DST, label="uniforms"
        )
        self.host = np.zeros(self.SIZE, dtype=np.uint8)
        self.used = 0
        self.dirty = False

    def host_view(self, offset: int, size: int) -> memoryview:
        return memoryview(self.host[offset : offset + size])

    def allocate(self, size: int) -> int | None:
        align = self.gpu.uniform_alignment
        start = (self.used + align - 1) // align * align
        if start + size > self.SIZE:
            return None
        self.used = start + size
        return start

    def flush(self) -> None:
        if self.dirty:
            self.gpu.queue.write_buffer(self.buffer, 0, memoryview(self.host[: self.used]))
            self.dirty = False
