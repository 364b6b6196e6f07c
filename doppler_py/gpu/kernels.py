"""Kernel registry: WGSL files → cached pipelines, bind groups and uniform slots, and dispatch helpers.

Conventions every shader in `shaders/` follows (and the registry relies on):
* all bindings live in `@group(0)`; the registry reads them from the source and builds an explicit bind
  group layout, so a resource is bound by its WGSL variable name (`bind(k, x=..., out=...)`);
* at most one `var<uniform>`; its struct holds only 4-byte scalars (u32, i32, f32), written by field name;
* tunables are `override` constants, passed as keyword arguments to `kernel()`.

The rest of the GPU layer lives beside it: the WGSL text in `wgsl.py`, uniform slots and their arenas in
`uniforms.py`, recording and tapes in `recorder.py` (wgpu-native's pass functions in `native_pass.py`). The names
other code imports from here are re-exported (`__all__`).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from doppler_py.errors import DeviceLimitError, ShaderError
from doppler_py.gpu import dispatch_loop
from doppler_py.gpu.device import Gpu
from doppler_py.gpu.native_pass import _NATIVE
from doppler_py.gpu.recorder import Recorder, Tape
from doppler_py.gpu.tensor import Tensor
from doppler_py.gpu.uniforms import UniformLayout, UniformSlot, _UniformArena
from doppler_py.gpu.webgpu import DAWN, WGPU_NATIVE
from doppler_py.gpu.wgsl import (
    SHADER_DIR,
    Binding,
    entry_bindings,
    parse_bindings,
    parse_uniform,
    prune_to_entry,
    read_shader,
    source_for_naga,
)

__all__ = [
    "SHADER_DIR",
    "Binding",
    "Bound",
    "CompileRecord",
    "Kernel",
    "KernelRegistry",
    "PipelineCache",
    "Recorder",
    "Tape",
    "UniformSlot",
    "entry_bindings",
    "parse_bindings",
    "parse_uniform",
    "read_shader",
    "source_for_naga",
    "workgroups",
]


@dataclass(eq=False)
class Kernel:
    """A compute pipeline for one (shader, entry point, override constants)."""

    name: str
    entry: str
    constants: tuple[tuple[str, float], ...]
    pipeline: object
    layout: object
    bindings: tuple[Binding, ...]
    uniform: UniformLayout | None

    def __repr__(self) -> str:
        consts = ", ".join(f"{k}={v}" for k, v in self.constants)
        return f"Kernel({self.name}.{self.entry}{'; ' + consts if consts else ''})"


@dataclass(frozen=True)
class CompileRecord:
    """One pipeline compiled in this process: its key (`KernelRegistry.kernel_key`), the seconds its shader
    module took (0 when the module existed already: modules are shared by a file's pipelines), the seconds the
    pipeline itself took (naga's SPIR-V output and the driver's compile: LLVM on a CPU adapter), the thread that
    compiled it and when it started (`time.perf_counter`). For `tools/bench_compile.py`."""

    key: tuple
    module_s: float
    pipeline_s: float
    thread: str
    started: float


@dataclass(eq=False)
class Bound:
    """A kernel with its resources bound: the unit `Recorder.dispatch` records."""

    kernel: Kernel
    bind_group: object
    params: UniformSlot | None
    resources: dict[str, Tensor]

    def __post_init__(self) -> None:
        # The native handles the fast dispatch path passes straight to wgpu-native (see native_pass.py).
        self.native = (getattr(self.kernel.pipeline, "_internal", None), getattr(self.bind_group, "_internal", None))


class PipelineCache:
    """The shader modules and compute pipelines compiled on one device from one shader folder, shared by every
    registry on that device for the life of the process: a second `load()` (or an engine per test) compiles
    nothing its predecessors compiled. Pipelines hold no buffers, so sharing them cannot leak an engine's data.

    Two threads never compile one pipeline twice (a lock per pipeline), but may compile two different ones at
    once: wgpu-native releases the GIL while compiling, so a software adapter uses two CPU cores."""

    def __init__(self) -> None:
        self.modules: dict[str, tuple[object, str]] = {}
        self.kernels: dict[tuple, Kernel] = {}  # (shader, entry point, override constants) -> pipeline
        self.lock = threading.Lock()  # guards the dicts and `pipeline_locks`
        self.pipeline_locks: dict[tuple, threading.Lock] = {}
        self.compile_s: dict[str, list[float]] = {}  # per shader: how long each of its pipelines took to compile
        self.records: list[CompileRecord] = []  # every pipeline compiled, in order (appended under `lock`)

    @staticmethod
    def of(gpu: Gpu, shader_dir: Path) -> PipelineCache:
        with _CACHES_LOCK:
            return gpu.pipeline_caches.setdefault(str(shader_dir), PipelineCache())


_CACHES_LOCK = threading.Lock()


class KernelRegistry:
    """Loads shaders by name and caches bind groups and uniforms for one owner (an engine); modules and
    pipelines come from the device's process-wide `PipelineCache`."""

    def __init__(self, gpu: Gpu, shader_dir: Path = SHADER_DIR, *, fork: bool = False):
        """`fork`: a registry that owns no buffer bound through it (see `fork`)."""
        # Tests swap in a recorder that also replays each submit under Dawn (tests/parity/dawn).
        self.recorder_class: type[Recorder] = Recorder
        self.gpu = gpu
        self.shader_dir = shader_dir
        self.pipelines = PipelineCache.of(gpu, shader_dir)
        self._is_fork = fork
        self._bind_groups: dict[tuple, object] = {}
        # id of a bound buffer -> the keys of the cached groups binding it, so forgetting a buffer (every KV cache
        # released at a generation's end) costs its own groups, not a scan of all of them.
        self._groups_by_buffer: dict[int, set[tuple]] = {}
        self._arenas: list[_UniformArena] = []
        self._free_slots: list[UniformSlot] = []  # slots of released ops, reused before the arenas grow
        self._placeholders: dict[int, Tensor] = {}
        # Per op slot (its key): (id of the bound, phase) -> (the bound, its copy for that phase); see `phased`.
        self._phased: dict[tuple[int, int], dict[tuple[int, int], tuple[Bound, Bound]]] = {}
        self.max_workgroups = int(gpu.limits.get("max-compute-workgroups-per-dimension", 65535))
        # DOPPLER_PUBLIC_DISPATCH=1 records through wgpu-py's public API only (the tests run both paths).
        # The fast path calls wgpu-native's own functions, so a Dawn device records through the public API.
        self.native_dispatch = (
            _NATIVE.available and gpu.webgpu == WGPU_NATIVE and os.environ.get("DOPPLER_PUBLIC_DISPATCH") != "1"
        )
        # Tapes play their dispatches through the compiled loop once it is built (the tests also play them
        # through the Python loop, which records the same commands).
        self.compiled_loop = self.native_dispatch
        if self.compiled_loop:
            dispatch_loop.start()

    def fork(self) -> KernelRegistry:
        """A registry for ops another thread records: it shares this one's compiled pipelines, so what it
        compiles serves both, but has its own uniform arenas and bind groups, so nothing it records can touch a
        uniform value this registry's ops have set. Closing it frees only its arenas; the buffers bound
        through it belong to their owners."""
        fork = KernelRegistry(self.gpu, self.shader_dir, fork=True)
        fork.recorder_class = self.recorder_class
        return fork

    # -- compilation ---------------------------------------------------------------------------------
    def source(self, name: str) -> str:
        return read_shader(name, self.shader_dir)

    def _module(self, name: str, entry: str) -> tuple[object, str, float]:
        """(the shader module, its WGSL source, the seconds spent creating it now: 0 when it existed)."""
        # Without subgroups each entry point gets a module pruned to what it calls (see prune_to_entry).
        key = name if self.gpu.has_subgroups else f"{name}.{entry}"
        cache = self.pipelines
        with cache.lock:
            if key in cache.modules:
                return (*cache.modules[key], 0.0)
            start = time.perf_counter()
            source = self.source(name)
            if not self.gpu.has_subgroups:
                code = prune_to_entry(source, entry)
            else:  # Tint requires the `enable subgroups;` that naga rejects
                code = source if self.gpu.webgpu == DAWN else source_for_naga(source)
            try:
                module = self.gpu.device.create_shader_module(code=code, label=key)
            except Exception as exc:  # wgpu raises its own error types with the compiler's message
                raise ShaderError(f"shader {name}.wgsl ({entry}) failed to compile: {exc}") from exc
            cache.modules[key] = (module, source)
            return (*cache.modules[key], time.perf_counter() - start)

    @staticmethod
    def kernel_key(name: str, entry: str = "main", **constants: float | int | bool) -> tuple:
        """What identifies the pipeline `kernel(name, entry, **constants)` returns."""
        return (name, entry, tuple(sorted(constants.items())))

    def kernel(self, name: str, entry: str = "main", **constants: float | int | bool) -> Kernel:
        key = self.kernel_key(name, entry, **constants)
        cache = self.pipelines
        kernel = cache.kernels.get(key)
        if kernel is None:
            with cache.lock:
                lock = cache.pipeline_locks.setdefault(key, threading.Lock())
            with lock:
                kernel = cache.kernels.get(key)
                if kernel is None:
                    start = time.perf_counter()
                    kernel, module_s = self._compile(key)
                    seconds = time.perf_counter() - start
                    record = CompileRecord(key, module_s, seconds - module_s, threading.current_thread().name, start)
                    with cache.lock:
                        cache.kernels[key] = kernel
                        cache.compile_s.setdefault(name, []).append(seconds)
                        cache.records.append(record)
        return kernel

    def compiled(self, key: tuple) -> bool:
        """Whether the pipeline of `key` (`kernel_key`) is compiled already."""
        return key in self.pipelines.kernels

    def _compile(self, key: tuple) -> tuple[Kernel, float]:
        """The pipeline of `key` and the seconds its shader module took to create (0 if it existed)."""
        name, entry, constants = key
        module, source, module_s = self._module(name, entry)
        bindings = entry_bindings(source, entry, parse_bindings(source))
        self._check_limits(name, bindings)
        entries = [
            {
                "binding": b.index,
                "visibility": self.gpu.api.ShaderStage.COMPUTE,
                "buffer": {"type": b.kind},
            }
            for b in bindings
        ]
        bgl = self.gpu.device.create_bind_group_layout(entries=entries, label=name)
        layout = self.gpu.device.create_pipeline_layout(bind_group_layouts=[bgl], label=name)
        stage = {"module": module, "entry_point": entry}
        if constants:
            stage["constants"] = {k: float(v) for k, v in constants}
        try:
            pipeline = self.gpu.device.create_compute_pipeline(layout=layout, compute=stage, label=f"{name}.{entry}")
        except Exception as exc:
            raise ShaderError(f"pipeline {name}.{entry} {dict(constants) or ''} failed: {exc}") from exc
        kernel = Kernel(name, entry, constants, pipeline, bgl, tuple(bindings), parse_uniform(source, bindings))
        return kernel, module_s

    def _check_limits(self, name: str, bindings: list[Binding]) -> None:
        storage = sum(1 for b in bindings if b.kind != "uniform")
        limit = self.gpu.limits.get("max-storage-buffers-per-shader-stage", 8)
        if storage > limit:
            raise DeviceLimitError(f"shader {name}.wgsl binds {storage} storage buffers; the device allows {limit}")

    def placeholder(self, elements: int) -> Tensor:
        """An f32 tensor for a binding that an op's kernel variant never reads (WebGPU binds every buffer a
        pipeline declares): one per size, shared by every op, destroyed with the registry, bound or not."""
        if elements not in self._placeholders:
            self._placeholders[elements] = Tensor.empty(self.gpu, elements, label=f"placeholder {elements}")
        return self._placeholders[elements]

    # -- uniforms and bind groups --------------------------------------------------------------------
    def uniform_slot(self, layout: UniformLayout) -> UniformSlot:
        for i, free in enumerate(self._free_slots):
            if free.layout.size >= layout.size:
                del self._free_slots[i]
                # Zeroed like a fresh arena, so no field keeps a value of the op that held the slot before.
                free.arena.host[free.offset : free.offset + free.layout.size] = 0
                free.arena.dirty = True
                return UniformSlot(free.arena, free.offset, layout)
        for arena in reversed(self._arenas[-1:]):
            offset = arena.allocate(layout.size)
            if offset is not None:
                return UniformSlot(arena, offset, layout)
        arena = _UniformArena(self.gpu)
        self._arenas.append(arena)
        return UniformSlot(arena, arena.allocate(layout.size), layout)

    def bind(self, kernel: Kernel, params: dict | UniformSlot | None = None, **resources: Tensor) -> Bound:
        """Bind tensors by WGSL variable name; `params` is a dict of uniform values or an existing slot.

        Bind groups are cached by the identity of the buffers and slot, so binding the same resources
        again (e.g. every decode step) returns the cached group.
        """
        names = {b.name for b in kernel.bindings if b.kind != "uniform"}
        missing, extra = names - set(resources), set(resources) - names
        if missing or extra:
            raise ShaderError(f"{kernel!r}: missing bindings {sorted(missing)}, unknown bindings {sorted(extra)}")
        slot = params if isinstance(params, UniformSlot) else None
        if kernel.uniform is not None and slot is None:
            slot = self.uniform_slot(kernel.uniform)
            slot.set(**(params or {}))
        key = (
            id(kernel.layout),
            id(slot.arena.buffer) if slot else None,
            slot.offset if slot else None,
            *((name, id(t.buffer), t.offset, t.binding_size) for name, t in sorted(resources.items())),
        )
        cached = self._bind_groups.get(key)
        if cached is None:
            entries = []
            for b in kernel.bindings:
                if b.kind == "uniform":
                    resource = {"buffer": slot.arena.buffer, "offset": slot.offset, "size": kernel.uniform.size}
                else:
                    t = resources[b.name]
                    self._check_binding(kernel, b.name, t)
                    resource = {"buffer": t.buffer, "offset": t.offset, "size": t.binding_size}
                entries.append({"binding": b.index, "resource": resource})
            group = self.gpu.device.create_bind_group(layout=kernel.layout, entries=entries, label=kernel.name)
            # Keeping the buffers referenced stops their ids (our cache key) being reused by new buffers.
            cached = (group, [t.buffer for t in resources.values()])
            self._bind_groups[key] = cached
            for buffer in cached[1]:
                self._groups_by_buffer.setdefault(id(buffer), set()).add(key)
        return Bound(kernel, cached[0], slot, dict(resources))

    def _check_binding(self, kernel: Kernel, name: str, tensor: Tensor) -> None:
        if tensor.binding_size > self.gpu.max_binding_bytes:
            raise DeviceLimitError(
                f"{kernel!r}: binding {name} is {tensor.binding_size:,} bytes, above the device's "
                f"max storage binding of {self.gpu.max_binding_bytes:,} bytes",
                advice="split the tensor",
            )
        if tensor.offset % int(self.gpu.limits.get("min-storage-buffer-offset-alignment", 256)):
            raise DeviceLimitError(f"{kernel!r}: binding {name} has unaligned offset {tensor.offset}")

    def release_slot(self, slot: UniformSlot) -> None:
        """Take back the slot of an op that is gone (e.g. one bound to a released KV cache) for reuse, and the
        slots of its phase copies.

        Ops bound per generation would otherwise grow the arenas without end in a long-running process; their bind
        groups, which name the slot, are forgotten with it (the next holder of the slot binds its own).
        """
        slots = [slot, *(phased.params for _, phased in self._phased.pop(slot.key, {}).values())]
        for taken in slots:
            self._free_slots.append(taken)
            where = (id(taken.arena.buffer), taken.offset)
            # A snapshot of the keys (one C call, so atomic under the GIL): a compile thread may be binding a
            # matmul's variants meanwhile (`Linear.compile`), and iterating the dict itself then raises.
            for key in [key for key in tuple(self._bind_groups) if key[1:3] == where]:
                self._forget_group(key)

    def phased(self, bound: Bound, phase: int) -> Bound:
        """`bound` for phase `phase` of a recorder (`Recorder.phase`): the same kernel and resources with a
        uniform slot of its own, holding a copy of the values the op has just set in its slot."""
        slot = bound.params
        copies = self._phased.setdefault(slot.key, {})
        entry = copies.get((id(bound), phase))
        if entry is None or entry[0] is not bound:
            entry = (bound, self.bind(bound.kernel, self.uniform_slot(slot.layout), **bound.resources))
            copies[(id(bound), phase)] = entry
        copy = entry[1].params
        copy.view[:] = slot.view
        copy.arena.dirty = True
        return entry[1]

    def release_tensors(self, *tensors: Tensor) -> None:
        """Forget the bind groups of tensors this registry's ops owned, then destroy their buffers."""
        for tensor in tensors:
            self.forget_buffer(tensor.buffer)
            tensor.destroy()

    def close(self) -> None:
        """Destroy every buffer bound through this registry and its uniform arenas, and drop every cached
        module, pipeline and bind group: for an owner whose models and ops all live and end with the registry
        (an engine). This also frees what ops allocate for themselves, like scratch and placeholder buffers.
        A fork (see `fork`) only drops its bind groups and destroys its arenas. Compiled pipelines stay in the
        device's `PipelineCache` for the next registry."""
        if not self._is_fork:
            for _, buffers in self._bind_groups.values():
                for buffer in buffers:
                    buffer.destroy()
        for arena in self._arenas:
            arena.buffer.destroy()
        for tensor in self._placeholders.values():
            tensor.destroy()
        self._placeholders.clear()
        self._phased.clear()
        self._arenas.clear()
        self._free_slots.clear()
        self._bind_groups.clear()
        self._groups_by_buffer.clear()

    def forget_buffer(self, buffer) -> None:
        """Drop cached bind groups that reference `buffer` (call before destroying it)."""
        for key in self._groups_by_buffer.pop(id(buffer), ()):
            self._forget_group(key)

    def _forget_group(self, key: tuple) -> None:
        """Drop one cached bind group and its entries in the by-buffer index."""
        group = self._bind_groups.pop(key, None)
        if group is not None:
            for other in group[1]:
                keys = self._groups_by_buffer.get(id(other))
                if keys is not None:
                    keys.discard(key)
                    if not keys:
                        del self._groups_by_buffer[id(other)]

    def flush_uniforms(self) -> None:
        for arena in self._arenas:
            arena.flush()

    def recorder(self) -> Recorder:
        return self.recorder_class(self)

    @property
    def cache_sizes(self) -> dict[str, int]:
        cache = self.pipelines
        return {"modules": len(cache.modules), "pipelines": len(cache.kernels), "bind_groups": len(self._bind_groups)}


def workgroups(n: int, size: int) -> int:
    """Number of workgroups of `size` needed to cover `n` items."""
    return (n + size - 1) // size
