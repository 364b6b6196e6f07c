"""Recording GPU work: a `Recorder` puts dispatches and copies into ONE command encoder and sends them with one
queue submit; a `Tape` is what one call recorded, played again by a recorder without the Python that recorded it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from doppler_py.errors import DeviceLimitError, InternalError
from doppler_py.gpu import dispatch_loop
from doppler_py.gpu.native_pass import _NATIVE
from doppler_py.gpu.tensor import Tensor
from doppler_py.gpu.uniforms import UniformSlot, _UniformArena

if TYPE_CHECKING:
    from doppler_py.gpu.kernels import Bound, Kernel, KernelRegistry


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
