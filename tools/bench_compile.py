"""Where a fresh process's compile goes: every pipeline SmolLM2's `auto` mode builds, per kind, with its seconds.

    python tools/bench_compile.py [--json out.json] [--tokens 128]

Run it in a fresh process (it must be: pipelines are cached per process). Phases, in order:
  plain      a plain generation of a few tokens (its prefill and decode pipelines: what the first token waits for);
  stage N    what `auto`'s background warm-up compiles, stage by stage (`SpeculativeEngine.compile_stages`: on a
             CPU adapter the row counts of one-draft steps, then the rest), alone, with the main thread waiting:
             one verification step per row count on a shadow of the target (`PipelineWarmup`), per row count as
             it is reached ("stage N rows<=R"), then the drafter's own pipelines for them ("stage N drafter");
  generate   a `--tokens` generation with `auto` once everything is compiled: which row counts its steps verify
             (and anything it still had to compile).
Each pipeline is one `CompileRecord` (`gpu.kernels.PipelineCache.records`): its shader module's seconds (paid by
the first pipeline of a file) and the pipeline's own (naga's SPIR-V, then the driver: LLVM on lavapipe). Matmul
pipelines are grouped by their row tile (ROWS), weight format (FORMAT) and fused input (RMS_NORM, GLU).

Mesa's on-disk shader cache (MESA_SHADER_CACHE_DIR, default ~/.cache/mesa_shader_cache) decides what a second
process pays: point it at an empty folder for a first-process figure, run twice for a second-process one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from host_cpu import describe_cpu

import doppler_py
from doppler_py.gpu.kernels import CompileRecord
from doppler_py.sampling import SamplingParams

FORMATS = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 4: "q8_0"}
PROMPT = "Write a short story about a night-train conductor and a passenger who cannot sleep."


def kind(record: CompileRecord) -> str:
    """A pipeline's kind: the shader and entry point, and for matmuls the overrides that make a variant."""
    shader, entry, constants = record.key
    consts = dict(constants)
    if shader != "matmul":
        return f"{shader}.{entry}"
    fused = "+norm" if consts.get("RMS_NORM") else "+glu" if consts.get("GLU") else ""
    tile = f"rows{int(consts['ROWS'])}" if "ROWS" in consts else "gemm"
    return f"matmul {FORMATS.get(int(consts.get('FORMAT', 0)), '?')} {tile}{fused}"


def summarise(records: list[CompileRecord], phases: dict[str, tuple[float, float]]) -> dict:
    """Per phase: pipelines, their summed seconds (module + pipeline) and per kind: count, sum, median."""
    out = {}
    for phase, (start, end) in phases.items():
        mine = [r for r in records if start <= r.started < end]
        by_kind: dict[str, list[CompileRecord]] = defaultdict(list)
        for r in mine:
            by_kind[kind(r)].append(r)
        out[phase] = {
            "wall_s": end - start,
            "pipelines": len(mine),
            "module_s": sum(r.module_s for r in mine),
            "pipeline_s": sum(r.pipeline_s for r in mine),
            "kinds": {
                k: {
                    "count": len(rs),
                    "sum_s": sum(r.module_s + r.pipeline_s for r in rs),
                    "median_pipeline_s": statistics.median(r.pipeline_s for r in rs),
                }
                for k, rs in sorted(by_kind.items(), key=lambda item: -sum(r.pipeline_s for r in item[1]))
            },
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens of the generation after the compile")
    parser.add_argument("--weights", default="keep")
    args = parser.parse_args()

    t0 = time.perf_counter()
    engine = doppler_py.load(weights=args.weights, progress=False, warmup="background")
    phases = {"load": (t0, time.perf_counter())}
    cache = engine.model.registry.pipelines
    chat = engine.encode_prompt(PROMPT, chat=True)

    start = time.perf_counter()
    engine.generate(PROMPT, chat=True, max_tokens=4, speculative=None)
    phases["plain"] = (start, time.perf_counter())

    mode = engine.resolve_mode("auto")
    spec = engine.speculative_engine(mode)  # background: nothing compiles until a generation starts the warm-up
    rows = spec.verify_rows()
    done: list[int] = []
    for number, stage in enumerate(spec.compile_stages(), 1):
        stage_rows = [r for r in stage if r not in done]
        start = time.perf_counter()
        warmup = spec.start_warmup(stage_rows)  # the stage's row counts, then the drafter's pipelines for them
        reached: dict[int, float] = {}
        while not warmup.done.wait(0.005):
            reached.setdefault(warmup.compiled_rows, time.perf_counter())
        warmup.finish()
        end = time.perf_counter()
        name = f"stage {number}"
        phases[name] = (start, end)
        marks = [*sorted((t, r) for r, t in reached.items() if r in stage_rows), (end, stage_rows[-1])]
        previous = start
        for t, r in marks:  # the pipelines started before row count r was reached belong to it
            phases[f"{name} rows<={r}"] = (previous, t)
            previous = t
        phases[f"{name} drafter"] = (reached.get(stage_rows[-1], end), end)
        done += stage_rows

    start = time.perf_counter()
    result = spec.generate(chat, args.tokens, SamplingParams())
    phases["generate"] = (start, time.perf_counter())
    stats = result.stats
    rows_used = Counter(d + 1 for d in stats.k_history)
    rows_used[1] += stats.plain_steps

    records = list(cache.records)
    report = {
        "cpu": describe_cpu(),
        "adapter": engine.model.gpu.summary()["adapter"],
        "mode": mode,
        "mesa_shader_cache": os.environ.get("MESA_SHADER_CACHE_DIR", "~/.cache/mesa_shader_cache (default)"),
        "verify_rows": rows,
        "phases": summarise(records, phases),
        "generate": {
            "tokens": len(result.tokens),
            "steps": stats.steps,
            "tree_steps": stats.tree_steps,
            "plain_steps": stats.plain_steps,
            "rows_used": dict(sorted(rows_used.items())),
            "tok_s": len(result.tokens) / stats.total_s if stats.total_s else None,
        },
    }
    engine.close()

    print(f"{report['cpu']} | {report['adapter']} | {mode} | verify rows {rows[0]}..{rows[-1]}")
    print(f"Mesa shader cache: {report['mesa_shader_cache']}")
    # "other": wall time not spent creating pipelines: running the steps, and on lavapipe the LLVM code generation
    # of each pipeline at its first dispatch (what Mesa's disk cache keeps), which no record sees.
    print(f"{'phase':<16} {'wall s':>7} {'pipes':>5} {'module s':>8} {'pipe s':>7} {'other s':>7}")
    for phase, p in report["phases"].items():
        other = p["wall_s"] - p["module_s"] - p["pipeline_s"]
        seconds = f"{p['wall_s']:7.2f} {p['pipelines']:5d} {p['module_s']:8.2f} {p['pipeline_s']:7.2f} {other:7.2f}"
        print(f"{phase:<16} {seconds}")
    for phase in [p for p in report["phases"] if p == "plain" or (p.startswith("stage") and "<=" not in p)] + [
        "generate"
    ]:
        kinds = report["phases"][phase]["kinds"]
        if kinds:
            print(f"\n{phase}: {'kind':<34} {'n':>3} {'sum s':>6} {'median s':>8}")
            for name, k in kinds.items():
                print(f"  {name:<40} {k['count']:3d} {k['sum_s']:6.2f} {k['median_pipeline_s']:8.3f}")
    g = report["generate"]
    print(
        f"\ngenerate {g['tokens']} tokens: {g['steps']} speculative steps ({g['tree_steps']} trees), "
        f"{g['plain_steps']} plain; rows verified per step: {g['rows_used']}"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
