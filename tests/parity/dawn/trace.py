"""Replays every submit under Dawn (on Chrome's SwiftShader) and holds wgpu-py's results to Dawn's.

`DawnReplay.recorder_class` is a `Recorder` that, on `submit()`:
1. reads back (through wgpu) the bytes of every buffer region its dispatches and copies touch, and the
   uniform bytes of each dispatch — the state the GPU work starts from;
2. lets the wgpu submit happen;
3. sends the same dispatch sequence, with the same explicit layouts and override constants, to the Dawn
   worker and compares every region a dispatch wrote (read_write bindings, copy destinations) with wgpu's.
A mismatch or a dispatch Dawn rejects raises `AssertionError` inside the test that submitted.

With DOPPLER_DAWN_REPLAY=1 (what `tools/test.sh` sets) the shared `registry` records through it while each test of
tests/kernels runs (tests/kernels/conftest.py). A submit is replayed when it dispatches a pipeline (shader, entry
point, override constants, bind group layout) no earlier replay covered, so every distinct pipeline the kernel
tests dispatch runs under Dawn once, in the first submit that uses it, with the state that submit starts from.
The terminal summary prints how many pipelines were replayed and the per-kernel maximum differences; a pipeline
the kernel tests dispatched that no replay covered fails the run (`pytest_sessionfinish`), except one that needs
shader-f16 where the Dawn adapter lacks it (validated by Tint in test_tint_validation.py, listed as such).
"""

from __future__ import annotations

import os
import re
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest
from parity.dawn.client import DawnUnavailable, DawnWorker, b64, in_ci, pipeline_spec, shared_worker

from doppler_py.gpu.kernels import Bound, Kernel, KernelRegistry, Recorder
from doppler_py.gpu.tensor import DTYPES, Tensor

# Submits whose touched buffers add up to more than this are not replayed (JSON + base64 both ways); a pipeline
# only such submits dispatch is reported as never replayed.
MAX_REPLAY_BYTES = int(os.environ.get("DOPPLER_DAWN_MAX_BYTES", 64 << 20))
_STORAGE_ALIGN = 256
_ENABLE_F16_RE = re.compile(r"^\s*enable\s+f16\s*;", re.M)


@dataclass(frozen=True)
class Tolerance:
    """How far Dawn's output may be from wgpu's: |dawn − wgpu| ≤ rel · (1 + max|wgpu|), integers within int_abs."""

    rel: float = 1e-4
    f16_rel: float = 2e-3  # two f16 ulps near 1: one rounding of an f16 output may land either side
    int_abs: int = 0
    why: str = "same f32 operations on both drivers; only rounding of transcendentals and FMA contraction differ"


DEFAULT_TOLERANCE = Tolerance()

# Override constants that describe the device wgpu ran on rather than the computation: Dawn gets the value
# valid on every WebGPU device (SUBGROUP_MIN: lavapipe's subgroups have 8 lanes, SwiftShader's 4; see
# doppler_py/gpu/subgroups.py).
PORTABLE_CONSTANTS = {"SUBGROUP_MIN": 4}


def portable_constants(kernel: Kernel) -> dict[str, float]:
    return {name: PORTABLE_CONSTANTS.get(name, value) for name, value in kernel.constants}


# Looser tolerances, keyed by shader name or "shader.entry", each with the reason it is needed.
TOLERANCES: dict[str, Tolerance] = {}


def tolerance_for(kernel: Kernel) -> Tolerance:
    return TOLERANCES.get(f"{kernel.name}.{kernel.entry}") or TOLERANCES.get(kernel.name) or DEFAULT_TOLERANCE


def _loosest(tolerances) -> Tolerance:
    return max(tolerances, key=lambda t: (t.rel, t.f16_rel, t.int_abs), default=DEFAULT_TOLERANCE)


def variant_label(kernel: Kernel) -> str:
    return ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in kernel.constants)


