"""The adapter's limit: its streaming read rate per load type, and decode's weight bytes per second as a fraction
of it, per weight format (issue 64, part 2).

    python tools/bench_bandwidth.py [--weights q4_1,q8_0,f16] [--new-tokens 128] [--repeats 3] [--json out.json]

1. The streaming rate (doppler_py/bandwidth.py): shaders/stream_read.wgsl reads one buffer of 256 MiB or the
   device's max storage binding (whichever is smaller) with each load type the matmuls use, over a sweep of
   shapes; per load the best shape's median rate. The figure is cached for `doppler-py info`.
2. Decode: SmolLM2-135M, plain greedy decode of --new-tokens after a 16-token prompt, per weight format; tok/s
   times the weight bytes a step reads (every layer matrix, the LM head, one embedding row: `decode_weight_bytes`)
   is decode's weight bytes/s. Before and after each decode the best streaming shape is timed again (--rounds
   reads each, the two medians averaged), so each ratio sets the two side by side under the same load of a shared
   machine (its speed swings 3x within seconds); the fraction is the median of the --repeats ratios.

Formats: q4_1 is the shipped GGUF (q4_1 layers, its q8_0 embedding as the tied LM head); q8_0 and f16 come from
the same values dequantised to f16 once (`resolve_model(..., "f16")`, converted into the model cache), then
quantised to q8_0 or kept in f16, so every matrix is in the named format.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from doppler_py.bandwidth import (
    SHAPES,
    StreamProbe,
    decode_weight_bytes,
    measure_stream_rates,
    save_stream_rate,
    stream_bytes,
    stream_report,
)
from doppler_py.gpu.device import _cpu_flags, default_gpu
from doppler_py.ops.stream_read import LOADS

CPU_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_tile")


def host() -> dict:
    """The CPU (what a software adapter runs on): model name, the vector flags that decide lavapipe's width."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    flags = _cpu_flags()
    return {"cpu": model, "cpus": os.cpu_count(), "vector_flags": [f for f in CPU_FLAGS if f in flags]}


