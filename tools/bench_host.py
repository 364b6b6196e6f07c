"""Host cost of one SmolLM2 step (GPU time excluded), and how long a new process takes to show a first token.

    python tools/bench_host.py --weights q4_1 --repeats 200 --cold --json host.json

Per step: build a command encoder, record the target forward (T = 1: a decode step; T = 5: the rows a k = 4
speculative step verifies, logits for every row) and submit it — the host's share of a step. The GPU's work is
awaited after each step, outside the timed span, so the figures exclude GPU time and one step's GPU work never
overlaps the next step's recording. The verifier's own dispatches and the readback come on top of these.
Tapes play through the compiled dispatch loop where it could be built (`DOPPLER_COMPILED_LOOP=0`: the Python
loop); the report says which. Cold (--cold): fresh `doppler-py generate` processes, time to the first streamed
byte and to the end: speculation auto (the default command) with no verification costs cached on disk, auto
again with costs cached (stored by a `--warmup now` process in between), and none. The last line is
`host_ms_per_decode_step=X`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONTEXT = 64  # positions already in the KV cache when a step is recorded
COLD_PROMPT = "Name three rivers."
# A step's host time in three parts (medians each): creating the recorder's encoder, recording the forward
# (a played tape: its Python and the dispatch loop), and the submit (ending the pass, uploading the uniforms,
# wgpu-core finishing the command buffer, the queue submit).
STEP_PARTS = ("encoder", "record", "submit")


def host_step(model, cache, rows: int, repeats: int) -> dict:
    """Median host ms to record + submit a forward over `rows` rows at position CONTEXT."""
    logits = "last" if rows == 1 else "all"
    samples, parts, dispatches = [], {part: [] for part in STEP_PARTS}, 0
    model.ids.view((rows,)).write(model.check_ids([1] * rows))
    for i in range(repeats + 5):
        start = time.perf_counter()
        rec = model.registry.recorder()
        created = time.perf_counter()
        model.record_forward(rec, rows, cache, CONTEXT, logits=logits)
        recorded = time.perf_counter()
        rec.submit()
        submitted = time.perf_counter()
        model.gpu.wait_idle()
        cache.truncate(CONTEXT)
        dispatches = rec.dispatches
        if i >= 5:  # the first steps bind groups and compile pipelines
            samples.append((submitted - start) * 1e3)
            spans = (created - start, recorded - created, submitted - recorded)
            for part, elapsed in zip(STEP_PARTS, spans, strict=True):
                parts[part].append(elapsed * 1e3)
    median = statistics.median(samples)
    return {
        "rows": rows,
        "host_ms": round(median, 3),
        "host_ms_p90": round(statistics.quantiles(samples, n=10)[-1], 3),
        "dispatches": dispatches,
        "host_us_per_dispatch": round(median * 1e3 / dispatches, 1),
        "parts_ms": {part: round(statistics.median(values), 3) for part, values in parts.items()},
    }


def cold_start(speculative: str, weights: str, cache: Path, *extra: str) -> dict:
    """A fresh process using the cache folder `cache`: seconds to its first streamed byte and to its exit."""
    doppler = Path(sys.executable).with_name("doppler-py")
    args = [str(doppler), "generate", COLD_PROMPT, "--max-tokens", "32", "--weights", weights, *extra]
    costs = cache / "verify-costs"
    cached = costs.is_dir() and any(costs.iterdir())
    env = {**os.environ, "DOPPLER_CACHE": str(cache)}
    start = time.perf_counter()
    proc = subprocess.Popen(
        [*args, "--speculative", speculative], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    proc.stdout.read(1)
    first = time.perf_counter() - start
    proc.communicate()
    return {
        "speculative": speculative,
        "options": list(extra),
        "costs_cached": cached,
        "first_token_s": round(first, 2),
        "total_s": round(time.perf_counter() - start, 2),
    }


def cold_starts(weights: str) -> list[dict]:
    """Fresh processes: speculation auto with no measured costs on disk; one with `--warmup now`, which
    compiles and calibrates before its first token and stores the costs (a 32-token answer with the default
    warmup never starts compiling on a CPU adapter, so it stores none); auto again, now with the costs
    cached; and none. They share every other cached thing (the models, the compiled dispatch loop)."""
    from doppler_py.paths import cache_dir

    shared = cache_dir()
    with tempfile.TemporaryDirectory(prefix="doppler-cold-") as folder:
        cache = Path(folder)
        for entry in shared.iterdir():
            if entry.name != "verify-costs":
                (cache / entry.name).symlink_to(entry)
        runs = [("auto",), ("auto", "--warmup", "now"), ("auto",), ("none",)]
        return [cold_start(mode, weights, cache, *extra) for mode, *extra in runs]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", default="q4_1")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--cold", action="store_true", help="also time fresh processes to their first token")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    import doppler_py
    from doppler_py.gpu import dispatch_loop

    report: dict = {"weights": args.weights}
    with doppler_py.load(weights=args.weights, progress=False, max_seq=256, draft_head=False) as engine:
        model = engine.model
        dispatch_loop.wait()  # a new machine builds the compiled loop once; steps are timed with it in use
        report["dispatch_loop"] = dispatch_loop.status()
        print(f"adapter: {model.gpu.name} via {model.gpu.backend}; dispatch loop: {report['dispatch_loop']}")
        cache = model.new_cache(256)
        model.forward(list(range(1, CONTEXT + 1)), cache, 0, logits="none")
        report["steps"] = [host_step(model, cache, rows, args.repeats) for rows in (1, 5)]
        model.release_cache(cache)
    if args.cold:
        report["cold"] = cold_starts(args.weights)

    print(f"{'rows':>4s} {'host ms':>8s} {'p90':>7s} {'dispatches':>10s} {'µs/dispatch':>11s}", end="")
    print("".join(f" {part + ' ms':>10s}" for part in STEP_PARTS))
    for row in report["steps"]:
        print(
            f"{row['rows']:4d} {row['host_ms']:8.3f} {row['host_ms_p90']:7.3f} {row['dispatches']:10d} "
            f"{row['host_us_per_dispatch']:11.1f}" + "".join(f" {row['parts_ms'][part]:10.3f}" for part in STEP_PARTS)
        )
    for row in report.get("cold", []):
        costs = "costs cached" if row["costs_cached"] else "no costs cached"
        print(
            f"new process, speculative {' '.join([row['speculative'], *row['options']])} ({costs}): "
            f"first token {row['first_token_s']} s, "
            f"end {row['total_s']} s"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    print(f"host_ms_per_decode_step={report['steps'][0]['host_ms']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