def kernel_label(kernel: Kernel) -> str:
    variant = variant_label(kernel)
    return f"{kernel.name}.{kernel.entry}" + (f"[{variant}]" if variant else "")


def pipeline_key(kernel: Kernel) -> tuple:
    """What makes a pipeline distinct for the replay: shader, entry point, override constants, bind group layout."""
    return (kernel.name, kernel.entry, kernel.constants, tuple((b.index, b.kind) for b in kernel.bindings))


@dataclass(frozen=True)
class Difference:
    max_abs: float  # max |dawn − wgpu| (inf when NaN/inf patterns differ)
    limit: float  # what the tolerance allows for this region
    worst: int  # index of the element that differs most

    @property
    def ok(self) -> bool:
        return self.max_abs <= self.limit


def compare(dtype: str, expected: np.ndarray, actual: np.ndarray, tolerance: Tolerance) -> Difference:
    """Compare wgpu's `expected` with Dawn's `actual` (same dtype and size)."""
    if dtype not in ("f32", "f16"):
        diff = np.abs(expected.astype(np.int64) - actual.astype(np.int64))
        worst = int(np.argmax(diff)) if diff.size else 0
        return Difference(float(diff.max(initial=0)), float(tolerance.int_abs), worst)
    e, a = expected.astype(np.float64), actual.astype(np.float64)
    special_e, special_a = ~np.isfinite(e), ~np.isfinite(a)
    if not np.array_equal(special_e, special_a) or not np.array_equal(e[special_e], a[special_a], equal_nan=True):
        return Difference(float("inf"), 0.0, int(np.argmax(special_e != special_a)))
    diff = np.zeros_like(e)
    diff[~special_e] = np.abs(e[~special_e] - a[~special_e])
    rel = tolerance.rel if dtype == "f32" else tolerance.f16_rel
    scale = 1.0 + float(np.max(np.abs(e[~special_e]), initial=0.0))
    worst = int(np.argmax(diff)) if diff.size else 0
    return Difference(float(diff.max(initial=0.0)), rel * scale, worst)


@dataclass
class _Extent:
    """The part of one wgpu buffer a submit touches, mirrored by one Dawn buffer."""

    key: str
    buffer: object
    lo: int
    hi: int


@dataclass
class _Written:
    """A region some dispatch (or copy) wrote, compared as its tensor's dtype."""

    extent: _Extent
    offset: int
    tensor: Tensor
    what: str  # binding name or "copy destination"
    writers: list[Kernel] = field(default_factory=list)


@dataclass
class ReplayPlan:
    """What one submit did, in the worker's job format, plus what to compare afterwards."""

    job: dict
    written: list[_Written]
    kernels: list[Kernel]
    skip: str | None = None


@dataclass
class KernelNumbers:
    """What the replay saw of one entry point (all its override variants together)."""

    tolerance: Tolerance
    compared: int = 0
    max_abs: float = 0.0
    worst_ratio: float = 0.0  # max_abs / limit over all comparisons (≤ 1 passes)
    worst_variant: str = ""
    variants: set[str] = field(default_factory=set)
    dawn_ms: float = 0.0  # Dawn's time on the submits this entry point ended


