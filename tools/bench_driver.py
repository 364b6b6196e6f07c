"""What a kernel's operations cost on this adapter: an empty dispatch, and per workgroup of 16 invocations a loop
iteration, a vec4 multiply-add, storage loads (one address for every invocation, or one each), a packed-f16 load, a
workgroup-memory load, exp, and with subgroups broadcast, shuffle-xor and add.

    python tools/bench_driver.py [--json out.json] [--rounds 5]

Each probe is one workgroup running a loop of ITERATIONS iterations whose body does its operation 8 times (four
independent chains where the operation allows, so the figure is throughput, not latency); a measurement records
DISPATCHES dispatches in one submit, waits for it and divides. Per operation the table gives nanoseconds for the
workgroup, after taking off the empty dispatch and the empty loop's iteration, and the ratio to a vec4
multiply-add; medians over `--rounds`, the probes taking turns round by round (the machine may be shared).

On a CPU adapter a workgroup of 16 is one or two vectors, so this is the arithmetic a kernel design runs on
(shaders/README.md): on lavapipe a storage load costs its components lane by lane, whatever the addresses, and a
dispatch costs the driver's worker threads waking. On a GPU the loop's figures are latencies of one warp, which
say little about throughput.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from doppler_py.gpu.device import default_gpu
from doppler_py.gpu.kernels import KernelRegistry
from doppler_py.gpu.tensor import Tensor

WORKGROUP = 16
ITERATIONS = 4096
DISPATCHES = 20
EMPTY_DISPATCHES = 200
# (name, loop body doing the operation 8 times); `a`..`d` are vec4 accumulators, `x` a vec4 of the invocation's own,
# `j` the iteration (a multiple of 8), `t` the invocation's index.
PROBES = [
    ("loop iteration", "a += vec4<f32>(f32(j));"),
    ("vec4 multiply-add", "a = a * x + b; b = b * x + c; c = c * x + d; d = d * x + a; " * 2),
    ("vec4 storage load, one address", " ".join(f"a += src[j + {u}u];" for u in range(8))),
    ("vec4 storage load, one per invocation", " ".join(f"a += src[(j + {u}u) * 16u + t];" for u in range(8))),
    ("f32 storage load, one per invocation", " ".join(f"a.x += src[(j + {u}u) * 16u + t].x;" for u in range(8))),
    (
        "4 f16 (2 u32) load + unpack",
        " ".join(
            f"let w{u} = packed[(j + {u}u) * 16u + t]; "
            f"a += vec4<f32>(unpack2x16float(w{u}.x), unpack2x16float(w{u}.y));"
            for u in range(8)
        ),
    ),
    ("vec4 workgroup-memory load", " ".join(f"a += shared_v[(j + {u}u + t) % 256u];" for u in range(8))),
    ("vec4 exp", "a = exp(a - x); b = exp(b - a); c = exp(c - b); d = exp(d - c); " * 2),
]
SUBGROUP_PROBES = [
    ("vec4 subgroupBroadcast", " ".join(f"a += subgroupBroadcast(x + a, {u}u);" for u in range(8))),
    ("vec4 subgroupShuffleXor", " ".join(f"a += subgroupShuffleXor(x + a, {1 << (u % 2)}u);" for u in range(8))),
    ("vec4 subgroupAdd", " ".join("a += subgroupAdd(x + a);" for _ in range(8))),
]
REFERENCE = "vec4 multiply-add"


def shader(probes: list[tuple[str, str]], subgroups: bool) -> str:
    branches = "\n".join(f"    if (MODE == {i}u) {{ {body} }}" for i, (_, body) in enumerate(probes))
    return f"""{"enable subgroups;" if subgroups else ""}
@group(0) @binding(0) var<storage, read> src: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> packed: array<vec2<u32>>;
@group(0) @binding(2) var<storage, read_write> out: array<vec4<f32>>;
override MODE: u32 = 0u;
var<workgroup> shared_v: array<vec4<f32>, 256>;

