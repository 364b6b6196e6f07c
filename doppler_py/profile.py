"""Where a step's time goes: GPU time per kernel and the host/GPU split per step (`doppler-py profile`).

A profile runs one prompt's prefill, `steps` decode steps (T = 1) and a few verify-sized forwards (T = rows,
logits for every row: what a speculative step with rows - 1 drafts verifies) twice:

1. with the ordinary recorder: host ms to record + submit a step (the GPU is awaited after the timed span, as
   tools/bench_host.py does), GPU ms between two stamps around the step, wall ms to the step's small readback;
2. with `ProfilingRecorder`, which runs every dispatch in its own compute pass stamped at its start and end
   (WebGPU stamps only at pass boundaries): GPU time per kernel. One pass per dispatch adds pass boundaries,
   so the kernels' sum is set against the stamped span of the same profiled step, not the ordinary one.

GPU figures need the adapter's `timestamp-query` feature; without it only host and wall times are reported.
Stamps are taken as nanoseconds (what WebGPU specifies); a step whose stamps go backwards or span more than
its own wall time makes that phase's GPU figures unavailable, with the reason, rather than wrong.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from doppler_py.errors import CapacityError, GenerationOptionError, InternalError
from doppler_py.gpu.device import Gpu
from doppler_py.gpu.kernels import Bound, KernelRegistry
from doppler_py.gpu.recorder import Recorder
from doppler_py.gpu.weights import FORMATS

PROMPT = "Name three rivers and say which one is the longest."
MAX_QUERIES = 4096  # WebGPU's largest timestamp query set: 2048 stamped dispatches per step
# Override constants that describe the device, not the work: left out of kernel labels.
_DEVICE_CONSTANTS = frozenset({"SIMD_LANES", "SUBGROUP_MIN", "WORKGROUP_SIZE", "COLS"})
NO_TIMESTAMPS = "the adapter has no timestamp-query feature: GPU time is not measured, only host and wall time"


# --- GPU stamps ------------------------------------------------------------------------------------------------
class QueryStamps:
    """A timestamp query set and the buffer it resolves into (both freed by `close`)."""

    def __init__(self, gpu: Gpu, count: int = MAX_QUERIES):
        self.gpu = gpu
        self.count = count
        self.query_set = gpu.device.create_query_set(type="timestamp", count=count, label="profile stamps")
        self.resolved = gpu.device.create_buffer(
            size=8 * count,
            usage=gpu.api.BufferUsage.QUERY_RESOLVE | gpu.api.BufferUsage.COPY_SRC,
            label="profile stamps",
        )

    def read(self, count: int) -> np.ndarray:
        """Stamps 0..count-1 in nanoseconds (waits for the GPU)."""
        raw = self.gpu.queue.read_buffer(self.resolved, 0, 8 * count)
        return np.frombuffer(raw, np.uint64).astype(np.int64)

    def close(self) -> None:
        self.query_set.destroy()
        self.resolved.destroy()


def stamp_problem(stamps: np.ndarray, wall_s: float) -> str | None:
    """Why (begin, end) stamp pairs in recording order cannot be trusted as one step's nanoseconds, or None."""
    begins, ends = stamps[0::2], stamps[1::2]
    if np.any(ends < begins) or np.any(np.diff(begins) < 0):
        return "the adapter's stamps go backwards"
    span_s = (ends.max() - begins.min()) * 1e-9
    if span_s > wall_s * 1.05 + 1e-3:  # the GPU cannot have worked longer than the host waited for it
        return f"the adapter's stamps span {span_s * 1e3:.1f} ms, more than the step's {wall_s * 1e3:.1f} ms wall time"
    if ends.max() == begins.min():
        return "the adapter's stamps do not advance"
    return None


# --- the profiling recorder ------------------------------------------------------------------------------------
def kernel_label(bound: Bound) -> str:
    """What a dispatch runs: shader.entry, its work-describing override constants, and a matmul's N×K."""
    kernel = bound.kernel
    parts = [f"{kernel.name}.{kernel.entry}"]
    for key, value in kernel.constants:
        if key in _DEVICE_CONSTANTS or value is False:
            continue
        if key == "FORMAT":
            parts.append(FORMATS[int(value)])
        elif value is True:
            parts.append(key)
        else:
            parts.append(f"{key}={int(value) if float(value).is_integer() else value}")
    if bound.params is not None:
        # Matmuls share one kernel for every weight; the weight's shape tells the LM head from the MLP.
        fields = bound.params.values()
        n = fields.get("n_total", fields.get("n"))
        if n is not None and "k" in fields:
            parts.append(f"{int(n)}x{int(fields['k'])}")
    return " ".join(parts)