class DawnReplay:
    """One per pytest process: the worker, the numbers per kernel, and the terminal summary (a pytest plugin)."""

    def __init__(self, worker: DawnWorker | None, unavailable: str | None = None):
        self.worker = worker
        self.unavailable = unavailable
        self.numbers: dict[str, KernelNumbers] = {}
        self.skipped: Counter[str] = Counter()
        self.submits = 0
        self.covered_submits = 0  # submits whose every pipeline an earlier replay had covered
        self.dispatched: dict[tuple, str] = {}  # pipeline_key -> label, of every submit planned
        self.replayed: set[tuple] = set()
        self.f16_only: set[tuple] = set()  # dispatched in submits Dawn cannot run for want of shader-f16
        self.dawn_ms = 0.0
        self.wall_s = 0.0
        self._sources: dict[str, str] = {}
        # Replays every submit (the lane's own tests), or only those with a pipeline not replayed yet (the
        # kernel tests under DOPPLER_DAWN_REPLAY=1, whose dispatched pipelines must all end up replayed).
        self.recorder_class = type("DawnReplayRecorder", (ReplayRecorder,), {"replay": self})
        self.new_pipelines_recorder_class = type(
            "DawnNewPipelinesRecorder", (ReplayRecorder,), {"replay": self, "every_submit": False}
        )

    # -- planning (before the wgpu submit) ------------------------------------------------------------
    def plan(self, registry: KernelRegistry, steps: list, every_submit: bool = True) -> ReplayPlan:
        kernels = [s.bound.kernel for s in steps if isinstance(s, _Dispatch)]
        keys = {pipeline_key(k): kernel_label(k) for k in kernels}
        if not every_submit:
            self.dispatched.update(keys)
            if self.replayed.issuperset(keys):
                self.covered_submits += 1
                return ReplayPlan({}, [], kernels, "covered")
        extents: dict[int, _Extent] = {}
        for step in steps:
            for buffer, offset, nbytes in _touched(step):
                _extend(extents, buffer, offset, nbytes)
        total = sum(e.hi - e.lo for e in extents.values())
        if total > MAX_REPLAY_BYTES:
            return ReplayPlan({}, [], kernels, f"over {MAX_REPLAY_BYTES >> 20} MiB of buffers")
        needs_f16 = any(_ENABLE_F16_RE.search(self._source(registry, k.name)) for k in kernels)
        if needs_f16 and "shader-f16" not in self.worker.adapters["vulkan"].features:
            self.f16_only.update(keys)
            return ReplayPlan({}, [], kernels, "needs shader-f16, which the Dawn adapter lacks (Tint-validated only)")

        queue = registry.gpu.queue
        buffers = {
            e.key: {"size": e.hi - e.lo, "data": b64(queue.read_buffer(e.buffer, e.lo, e.hi - e.lo))}
            for e in extents.values()
        }
        modules: dict[str, str] = {}
        pipelines: dict[str, dict] = {}
        written: dict[tuple, _Written] = {}
        job_steps = []
        for step in steps:
            if isinstance(step, _Copy):
                src, dst = extents[id(step.src.buffer)], extents[id(step.dst.buffer)]
                copy = {
                    "src": src.key,
                    "src_offset": step.src.offset + step.src_offset - src.lo,
                    "dst": dst.key,
                    "dst_offset": step.dst.offset + step.dst_offset - dst.lo,
                    "size": step.nbytes,
                }
                job_steps.append({"copy": copy})
                _note_write(written, dst, step.dst, "copy destination", None)
                continue
            kernel = step.bound.kernel
            modules.setdefault(kernel.name, self._source(registry, kernel.name))
            pipeline = kernel_label(kernel)
            pipelines.setdefault(
                pipeline, pipeline_spec(kernel.name, kernel.entry, portable_constants(kernel), kernel.bindings)
            )
            bind, uniform = [], None
            for b in kernel.bindings:
                if b.kind == "uniform":
                    slot = step.bound.params
                    data = slot.arena.host[slot.offset : slot.offset + slot.layout.size]
                    uniform = {"binding": b.index, "data": b64(data.tobytes())}
                    continue
                tensor = step.bound.resources[b.name]
                extent = extents[id(tensor.buffer)]
                bind.append(
                    {
                        "binding": b.index,
                        "buffer": extent.key,
                        "offset": tensor.offset - extent.lo,
                        "size": tensor.binding_size,
                    }
                )
                if b.kind == "storage":
                    _note_write(written, extent, tensor, b.name, kernel)
            job_steps.append(
                {"dispatch": pipeline, "workgroups": list(step.workgroups), "bind": bind, "uniform": uniform}
            )
        job = {
            "adapter": "vulkan",
            "modules": modules,
            "pipelines": pipelines,
            "buffers": buffers,
            "steps": job_steps,
            "read": sorted({w.extent.key for w in written.values()}),
        }
        return ReplayPlan(job, list(written.values()), kernels)

    def _source(self, registry: KernelRegistry, name: str) -> str:
        if name not in self._sources:
            self._sources[name] = registry.source(name)  # as written: Tint needs `enable subgroups;`
        return self._sources[name]

    # -- checking (after the wgpu submit) -------------------------------------------------------------
    def check(self, registry: KernelRegistry, plan: ReplayPlan) -> None:
        if plan.skip == "covered":
            return
        if plan.skip:
            for kernel in {f"{k.name}.{k.entry}" for k in plan.kernels}:
                self.skipped[f"{kernel}: {plan.skip}"] += 1
            return
        started = time.perf_counter()
        result = self.worker.run(plan.job)
        self.submits += 1
        self.dawn_ms += result.ms
        names = ", ".join(dict.fromkeys(kernel_label(k) for k in plan.kernels))
        if not result.ok:
            raise AssertionError(f"Dawn rejected the dispatches of {names}:\n{result.describe()}")
        if plan.kernels:
            self._numbers(plan.kernels[-1]).dawn_ms += result.ms
        failures = []
        for region in compare_written(registry, plan, result.buffers):
            self._record(region.writer, region.difference, region.tolerance)
            if not region.difference.ok:
                failures.append(region.describe())
        self.wall_s += time.perf_counter() - started
        if failures:
            adapter = self.worker.adapters["vulkan"].description
            raise AssertionError(f"Dawn ({adapter}) and wgpu-py disagree:\n" + "\n".join(failures))
        self.replayed.update(pipeline_key(k) for k in plan.kernels)

    def never_replayed(self) -> list[str]:
        """Labels of the pipelines dispatched in a planned submit that no replay covered (shader-f16 ones that
        the Dawn adapter cannot run excepted)."""
        missing = set(self.dispatched) - self.replayed - self.f16_only
        return sorted(self.dispatched[key] for key in missing)

    def _numbers(self, kernel: Kernel | None, tolerance: Tolerance | None = None) -> KernelNumbers:
        key = f"{kernel.name}.{kernel.entry}" if kernel else "copy"
        if key not in self.numbers:
            self.numbers[key] = KernelNumbers(tolerance or (tolerance_for(kernel) if kernel else DEFAULT_TOLERANCE))
        return self.numbers[key]

    def _record(self, kernel: Kernel | None, difference: Difference, tolerance: Tolerance) -> None:
        numbers = self._numbers(kernel, tolerance)
        variant = variant_label(kernel) if kernel else ""
        numbers.variants.add(variant)
        numbers.compared += 1
        numbers.max_abs = max(numbers.max_abs, difference.max_abs)
        ratio = difference.max_abs / difference.limit if difference.limit else (0.0 if difference.ok else float("inf"))
        if numbers.compared == 1 or ratio > numbers.worst_ratio:
            numbers.worst_ratio, numbers.worst_variant = ratio, variant

    # -- pytest plugin hook ---------------------------------------------------------------------------
    def pytest_terminal_summary(self, terminalreporter) -> None:
        write = terminalreporter.write_line
        terminalreporter.write_sep("=", "Dawn replay vs wgpu-py")
        if self.unavailable:
            write(f"Dawn replay was requested but is unavailable: {self.unavailable}")
            return
        adapter = self.worker.adapters["vulkan"].description if self.worker else "?"
        write(
            f"adapter: {adapter}; {len(self.replayed)} distinct pipelines replayed in {self.submits} submits "
            f"({self.wall_s:.2f} s); {self.covered_submits} submits used only pipelines replayed before"
        )
        write(f"(Dawn's own time {self.dawn_ms / 1e3:.2f} s; the rest is snapshots, readbacks and JSON)")
        if self.numbers:
            width = max(len("kernel"), *(len(k) for k in self.numbers))
            write(
                f"{'kernel':<{width}}  variants  compared  max|dawn-wgpu|  worst diff/allowed  tolerance  Dawn s"
                "  worst variant"
            )
            for label in sorted(self.numbers):
                n = self.numbers[label]
                counts = f"{len(n.variants):>8}  {n.compared:>8}"
                write(
                    f"{label:<{width}}  {counts}  {n.max_abs:>14.3e}  {n.worst_ratio:>18.3f}"
                    f"  {n.tolerance.rel:>9g}  {n.dawn_ms / 1e3:6.2f}  {n.worst_variant or '-'}"
                )
        for reason, count in sorted(self.skipped.items()):
            write(f"submits not replayed ×{count}: {reason}")
        f16_only = sorted(self.dispatched[key] for key in self.f16_only - self.replayed)
        if f16_only:
            write(f"{len(f16_only)} shader-f16 pipelines validated by Tint only: {', '.join(f16_only)}")
        missing = self.never_replayed()
        if missing:
            terminalreporter.write_line(
                f"FAILED: {len(missing)} pipelines were dispatched but never replayed: {', '.join(missing)}", red=True
            )

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        if self.worker is not None and self.never_replayed() and exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


