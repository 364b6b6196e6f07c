"""Kernel registry: WGSL files → cached pipelines, bind groups, uniforms, and batched dispatch.

Conventions every shader in `shaders/` follows (and the registry relies on):
* all bindings live in `@group(0)`; the registry reads them from the source and builds an explicit bind
  group layout, so a resource is bound by its WGSL variable name (`bind(k, x=..., out=...)`);
* at most one `var<uniform>`; its struct holds only 4-byte scalars (u32, i32, f32), written by field name;
* tunables are `override` constants, passed as keyword arguments to `kernel()`.

Uniform values live in a `UniformSlot` inside a shared arena (one buffer per 64 KiB of slots). Setting a
value only touches host memory; `Recorder.submit()` uploads the dirty arenas once, so a forward pass with
hundreds of dispatches costs a handful of `write_buffer` calls. A slot holds ONE set of values per submit:
a call site that records the same dispatch twice with different uniforms needs two slots. `Recorder.dispatch`
enforces this: a slot dispatched again in the same recorder with different bytes raises `InternalError`.
"""

from __future__ import annotations

import functools
import importlib.resources
import os
import re
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from doppler_py.errors import DeviceLimitError, InternalError, ShaderError
from doppler_py.gpu import dispatch_loop
from doppler_py.gpu.device import Gpu
from doppler_py.gpu.tensor import Tensor


def _shader_dir() -> Path:
    """The WGSL folder: doppler_py/shaders in an installed wheel (the build maps the repository's top-level shaders/
    there, see pyproject.toml), the checkout's own shaders/ beside the package in a source tree or editable install."""
    package = Path(str(importlib.resources.files("doppler_py"))).resolve()
    installed, checkout = package / "shaders", package.parent / "shaders"
    # The installed copy wins; the checkout's only when the package has none, so a wheel never reads a stray
    # site-packages/shaders of another distribution.
    return checkout if not installed.is_dir() and checkout.is_dir() else installed


SHADER_DIR = _shader_dir()

_BINDING_RE = re.compile(
    r"@group\(\s*0\s*\)\s*@binding\(\s*(\d+)\s*\)\s*var\s*<\s*(uniform|storage)\s*(?:,\s*(read_write|read))?\s*>"
    r"\s*(\w+)\s*:\s*([\w<>, ]+?)\s*;"
)
_STRUCT_RE = re.compile(r"struct\s+(\w+)\s*\{([^}]*)\}", re.S)
_FIELD_RE = re.compile(r"(\w+)\s*:\s*(\w+)")
_ENABLE_SUBGROUPS_RE = re.compile(r"^\s*enable\s+subgroups\s*;\s*$", re.M)
_COMMENT_RE = re.compile(r"//[^\n]*")

_SCALAR_FORMATS = {"u32": "I", "i32": "i", "f32": "f"}


def read_shader(name: str, shader_dir: Path = SHADER_DIR) -> str:
    path = shader_dir / f"{name}.wgsl"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in shader_dir.glob("*.wgsl")))
        if not known:  # not a typo in `name`: a package built without its WGSL files
            raise ShaderError(
                f"no WGSL files in {shader_dir}: this installation of doppler-py was built without its shaders; "
                "reinstall it"
            )
        raise ShaderError(f"no shader named {name!r} in {shader_dir} (known: {known})")
    return path.read_text()


def source_for_naga(source: str) -> str:
    """naga (wgpu-py) rejects `enable subgroups;` which Tint requires; the builtins work without it."""
    return _ENABLE_SUBGROUPS_RE.sub("", source)


@dataclass(frozen=True)
class Binding:
    index: int
    name: str
    kind: str  # "uniform", "read-only-storage" or "storage"
    type_name: str


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


def parse_bindings(source: str) -> list[Binding]:
    text = _COMMENT_RE.sub("", source)
    bindings = []
    for m in _BINDING_RE.finditer(text):
        index, space, access, name, type_name = m.groups()
        if space == "uniform":
            kind = "uniform"
        else:
            kind = "storage" if access == "read_write" else "read-only-storage"
        bindings.append(Binding(int(index), name, kind, type_name.strip()))
    return sorted(bindings, key=lambda b: b.index)


