"""The adapter's limit: how many bytes per second it streams from a storage buffer, and how many weight bytes a
decode step reads, so decode's speed can be set against it (tools/bench_bandwidth.py, `doppler-py info
--bandwidth`).

The streaming rate is measured with shaders/stream_read.wgsl (doppler_py/ops/stream_read.py) over one buffer of
`stream_bytes(gpu)`: 256 MiB or the device's max storage binding, whichever is smaller, so more than a CPU's or a
GPU's last-level cache. For each load type the matmuls use (f32 / vec4<f32>, u32 / vec4<u32>) it sweeps the
shapes in `SHAPES` (pattern, workgroup size, loads per iteration, bytes per invocation: 1 KiB per invocation gives
a GPU thousands of workgroups, 16 KiB gives a CPU adapter long runs per lane), one timed read each, then times the
best `FINALISTS` per load `rounds` more times, interleaved, and keeps the median. A read is timed by the wall
clock from submit to the end of a wait for the queue, after a warm-up read that also compiles the pipeline; one
submit holds enough dispatches to last `MIN_SUBMIT_S` (one on a CPU adapter, many on a GPU). Each warm-up read's
sums are checked: the buffer holds 1.0 everywhere, so the f32 sums add up to its length and the u32 ones to its
length times 0x3F800000 (mod 2^32): a kernel that skipped or repeated loads would fail the measurement.

A measurement is cached per adapter (its summary: name, driver, features, limits), host (CPU count, lavapipe's
thread count and vector width) and kernel source, in `cache_dir("stream-rate")`; `doppler-py info` shows the
cached figure and measures only when asked.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from doppler_py.errors import InternalError
from doppler_py.gpu.device import Gpu
from doppler_py.gpu.kernels import KernelRegistry
from doppler_py.gpu.tensor import Tensor
from doppler_py.gpu.wgsl import SHADER_DIR
from doppler_py.ops.stream_read import LOADS, StreamRead, min_per_invocation
from doppler_py.paths import cache_dir

if TYPE_CHECKING:
    from doppler_py.model.loader import ModelWeights

MAX_STREAM_BYTES = 256 << 20
MIN_SUBMIT_S = 0.02  # a timed submit lasts at least this long, so its fixed cost is a small part of it
FINALISTS = 2  # shapes per load timed again `rounds` times
ONE_BITS = 0x3F800000  # 1.0f: what every word of the streamed buffer holds


@dataclass(frozen=True)
class StreamShape:
    """How the kernel reads: load type, pattern, workgroup size, loads per iteration and bytes per invocation
    (rounded to whole elements, and raised where the grid would need more than the device's workgroups)."""

    load: str
    pattern: str
    workgroup_size: int
    unroll: int
    bytes_per_invocation: int

    def label(self) -> str:
        return (
            f"{self.pattern}, workgroup {self.workgroup_size}, {self.unroll} per iteration, "
            f"{_size(self.bytes_per_invocation)} per invocation"
        )


SHAPES: tuple[StreamShape, ...] = tuple(
    StreamShape(load, pattern, size, unroll, per_invocation)
    for load, pattern, size, unroll, per_invocation in itertools.product(
        LOADS, ("contiguous", "interleaved"), (16, 64, 256), (1, 4), (1 << 10, 16 << 10)
    )
)


@dataclass
class StreamRate:
    """One shape's measurement: bytes read per timed submit and the seconds each submit took."""

    shape: StreamShape
    nbytes: int
    seconds: list[float]

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / statistics.median(self.seconds)

    def record(self) -> dict:
        return asdict(self.shape) | {"bytes_per_s": self.bytes_per_s, "label": self.shape.label()}


def stream_bytes(gpu: Gpu) -> int:
    """The streamed buffer's size: 256 MiB or the device's largest storage binding or buffer, a multiple of 64 KiB."""
    limit = min(MAX_STREAM_BYTES, gpu.max_binding_bytes, int(gpu.limits["max-buffer-size"]))
    return limit // (64 << 10) * (64 << 10)


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


class StreamReader:
    """One shape's op over the shared buffer, timed by wall clock around submit + wait."""

    def __init__(self, registry: KernelRegistry, src: Tensor, shape: StreamShape):
        load = LOADS[shape.load]
        elements = src.nbytes // load.element_bytes
        per_invocation = max(
            shape.bytes_per_invocation // load.element_bytes,
            min_per_invocation(elements, shape.workgroup_size, registry.max_workgroups),
        )
        view = src.view((src.numel,), load.dtype)
        self.gpu = registry.gpu
        self.registry = registry
        self.shape = shape
        self.op = StreamRead(
            registry,
            view,
            shape.load,
            workgroup_size=shape.workgroup_size,
            pattern=shape.pattern,
            per_invocation=per_invocation,
            unroll=shape.unroll,
        )
        self.dispatches = 1

    def time(self) -> float:
        rec = self.registry.recorder()
        for _ in range(self.dispatches):
            self.op.record(rec)
        start = time.perf_counter()
        rec.submit()
        self.gpu.wait_idle()
        return time.perf_counter() - start

    def warm_up(self) -> float:
        """One read (compiling the pipeline), checked; then as many dispatches per submit as last MIN_SUBMIT_S.
        Returns the seconds per dispatch of one timed submit with that many."""
        self.time()
        partials = self.op.partials()
        words = self.op.elements * self.op.load.lanes
        if self.op.load.out == "sums":
            total, expected = float(partials.sum(dtype=np.float64)), float(words)
        else:
            total, expected = int(partials.sum(dtype=np.uint64)) % 2**32, words * ONE_BITS % 2**32
        if total != expected:
            raise InternalError(
                f"stream_read ({self.shape.load}, {self.shape.label()}) summed {total} over a buffer whose sum is "
                f"{expected}: the kernel did not read every element exactly once on this adapter"
            )
        once = self.time()
        self.dispatches = max(1, min(64, math.ceil(MIN_SUBMIT_S / max(once, 1e-6))))
        return once if self.dispatches == 1 else self.time() / self.dispatches

    def rate(self, seconds: list[float]) -> StreamRate:
        return StreamRate(self.shape, self.dispatches * self.op.nbytes, seconds)


class StreamProbe:
    """The streamed buffer (1.0 in every word) and one reader per shape over it; `close` frees them."""

    def __init__(self, gpu: Gpu, shapes: tuple[StreamShape, ...] | list[StreamShape], nbytes: int | None = None):
        self.nbytes = nbytes or stream_bytes(gpu)
        if self.nbytes % 16 or self.nbytes <= 0:
            raise ValueError(f"the streamed buffer must be a whole number of vec4s, got {self.nbytes} bytes")
        self.registry = KernelRegistry(gpu)
        try:
            src = Tensor.empty(gpu, self.nbytes // 4, "u32", label="stream_read source")
            src.write(np.full(self.nbytes // 4, ONE_BITS, np.uint32))
            self.readers = [StreamReader(self.registry, src, shape) for shape in shapes]
        except BaseException:
            self.registry.close()
            raise

    def time_rounds(self, readers: list[StreamReader], rounds: int) -> list[StreamRate]:
        """`rounds` timed submits of each reader, the readers taking turns round by round."""
        seconds: dict[int, list[float]] = {id(r): [] for r in readers}
        for _ in range(rounds):
            for reader in readers:
                seconds[id(reader)].append(reader.time())
        return [reader.rate(seconds[id(reader)]) for reader in readers]

    def close(self) -> None:
        self.registry.close()  # destroys the source and every op's buffers


def measure_stream_rates(
    gpu: Gpu,
    *,
    nbytes: int | None = None,
    shapes: tuple[StreamShape, ...] = SHAPES,
    rounds: int = 5,
    finalists: int = FINALISTS,
    log=None,
) -> list[StreamRate]:
    """Every finalist's measurement (`finalists` best shapes per load after one timed read of each shape), best
    first. `nbytes` defaults to `stream_bytes(gpu)`."""
    probe = StreamProbe(gpu, shapes, nbytes)
    try:
        first: dict[str, list[tuple[float, StreamReader]]] = {}
        for reader in probe.readers:
            first.setdefault(reader.shape.load, []).append((reader.warm_up(), reader))
        chosen = [
            reader for timed in first.values() for _, reader in sorted(timed, key=lambda pair: pair[0])[:finalists]
        ]
        if log:
            swept = f"swept {len(probe.readers)} shapes over {_size(probe.nbytes)}"
            log(f"{swept}; timing {len(chosen)} finalists {rounds} times")
        rates = probe.time_rounds(chosen, rounds)
    finally:
        probe.close()
    return sorted(rates, key=lambda r: -r.bytes_per_s)


def best_per_load(rates: list[StreamRate]) -> dict[str, StreamRate]:
    best: dict[str, StreamRate] = {}
    for rate in rates:
        if rate.shape.load not in best or rate.bytes_per_s > best[rate.shape.load].bytes_per_s:
            best[rate.shape.load] = rate
    return best


def stream_report(gpu: Gpu, rates: list[StreamRate], nbytes: int) -> dict:
    """What is cached and shown: the best rate overall and per load, with their shapes."""
    per_load = best_per_load(rates)
    best = max(per_load.values(), key=lambda r: r.bytes_per_s)
    return {
        "adapter": gpu.name,
        "buffer_bytes": nbytes,
        "bytes_per_s": best.bytes_per_s,
        "best": best.record(),
        "per_load": {load: rate.record() for load, rate in per_load.items()},
        "finalists": [rate.record() for rate in sorted(rates, key=lambda r: -r.bytes_per_s)],
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


# --- the cache ------------------------------------------------------------------------------------------------
def _cache_key(gpu: Gpu, nbytes: int) -> dict:
    return json.loads(
        json.dumps(
            {
                "gpu": gpu.summary(),
                "cpus": os.cpu_count(),
                "lavapipe": [os.environ.get("LP_NUM_THREADS"), os.environ.get("LP_NATIVE_VECTOR_WIDTH")],
                "kernel": hashlib.sha256((SHADER_DIR / "stream_read.wgsl").read_bytes()).hexdigest(),
                "buffer_bytes": nbytes,
            }
        )
    )


def _cache_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return cache_dir("stream-rate") / f"{digest[:32]}.json"


def cached_stream_rate(gpu: Gpu) -> dict | None:
    """The last measurement on this adapter and host with the default buffer, or None."""
    key = _cache_key(gpu, stream_bytes(gpu))
    try:
        record = json.loads(_cache_path(key).read_text())
        if record["key"] != key or not record["report"]["bytes_per_s"] > 0:
            return None
        return record["report"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_stream_rate(gpu: Gpu, report: dict) -> None:
    """Cache `report` (a `stream_report` over `stream_bytes(gpu)`, every load) as this adapter's figure."""
    key = _cache_key(gpu, report["buffer_bytes"])
    _cache_path(key).write_text(json.dumps({"key": key, "report": report}, indent=1))


def measure_stream_rate(gpu: Gpu, *, rounds: int = 5, log=None) -> dict:
    """Measure with the default buffer and shapes, cache the report for this adapter and return it."""
    nbytes = stream_bytes(gpu)
    report = stream_report(gpu, measure_stream_rates(gpu, nbytes=nbytes, rounds=rounds, log=log), nbytes)
    save_stream_rate(gpu, report)
    return report


def format_rate(report: dict) -> str:
    best = report["best"]
    return (
        f"{report['bytes_per_s'] / 1e9:.2f} GB/s ({best['load']} loads, {best['label']}; "
        f"measured {report['measured_at']} over {_size(report['buffer_bytes'])})"
    )


# --- what decode reads ----------------------------------------------------------------------------------------
def decode_weight_bytes(weights: ModelWeights) -> dict[str, int]:
    """Weight bytes one decode step (T = 1) reads, as stored on the GPU (block scales and the zero rows padding
    each part to 8 rows included): every layer matrix, the LM head in full, and one row of the token embedding
    (and of Gemma 4's per-layer embedding) for the token fed in. Norm gains and biases (a few KiB) and the KV
    cache are not weights streamed per token and are left out."""
    layers = sum(w.nbytes for layer in weights.layers for w in layer.matrices())
    extra = weights.per_layer_projection.nbytes if weights.per_layer_projection is not None else 0
    rows = weights.embed.nbytes // weights.embed.shape[0]
    if weights.per_layer_embed is not None:
        rows += weights.per_layer_embed.nbytes // weights.per_layer_embed.shape[0]
    head = weights.lm_head.nbytes
    return {"layers": layers + extra, "lm_head": head, "embedding_rows": rows, "total": layers + extra + head + rows}