@dataclass(frozen=True)
class RegionDifference:
    """One written region of a replayed submit: who wrote it, and how far the other driver's bytes are from wgpu's."""

    region: _Written
    writer: Kernel | None  # the last kernel that wrote it; None for a region only copies wrote
    tolerance: Tolerance
    difference: Difference
    expected: np.ndarray  # wgpu's values
    actual: np.ndarray  # the other driver's values

    @property
    def label(self) -> str:
        return kernel_label(self.writer) if self.writer else "copy"

    def describe(self, other: str = "dawn") -> str:
        tensor, i = self.region.tensor, self.difference.worst
        return (
            f"{self.label}: buffer {self.region.what!r} ({tensor.dtype}{list(tensor.shape)}) max |{other} - wgpu| = "
            f"{self.difference.max_abs:.3e} > allowed {self.difference.limit:.3e}; "
            f"worst at flat index {i}: wgpu {self.expected[i]!r}, {other} {self.actual[i]!r}"
        )


def compare_written(registry: KernelRegistry, plan: ReplayPlan, buffers: dict[str, bytes]) -> list[RegionDifference]:
    """Compare every region `plan`'s dispatches wrote, as wgpu left it, with `buffers` (the job's "read" buffers
    as another WebGPU implementation returned them: the Dawn worker, or a browser page)."""
    regions = []
    for region in plan.written:
        tensor = region.tensor
        dtype = DTYPES[tensor.dtype]
        wgpu_bytes = registry.gpu.queue.read_buffer(tensor.buffer, tensor.offset, tensor.binding_size)
        start = region.offset
        other_bytes = buffers[region.extent.key][start : start + tensor.binding_size]
        expected = np.frombuffer(wgpu_bytes, dtype=dtype, count=tensor.numel)
        actual = np.frombuffer(other_bytes, dtype=dtype, count=tensor.numel)
        # A region several kernels wrote gets the loosest of their tolerances; a copy destination may hold
        # any kernel's output, so it gets the loosest of the submit's.
        tolerance = _loosest(tolerance_for(k) for k in (region.writers or plan.kernels))
        difference = compare(tensor.dtype, expected, actual, tolerance)
        writer = region.writers[-1] if region.writers else None
        regions.append(RegionDifference(region, writer, tolerance, difference, expected, actual))
    return regions