_FN_RE = re.compile(r"\bfn\s+(\w+)\s*\(")
_IDENT_RE = re.compile(r"\b[A-Za-z_]\w*\b")


_ATTRIBUTES_BEFORE_RE = re.compile(r"(?:@\w+\s*(?:\([^)]*\))?\s*)*$")


def _blank_comments(source: str) -> str:
    """Comments replaced by spaces of the same length, so positions still match the source."""
    return _COMMENT_RE.sub(lambda m: " " * len(m.group(0)), source)


def _function_spans(text: str) -> dict[str, tuple[int, int, int]]:
    """Each WGSL function's name → (start incl. attributes, body start, end), brace-matched."""
    spans = {}
    for m in _FN_RE.finditer(text):
        body = text.index("{", m.end())
        depth, i = 0, body
        while True:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
            if depth == 0:
                break
        start = _ATTRIBUTES_BEFORE_RE.search(text, 0, m.start()).start()
        spans[m.group(1)] = (start, body, i)
    return spans


def _function_bodies(text: str) -> dict[str, str]:
    """Each WGSL function's name → its body text."""
    return {name: text[body:end] for name, (_, body, end) in _function_spans(text).items()}


def _reachable(bodies: dict[str, str], entry: str) -> tuple[set[str], set[str]]:
    """Functions reachable from `entry` and every identifier their bodies use."""
    seen, todo, used = set(), [entry], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        idents = set(_IDENT_RE.findall(bodies[name]))
        used |= idents
        todo.extend(idents & bodies.keys())
    return seen, used


def prune_to_entry(source: str, entry: str) -> str:
    """The source with only `entry` and the functions it calls, without `enable subgroups;`.

    For devices without subgroups: a file's subgroup entry point would make the whole module fail to compile
    there, so each non-subgroup entry point is compiled from its own pruned module.
    """
    text = _blank_comments(source)
    spans = _function_spans(text)
    if entry not in spans:
        raise ShaderError(f"entry point {entry!r} not found (functions: {sorted(spans)})")
    keep, _ = _reachable(_function_bodies(text), entry)
    pieces, last = [], 0
    for name, (start, _, end) in sorted(spans.items(), key=lambda item: item[1][0]):
        if name not in keep:
            pieces.append(source[last:start])
            last = end
    pieces.append(source[last:])
    return source_for_naga("".join(pieces))


def entry_bindings(source: str, entry: str, bindings: list[Binding]) -> list[Binding]:
    """The bindings that `entry` reaches through its call graph.

    A file may hold several entry points that share helper functions but not all resources; like WebGPU's
    "auto" layout, each pipeline's bind group holds only what its entry point uses.
    """
    bodies = _function_bodies(_COMMENT_RE.sub("", source))
    if entry not in bodies:
        raise ShaderError(f"entry point {entry!r} not found (functions: {sorted(bodies)})")
    _, used = _reachable(bodies, entry)
    return [b for b in bindings if b.name in used]


