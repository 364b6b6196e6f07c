"""Decoding of this checkout against another one, side by side in one run: did a change make it slower?

    git worktree add /tmp/before <commit>
    python tools/bench_ab.py --before /tmp/before --weights q4_1,f16 --rounds 14 --json ab.json
    python tools/bench_ab.py --before /tmp/before --weights q4_1 --modes prompt-lookup,eagle --rounds 10

Each checkout's SmolLM2 loads once, in a process of its own (its tree first on the import path), and the two
take turns: one measurement each per round, the order alternating between rounds. Both then see the same phase
of a noisy shared machine, which separate runs minutes apart do not (this machine's speed drifts by ±30% within
an hour), so what counts is the ratio after / before within each round: its median, geometric mean and how many
rounds read worse.

Per measurement: plain greedy decode tokens/s of one generation of --new-tokens tokens (its end included, as a
user waits for it), and the median wall ms of 8 bare T = 1 forwards with the last row's logits read back (the
model's kernels with little of the engine around them). With --modes, also each speculative mode's tokens/s
(greedy, the policy choosing k) on a chat prompt, its engine prepared before the first round. Without --modes
both checkouts load without draft heads.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORWARDS = 8  # bare forwards per measurement
MEASURES = {"decode_tok_s": True, "forward_ms": False}  # name -> whether higher is better
CHAT_PROMPT = "Explain how a bicycle's gears make climbing a hill easier, in a few short paragraphs."


def worker(weights: str, new_tokens: int, modes: list[str]) -> None:
    """Load this tree's model, then answer each line on stdin with one measurement (a JSON line)."""
    import numpy as np

    import doppler_py
    from doppler_py.sampling import SamplingParams

    has_heads = "draft_head" in inspect.signature(doppler_py.load).parameters
    options = {"draft_head": False} if has_heads and not modes else {}
    if "warmup" in inspect.signature(doppler_py.load).parameters:  # modes compiled and calibrated when made
        options["warmup"] = "now"
    engine = doppler_py.load(weights=weights, progress=False, max_seq=256, **options)
    model = engine.model
    ids = np.random.default_rng(0).integers(100, 30000, size=16 + FORWARDS).tolist()
    plain = engine.speculative_engine("none")
    cache = model.new_cache(256)
    model.forward(ids[:8], cache, 0, logits="none")  # compile the pipelines outside the timings
    plain.generate(ids[:8], 4, SamplingParams())
    chat = engine.encode_prompt(CHAT_PROMPT, chat=True)
    speculative = {mode: engine.speculative_engine(mode) for mode in modes}  # prepared (compiled, calibrated) now
    print(json.dumps({"ready": doppler_py.__file__}), flush=True)
    for _ in sys.stdin:
        stats = plain.generate(ids[:16], new_tokens, SamplingParams()).stats
        cache.truncate(0)
        model.forward(ids[:16], cache, 0, logits="none")
        forward_s = []
        for i in range(FORWARDS):
            start = time.perf_counter()
            model.forward([ids[16 + i]], cache, 16 + i, logits="last")
            forward_s.append(time.perf_counter() - start)
        row = {"decode_tok_s": stats.generated / stats.decode_s, "forward_ms": 1e3 * statistics.median(forward_s)}
        for mode, spec in speculative.items():
            mode_stats = spec.generate(chat, new_tokens, SamplingParams()).stats
            row[f"{mode}_tok_s"] = mode_stats.generated / mode_stats.decode_s
        print(json.dumps(row), flush=True)
    model.release_cache(cache)
    engine.close()


class Side:
    """One checkout's worker process."""

    def __init__(self, tree: Path, weights: str, new_tokens: int, modes: list[str]):
        env = dict(os.environ, PYTHONPATH=str(tree))
        script = str(Path(__file__).resolve())
        command = [sys.executable, script, "--worker", weights, "--new-tokens", str(new_tokens)]
        command += ["--modes", ",".join(modes)] if modes else []
        self.proc = subprocess.Popen(
            command, cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        ready = self.proc.stdout.readline()
        if not ready:
            raise RuntimeError(f"the worker for {tree} ended before loading its model (exit {self.proc.wait()})")
        self.module = json.loads(ready)["ready"]
        if not Path(self.module).resolve().is_relative_to(tree.resolve()):
            raise RuntimeError(f"the worker for {tree} imported {self.module}: is the package installed elsewhere?")

    def measure(self) -> dict:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def paired_summary(before: list[float], after: list[float], higher_is_better: bool) -> dict:
    """Per-round ratios after / before and how often `after` read worse."""
    ratios = [a / b for a, b in zip(after, before, strict=True)]
    worse = sum(r < 1 if higher_is_better else r > 1 for r in ratios)
    return {
        "before_median": statistics.median(before),
        "after_median": statistics.median(after),
        "ratio_median": statistics.median(ratios),
        "ratio_geomean": statistics.geometric_mean(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "rounds_worse": worse,
        "rounds": len(ratios),
    }


def compare(before_tree: Path, weights: str, rounds: int, new_tokens: int, modes: list[str]) -> dict:
    sides = {"before": Side(before_tree, weights, new_tokens, modes), "after": Side(ROOT, weights, new_tokens, modes)}
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    try:
        for r in range(rounds):
            for name in ("before", "after") if r % 2 == 0 else ("after", "before"):
                runs[name].append(sides[name].measure())
            print(f"{weights} round {r}: {json.dumps({n: rows[-1] for n, rows in runs.items()})}", file=sys.stderr)
    finally:
        for side in sides.values():
            side.close()
    measures = {**MEASURES, **{f"{mode}_tok_s": True for mode in modes}}
    summary = {
        measure: paired_summary([r[measure] for r in runs["before"]], [r[measure] for r in runs["after"]], higher)
        for measure, higher in measures.items()
    }
    return {"weights": weights, "summary": summary, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, help="the other checkout (e.g. a git worktree of the old commit)")
    parser.add_argument("--weights", default="q4_1,f16")
    parser.add_argument("--rounds", type=int, default=14)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--modes", default="", help="speculative modes to time too, comma-separated (e.g. eagle)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    modes = [mode for mode in args.modes.split(",") if mode]
    if args.worker:
        worker(args.worker, args.new_tokens, modes)
        return 0
    if args.before is None or not (args.before / "doppler_py").is_dir():
        parser.error("--before must name another checkout of this repository (a folder holding doppler_py/)")
    results = [compare(args.before, w, args.rounds, args.new_tokens, modes) for w in args.weights.split(",")]
    print(
        f"{'weights':8s} {'measure':22s} {'before':>8s} {'after':>8s} {'after/before: median':>21s} {'geo-mean':>9s} "
        f"{'range':>12s} {'rounds worse':>13s}"
    )
    for result in results:
        for measure, s in result["summary"].items():
            print(
                f"{result['weights']:8s} {measure:22s} {s['before_median']:8.2f} {s['after_median']:8.2f} "
                f"{s['ratio_median']:21.3f} {s['ratio_geomean']:9.3f} {s['ratio_min']:5.2f}-{s['ratio_max']:<6.2f} "
                f"{s['rounds_worse']:>9d}/{s['rounds']}"
            )
    if args.json:
        args.json.write_text(json.dumps({"before": str(args.before), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
