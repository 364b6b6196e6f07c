"""SmolLM2-135M on the GPU per weight format and WebGPU implementation, next to HF transformers (torch CPU) in the
same run.

    python tools/bench_model.py --weights f32,f16,q4_1 --repeats 3 --json model.json
    python tools/bench_model.py --weights q4_1 --webgpu wgpu-native,dawn --mesa25 --no-peers

For each format and implementation: load time (model already converted into the cache), the seconds its pipelines
took to compile (the first load in the process compiles them; later ones share them), resident GPU memory (live
buffers: weights + activations + a KV cache of --max-seq positions), prefill tokens/s (one --prompt-tokens prompt),
first-token time (that prompt's prefill and first token, pipelines compiled) and plain greedy decode tokens/s
(--new-tokens). Medians over --repeats (compile: the first repeat's); formats, implementations and the peer are
interleaved per repeat so machine noise hits them alike. --mesa25 runs every implementation on Mesa 25's lavapipe
(tools/mesa25.sh), the one Vulkan driver here that both wgpu-native and Dawn accept, so they share an adapter.
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


def gpu_buffer_bytes(webgpu: str) -> int:
    from doppler_py.gpu.webgpu import api

    gc.collect()
    return int(api(webgpu).diagnostics.object_counts.get_dict()["Buffer"].get("resource_mem", 0))


def prompt_ids(vocab: int, n: int) -> list[int]:
    return np.random.default_rng(0).integers(100, min(vocab, 30000), size=n).tolist()


def compile_seconds(model) -> float:
    """Seconds every pipeline compiled so far on the model's device took (kernels.PipelineCache's records)."""
    return sum(
        r.module_s + r.pipeline_s for cache in model.registry.gpu.pipeline_caches.values() for r in cache.records
    )


def bench_ours(weights: str, webgpu: str, args) -> dict:
    import doppler_py
    from doppler_py.sampling import SamplingParams

    before = gpu_buffer_bytes(webgpu)
    start = time.perf_counter()
    # No draft heads: the resident figure is the plain model's (SmolLM2's three shipped heads add ~34 MiB).
    engine = doppler_py.load(weights=weights, progress=False, max_seq=args.max_seq, draft_head=False, webgpu=webgpu)
    load_s = time.perf_counter() - start
    model = engine.model
    compiled_before = compile_seconds(model)
    ids = prompt_ids(model.config.vocab_size, args.prompt_tokens)
    cache = model.new_cache(args.max_seq)
    plain = engine.speculative_engine("none")
    model.forward(ids[:8], cache, 0, logits="none")  # compile the pipelines outside the timings
    plain.generate(ids[:8], 4, SamplingParams())
    start = time.perf_counter()
    plain.generate(ids, 1, SamplingParams())
    first_token_s = time.perf_counter() - start
    cache.truncate(0)
    start = time.perf_counter()
    model.forward(ids, cache, 0, logits="last")
    prefill_s = time.perf_counter() - start
    resident = gpu_buffer_bytes(webgpu) - before
    model.release_cache(cache)
    stats = plain.generate(ids[:16], args.new_tokens, SamplingParams()).stats
    weight_bytes = model.weights.nbytes
    # Everything this run compiled (the first repeat; later ones share its pipelines), the large prefill's too.
    compile_s = compile_seconds(model) - compiled_before
    engine.close()
    return {
        "load_s": load_s,
        "compile_s": compile_s,
        "first_token_s": first_token_s,
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
        "compile_s": None,
        "first_token_s": None,
        "gpu_bytes": None,
        "weight_bytes": params,
        "prefill_tok_s": args.prompt_tokens / prefill_s,
        "decode_tok_s": n / decode_s,
    }


def _adapter(webgpu: str) -> str:
    from doppler_py.gpu.device import default_gpu

    gpu = default_gpu(False, webgpu)
    return f"{gpu.name}; {gpu.info.get('description', '')}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", default="f32,f16,q4_1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-seq", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2, help="torch threads for the peer")
    parser.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--webgpu", default="wgpu-native", help="implementations, comma-separated: wgpu-native,dawn")
    parser.add_argument("--mesa25", action="store_true", help="every implementation on Mesa 25's lavapipe")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    implementations = args.webgpu.split(",")
    if args.mesa25:
        from doppler_py.gpu.webgpu import use_mesa25_everywhere

        use_mesa25_everywhere()

    runs: dict[str, list[dict]] = {}
    peer = None
    if args.peers:
        try:
            peer = load_peer(args.threads)
        except ImportError as exc:
            print(f"peer skipped: {exc}", file=sys.stderr)
    for repeat in range(args.repeats):
        for weights in args.weights.split(","):
            for webgpu in implementations:
                name = f"{weights} on {webgpu}"
                runs.setdefault(name, []).append(bench_ours(weights, webgpu, args))
                print(f"rep {repeat} {name}: {runs[name][-1]}", file=sys.stderr)
        if peer is not None:
            runs.setdefault("transformers f32 (torch CPU)", []).append(bench_peer(*peer, args))
            print(f"rep {repeat} peer: {runs['transformers f32 (torch CPU)'][-1]}", file=sys.stderr)

    def med(rows, key):
        values = [r[key] for r in rows if r[key] is not None]
        return statistics.median(values) if values else None

    table = [
        {"engine": name, **{key: med(rows, key) for key in rows[0]}, "compile_s": rows[0]["compile_s"]}
        for name, rows in runs.items()
    ]
    adapters = {w: _adapter(w) for w in implementations}
    print(
        f"{'engine':30s} {'load s':>7s} {'compile s':>10s} {'weights MiB':>12s} {'GPU MiB':>8s} "
        f"{'prefill tok/s':>14s} {'first token s':>14s} {'decode tok/s':>13s}"
    )
    for row in table:
        mib = f"{row['gpu_bytes'] / 2**20:8.1f}" if row["gpu_bytes"] else f"{'-':>8s}"
        compile_s = f"{row['compile_s']:10.2f}" if row["compile_s"] is not None else f"{'-':>10s}"
        first = f"{row['first_token_s']:14.3f}" if row["first_token_s"] is not None else f"{'-':>14s}"
        print(
            f"{row['engine']:30s} {row['load_s']:7.2f} {compile_s} {row['weight_bytes'] / 2**20:12.1f} {mib} "
            f"{row['prefill_tok_s']:14.1f} {first} {row['decode_tok_s']:13.2f}"
        )
    for webgpu, adapter in adapters.items():
        print(f"{webgpu}: {adapter}")
    if args.json:
        report = {"args": vars(args) | {"json": str(args.json)}, "adapters": adapters, "rows": table}
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
