"""Embeddings per second: 32 short texts in one call (batched: several inputs' rows per forward) vs one call per text,
interleaved in one process.

    python tools/bench_embeddings.py --rounds 5 [--model smollm2-135m-instruct --weights q4_1]

SmolLM2 stands in for an embedding model (last-token pooling of a causal LM: the same forwards a Qwen3-Embedding runs,
at 135 M parameters). Both variants run once before the timings (every matmul pipeline compiled); then each round
runs both, the order alternating, and the figure is the median over the rounds. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from host_cpu import describe_cpu

import doppler_py
from doppler_py.model.catalog import DEFAULT_MODEL

SUBJECTS = ["rivers", "trains", "bread", "stars", "glass", "moss", "wolves", "clocks"]
TEMPLATES = ["A note about {}.", "Why {} matter to people", "The history of {} in brief", "{} at night"]
TEXTS = [t.format(s) for t in TEMPLATES for s in SUBJECTS]  # 32 short texts (4-8 tokens each)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--weights", default="q4_1")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    variants = {
        "batched": lambda engine: engine.embeddings(TEXTS),
        "one_at_a_time": lambda engine: [engine.embeddings(text) for text in TEXTS],
    }
    with doppler_py.load(args.model, args.weights, progress=False) as engine:
        for run in variants.values():  # compiles every row count's pipelines
            run(engine)
        seconds: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(args.rounds):
            for name in list(variants) if r % 2 == 0 else list(variants)[::-1]:
                start = time.perf_counter()
                variants[name](engine)
                seconds[name].append(time.perf_counter() - start)
        adapter = engine.model.gpu.summary()["adapter"]
    per_s = {name: len(TEXTS) / statistics.median(s) for name, s in seconds.items()}
    print(
        json.dumps(
            {
                "model": args.model,
                "weights": args.weights,
                "texts": len(TEXTS),
                "embeddings_per_s": {k: round(v, 1) for k, v in per_s.items()},
                "speedup": round(per_s["batched"] / per_s["one_at_a_time"], 2),
                "seconds": {k: [round(x, 3) for x in v] for k, v in seconds.items()},
                "adapter": adapter,
                "cpu": describe_cpu(),
            }
        )
    )


if __name__ == "__main__":
    main()