@compute @workgroup_size({WORKGROUP})
fn main(@builtin(local_invocation_index) t: u32) {{
  for (var i = t; i < 256u; i += {WORKGROUP}u) {{
    shared_v[i] = src[i];
  }}
  workgroupBarrier();
  let x = src[t];
  var a = vec4<f32>(0.0);
  var b = vec4<f32>(0.5);
  var c = vec4<f32>(0.25);
  var d = vec4<f32>(0.125);
  for (var j = 0u; j < {ITERATIONS}u; j += 8u) {{
{branches}
  }}
  out[t] = a + b + c + d;
}}

@compute @workgroup_size(1)
fn empty() {{
  out[0] = out[0] + vec4<f32>(1.0);
}}
"""


def seconds_per_dispatch(gpu, registry: KernelRegistry, bound, sync: Tensor, dispatches: int) -> float:
    rec = registry.recorder()
    for _ in range(dispatches):
        rec.dispatch(bound, 1)
    start = time.perf_counter()
    rec.submit()
    gpu.queue.read_buffer(sync.buffer, 0, 4)
    return (time.perf_counter() - start) / dispatches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="measurements per probe (median reported)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)

    gpu = default_gpu()
    probes = PROBES + (SUBGROUP_PROBES if gpu.has_subgroups else [])
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "probes.wgsl").write_text(shader(probes, gpu.has_subgroups))
        registry = KernelRegistry(gpu, Path(folder))
        loads = ITERATIONS * WORKGROUP + 256
        src = Tensor.from_numpy(gpu, np.full((loads, 4), 1e-3, np.float32))
        packed = Tensor.from_numpy(gpu, np.zeros((loads, 2), np.uint32))
        out = Tensor.empty(gpu, (WORKGROUP, 4))
        buffers = {"src": src, "packed": packed, "out": out}
        bounds = [registry.bind(registry.kernel("probes", MODE=i), **buffers) for i in range(len(probes))]
        empty = registry.bind(registry.kernel("probes", "empty"), out=out)
        times: list[list[float]] = [[] for _ in probes]
        empties: list[float] = []
        for _ in range(args.rounds):
            empties.append(seconds_per_dispatch(gpu, registry, empty, out, EMPTY_DISPATCHES))
            for i, bound in enumerate(bounds):
                times[i].append(seconds_per_dispatch(gpu, registry, bound, out, DISPATCHES))
        registry.close()
    dispatch_s = statistics.median(empties)
    per_iteration = [(statistics.median(t) - dispatch_s) / (ITERATIONS / 8) for t in times]
    loop = per_iteration[0]
    rows = [{"probe": "loop iteration", "ns": loop * 1e9}]
    rows += [
        {"probe": name, "ns": (it - loop) / 8 * 1e9}
        for (name, _), it in zip(probes[1:], per_iteration[1:], strict=True)
    ]
    reference = next(row["ns"] for row in rows if row["probe"] == REFERENCE)
    for row in rows:
        row["per_multiply_add"] = row["ns"] / reference
    adapter = gpu.summary()
    print(f"adapter: {adapter['adapter']} ({adapter.get('driver', '')}), {adapter['adapter_type']}")
    print(f"empty dispatch: {dispatch_s * 1e6:.1f} us ({EMPTY_DISPATCHES} per submit)")
    print(f"per workgroup of {WORKGROUP} invocations, per operation:")
    print(f"{'operation':<40} {'ns':>8} {'× multiply-add':>15}")
    for row in rows:
        print(f"{row['probe']:<40} {row['ns']:>8.1f} {row['per_multiply_add']:>15.1f}")
    if args.json:
        record = {"adapter": adapter, "empty_dispatch_us": dispatch_s * 1e6, "workgroup": WORKGROUP}
        args.json.write_text(json.dumps(record | {"operations": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
