"""Plain vs speculative decoding on SmolLM2-135M, side by side in one run (interleaved, medians).

    python tools/bench_speculative.py --weights f32,f16,q4_1 --repeats 3 --json bench.json --png bench.png

For every weight format and prompt kind, each repeat runs every method once, one after another, so machine
noise hits all methods alike; the table reports medians and the speedup of each method over plain decoding of
the same model measured in the same run. Greedy decoding throughout (so all methods produce the same text).
Peers (HF transformers on torch CPU, plain and with its prompt lookup) run on the same prompts when installed.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

PROMPTS = {
    "chat": [{"role": "user", "content": "What are three good ways to stay healthy in winter? Explain each briefly."}],
    "repeat": [
        {
            "role": "user",
            "content": "Repeat this passage exactly, word for word:\n\nThe river bends twice before the old mill, "
            "where herons wait in the reeds and the water slows to a mirror under the willows. In spring the "
            "meadow floods and the path to the village disappears for a week; in autumn the miller's children "
            "gather walnuts along the bank and race paper boats from the bridge to the weir.",
        }
    ],
    # A realistic code edit: the answer mostly copies a longer block (where prompt lookup is meant to help).
    "code": [
        {
            "role": "user",
            "content": "Add a one-line docstring to the add method of this class. Reply with the complete class "
            "only.\n\nclass Inventory:\n    def __init__(self):\n        self.items = {}\n\n"
            "    def add(self, name, count):\n        if name in self.items:\n            self.items[name] += count\n"
            "        else:\n            self.items[name] = count\n\n    def remove(self, name, count):\n"
            "        if name not in self.items:\n            raise KeyError(name)\n"
            "        self.items[name] -= count\n        if self.items[name] <= 0:\n            del self.items[name]\n\n"
            "    def total(self):\n        return sum(self.items.values())\n",
        }
    ],
    # A short function: SmolLM2 rewrites more than it copies, so lookup finds less to propose.
    "code-small": [
        {
            "role": "user",
            "content": "Here is a Python function:\n\ndef summarize(values):\n    x = 0\n    for v in values:\n"
            "        if v > 0:\n            x += v\n    count = len(values)\n    mean = x / count if count else 0\n"
            "    return {'total': x, 'mean': mean}\n\nRewrite the function with the variable x renamed to total. "
            "Reply with the code only.",
        }
    ],
    "summarise": [
        {
            "role": "user",
            "content": "Summarise in two sentences: The town council met on Tuesday to discuss the new library. "
            "Residents asked for longer opening hours and more study rooms. The council agreed to extend hours on "
            "weekends starting next month and to convert the old archive into two study rooms by the end of the "
            "year, funded by the regional culture grant.",
        }
    ],
}
METHODS = ("plain", "prompt-lookup", "layer-skip")


def run_ours(engine, prompt, method: str, tokens: int) -> dict:
    speculative = None if method == "plain" else method
    result = engine.generate(prompt, max_tokens=tokens, speculative=speculative)
    stats = result.stats
    return {
        "tokens": len(result.tokens),
        "tokens_per_s": result.tokens_per_s,
        "acceptance_rate": result.acceptance_rate,
        "tokens_per_step": stats["tokens_per_step"],
        "plain_steps": stats["plain_steps"],
        "steps": stats["steps"],
        "text_tokens": result.tokens,
    }


def run_peer(model, tokenizer, prompt, tokens: int, lookup: bool) -> dict:
    import torch

    ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt")
    if not isinstance(ids, torch.Tensor):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    kwargs = {"prompt_lookup_num_tokens": 10} if lookup else {}
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=0, **kwargs)
    elapsed = time.perf_counter() - start
    n = out.shape[1] - ids.shape[1]
    return {"tokens": n, "tokens_per_s": n / elapsed}


def load_peer(threads: int):
    try:
        import torch
        import transformers
    except ImportError:
        return None
    import os

    from doppler_py.model.catalog import DEFAULT_MODEL, known_model_file

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(threads)
    path = known_model_file(DEFAULT_MODEL)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.eval(), tokenizer


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", default="f32,f16,q4_1")
    parser.add_argument("--prompts", default=",".join(PROMPTS))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--peers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run HF transformers (torch CPU) when installed",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads for the peer")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args(argv)

    import doppler_py

    weights = args.weights.split(",")
    prompts = args.prompts.split(",")
    methods = args.methods.split(",")
    results: dict[str, dict[str, dict[str, list[dict]]]] = {}
    for weight in weights:
        with doppler_py.load(weights=weight, progress=False, max_seq=1024) as engine:
            print(f"[{weight}] adapter: {engine.model.gpu.name} via {engine.model.gpu.backend}", file=sys.stderr)
            for method in methods:  # warm-up: pipelines compile, cost models calibrate
                run_ours(engine, PROMPTS["chat"], method, 8)
            per_prompt = results.setdefault(weight, {})
            for repeat in range(args.repeats):
                for prompt in prompts:
                    for method in methods:
                        row = run_ours(engine, PROMPTS[prompt], method, args.tokens)
                        per_prompt.setdefault(prompt, {}).setdefault(method, []).append(row)
                        print(
                            f"[{weight}] rep {repeat} {prompt:9s} {method:14s} {row['tokens_per_s']:7.2f} tok/s "
                            f"accept {row['acceptance_rate']:.2f}",
                            file=sys.stderr,
                        )
    peers: dict[str, dict[str, list[dict]]] = {}
    peer = load_peer(args.threads) if args.peers else None
    if peer is not None:
        model, tokenizer = peer
        for _ in range(args.repeats):
            for prompt in prompts:
                for name, lookup in (("transformers", False), ("transformers+lookup", True)):
                    row = run_peer(model, tokenizer, PROMPTS[prompt], args.tokens, lookup)
                    peers.setdefault(prompt, {}).setdefault(name, []).append(row)
                    print(f"[peer] {prompt:9s} {name:20s} {row['tokens_per_s']:7.2f} tok/s", file=sys.stderr)

    table = []
    for weight, per_prompt in results.items():
        for prompt, per_method in per_prompt.items():
            plain = median(per_method["plain"], "tokens_per_s") if "plain" in per_method else None
            for method, rows in per_method.items():
                tps = median(rows, "tokens_per_s")
                same_text = (
                    all(r["text_tokens"] == per_method["plain"][0]["text_tokens"] for r in rows)
                    if "plain" in per_method
                    else None
                )
                table.append(
                    {
                        "weights": weight,
                        "prompt": prompt,
                        "method": method,
                        "tokens_per_s": round(tps, 2),
                        "speedup_vs_plain": round(tps / plain, 3) if plain else None,
                        "acceptance_rate": round(median(rows, "acceptance_rate"), 3),
                        "tokens_per_step": round(median(rows, "tokens_per_step"), 2),
                        "same_tokens_as_plain": same_text,
                        "repeats": len(rows),
                    }
                )
    for prompt, per_method in peers.items():
        plain = median(per_method["transformers"], "tokens_per_s")
        for name, rows in per_method.items():
            tps = median(rows, "tokens_per_s")
            table.append(
                {
                    "weights": "f32 (torch)",
                    "prompt": prompt,
                    "method": name,
                    "tokens_per_s": round(tps, 2),
                    "speedup_vs_plain": round(tps / plain, 3),
                    "acceptance_rate": None,
                    "tokens_per_step": None,
                    "same_tokens_as_plain": None,
                    "repeats": len(rows),
                }
            )

    header = (
        f"{'weights':12s} {'prompt':10s} {'method':20s} {'tok/s':>8s} {'vs plain':>9s} {'accept':>7s} "
        f"{'tok/step':>8s}  same"
    )
    print(header)
    print("-" * len(header))
    for row in table:
        accept = "" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.2f}"
        per_step = "" if row["tokens_per_step"] is None else f"{row['tokens_per_step']:.2f}"
        speedup = "" if row["speedup_vs_plain"] is None else f"{row['speedup_vs_plain']:.2f}x"
        same = "" if row["same_tokens_as_plain"] is None else ("yes" if row["same_tokens_as_plain"] else "NO")
        print(
            f"{row['weights']:12s} {row['prompt']:10s} {row['method']:20s} {row['tokens_per_s']:8.2f} "
            f"{speedup:>9s} {accept:>7s} {per_step:>8s}  {same}"
        )
    report = {
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "tokens": args.tokens,
        "repeats": args.repeats,
        "rows": table,
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.png:
        plot(table, args.png)
    return 0


def plot(table: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["weights"], r["prompt"]) for r in table})
    methods = sorted({r["method"] for r in table})
    fig, ax = plt.subplots(figsize=(max(8, len(groups) * 1.1), 4.5))
    width = 0.8 / len(methods)
    for j, method in enumerate(methods):
        values = [
            next((r["tokens_per_s"] for r in table if (r["weights"], r["prompt"]) == g and r["method"] == method), 0.0)
            for g in groups
        ]
        ax.bar([i + j * width for i in range(len(groups))], values, width, label=method)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
    ax.set_xticklabels([f"{w}\n{p}" for w, p in groups], fontsize=8)
    ax.set_ylabel("tokens/s (median)")
    ax.set_title("SmolLM2-135M: plain vs speculative decoding")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
