"""What penalties cost a decode step: SmolLM2 generations with and without them, interleaved in one process.

    python tools/bench_penalties.py --rounds 16
    python tools/bench_penalties.py --modes none,eagle --rounds 6 --new-tokens 128   # does speculation pay under one?

Per decoding mode (plain, prompt lookup), each round runs one generation per variant, the order alternating between
rounds, so every variant sees the same phase of a noisy shared machine; what counts is each round's step-time ratio
against "off" (its median over the rounds). Variants: "off"; "tiny" (penalties of 1e-6: the kernel runs and the
counts upload every step, the tokens stay those of "off", so the steps are the same steps); "freq0.5" (the user's
--frequency-penalty 0.5: other tokens, so other acceptance). A step's time is the generation's wall time over its
forwards (speculative and plain steps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import doppler_py
from doppler_py.sampling import SamplingParams

VARIANTS = {
    "off": SamplingParams(),
    "tiny": SamplingParams(frequency_penalty=1e-6, presence_penalty=1e-6, repetition_penalty=1.000001),
    "freq0.5": SamplingParams(frequency_penalty=0.5),
}
PROMPT = "Write a story about a night train."


def measure(spec, prompt: list[int], new_tokens: int, rounds: int) -> dict[str, dict[str, float]]:
    for params in VARIANTS.values():  # every pipeline compiled before the timings
        spec.generate(prompt, 8, params)
    runs: dict[str, list[tuple[float, float, int]]] = {name: [] for name in VARIANTS}  # (step ms, tok/s, forwards)
    acceptance: dict[str, list[tuple[int, int]]] = {name: [] for name in VARIANTS}  # (accepted, drafted)
    for r in range(rounds):
        for name in list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]:
            start = time.perf_counter()
            result = spec.generate(prompt, new_tokens, VARIANTS[name])
            wall = time.perf_counter() - start
            forwards = result.stats.steps + result.stats.plain_steps
            runs[name].append((1000 * wall / forwards, len(result.tokens) / wall, forwards))
            acceptance[name].append((result.stats.accepted, result.stats.drafted))
    return {
        name: {
            "step_ms": statistics.median(run[0] for run in rows),
            "tok_s": statistics.median(run[1] for run in rows),
            "forwards": statistics.median(run[2] for run in rows),
            "step_ratio_vs_off": statistics.median(a[0] / b[0] for a, b in zip(rows, runs["off"], strict=True)),
            "accepted_of_drafted": [sum(a for a, _ in acceptance[name]), sum(d for _, d in acceptance[name])],
        }
        for name, rows in runs.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--weights", default="q4_1")
    parser.add_argument("--modes", default="none,prompt-lookup", help="comma-separated drafters (none: plain decoding)")
    args = parser.parse_args()
    engine = doppler_py.load(weights=args.weights, progress=False, max_seq=512, warmup="now")
    prompt = engine.encode_prompt(PROMPT, chat=True)
    report = {
        mode: measure(engine.speculative_engine(mode), prompt, args.new_tokens, args.rounds)
        for mode in args.modes.split(",")
    }
    engine.close()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