@dataclass
class _Dispatch:
    bound: Bound
    workgroups: tuple[int, int, int]


@dataclass
class _Copy:
    src: Tensor
    dst: Tensor
    nbytes: int
    src_offset: int
    dst_offset: int


def _touched(step: _Dispatch | _Copy) -> list[tuple[object, int, int]]:
    """(buffer, offset, bytes) of each region a step reads or writes."""
    if isinstance(step, _Copy):
        src, dst = step.src, step.dst
        # The whole destination tensor is mirrored, since that is what gets compared afterwards.
        return [
            (src.buffer, src.offset + step.src_offset, step.nbytes),
            (dst.buffer, dst.offset + step.dst_offset, step.nbytes),
            (dst.buffer, dst.offset, dst.binding_size),
        ]
    return [(t.buffer, t.offset, t.binding_size) for t in step.bound.resources.values()]


def _extend(extents: dict[int, _Extent], buffer, offset: int, nbytes: int) -> None:
    lo = offset // _STORAGE_ALIGN * _STORAGE_ALIGN  # keeps every rebased binding offset aligned
    hi = min(int(buffer.size), (offset + nbytes + 3) // 4 * 4)
    extent = extents.get(id(buffer))
    if extent is None:
        extents[id(buffer)] = _Extent(f"b{len(extents)}", buffer, lo, hi)
    else:
        extent.lo, extent.hi = min(extent.lo, lo), max(extent.hi, hi)


def _note_write(written: dict, extent: _Extent, tensor: Tensor, what: str, kernel: Kernel | None) -> None:
    key = (id(tensor.buffer), tensor.offset, tensor.nbytes, tensor.dtype)
    region = written.setdefault(key, _Written(extent, tensor.offset - extent.lo, tensor, what))
    if kernel is not None:
        region.writers.append(kernel)


class ReplayRecorder(Recorder):
    """A `Recorder` that keeps its steps and has them replayed and checked under Dawn on `submit()`."""

    replay: DawnReplay  # set on the subclasses `DawnReplay.recorder_class` and `.new_pipelines_recorder_class`
    every_submit = True

    def __init__(self, registry: KernelRegistry):
        super().__init__(registry)
        self.steps: list[_Dispatch | _Copy] = []

    def dispatch(self, bound: Bound, x: int, y: int = 1, z: int = 1) -> Bound | None:
        dispatched = super().dispatch(bound, x, y, z)
        if dispatched is not None:
            self.steps.append(_Dispatch(dispatched, (x, y, z)))
        return dispatched

    def copy(
        self, src: Tensor, dst: Tensor, nbytes: int | None = None, *, src_offset: int = 0, dst_offset: int = 0
    ) -> None:
        super().copy(src, dst, nbytes, src_offset=src_offset, dst_offset=dst_offset)
        size = nbytes if nbytes is not None else src.binding_size
        self.steps.append(_Copy(src, dst, size, src_offset, dst_offset))

    def plan(self) -> ReplayPlan:
        return self.replay.plan(self.registry, self.steps, self.every_submit)

    def submit(self) -> None:
        if not self.steps:
            super().submit()
            return
        plan = self.plan()
        super().submit()
        self.replay.check(self.registry, plan)


_shared: dict[str, DawnReplay] = {}


def shared_replay(config: pytest.Config) -> DawnReplay:
    """The process-wide replay, registered as a plugin so its summary ends the pytest run."""
    if "replay" not in _shared:
        try:
            worker = shared_worker()
            if "vulkan" not in worker.adapters:
                raise DawnUnavailable(
                    "Dawn found no Vulkan adapter (is Debian's chromium, with SwiftShader, installed?)"
                )
            replay = DawnReplay(worker)
        except DawnUnavailable as exc:
            replay = DawnReplay(None, str(exc))
        config.pluginmanager.register(replay, "doppler-dawn-replay")
        _shared["replay"] = replay
    return _shared["replay"]


def replaying_recorder(config: pytest.Config) -> type[Recorder] | None:
    """The recorder class that replays each submit with a new pipeline under Dawn; None without Dawn (a failure
    under CI=true)."""
    replay = shared_replay(config)
    if replay.unavailable:
        if in_ci():
            pytest.fail(
                f"DOPPLER_DAWN_REPLAY=1 under CI=true but Dawn is unavailable: {replay.unavailable}", pytrace=False
            )
        return None
    return replay.new_pipelines_recorder_class
