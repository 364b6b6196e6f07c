"""Time WGSL kernels on SmolLM2-135M shapes next to numpy doing the same op in the same run.

    python tools/bench_kernels.py [--json out.json] [--only lm_head mlp] [--rounds 9] [--dispatches 10]

Each measurement records many dispatches of one op into one command encoder (at least `--dispatches`, more
for small ops so that a submit lasts about `--min-ms`), submits once, waits once and divides by the count.
Ops take turns round by round (the machine may be shared: a slow spell hits every op alike) and the table
reports medians. numpy runs after the GPU ops of each round, then the script pauses, because OpenBLAS
threads keep spinning after a call and would slow the next GPU op. The per-dispatch overhead line times a
kernel that does almost nothing, the same way. GB/s counts the bytes an op must read and write (weights at
their stored size, activations in f32); numpy always multiplies by the f32 matrix.

To add a kernel, write a function returning `Op`s and list it in CASES.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

# numpy runs single-threaded unless told otherwise: on a shared machine OpenBLAS's threads spin-wait for each
# other and a GEMV then takes a scheduler time slice (measured 24 ms instead of 10 under load).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

from doppler_py.gpu.device import default_gpu
from doppler_py.gpu.kernels import KernelRegistry
from doppler_py.gpu.tensor import Tensor
from doppler_py.gpu.weights import Weight
from doppler_py.ops.embedding import Embedding
from doppler_py.ops.linear import Linear

HIDDEN, MLP, VOCAB = 576, 1536, 49152  # SmolLM2-135M (9 heads, 3 KV heads, head_dim 64)
# With OPENBLAS_NUM_THREADS > 1, its workers spin for a while after a call and would slow the next GPU op.
NUMPY_SETTLE_S = 0.3
MAX_REPEATS = 500
# Table columns (title, format width); the numeric ones print these keys of a result row.
COLUMNS = [("op", "24s"), ("kernel", "10s"), ("shape", "18s"), ("format", "6s")] + [
    (title, ">9s") for title in ("ms", "cpu ms", "GB/s", "GFLOP/s", "numpy ms", "ms/numpy")
]
NUMERIC_KEYS = ("ms", "cpu_ms", "GB/s", "GFLOP/s", "numpy_ms", "ratio")


@dataclass
class Op:
    name: str  # unique row label
    kernel: str
    shape: str
    fmt: str
    record: Callable  # record(rec): one dispatch of the op (may be several GPU dispatches for split weights)
    nbytes: int
    flops: int
    numpy: Callable[[], object]


class Bench:
    """Shared state for building cases: device, registry, seeded data, and cached weights per format."""

    def __init__(self):
        self.gpu = default_gpu()
        self.registry = KernelRegistry(self.gpu)
        self.rng = np.random.default_rng(0)
        self._matrices: dict[tuple[int, int], np.ndarray] = {}
        self._weights: dict[tuple[int, int, str], Weight] = {}
        self._sync = Tensor.empty(self.gpu, 1, label="bench sync")

    def matrix(self, n: int, k: int) -> np.ndarray:
        if (n, k) not in self._matrices:
            self._matrices[(n, k)] = (self.rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        return self._matrices[(n, k)]

    def weight(self, n: int, k: int, fmt: str) -> Weight:
        if (n, k, fmt) not in self._weights:
            self._weights[(n, k, fmt)] = Weight.from_numpy(self.gpu, self.matrix(n, k), fmt, name=f"{n}x{k}")
        return self._weights[(n, k, fmt)]

    def linear(self, name: str, n: int, k: int, fmt: str, rows: int, **kwargs) -> Op:
        weight = self.weight(n, k, fmt)
        x_host = self.rng.standard_normal((rows, k)).astype(np.float32)
        x = Tensor.from_numpy(self.gpu, x_host)
        out = Tensor.empty(self.gpu, (rows, n))
        op = Linear(self.registry, weight, x, out, max_rows=rows, **kwargs)
        w32 = self.matrix(n, k)
        numpy = (lambda: w32 @ x_host[0]) if rows == 1 else (lambda: x_host @ w32.T)
        return Op(
            name,
            "matmul",
            f"{n}x{k} T={rows}",
            fmt,
            lambda rec: op.record(rec, rows),
            weight.nbytes + 4 * rows * (n + k),
            2 * rows * n * k,
            numpy,
        )

    def time_op(self, op: Op, dispatches: int) -> tuple[float, float]:
        """(wall, process CPU) seconds per dispatch; on a CPU adapter the CPU time is the driver's work."""
        rec = self.registry.recorder()
        for _ in range(dispatches):
            op.record(rec)
        start, start_cpu = time.perf_counter(), time.process_time()
        rec.submit()
        self.gpu.queue.read_buffer(self._sync.buffer, 0, 4)  # waits for the submit
        return (time.perf_counter() - start) / dispatches, (time.process_time() - start_cpu) / dispatches