def run_info() -> dict:
    """When, from which commit and with which command: a figure is published with all three."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": commit or "unknown",
        "command": " ".join(["python", "tools/bench_bandwidth.py", *sys.argv[1:]]),
    }


def formats_of(weights) -> str:
    """Which formats the matrices a decode step reads are stored in: 'q4_1 layers, q8_0 LM head'."""
    layers = sorted({w.format for layer in weights.layers for w in layer.matrices()})
    return f"{'/'.join(layers)} layers, {weights.lm_head.format} LM head"


def load_engine(fmt: str, model: str | None, max_seq: int):
    import doppler_py
    from doppler_py.model.catalog import DEFAULT_MODEL, resolve_model

    source: str | Path = model or DEFAULT_MODEL
    if model is None and fmt not in ("q4_1", "keep"):
        # The GGUF's q4_1 blocks would be kept under any block format: start from its values in f16 instead.
        source = resolve_model(DEFAULT_MODEL, "f16", progress=False)
    return doppler_py.load(source, weights=fmt, progress=False, max_seq=max_seq, draft_head=False)


def decode_once(engine, ids: list[int], new_tokens: int) -> float:
    """Plain greedy decode: tokens per second of the T=1 steps."""
    from doppler_py.sampling import SamplingParams

    stats = engine.speculative_engine("none").generate(ids, new_tokens, SamplingParams()).stats
    return stats.generated / stats.decode_s


def run(args) -> dict:
    gpu = default_gpu()
    loads = [load.strip() for load in args.loads.split(",") if load.strip()]
    unknown = sorted(set(loads) - set(LOADS))
    if unknown:
        raise SystemExit(f"unknown loads {unknown}; choose from {', '.join(LOADS)}")
    nbytes = args.stream_mib << 20 if args.stream_mib else stream_bytes(gpu)
    shapes = tuple(s for s in SHAPES if s.load in loads)
    log = (lambda line: print(line, file=sys.stderr)) if not args.quiet else None
    rates = measure_stream_rates(gpu, nbytes=nbytes, shapes=shapes, rounds=args.rounds, log=log)
    stream = stream_report(gpu, rates, nbytes)
    if nbytes == stream_bytes(gpu) and set(loads) == set(LOADS):
        save_stream_rate(gpu, stream)  # what `doppler-py info` shows
    record = {"run": run_info(), "host": host(), "adapter": gpu.summary(), "stream": stream, "decode": []}
    formats = [f.strip() for f in args.weights.split(",") if f.strip()]
    if not formats:
        return record

    best = max(rates, key=lambda r: r.bytes_per_s)
    probe = StreamProbe(gpu, [best.shape], nbytes)
    engines = {}
    try:
        reader = probe.readers[0]
        reader.warm_up()
        for fmt in formats:
            engines[fmt] = load_engine(fmt, args.model, args.max_seq)
        vocab = next(iter(engines.values())).model.config.vocab_size
        ids = np.random.default_rng(0).integers(min(100, vocab - 1), min(30000, vocab), size=16).tolist()
        for fmt in formats:
            decode_once(engines[fmt], ids, 4)  # compile the decode pipelines outside the timings
        # Per format and repeat: the streaming rate timed just before and just after the decode (the next format's
        # "before"), averaged, so each ratio compares the two under the same load of a shared machine.
        window: dict[str, list[float]] = {fmt: [] for fmt in formats}
        tok_s: dict[str, list[float]] = {fmt: [] for fmt in formats}
        for repeat in range(args.repeats):
            before = probe.time_rounds([reader], args.rounds)[0].bytes_per_s
            for fmt in formats:
                tok_s[fmt].append(decode_once(engines[fmt], ids, args.new_tokens))
                after = probe.time_rounds([reader], args.rounds)[0].bytes_per_s
                window[fmt].append((before + after) / 2)
                before = after
            if log:
                decoded = ", ".join(
                    f"{fmt} {tok_s[fmt][-1]:.2f} tok/s ({window[fmt][-1] / 1e9:.2f})" for fmt in formats
                )
                log(f"repeat {repeat} (stream GB/s around each): {decoded}")
        record["stream"]["window_bytes_per_s"] = statistics.median(v for runs in window.values() for v in runs)
        for fmt in formats:
            weights = engines[fmt].model.weights
            read = decode_weight_bytes(weights)
            rate = statistics.median(tok_s[fmt])
            fractions = [t * read["total"] / w for t, w in zip(tok_s[fmt], window[fmt], strict=True)]
            record["decode"].append(
                {
                    "weights": fmt,
                    "formats": formats_of(weights),
                    "weight_bytes_per_token": read,
                    "tok_s": rate,
                    "tok_s_runs": tok_s[fmt],
                    "stream_bytes_per_s_runs": window[fmt],
                    "weight_bytes_per_s": rate * read["total"],
                    "fraction_of_stream": statistics.median(fractions),
                    "fraction_runs": fractions,
                }
            )
    finally:
        for engine in engines.values():
            engine.close()
        probe.close()
    return record


def format_table(record: dict) -> str:
    host_ = record["host"]
    adapter = record["adapter"]
    stream = record["stream"]
    run = record["run"]
    lines = [
        f"{run['date']}, commit {run['commit']}: {run['command']}",
        f"host: {host_['cpu']} ({host_['cpus']} CPUs; {', '.join(host_['vector_flags']) or 'no AVX2/AVX-512'})",
        f"adapter: {adapter['adapter']} ({adapter['driver']}), {adapter['adapter_type']}",
        f"streaming read over {stream['buffer_bytes'] / 2**20:g} MiB, best shape per load (median):",
        f"  {'load':<10} {'GB/s':>7}  shape",
    ]
    for load, rate in sorted(stream["per_load"].items(), key=lambda kv: -kv[1]["bytes_per_s"]):
        lines.append(f"  {load:<10} {rate['bytes_per_s'] / 1e9:7.2f}  {rate['label']}")
    if record["decode"]:
        window = stream["window_bytes_per_s"]
        lines.append(
            f"decode (plain greedy); the best shape, timed again around each decode, read {window / 1e9:.2f} GB/s "
            "(median); 'of stream': the median over repeats of decode's rate over the reads around it"
        )
        lines.append(
            f"  {'weights':<8} {'stored as':<28} {'MB/token':>9} {'tok/s':>7} {'weights GB/s':>13} {'of stream':>10}"
            f"  {'range':>9}"
        )
        for row in record["decode"]:
            lines.append(
                f"  {row['weights']:<8} {row['formats']:<28} {row['weight_bytes_per_token']['total'] / 1e6:9.1f} "
                f"{row['tok_s']:7.2f} {row['weight_bytes_per_s'] / 1e9:13.2f} {row['fraction_of_stream']:10.0%}  "
                f"{min(row['fraction_runs']):.0%}-{max(row['fraction_runs']):.0%}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", default="q4_1,q8_0,f16", help="weight formats to decode with ('' for none)")
    parser.add_argument("--model", help="a model folder instead of SmolLM2 (every format quantised from it)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="decode runs per format (median)")
    parser.add_argument("--rounds", type=int, default=5, help="timed reads per streaming shape (median)")
    parser.add_argument("--loads", default=",".join(LOADS), help="load types to sweep (default: all)")
    parser.add_argument("--stream-mib", type=int, help="streamed buffer size (default: 256 MiB or the binding limit)")
    parser.add_argument("--max-seq", type=int, default=512)
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--json", type=Path, help="also write the record here")
    args = parser.parse_args(argv)
    record = run(args)
    print(format_table(record))
    print(json.dumps(record))
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