def parse_uniform(source: str, bindings: list[Binding]) -> UniformLayout | None:
    uniforms = [b for b in bindings if b.kind == "uniform"]
    if not uniforms:
        return None
    if len(uniforms) > 1:
        raise ShaderError(f"at most one uniform binding per shader, found {[b.name for b in uniforms]}")
    text = _COMMENT_RE.sub("", source)
    structs = {m.group(1): m.group(2) for m in _STRUCT_RE.finditer(text)}
    type_name = uniforms[0].type_name
    if type_name not in structs:
        raise ShaderError(f"uniform {uniforms[0].name}: struct {type_name} not found")
    fields = tuple(_FIELD_RE.findall(structs[type_name]))
    for name, kind in fields:
        if kind not in _SCALAR_FORMATS:
            raise ShaderError(f"uniform struct {type_name}.{name}: only u32/i32/f32 fields are supported")
    return UniformLayout(type_name, fields)


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
        import wgpu

        self.gpu = gpu
        self.buffer = gpu.device.create_buffer(
            size=self.SIZE, usage=wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST, label="uniforms"
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


@dataclass(eq=False)
class Bound:
    """A kernel with its resources bound: the unit `Recorder.dispatch` records."""

    kernel: Kernel
    bind_group: object
    params: UniformSlot | None
    resources: dict[str, Tensor]

    def __post_init__(self) -> None:
        # The native handles the fast dispatch path passes straight to wgpu-native (see _NativePassCalls).
        self.native = (getattr(self.kernel.pipeline, "_internal", None), getattr(self.bind_group, "_internal", None))


class _NativePassCalls:
    """wgpu-native's three compute-pass entry points, called without wgpu-py's per-call wrapper, and a step's
    encoder, pass and submit created and ended through wgpu-py's raising wrappers without its objects.

    A decode step records ~200 dispatches, and wgpu-py's wrapper (argument conversion, an error-capture
    stack push and pop around every C call) cost ~3.5 of the ~5 µs each dispatch took on the host. Errors in a
    pass are not lost: wgpu-core reports them when the pass ends or the encoder finishes, and those calls still
    go through wgpu-py, which raises them. Where the private module or handles are missing (another wgpu-py
    version or backend), `available` is False and the recorder uses the public API.
    """

    def __init__(self) -> None:
        try:
            from wgpu.backends.wgpu_native._api import GPUCommandEncoder, libf
            from wgpu.backends.wgpu_native._ffi import ffi, lib

            # A step's encoder, pass, command buffer and submit go through wgpu-py's error-raising wrappers
            # (`libf`) but skip its descriptor structs and the pass and command buffer objects (~0.1 ms a step
            # on a slow machine); none has a label.
            self.encoder_class = GPUCommandEncoder
            self.create_encoder = libf.wgpuDeviceCreateCommandEncoder
            self.encoder_descriptor = ffi.new("WGPUCommandEncoderDescriptor *")
            self.begin_pass = libf.wgpuCommandEncoderBeginComputePass
            self.end_pass = libf.wgpuComputePassEncoderEnd
            self.release_pass = lib.wgpuComputePassEncoderRelease
            self.pass_descriptor = ffi.new("WGPUComputePassDescriptor *")
            self.finish = libf.wgpuCommandEncoderFinish
            self.commands_descriptor = ffi.new("WGPUCommandBufferDescriptor *")
            self.submit = libf.wgpuQueueSubmit
            self.release_commands = lib.wgpuCommandBufferRelease
            self.set_pipeline = lib.wgpuComputePassEncoderSetPipeline
            self.set_bind_group = lib.wgpuComputePassEncoderSetBindGroup
            self.dispatch = lib.wgpuComputePassEncoderDispatchWorkgroups
            self.null = ffi.NULL
            self._ffi = ffi
            # Addresses of the same three functions, for the compiled loop (dispatch_loop.py) to call.
            self.functions = tuple(
                self.address(ffi.addressof(lib, name))
                for name in (
                    "wgpuComputePassEncoderSetPipeline",
                    "wgpuComputePassEncoderSetBindGroup",
                    "wgpuComputePassEncoderDispatchWorkgroups",
                )
            )
            self.available = True
        except (ImportError, AttributeError):
            self.available = False

    def address(self, handle) -> int:
        return int(self._ffi.cast("uintptr_t", handle))

    def command_encoder(self, device):
        """A wgpu-py command encoder (copies, timestamps and tests use its methods) created without its
        descriptor struct."""
        return self.encoder_class("", self.create_encoder(device._internal, self.encoder_descriptor), device)

    def finish_and_submit(self, encoder, queue) -> None:
        commands = self.finish(encoder._internal, self.commands_descriptor)
        try:
            self.submit(queue._internal, 1, self._ffi.new("WGPUCommandBuffer[1]", [commands]))
        finally:
            self.release_commands(commands)


_NATIVE = _NativePassCalls()


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

    def mean_compile_s(self, shader: str) -> float | None:
        """Seconds a pipeline of `shader` took to compile here, on average (None: none compiled yet)."""
        times = list(self.compile_s.get(shader, ()))
        return sum(times) / len(times) if times else None

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
        self.native_dispatch = _NATIVE.available and os.environ.get("DOPPLER_PUBLIC_DISPATCH") != "1"
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

    def _module(self, name: str, entry: str):
        # Without subgroups each entry point gets a module pruned to what it calls (see prune_to_entry).
        key = name if self.gpu.has_subgroups else f"{name}.{entry}"
        cache = self.pipelines
        with cache.lock:
            if key not in cache.modules:
                source = self.source(name)
                code = source_for_naga(source) if self.gpu.has_subgroups else prune_to_entry(source, entry)
                try:
                    module = self.gpu.device.create_shader_module(code=code, label=key)
                except Exception as exc:  # wgpu raises its own error types with the compiler's message
                    raise ShaderError(f"shader {name}.wgsl ({entry}) failed to compile: {exc}") from exc
                cache.modules[key] = (module, source)
            return cache.modules[key]

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
                    kernel = cache.kernels[key] = self._compile(key)
                    cache.compile_s.setdefault(name, []).append(time.perf_counter() - start)
        return kernel

    def compiled(self, key: tuple) -> bool:
        """Whether the pipeline of `key` (`kernel_key`) is compiled already."""
        return key in self.pipelines.kernels

    def _compile(self, key: tuple) -> Kernel:
        import wgpu

        name, entry, constants = key
        module, source = self._module(name, entry)
        bindings = entry_bindings(source, entry, parse_bindings(source))
        self._check_limits(name, bindings)
        entries = [
            {
                "binding": b.index,
                "visibility": wgpu.ShaderStage.COMPUTE,
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
        return Kernel(name, entry, constants, pipeline, bgl, tuple(bindings), parse_uniform(source, bindings))

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

        Ops bound per generation would otherwise grow the arenas without end in a long-running process.
        """
        self._free_slots.append(slot)
        for _, phased in self._phased.pop(slot.key, {}).values():
            self._free_slots.append(phased.params)

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


class Tape:
    """What one call recorded (dispatches and copies, in order), to record again by `Recorder.play_tape` without
    the Python of the ops that recorded it: a decode step's ~150 dispatches then cost the host little more than
    wgpu-native's own work. `restore()` puts every uniform slot the calls used back to its bytes at capture;
    values that change between plays (positions) are the caller's to set after it. The tape keeps its bounds
    (so their pipelines and bind groups) alive; drop it when any op or buffer it used is released.
    """

    def __init__(self, phase: int):
        self.phase = phase
        # (bound, x, y, z) per dispatch; (None, src, dst, nbytes, src_offset, dst_offset) per copy
        self.calls: list[tuple] = []
        self.bounds: dict[tuple[int, int], Bound] = {}  # per slot used (phase copies in a phase): a bound using it
        self.origins: set[tuple[int, int]] = set()  # the ops' own slots behind the phase copies
        self.dispatches = 0
        self.keys: frozenset[tuple[int, int]] = frozenset()
        # Per arena: the span [start, end) holding the tape's slots, which of its bytes are theirs, and the span's
        # bytes at capture. Slots are restored and gathered per arena with one numpy call over the whole span: a
        # Python loop over ~150 slots cost ~100 µs, and a fancy-indexed scatter ~190 µs right after a step's
        # GPU work has evicted the caches (a masked copy of a contiguous span touches a third of the memory).
        self._spans: list[tuple[_UniformArena, int, int, np.ndarray, np.ndarray]] = []
        self._where: dict[tuple[int, int], tuple[int, int, int]] = {}  # slot key -> (span, start, end) in it
        self._runs: list[tuple] | None = None  # the calls for the compiled loop (`compiled_runs`)

    def compiled_runs(self) -> list[tuple]:
        """The calls as the compiled loop plays them: each run of consecutive dispatches as (count, pipelines,
        bind groups, grids) in arrays of the loop's cffi, and each copy as (None, copy args)."""
        if self._runs is None:
            ffi, runs, run = dispatch_loop.ffi(), [], []

            def close_run() -> None:
                if run:
                    pipelines = ffi.new("uintptr_t[]", [_NATIVE.address(bound.native[0]) for bound, *_ in run])
                    groups = ffi.new("uintptr_t[]", [_NATIVE.address(bound.native[1]) for bound, *_ in run])
                    grids = ffi.new("uint32_t[]", [n for _, *grid in run for n in grid])
                    runs.append((len(run), pipelines, groups, grids))
                    run.clear()

            for call in self.calls:
                if call[0] is None:
                    close_run()
                    runs.append((None, list(call[1:])))
                else:
                    run.append(call)
            close_run()
            self._runs = runs
        return self._runs

    def _finish(self) -> None:
        self.keys = frozenset(self.bounds)
        by_arena: dict[int, tuple[_UniformArena, list[UniformSlot]]] = {}
        for bound in self.bounds.values():
            slot = bound.params
            by_arena.setdefault(id(slot.arena), (slot.arena, []))[1].append(slot)
        for arena, slots in by_arena.values():
            start = min(slot.offset for slot in slots)
            end = max(slot.offset + slot.layout.size for slot in slots)
            mask = np.zeros(end - start, dtype=bool)
            for slot in slots:
                mask[slot.offset - start : slot.offset - start + slot.layout.size] = True
                self._where[slot.key] = (len(self._spans), slot.offset - start, slot.offset - start + slot.layout.size)
            self._spans.append((arena, start, end, mask, arena.host[start:end].copy()))

    def restore(self) -> None:
        for arena, start, end, mask, data in self._spans:
            np.copyto(arena.host[start:end], data, where=mask)
            arena.dirty = True

    def gather(self) -> list[np.ndarray]:
        """The tape's spans' bytes as they are now (for `slot_bytes`)."""
        return [arena.host[start:end].copy() for arena, start, end, _, _ in self._spans]

    def slot_bytes(self, key: tuple[int, int], gathered: list[np.ndarray]) -> bytes:
        span, start, end = self._where[key]
        return gathered[span][start:end].tobytes()


class Recorder:
    """Records dispatches and copies into ONE command encoder; `submit()` sends it with one queue submit."""

    def __init__(self, registry: KernelRegistry):
        self.registry = registry
        self._native = registry.native_dispatch
        device = registry.gpu.device
        self.encoder = _NATIVE.command_encoder(device) if self._native else device.create_command_encoder()
        # The open compute pass: wgpu-native's handle when `_native`, else wgpu-py's pass object.
        self._pass = self._last_pipeline = self._last_group = None
        self._max_workgroups = registry.max_workgroups
        self.dispatches = 0
        # Dispatches recorded while `phase` > 0 use per-phase copies of their ops' uniform slots, so one submit
        # can hold several forward passes whose ops set different values (consecutive decode steps). A submit
        # that uses phases must use them for every dispatch of such ops: the op's own slot is uploaded with the
        # last values set, which a phase-0 dispatch would then run with.
        self.phase = 0
        self._phased_origins: set[tuple[int, int]] = set()  # keys of the slots dispatched through phase copies
        # Per uniform slot (arena, offset): its bytes at its first dispatch here, and that dispatch's kernel.
        # The arena is uploaded once at submit, so every dispatch of a slot runs with the LAST values set;
        # a later dispatch that sees other bytes would silently run the earlier one with them too.
        self._uniforms: dict[tuple[int, int], tuple[bytes, Kernel]] = {}
        self._tape: Tape | None = None  # being captured (`capture`)
        self._played: list[tuple[Tape, list[np.ndarray]]] = []  # tapes played, with their slots' bytes then

    def __del__(self) -> None:
        # A recorder dropped with its pass open (an op raised mid-step): the native pass has no wgpu-py object
        # whose collection would release it.
        if getattr(self, "_native", False) and self._pass is not None:
            _NATIVE.release_pass(self._pass)
            self._pass = None

    @property
    def can_play_tapes(self) -> bool:
        """Whether `play_tape` takes the fast path; recorders that do more per dispatch (the profiler's, the
        tests' Dawn replay) get every call through their own `dispatch` and `copy`."""
        return bool(self._native) and type(self).dispatch is Recorder.dispatch and type(self).copy is Recorder.copy

    def capture(self) -> Tape:
        """Start a tape of the calls recorded from now until `end_capture`."""
        if self._tape is not None:
            raise InternalError("a recorder captures one tape at a time")
        self._tape = Tape(self.phase)
        return self._tape

    def end_capture(self) -> Tape:
        tape, self._tape = self._tape, None
        tape._finish()
        return tape

    def play_tape(self, tape: Tape) -> None:
        """Record `tape`'s calls again, each slot holding its bytes as they are now (after `Tape.restore` and the
        caller's updates), under `dispatch`'s checks: a slot dispatched twice in one submit must hold the same
        bytes both times, and an op's slot is not dispatched both with and without a phase."""
        if tape.phase != self.phase:
            raise InternalError(f"a tape captured in phase {tape.phase} played in phase {self.phase}")
        if not self.can_play_tapes:
            for bound, *args in tape.calls:
                if bound is not None:
                    self.dispatch(bound, *args)
                else:
                    self._play_copy(args)
            return
        gathered = tape.gather()
        if tape.origins:
            if any(self._first_use(key) is not None for key in tape.origins):
                self._phase_mix(next(iter(tape.bounds.values())))
            self._phased_origins.update(tape.origins)
        elif not self._phased_origins.isdisjoint(tape.keys):
            self._phase_mix(tape.bounds[next(iter(tape.keys & self._phased_origins))])
        reused = tape.keys & self._uniforms.keys() if self._uniforms else set()
        for other, _ in self._played:
            reused |= tape.keys & other.keys
        for key in reused:
            first, now = self._first_use(key), tape.slot_bytes(key, gathered)
            if first[0] != now:
                self._uniform_clash(tape.bounds[key], first[0], first[1], now)
        self._played.append((tape, gathered))
        compiled = dispatch_loop.loop() if self.registry.compiled_loop else None
        if compiled is not None:
            self._play_compiled(tape, compiled)
        else:
            for bound, *args in tape.calls:
                if bound is None:
                    self._play_copy(args)
                    continue
                if self._pass is None:
                    self._begin_pass()
                self._native_dispatch(*bound.native, *args)
        self.dispatches += tape.dispatches

    def _play_compiled(self, tape: Tape, compiled) -> None:
        set_pipeline, set_group, dispatch = _NATIVE.functions
        for count, *run in tape.compiled_runs():
            if count is None:
                self._play_copy(run[0])
                continue
            if self._pass is None:
                self._begin_pass()
            compiled.play_dispatches(_NATIVE.address(self._pass), set_pipeline, set_group, dispatch, count, *run)
        # The loop set its own pipelines and groups: the next Python dispatch sets its own again.
        self._last_pipeline = self._last_group = None

    def _first_use(self, key: tuple[int, int]) -> tuple[bytes, Kernel, Bound | None] | None:
        """A slot's bytes and kernel at its first dispatch in this submit (by `dispatch` or a played tape)."""
        first = self._uniforms.get(key)
        if first is not None:
            return (*first, None)
        for tape, gathered in self._played:
            if key in tape.keys:
                bound = tape.bounds[key]
                return tape.slot_bytes(key, gathered), bound.kernel, bound
        return None

    def _play_copy(self, args: list) -> None:
        src, dst, nbytes, src_offset, dst_offset = args
        self.copy(src, dst, nbytes, src_offset=src_offset, dst_offset=dst_offset)

    def dispatch(self, bound: Bound, x: int, y: int = 1, z: int = 1) -> Bound | None:
        """Record a dispatch of `bound`; returns what was dispatched (its phase copy while `phase` > 0), or None
        for an empty grid."""
        limit = self._max_workgroups
        if x > limit or y > limit or z > limit or x < 0 or y < 0 or z < 0:
            raise DeviceLimitError(f"{bound.kernel!r}: dispatch ({x}, {y}, {z}) exceeds {limit} per dimension")
        if x == 0 or y == 0 or z == 0:
            return None
        slot = origin = bound.params
        if slot is not None:
            played = self._played
            if self.phase:
                self._phased_origins.add(slot.key)
                if slot.key in self._uniforms or (played and self._first_use(slot.key)):
                    self._phase_mix(bound)
                bound = self.registry.phased(bound, self.phase)
                slot = bound.params
            elif slot.key in self._phased_origins:
                self._phase_mix(bound)
            data = slot.view.tobytes()
            first = self._uniforms.get(slot.key)
            if first is None and played:
                first = self._first_use(slot.key)
            if first is None:
                self._uniforms[slot.key] = (data, bound.kernel)
            elif first[0] != data:
                self._uniform_clash(bound, first[0], first[1], data)
        if self._pass is None:
            self._begin_pass()
        if self._native:
            self._native_dispatch(*bound.native, x, y, z)
        else:
            self._pass.set_pipeline(bound.kernel.pipeline)
            self._pass.set_bind_group(0, bound.bind_group)
            self._pass.dispatch_workgroups(x, y, z)
        self.dispatches += 1
        if self._tape is not None:
            self._tape.calls.append((bound, x, y, z))
            self._tape.dispatches += 1
            if slot is not None:
                self._tape.bounds.setdefault(slot.key, bound)
                if self.phase:
                    self._tape.origins.add(origin.key)
        return bound

    def _begin_pass(self) -> None:
        if self._native:
            self._pass = _NATIVE.begin_pass(self.encoder._internal, _NATIVE.pass_descriptor)
        else:
            self._pass = self.encoder.begin_compute_pass()
        self._last_pipeline = self._last_group = None

    def _native_dispatch(self, pipeline, group, x: int, y: int, z: int) -> None:
        native = _NATIVE
        if pipeline != self._last_pipeline:  # consecutive dispatches of one kernel keep it set
            native.set_pipeline(self._pass, pipeline)
            self._last_pipeline = pipeline
        if group != self._last_group:
            native.set_bind_group(self._pass, 0, group, 0, native.null)
            self._last_group = group
        native.dispatch(self._pass, x, y, z)

    @staticmethod
    def _phase_mix(bound: Bound) -> None:
        raise InternalError(
            f"{bound.kernel!r}: dispatched both with and without a phase in one submit; its own uniform slot "
            "would hold the last values set for every phase, so record all of its dispatches with phase > 0"
        )

    @staticmethod
    def _uniform_clash(bound: Bound, before: bytes, first_kernel: Kernel, now: bytes) -> None:
        slot = bound.params
        old, new = slot.values(before), slot.values(now)
        changed = ", ".join(f"{name} {old[name]} -> {new[name]}" for name in old if old[name] != new[name])
        also = "" if first_kernel is bound.kernel else f" (first dispatched by {first_kernel!r})"
        raise InternalError(
            f"{bound.kernel!r}: its uniform slot (offset {slot.offset}){also} was dispatched again in the same "
            f"submit with different values ({changed}); a slot holds one set of values per submit, so both "
            "dispatches would run with the last ones: give the second dispatch its own slot or submit in between"
        )

    def _end_pass(self) -> None:
        # Forgotten before ending: a pass whose end raised is still released once, here and not again by __del__.
        open_pass, self._pass = self._pass, None
        if open_pass is None:
            return
        if not self._native:
            open_pass.end()
            return
        try:
            _NATIVE.end_pass(open_pass)
        finally:
            _NATIVE.release_pass(open_pass)

    def copy(
        self, src: Tensor, dst: Tensor, nbytes: int | None = None, *, src_offset: int = 0, dst_offset: int = 0
    ) -> None:
        """Copy bytes between buffers inside this encoder (offsets relative to each tensor's own offset)."""
        self._end_pass()
        size = nbytes if nbytes is not None else src.binding_size
        if self._tape is not None:
            self._tape.calls.append((None, src, dst, size, src_offset, dst_offset))
        self.encoder.copy_buffer_to_buffer(
            src.buffer, src.offset + src_offset, dst.buffer, dst.offset + dst_offset, size
        )

    def write_timestamp(self, query_set, index: int) -> None:
        """Stamp the GPU time once everything recorded so far has run (needs the timestamp-query feature).

        WebGPU stamps only at pass boundaries, so this records an empty pass whose end is stamped.
        """
        self._end_pass()
        stamp = self.encoder.begin_compute_pass(
            timestamp_writes={"query_set": query_set, "end_of_pass_write_index": index}
        )
        stamp.end()

    def resolve_timestamps(self, query_set, count: int, destination) -> None:
        """Write stamps 0..count-1 as u64 nanoseconds into `destination` (a QUERY_RESOLVE buffer)."""
        self._end_pass()
        self.encoder.resolve_query_set(query_set, 0, count, destination, 0)

    def submit(self) -> None:
        self._end_pass()
        self.registry.flush_uniforms()
        queue = self.registry.gpu.queue
        if self._native:
            _NATIVE.finish_and_submit(self.encoder, queue)
        else:
            queue.submit([self.encoder.finish()])
        self.encoder = None


def workgroups(n: int, size: int) -> int:
    """Number of workgroups of `size` needed to cover `n` items."""
    return (n + size - 1) // size