def lm_head_formats(b: Bench) -> list[Op]:
    return [b.linear(f"lm_head {fmt}", VOCAB, HIDDEN, fmt, 1) for fmt in ("f32", "f16", "q4_1", "q4_0", "q8_0")]


def lm_head_rows(b: Bench) -> list[Op]:
    return [b.linear(f"lm_head f16 T={rows}", VOCAB, HIDDEN, "f16", rows) for rows in (2, 5, 8, 16)]


def mlp(b: Bench) -> list[Op]:
    ops = []
    for fmt in ("f32", "q4_1"):
        ops.append(b.linear(f"mlp_up {fmt}", MLP, HIDDEN, fmt, 1))
        ops.append(b.linear(f"mlp_down {fmt}", HIDDEN, MLP, fmt, 1))
    return ops


def prefill(b: Bench) -> list[Op]:
    return [
        b.linear(f"prefill {fmt} {kind}", MLP, HIDDEN, fmt, 128, tiled_gemm=kind == "tiled")
        for fmt in ("f32", "q4_1")
        for kind in ("tiled", "register")
    ]


def embedding(b: Bench) -> list[Op]:
    ops = []
    for rows in (1, 128):
        table = b.weight(VOCAB, HIDDEN, "q4_1")
        ids_host = b.rng.integers(0, VOCAB, rows).astype(np.uint32)
        ids = Tensor.from_numpy(b.gpu, ids_host)
        out = Tensor.empty(b.gpu, (rows, HIDDEN))
        emb = Embedding(b.registry, table, ids, out, max_rows=rows)
        w32 = b.matrix(VOCAB, HIDDEN)
        ops.append(
            Op(
                f"embedding T={rows}",
                "embedding",
                f"{VOCAB}x{HIDDEN} T={rows}",
                "q4_1",
                lambda rec, emb=emb, rows=rows: emb.record(rec, rows),
                rows * HIDDEN * (20 / 32 + 4),
                0,
                lambda w32=w32, ids_host=ids_host: w32[ids_host],
            )
        )
    return ops


CASES: dict[str, Callable[[Bench], list[Op]]] = {
    "lm_head": lm_head_formats,
    "lm_head_rows": lm_head_rows,
    "mlp": mlp,
    "prefill": prefill,
    "embedding": embedding,
}


def dispatch_overhead(b: Bench, dispatches: int, rounds: int) -> float:
    """Seconds per dispatch of a 1 x 32 GEMV: what every dispatch costs before doing any work."""
    op = b.linear("overhead", 1, 32, "f32", 1)
    return statistics.median(b.time_op(op, dispatches * 10)[0] for _ in range(rounds))


def repeats(seconds_once: float, min_ms: float, at_least: int) -> int:
    return max(at_least, min(MAX_REPEATS, int(min_ms / 1e3 / max(seconds_once, 1e-7)) + 1))


