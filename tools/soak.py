"""Soak run: thousands of speculative tokens with many rollbacks, checked against plain greedy, memory watched.

    python tools/soak.py [--tokens 5000] [--chunk 500] [--k 4] [--drafters prompt-lookup,layer-skip]
                         [--model smollm2-135m-instruct] [--weights q4_1] [--json PATH]

Generations of `--chunk` tokens (greedy, no stop token, the draft length pinned to `--k` so speculation never
pauses) take turns over the drafters and a set of prompts until `--tokens` tokens are made. Every step that
keeps fewer drafts than it made rolls the KV caches back; the run counts them. Each generation is then
repeated with plain decoding: greedy speculative decoding must give the same tokens. Where they differ, the
target's two candidate logits at the first difference are printed, to tell a near-tie of float rounding
(the verifier scores k+1 rows in one matmul, plain decoding one row) from a real fault. GPU buffers
(count and bytes, as wgpu-py counts live buffers after a garbage collection) are recorded after every
generation and must not grow; after `close()` they must be back where they were before loading.

Prints a summary and writes it as JSON. Exit status 1 if memory grew or a difference is not a near-tie.
Not part of the test suite: the full run takes tens of minutes on a software adapter.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import asdict, dataclass, field, fields

import numpy as np
import wgpu

import doppler_py
from doppler_py.gpu.device import default_gpu
from doppler_py.paths import cache_dir
from doppler_py.sampling import SamplingParams
from doppler_py.speculative.stats import SpecStats

PROMPTS = [
    "Repeat this passage exactly, twice: The quick brown fox jumps over the lazy dog while the farmer sleeps "
    "under the old oak tree, dreaming of rain.",
    "Rewrite this Python function with type hints and a docstring, keeping the logic:\n"
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)",
    "Tell me a long story about a lighthouse keeper who finds a message in a bottle.",
    "List the planets of the solar system with one fact about each, then list them again in reverse order.",
    "Explain how a hash table works, step by step, with an example.",
]
# A logit gap this small between the two tokens where runs differ is float rounding, not a fault: the verifier's
# k+1-row matmul and plain decoding's one-row GEMV sum in different orders.
NEAR_TIE = 1e-2


@dataclass
class Memory:
    buffers: int
    nbytes: int


def gpu_memory() -> Memory:
    gc.collect()
    counts = wgpu.diagnostics.object_counts.get_dict()["Buffer"]
    return Memory(counts["count"], counts.get("resource_mem", 0))


@dataclass
class Tally:
    tokens: int = 0
    steps: int = 0  # speculative steps
    plain_steps: int = 0
    rollbacks: int = 0  # steps that kept fewer drafts than they made
    rolled_back_positions: int = 0  # rejected draft positions discarded from the caches
    drafted: int = 0
    accepted: int = 0
    seconds: float = 0.0

    def add_step(self, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        if accepted < drafted:
            self.rollbacks += 1
            self.rolled_back_positions += drafted - accepted

    def merge(self, other: Tally) -> None:
        for name in (f.name for f in fields(self)):
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class Report:
    model: str
    weights: str
    k: int
    chunk: int
    total: Tally = field(default_factory=Tally)
    by_drafter: dict[str, Tally] = field(default_factory=dict)
    generations: int = 0
    identical_to_plain: int = 0
    differences: list[dict] = field(default_factory=list)
    plain_seconds: float = 0.0
    memory_before_load: Memory | None = None
    memory_loaded: Memory | None = None
    memory_after_each: list[Memory] = field(default_factory=list)
    memory_after_close: Memory | None = None

    @property
    def memory_flat(self) -> bool:
        return all(m == self.memory_loaded for m in self.memory_after_each)

    @property
    def faults(self) -> list[dict]:
        return [d for d in self.differences if d["logit_gap"] is None or d["logit_gap"] > NEAR_TIE]


def speculative_run(engine, mode: str, ids: list[int], count: int, k: int) -> tuple[list[int], Tally]:
    """Greedy speculative generation of exactly `count` tokens, counting steps and rollbacks as it goes."""
    tally = Tally()
    spec = engine.speculative_engine(mode)
    stats = SpecStats()
    tokens: list[int] = []
    steps, accepted = 0, 0
    start = time.perf_counter()
    for new in spec.iter_generate(ids, count, SamplingParams(), stats=stats, k=k):
        if stats.steps > steps:  # these tokens came from a speculative step
            tally.add_step(stats.k_history[-1], stats.accepted - accepted)
            steps, accepted = stats.steps, stats.accepted
        else:
            tally.plain_steps += 1
        tokens.extend(new)
    tally.seconds = time.perf_counter() - start
    tally.tokens = len(tokens)
    return tokens, tally


def plain_run(engine, ids: list[int], count: int) -> list[int]:
    spec = engine.speculative_engine("none")
    return spec.generate(ids, count, SamplingParams()).tokens


def logit_gap(engine, prefix: list[int], a: int, b: int) -> float | None:
    """|logit(a) - logit(b)| of the target after `prefix` (plain forward), None if it cannot be computed."""
    model = engine.model
    cache = model.new_cache(len(prefix))
    try:
        logits = model.forward(prefix, cache, 0)
    finally:
        model.release_cache(cache)
    gap = abs(float(logits[a]) - float(logits[b]))
    return gap if np.isfinite(gap) else None


def soak(args: argparse.Namespace) -> Report:
    report = Report(model=args.model, weights=args.weights, k=args.k, chunk=args.chunk)
    drafters = args.drafters.split(",")
    gpu = default_gpu()
    gpu.wait_idle()  # the device and its own small sync buffer exist before the baseline is taken
    report.memory_before_load = gpu_memory()
    engine = doppler_py.load(args.model, weights=args.weights, max_seq=args.chunk + 256, progress=False, gpu=gpu)
    try:
        prompts = [engine.encode_prompt([{"role": "user", "content": text}]) for text in PROMPTS]
        for mode in [*drafters, "none"]:  # build and calibrate every engine before measuring memory
            engine.speculative_engine(mode).generate(prompts[0], 4, SamplingParams())
        report.memory_loaded = gpu_memory()
        turn = 0
        while report.total.tokens < args.tokens:
            mode, ids = drafters[turn % len(drafters)], prompts[turn % len(prompts)]
            count = min(args.chunk, args.tokens - report.total.tokens)
            tokens, run = speculative_run(engine, mode, ids, count, args.k)
            report.total.merge(run)
            report.by_drafter.setdefault(mode, Tally()).merge(run)
            start = time.perf_counter()
            plain = plain_run(engine, ids, count)
            report.plain_seconds += time.perf_counter() - start
            report.generations += 1
            if tokens == plain:
                report.identical_to_plain += 1
            else:
                at = next(i for i, (a, b) in enumerate(zip(tokens, plain, strict=False)) if a != b)
                gap = logit_gap(engine, ids + tokens[:at], tokens[at], plain[at])
                report.differences.append(
                    {"generation": turn, "drafter": mode, "position": at, "speculative": tokens[at],
                     "plain": plain[at], "logit_gap": gap}
                )  # fmt: skip
            report.memory_after_each.append(gpu_memory())
            print(
                f"[{turn}] {mode:14s} {len(tokens)} tokens, {run.rollbacks} rollbacks in {run.steps} steps; "
                f"same as plain: {tokens == plain}; GPU buffers {report.memory_after_each[-1]}",
                flush=True,
            )
            turn += 1
    finally:
        engine.close()
    del engine
    report.memory_after_close = gpu_memory()
    return report


def summary(report: Report) -> dict:
    total = report.total
    return {
        "model": report.model,
        "weights": report.weights,
        "k": report.k,
        "generations": report.generations,
        "tokens": total.tokens,
        "steps": total.steps,
        "plain_steps": total.plain_steps,
        "rollbacks": total.rollbacks,
        "rolled_back_positions": total.rolled_back_positions,
        "drafted": total.drafted,
        "accepted": total.accepted,
        "acceptance_rate": round(total.accepted / total.drafted, 4) if total.drafted else 0.0,
        "speculative_tokens_per_s": round(total.tokens / total.seconds, 2) if total.seconds else 0.0,
        "plain_tokens_per_s": round(total.tokens / report.plain_seconds, 2) if report.plain_seconds else 0.0,
        "by_drafter": {name: asdict(t) for name, t in report.by_drafter.items()},
        "identical_to_plain": report.identical_to_plain,
        "differences": report.differences,
        "near_tie_threshold": NEAR_TIE,
        "memory": {
            "before_load": asdict(report.memory_before_load),
            "loaded": asdict(report.memory_loaded),
            "after_last_generation": asdict(report.memory_after_each[-1]) if report.memory_after_each else None,
            "max_during": asdict(max(report.memory_after_each, key=lambda m: m.nbytes, default=report.memory_loaded)),
            "after_close": asdict(report.memory_after_close),
            "flat": report.memory_flat,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=5000, help="speculative tokens to generate in all")
    parser.add_argument("--chunk", type=int, default=500, help="tokens per generation")
    parser.add_argument("--k", type=int, default=4, help="draft length (pinned)")
    parser.add_argument("--drafters", default="prompt-lookup,layer-skip", help="comma-separated, taking turns")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--weights", default="q4_1")
    parser.add_argument("--json", help="where to write the summary (default: soak.json in the cache directory)")
    args = parser.parse_args(argv)
    args.json = args.json or str(cache_dir("soak") / "soak.json")
    report = soak(args)
    result = summary(report)
    with open(args.json, "w") as out:
        json.dump(result, out, indent=2)
    memory = result["memory"]
    print(
        f"\n{result['tokens']} tokens in {result['generations']} generations: {result['steps']} speculative steps "
        f"({result['plain_steps']} plain), {result['rollbacks']} rollbacks discarding "
        f"{result['rolled_back_positions']} draft positions; acceptance {result['acceptance_rate']:.1%}\n"
        f"same tokens as plain greedy: {result['identical_to_plain']}/{result['generations']} generations"
        + "".join(f"\n  differs: {d}" for d in result["differences"])
        + f"\nGPU buffers: before load {memory['before_load']}, loaded {memory['loaded']}, "
        f"after the last generation {memory['after_last_generation']}, after close {memory['after_close']}; "
        f"flat: {memory['flat']}\nwritten to {args.json}"
    )
    back_to_start = report.memory_after_close == report.memory_before_load
    return 0 if report.memory_flat and back_to_start and not report.faults else 1


if __name__ == "__main__":
    sys.exit(main())