class ProfilingRecorder(Recorder):
    """A `Recorder` that runs each dispatch in its own compute pass, stamped at the pass's start and end.

    `submit()` resolves the stamps and reads them back (it waits for the GPU): after it, `labels[i]` and
    `times_ns[i]` = (begin, end) describe dispatch i. Use `profiling_recorder(stamps)` for a class to install
    as `KernelRegistry.recorder_class`.
    """

    stamps: QueryStamps  # set on the subclass `profiling_recorder` makes

    def __init__(self, registry: KernelRegistry):
        super().__init__(registry)
        self.labels: list[str] = []
        self.times_ns = np.zeros((0, 2), np.int64)

    def dispatch(self, bound: Bound, x: int, y: int = 1, z: int = 1) -> Bound | None:
        limit = self._max_workgroups
        if not (0 < x <= limit and 0 < y <= limit and 0 < z <= limit):
            return super().dispatch(bound, x, y, z)  # the ordinary recorder refuses these or records nothing
        if self.phase:
            raise InternalError("the profiler stamps single forwards: it records no phased (batched) submits")
        # The ordinary recorder's check that a uniform slot is not reused with other values is not repeated:
        # profiled steps record the same forwards the ordinary recorder has already run.
        index = len(self.labels)
        if 2 * index + 2 > self.stamps.count:
            raise CapacityError(f"a profiled step may stamp at most {self.stamps.count // 2} dispatches")
        self._end_pass()
        stamped = self.encoder.begin_compute_pass(
            timestamp_writes={
                "query_set": self.stamps.query_set,
                "beginning_of_pass_write_index": 2 * index,
                "end_of_pass_write_index": 2 * index + 1,
            }
        )
        stamped.set_pipeline(bound.kernel.pipeline)
        stamped.set_bind_group(0, bound.bind_group)
        stamped.dispatch_workgroups(x, y, z)
        stamped.end()
        self.labels.append(kernel_label(bound))
        self.dispatches += 1
        return bound

    def submit(self) -> None:
        count = 2 * len(self.labels)
        if count:
            self.resolve_timestamps(self.stamps.query_set, count, self.stamps.resolved)
        super().submit()
        if count:
            self.times_ns = self.stamps.read(count).reshape(-1, 2)


def profiling_recorder(stamps: QueryStamps) -> type[ProfilingRecorder]:
    return type("BoundProfilingRecorder", (ProfilingRecorder,), {"stamps": stamps})


@contextmanager
def recording_with(registry: KernelRegistry, recorder_class: type[Recorder]) -> Iterator[None]:
    """Every recorder `registry` makes inside the block is a `recorder_class`; the previous class after it."""
    previous = registry.recorder_class
    registry.recorder_class = recorder_class
    try:
        yield
    finally:
        registry.recorder_class = previous


# --- steps -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Phase:
    name: str
    rows: int  # tokens per forward
    logits: str  # "last" or "all"
    positions: tuple[int, ...]  # start position of each step
    ids: tuple[int, ...]  # the ids every step of the phase feeds


@dataclass
class StepSample:
    host_s: float  # record + submit
    wall_s: float  # record + submit + GPU + readback
    dispatches: int
    gpu_s: float | None = None  # between the stamps around the step
    problem: str | None = None  # why the stamps were not used
    kernels: list[tuple[str, float]] | None = None  # profiled steps: (label, seconds) per dispatch