def numpy_seconds(fn: Callable[[], object], repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def targets(rows: dict[str, dict]) -> list[dict]:
    def ms(name):
        return rows[name]["ms"] if name in rows else None

    checks = []

    def check(what, value, limit, better="<="):
        if value is not None:
            ok = value <= limit if better == "<=" else value >= limit
            checks.append({"target": what, "value": round(value, 3), "limit": limit, "met": ok})

    f32, f16, q41 = ms("lm_head f32"), ms("lm_head f16"), ms("lm_head q4_1")
    if f32:
        check("lm_head f16 / f32 time", f16 / f32 if f16 else None, 0.6)
        check("lm_head q4_1 / f32 time", q41 / f32 if q41 else None, 0.4)
        check("lm_head f32 GB/s / numpy GB/s", rows["lm_head f32"]["numpy_ms"] / f32, 0.3, ">=")
    t5 = ms("lm_head f16 T=5")
    if f16 and t5:
        check("lm_head f16 T=5 / T=1 time", t5 / f16, 1.6)
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--only", nargs="*", choices=sorted(CASES), help="case groups to run (default: all)")
    parser.add_argument("--rounds", type=int, default=9, help="measurements per op (median reported)")
    parser.add_argument("--dispatches", type=int, default=10, help="minimum dispatches per submit")
    parser.add_argument("--min-ms", type=float, default=30.0, help="target duration of one measurement")
    args = parser.parse_args(argv)

    bench = Bench()
    threads = os.environ["OPENBLAS_NUM_THREADS"]
    print(f"adapter: {bench.gpu.name} ({bench.gpu.backend}), {os.cpu_count()} CPUs; numpy threads: {threads}")
    ops = [op for group in (args.only or CASES) for op in CASES[group](bench)]
    # Warm-up (first submits pay for lazy driver work) and repeat counts sized to ~min_ms per measurement.
    gpu_reps, numpy_reps = {}, {}
    for op in ops:
        bench.time_op(op, 1)
        gpu_reps[op.name] = repeats(bench.time_op(op, 1)[0], args.min_ms, args.dispatches)
        numpy_reps[op.name] = repeats(numpy_seconds(op.numpy, 1), args.min_ms, 1)
    time.sleep(NUMPY_SETTLE_S)
    gpu_times: dict[str, list[tuple[float, float]]] = {op.name: [] for op in ops}
    numpy_times: dict[str, list[float]] = {op.name: [] for op in ops}
    for _ in range(args.rounds):
        for op in ops:
            gpu_times[op.name].append(bench.time_op(op, gpu_reps[op.name]))
        for op in ops:
            numpy_times[op.name].append(numpy_seconds(op.numpy, numpy_reps[op.name]))
        time.sleep(NUMPY_SETTLE_S)
    overhead = dispatch_overhead(bench, args.dispatches, args.rounds)

    rows = {}
    print(" ".join(f"{title:{width}}" for title, width in COLUMNS))
    for op in ops:
        seconds = statistics.median(wall for wall, _ in gpu_times[op.name])
        numpy_s = statistics.median(numpy_times[op.name])
        row = {
            "kernel": op.kernel,
            "shape": op.shape,
            "format": op.fmt,
            "ms": seconds * 1e3,
            "cpu_ms": statistics.median(cpu for _, cpu in gpu_times[op.name]) * 1e3,
            "GB/s": op.nbytes / seconds / 1e9,
            "GFLOP/s": op.flops / seconds / 1e9,
            "numpy_ms": numpy_s * 1e3,
            "ratio": seconds / numpy_s,
            "ms_all": [wall * 1e3 for wall, _ in gpu_times[op.name]],
            "dispatches_per_submit": gpu_reps[op.name],
        }
        rows[op.name] = row
        cells = [op.name, op.kernel, op.shape, op.fmt, *(f"{row[key]:.2f}" for key in NUMERIC_KEYS)]
        print(" ".join(f"{cell:{width}}" for cell, (_, width) in zip(cells, COLUMNS, strict=True)))
    print(f"per-dispatch overhead (1x32 GEMV, {args.dispatches * 10} per submit): {overhead * 1e6:.1f} us")
    # On a CPU adapter, process CPU time / wall time shows how many cores the driver actually got.
    busy = statistics.median(row["cpu_ms"] / row["ms"] for row in rows.values())
    print(f"driver cores busy (cpu ms / ms, median over ops): {busy:.2f} of {os.cpu_count()}")
    checks = targets(rows)
    for c in checks:
        print(f"target {c['target']}: {c['value']} (limit {c['limit']}) {'met' if c['met'] else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "adapter": bench.gpu.summary(),
                    "cpus": os.cpu_count(),
                    "numpy_threads": threads,
                    "rounds": args.rounds,
                    "dispatch_overhead_us": overhead * 1e6,
                    "driver_cores_busy": busy,
                    "ops": rows,
                    "targets": checks,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
