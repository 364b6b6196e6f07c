"""Embeddings per second: 32 short texts in one call (batched: several inputs' rows per forward) vs one call per text;
and reranked documents per second: 32 documents in one call (the shared prompt prefix once, the documents' rows
batched) vs one forward per document (the reranker before batching, `doppler_py.rerank`'s module docstring); all
interleaved in one process.

    python tools/bench_embeddings.py --rounds 5 [--model smollm2-135m-instruct --weights q4_1] [--task rerank]

SmolLM2 stands in for an embedding model (last-token pooling of a causal LM: the same forwards a Qwen3-Embedding runs,
at 135 M parameters) and for a reranker (its "yes"/"no" logits: the forwards a Qwen3-Reranker runs). Every variant
runs once before the timings (every matmul pipeline compiled); then each round runs them all, the order reversed
every other round, and the figure is the median over the rounds. Prints one JSON object.
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
QUERY = "what lives in the forest at night?"


def one_forward_per_document(engine, documents: list[str]) -> list[float]:
    """The reranker before batching: each pair's whole prompt in one forward over its own cache."""
    engine.rerank(QUERY, documents[:1])  # makes the engine's reranker
    reranker = engine._reranker
    return reranker.scores_one_by_one(reranker.token_ids(QUERY, documents))


TASKS = {
    "embeddings": {
        "batched": lambda engine: engine.embeddings(TEXTS),
        "one_at_a_time": lambda engine: [engine.embeddings(text) for text in TEXTS],
    },
    "rerank": {
        "batched": lambda engine: engine.rerank(QUERY, TEXTS),
        "one_at_a_time": lambda engine: one_forward_per_document(engine, TEXTS),
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--weights", default="q4_1")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--task", choices=[*TASKS, "all"], default="all")
    args = parser.parse_args()
    tasks = list(TASKS) if args.task == "all" else [args.task]
    variants = {f"{task}/{name}": run for task in tasks for name, run in TASKS[task].items()}
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
                "per_s": {k: round(v, 1) for k, v in per_s.items()},  # embeddings or documents per second
                "speedup": {t: round(per_s[f"{t}/batched"] / per_s[f"{t}/one_at_a_time"], 2) for t in tasks},
                "seconds": {k: [round(x, 3) for x in v] for k, v in seconds.items()},
                "adapter": adapter,
                "cpu": describe_cpu(),
            }
        )
    )


if __name__ == "__main__":
    main()
