"""A matmul call of R rows run by different row tiles, interleaved: what a smaller (or larger) tile costs.

    python tools/bench_tiles.py --rows 2 --tiles 2,8        # a verification step's 2 rows in the 8-row tile
    python tools/bench_tiles.py --rows 48 --tiles 8,2       # a prompt's chunk in 2-row tiles (`ops.linear.row_tile`)

SmolLM2-135M's q4_1 layer matmuls (qkv and gate_up with their RMSNorm fused, down accumulating) and, for calls of
at most 8 rows, its q8_0 LM head, on seeded random weights (`tools/bench_kernels.py`'s cases). Each round times
every tile once per case (many dispatches in one submit; the order alternating between rounds); the table gives
the median ms per call and the median per-round ratio of each tile to the first. The tile is forced by replacing
`ops.linear.row_tile` while a call is compiled and recorded; rows past R are computed and never stored, as in the
engine. Every pipeline compiles (and runs once) before the timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import Bench
from host_cpu import describe_cpu

import doppler_py.ops.linear as linear_module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--tiles", default="2,8", help="row tiles to compare, the first the reference")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows, tiles = args.rows, [int(t) for t in args.tiles.split(",")]
    bench = Bench()
    cases = [
        bench.linear("qkv q4_1 +norm", 960, 576, "q4_1", max(rows, 8), norm=True),
        bench.linear("gate_up q4_1 +norm", 3072, 576, "q4_1", max(rows, 8), norm=True),
        bench.linear("down q4_1", 576, 1536, "q4_1", max(rows, 8), accumulate=True),
    ]
    if rows <= 8:
        cases.append(bench.linear("lm_head q8_0 +norm", 49152, 576, "q8_0", 8, norm=True))
    real_row_tile = linear_module.row_tile

    def timed(op, tile: int, calls: int) -> float:
        linear = op.record.__closure__[0].cell_contents  # the Linear behind the Op
        linear_module.row_tile = lambda _rows, _tiled_gemm: tile
        try:
            linear.compile(rows)
            rec = bench.registry.recorder()
            for _ in range(calls):
                linear.record(rec, rows)
            start = time.perf_counter()
            rec.submit()
            bench.gpu.queue.read_buffer(bench._sync.buffer, 0, 4)  # waits for the submit
            return (time.perf_counter() - start) / calls
        finally:
            linear_module.row_tile = real_row_tile

    report = {"cpu": describe_cpu(), "adapter": bench.gpu.summary()["adapter"], "rows": rows, "cases": {}}
    print(f"{report['cpu']} | {report['adapter']} | {rows} rows, tiles {tiles}, {args.rounds} rounds")
    for op in cases:
        calls = 3 if "lm_head" in op.name else max(2, 40 // rows)
        for tile in tiles:
            timed(op, tile, 1)
        times: dict[int, list[float]] = {tile: [] for tile in tiles}
        for i in range(args.rounds):
            for tile in tiles if i % 2 == 0 else tiles[::-1]:
                times[tile].append(timed(op, tile, calls))
        ms = {tile: statistics.median(t) * 1e3 for tile, t in times.items()}
        ratios = {
            tile: statistics.median(a / b for a, b in zip(times[tile], times[tiles[0]], strict=True))
            for tile in tiles[1:]
        }
        report["cases"][op.name] = {"ms": ms, "ratio_to_first": ratios}
        cells = " ".join(f"tile {t}: {ms[t]:.3f} ms" for t in tiles)
        print(f"{op.name:<20} {cells} | " + " ".join(f"{t}/{tiles[0]}: {r:.2f}" for t, r in ratios.items()))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
