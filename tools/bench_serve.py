"""Serving figures on SmolLM2-135M: an 8-turn chat's time to first token per turn, with the prefix cache and
without it, side by side in one run (the two alternate, their order swapped from repeat to repeat).

    python tools/bench_serve.py --repeats 2 --json serve.json --png serve.png

Each turn sends the whole conversation so far (as a server receives it): with the prefix cache, a turn prefills
only its new messages; without it, everything again. Time to first token is from the call to the first streamed
piece, which includes the prefill and the first step. Greedy, so both runs produce the same answers (checked).

Concurrent clients batched on the GPU (issue 50's other half) are not built yet: one generation runs at a time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

QUESTIONS = [
    "I'm planning a small vegetable garden. What should I plant first?",
    "How often should I water tomatoes?",
    "What about pests? Anything natural I can use?",
    "Can I grow herbs in the same bed?",
    "Which herbs are easiest for a beginner?",
    "How much sun do they need?",
    "Should I use compost or fertiliser?",
    "Thanks! Can you summarise the plan in three steps?",
]


def chat(engine, *, cached: bool, max_tokens: int) -> list[dict]:
    """One conversation of len(QUESTIONS) turns; per turn its time to first token, prompt and cached tokens."""
    engine.prefix_cache.clear()
    budget = engine.prefix_cache.budget_bytes
    if not cached:
        engine.prefix_cache.budget_bytes = 0
    messages, turns = [], []
    try:
        for question in QUESTIONS:
            messages.append({"role": "user", "content": question})
            start = time.perf_counter()
            first = None
            for _ in engine.stream(messages, max_tokens=max_tokens, speculative=None):
                first = first if first is not None else time.perf_counter() - start
            result = engine.last_result
            messages.append({"role": "assistant", "content": result.text})
            turns.append(
                {
                    "ttft_s": first,
                    "prompt_tokens": result.prompt_tokens,
                    "cached_tokens": result.cached_tokens,
                    "text": result.text,
                }
            )
    finally:
        engine.prefix_cache.budget_bytes = budget
        engine.prefix_cache.clear()
    return turns


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", default="keep")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args(argv)

    import doppler_py
    from doppler_py.ops.linear import compile_rows

    engine = doppler_py.load(weights=args.weights, progress=False, warmup="now")
    # Every prefill chunk's row count has pipelines of its own: compiled now, outside the timings of either mode.
    compile_rows(engine.model.linears())
    chat(engine, cached=False, max_tokens=4)
    runs: dict[str, list[list[dict]]] = {"cached": [], "uncached": []}
    for repeat in range(args.repeats):
        for mode in ("cached", "uncached") if repeat % 2 == 0 else ("uncached", "cached"):
            runs[mode].append(chat(engine, cached=mode == "cached", max_tokens=args.max_tokens))
            print(f"repeat {repeat} {mode}: " + " ".join(f"{t['ttft_s']:.2f}" for t in runs[mode][-1]), file=sys.stderr)
    engine.close()
    for cached, uncached in zip(runs["cached"], runs["uncached"], strict=True):
        if [t["text"] for t in cached] != [t["text"] for t in uncached]:
            print("the cached and uncached answers differ", file=sys.stderr)
            return 1
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'ttft cached s':>14} {'ttft uncached s':>16} {'ratio':>6}")
    table = []
    for turn in range(len(QUESTIONS)):
        with_cache = statistics.median(run[turn]["ttft_s"] for run in runs["cached"])
        without = statistics.median(run[turn]["ttft_s"] for run in runs["uncached"])
        prompt, hit = runs["cached"][0][turn]["prompt_tokens"], runs["cached"][0][turn]["cached_tokens"]
        table.append({"turn": turn + 1, "prompt_tokens": prompt, "cached_tokens": hit, "ttft_cached_s": with_cache})
        table[-1] |= {"ttft_uncached_s": without}
        print(f"{turn + 1:>4} {prompt:>7} {hit:>7} {with_cache:>14.3f} {without:>16.3f} {without / with_cache:>6.2f}")
    last_over_first = {
        mode: table[-1][f"ttft_{mode}_s"] / table[0][f"ttft_{mode}_s"] for mode in ("cached", "uncached")
    }
    print(
        f"turn 8 / turn 1 time to first token: cached {last_over_first['cached']:.2f}, uncached "
        f"{last_over_first['uncached']:.2f}"
    )
    if args.json:
        args.json.write_text(json.dumps({"turns": table, "last_over_first": last_over_first, "runs": runs}, indent=1))
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(figsize=(6, 3.5))
        turns = [row["turn"] for row in table]
        for mode in ("cached", "uncached"):
            axes.plot(
                turns,
                [row[f"ttft_{mode}_s"] for row in table],
                marker="o",
                label=f"prefix cache {'on' if mode == 'cached' else 'off'}",
            )
        axes.set_xlabel("chat turn")
        axes.set_ylabel("time to first token (s)")
        axes.legend()
        figure.tight_layout()
        figure.savefig(args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