def plan_phases(prompt: Sequence[int], steps: int, rows: int) -> list[Phase]:
    """Prefill at 0 (a few times); decode steps after the prompt; verify forwards after those, each at the same
    position (as a speculative step whose drafts were all rejected)."""
    p = len(prompt)
    cycle = [prompt[i % p] for i in range(max(p, rows))]
    return [
        Phase("prefill", p, "last", (0,) * max(3, steps // 8), tuple(prompt)),
        Phase("decode", 1, "last", tuple(range(p, p + steps)), (prompt[-1],)),
        Phase(f"verify T={rows}", rows, "all", (p + steps,) * max(1, steps // 4), tuple(cycle[:rows])),
    ]


def run_step(model, cache, phase: Phase, pos: int, stamps: QueryStamps | None) -> StepSample:
    """One forward of `phase` at `pos`, timed; `stamps` (ordinary recorder only) adds a stamp pair around it."""
    if cache.length > pos:
        cache.truncate(pos)
    model.ids.view((phase.rows,)).write(model.check_ids(phase.ids))
    start = time.perf_counter()
    rec = model.registry.recorder()
    if stamps is not None:
        rec.write_timestamp(stamps.query_set, 0)
    model.record_forward(rec, phase.rows, cache, pos, logits=phase.logits)
    if stamps is not None:
        rec.write_timestamp(stamps.query_set, 1)
        rec.resolve_timestamps(stamps.query_set, 2, stamps.resolved)
    rec.submit()
    host = time.perf_counter() - start
    # The step's readback: 4 bytes of the logits, as small as the token ids a decoding step reads.
    model.gpu.queue.read_buffer(model.logits.buffer, model.logits.offset, 4)
    sample = StepSample(host, time.perf_counter() - start, rec.dispatches)
    if stamps is not None:
        pair = stamps.read(2)
        sample.problem = stamp_problem(pair, sample.wall_s)
        sample.gpu_s = None if sample.problem else (pair[1] - pair[0]) * 1e-9
    if isinstance(rec, ProfilingRecorder):
        sample.problem = stamp_problem(rec.times_ns.reshape(-1), sample.wall_s) if rec.labels else None
        if sample.problem is None and rec.labels:
            times = rec.times_ns
            sample.gpu_s = (times[-1, 1] - times[0, 0]) * 1e-9
            sample.kernels = [(label, (e - b) * 1e-9) for label, (b, e) in zip(rec.labels, times, strict=True)]
    return sample


def run_phases(model, cache, phases: list[Phase], step: Callable) -> list[list[StepSample]]:
    return [[step(model, cache, phase, pos) for pos in phase.positions] for phase in phases]


# --- report ----------------------------------------------------------------------------------------------------
def _median_ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1e3, 3)


def aggregate_kernels(samples: list[StepSample]) -> list[dict]:
    """Per kernel label over the profiled steps: count, total ms, share of all kernel time, mean µs; by total."""
    totals: dict[str, list[float]] = {}
    for sample in samples:
        for label, seconds in sample.kernels or ():
            totals.setdefault(label, []).append(seconds)
    grand = sum(sum(times) for times in totals.values()) or 1.0
    rows = [
        {
            "kernel": label,
            "count": len(times),
            "per_step": round(len(times) / len(samples), 2),
            "total_ms": round(sum(times) * 1e3, 4),
            "share_pct": round(100 * sum(times) / grand, 2),
            "mean_us": round(sum(times) / len(times) * 1e6, 2),
        }
        for label, times in totals.items()
    ]
    return sorted(rows, key=lambda row: -row["total_ms"])


def phase_report(phase: Phase, plain: list[StepSample], profiled: list[StepSample] | None) -> dict:
    host = _median_ms([s.host_s for s in plain])
    dispatches = plain[-1].dispatches
    report = {
        "phase": phase.name,
        "rows": phase.rows,
        "steps": len(plain),
        "dispatches": dispatches,
        "host_ms": host,
        "host_us_per_dispatch": round(host * 1e3 / max(dispatches, 1), 2),
        "wall_ms": _median_ms([s.wall_s for s in plain]),
        "gpu_ms": None,
    }
    if profiled is None:
        return report
    problems = [s.problem for s in plain + profiled if s.problem]
    if problems:
        return report | {"gpu_problem": problems[0]}
    kernels = aggregate_kernels(profiled)
    return report | {
        "gpu_ms": _median_ms([s.gpu_s for s in plain]),
        "profiled_dispatches": profiled[-1].dispatches,
        # Means, as the kernel totals are sums: per step the kernels' sum lies within the stamped span.
        "profiled_gpu_ms": round(statistics.fmean(s.gpu_s for s in profiled) * 1e3, 4),
        "kernel_ms_per_step": round(sum(row["total_ms"] for row in kernels) / len(profiled), 4),
        "kernels": kernels,
    }


def profile_model(model, prompt: Sequence[int], *, steps: int = 32, rows: int = 5) -> dict:
    """Profile `model` (a Transformer) over `prompt`'s prefill, `steps` decode steps and verify forwards of
    `rows` rows; the result is what `format_report` prints and `--json` writes."""
    check_options(steps, rows)
    prompt = list(prompt)[: model.max_rows]  # one prefill forward
    if not prompt:
        raise GenerationOptionError("the profile's prompt has no tokens")
    if rows > model.max_logit_rows:
        raise CapacityError(f"--rows {rows}: a forward returns logits for at most {model.max_logit_rows} rows")
    cache = model.new_cache()
    try:
        needed = len(prompt) + steps + rows
        if needed > cache.max_seq:
            raise CapacityError(
                f"the profile needs {needed} positions but the KV cache holds {cache.max_seq}",
                advice="use fewer --steps",
            )
        return _profile(model, cache, plan_phases(prompt, steps, rows)) | {
            "prompt_tokens": len(prompt),
            "decode_steps": steps,
            "verify_rows": rows,
        }
    finally:
        model.release_cache(cache)


def check_options(steps: int, rows: int) -> None:
    if steps < 1:
        raise GenerationOptionError(f"--steps must be at least 1, got {steps}")
    if rows < 1:
        raise GenerationOptionError(f"--rows must be at least 1, got {rows}")


def _profile(model, cache, phases: list[Phase]) -> dict:
    gpu = model.gpu
    timed = "timestamp-query" in gpu.features
    report = {
        "adapter": gpu.name,
        "backend": gpu.backend,
        "adapter_type": str(gpu.info.get("adapter_type", "")),
        "timestamps": timed,
        "note": None if timed else NO_TIMESTAMPS,
    }
    for _ in range(2):  # compiles every pipeline and bind group the timed steps use; a second round settles
        for phase in phases:
            run_step(model, cache, phase, min(phase.positions[0], cache.length), None)
    if not timed:
        plain = run_phases(model, cache, phases, lambda *a: run_step(*a, None))
        return report | {"phases": [phase_report(p, s, None) for p, s in zip(phases, plain, strict=True)]}
    stamps = QueryStamps(gpu)
    try:
        plain = run_phases(model, cache, phases, lambda *a: run_step(*a, stamps))
        with recording_with(model.registry, profiling_recorder(stamps)):
            profiled = run_phases(model, cache, phases, lambda *a: run_step(*a, None))
    finally:
        stamps.close()
    return report | {
        "phases": [phase_report(*args) for args in zip(phases, plain, profiled, strict=True)],
    }


# --- printing --------------------------------------------------------------------------------------------------
def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def format_report(report: dict) -> str:
    """The printed profile: the split per phase, a per-kernel table per phase, then one summary line."""
    lines = [
        f"adapter: {report['adapter']} ({report['adapter_type']}, {report['backend']}); "
        f"timestamps: {'yes' if report['timestamps'] else 'no'}"
    ]
    if "model" in report:
        lines.append(f"model: {report['model']} ({report['weights']}), prompt {report['prompt_tokens']} tokens")
    if report["note"]:
        lines.append(f"note: {report['note']}")
    header = ("phase", "rows", "steps", "dispatches", "host ms", "GPU ms", "wall ms", "host µs/dispatch")
    lines += ["", "{:12} {:>4} {:>5} {:>10} {:>8} {:>8} {:>8} {:>16}".format(*header)]
    for p in report["phases"]:
        lines.append(
            f"{p['phase']:12} {p['rows']:4d} {p['steps']:5d} {p['dispatches']:10d} {p['host_ms']:8.3f} "
            f"{_ms(p['gpu_ms']):>8} {p['wall_ms']:8.3f} {p['host_us_per_dispatch']:16.1f}"
        )
    for p in report["phases"]:
        lines += ["", *_kernel_table(p)]
    lines += ["", summary_line(report)]
    return "\n".join(lines)


def _kernel_table(phase: dict) -> list[str]:
    if "gpu_problem" in phase:
        return [f"{phase['phase']}: no GPU time per kernel: {phase['gpu_problem']}"]
    if "kernels" not in phase:
        return []
    width = max(len("kernel"), *(len(row["kernel"]) for row in phase["kernels"]))
    lines = [
        f"{phase['phase']}: GPU time per kernel over {phase['steps']} steps (one pass per dispatch: "
        f"{phase['profiled_gpu_ms']:.3f} ms/step, of which kernels {phase['kernel_ms_per_step']:.3f} ms)",
        f"{'kernel':{width}} {'count':>6} {'total ms':>9} {'share':>6} {'mean µs':>9}",
    ]
    for row in phase["kernels"]:
        lines.append(
            f"{row['kernel']:{width}} {row['count']:6d} {row['total_ms']:9.3f} {row['share_pct']:5.1f}% "
            f"{row['mean_us']:9.1f}"
        )
    return lines


def summary_line(report: dict) -> str:
    """One line on the decode step: host, GPU and wall ms, dispatches, and which side bounds it."""
    decode = next(p for p in report["phases"] if p["phase"] == "decode")
    line = f"decode step: host {decode['host_ms']:.3f} ms"
    if decode["gpu_ms"] is not None:
        bound = "GPU-bound" if decode["gpu_ms"] > decode["host_ms"] else "host-bound"
        line += f", GPU {decode['gpu_ms']:.3f} ms"
    else:
        bound = "GPU time not measured"
    line += f", wall {decode['wall_ms']:.3f} ms, {decode['dispatches']} dispatches ({bound})"
    if decode.get("kernels"):
        top = decode["kernels"][0]
        line += f"; top kernel {top['kernel']} {top['share_pct']:.0f}%"
    return line
