"""SmolLM2-135M on the GPU per weight format, next to HF transformers (torch CPU) in the same run.

    python tools/bench_model.py --weights f32,f16,q4_1 --repeats 3 --json model.json

For each format: load time (model already converted into the cache), resident GPU memory (live wgpu buffers:
weights + activations + a KV cache of --max-seq positions), prefill tokens/s (one --prompt-tokens prompt) and
plain greedy decode tokens/s (--new-tokens). Medians over --repeats; our formats and the peer are interleaved
per repeat so machine noise hits them alike.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def gpu_buffer_bytes() -> int:
    import wgpu

    gc.collect()
    return int(wgpu.diagnostics.object_counts.get_dict()["Buffer"].get("resource_mem", 0))


def prompt_ids(vocab: int, n: int) -> list[int]:
    return np.random.default_rng(0).integers(100, min(vocab, 30000), size=n).tolist()


def bench_ours(weights: str, args) -> dict:
    import doppler_py
    from doppler_py.sampling import SamplingParams

    before = gpu_buffer_bytes()
    start = time.perf_counter()
    # No draft heads: the resident figure is the plain model's (SmolLM2's three shipped heads add ~34 MiB).
    engine = doppler_py.load(weights=weights, progress=False, max_seq=args.max_seq, draft_head=False)
    load_s = time.perf_counter() - start
    model = engine.model
    ids = prompt_ids(model.config.vocab_size, args.prompt_tokens)
    cache = model.new_cache(args.max_seq)
    plain = engine.speculative_engine("none")
    model.forward(ids[:8], cache, 0, logits="none")  # compile the pipelines outside the timings
    plain.generate(ids[:8], 4, SamplingParams())
    cache.truncate(0)
    start = time.perf_counter()
    model.forward(ids, cache, 0, logits="last")
    prefill_s = time.perf_counter() - start
    resident = gpu_buffer_bytes() - before
    model.release_cache(cache)
    stats = plain.generate(ids[:16], args.new_tokens, SamplingParams()).stats
    weight_bytes = model.weights.nbytes
    engine.close()
    return {
        "load_s": load_s,
        "gpu_bytes": resident,
        "weight_bytes": weight_bytes,
        "prefill_tok_s": args.prompt_tokens / prefill_s,
        # Every token, the first included, is one T=1 step after the prefill of all but the last prompt token.
        "decode_tok_s": stats.generated / stats.decode_s,
    }


def load_peer(threads: int):
    import torch
    import transformers

    from doppler_py.model.catalog import DEFAULT_MODEL, known_model_file

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(threads)
    path = known_model_file(DEFAULT_MODEL)
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    return model, time.perf_counter() - start


def bench_peer(model, load_s: float, args) -> dict:
    import torch

    ids = torch.tensor([prompt_ids(model.config.vocab_size, args.prompt_tokens)])
    with torch.no_grad():
        model(ids[:, :8])
        start = time.perf_counter()
        model(ids)
        prefill_s = time.perf_counter() - start
        short = ids[:, :16]
        start = time.perf_counter()
        out = model.generate(
            short, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0
        )
        decode_s = time.perf_counter() - start
    n = out.shape[1] - short.shape[1]
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "load_s": load_s,
        "gpu_bytes": None,
        "weight_bytes": params,
        "prefill_tok_s": args.prompt_tokens / prefill_s,
        "decode_tok_s": n / decode_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", default="f32,f16,q4_1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-seq", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2, help="torch threads for the peer")
    parser.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    runs: dict[str, list[dict]] = {}
    peer = None
    if args.peers:
        try:
            peer = load_peer(args.threads)
        except ImportError as exc:
            print(f"peer skipped: {exc}", file=sys.stderr)
    for repeat in range(args.repeats):
        for weights in args.weights.split(","):
            runs.setdefault(weights, []).append(bench_ours(weights, args))
            print(f"rep {repeat} {weights}: {runs[weights][-1]}", file=sys.stderr)
        if peer is not None:
            runs.setdefault("transformers f32 (torch CPU)", []).append(bench_peer(*peer, args))
            print(f"rep {repeat} peer: {runs['transformers f32 (torch CPU)'][-1]}", file=sys.stderr)

    def med(rows, key):
        values = [r[key] for r in rows if r[key] is not None]
        return statistics.median(values) if values else None

    table = [{"engine": name, **{key: med(rows, key) for key in rows[0]}} for name, rows in runs.items()]
    print(
        f"{'engine':30s} {'load s':>7s} {'weights MiB':>12s} {'GPU MiB':>8s} {'prefill tok/s':>14s} "
        f"{'decode tok/s':>13s}"
    )
    for row in table:
        mib = f"{row['gpu_bytes'] / 2**20:8.1f}" if row["gpu_bytes"] else f"{'-':>8s}"
        print(
            f"{row['engine']:30s} {row['load_s']:7.2f} {row['weight_bytes'] / 2**20:12.1f} {mib} "
            f"{row['prefill_tok_s']:14.1f} {row['decode_tok_s']:13.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
