"""What an unmerged LoRA adapter costs a decode step: SmolLM2 generations with adapters of rank 8 and 16 on q, k, v, o
or on every projection, against the base model, interleaved in one process.

    python tools/bench_lora.py --rounds 8 [--new-tokens 64 --weights q4_1]

The adapters are random PEFT folders written here (numpy, adapter_config.json + adapter_model.safetensors; the cost
does not depend on the values) and loaded beside the base weights, in f32. Each round runs one greedy plain-decoding
generation per variant, the order alternating between rounds, so every variant sees the same phase of a noisy shared
machine; a generation's step time is its wall time after the prefill over its forwards. What counts is each round's
step-time ratio against the base model (its median over the rounds). Prints a Markdown table, then one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import doppler_py
from doppler_py.model.config import ModelConfig
from doppler_py.sampling import SamplingParams

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
EVERY = (*ATTENTION, "gate_proj", "up_proj", "down_proj")
VARIANTS = {"r8-qkvo": (8, ATTENTION), "r16-qkvo": (16, ATTENTION), "r8-all": (8, EVERY), "r16-all": (16, EVERY)}
PROMPT = "Write a story about a night train."


def write_adapter(folder: Path, config: ModelConfig, rank: int, modules: tuple[str, ...], seed: int) -> Path:
    """A random PEFT LoRA folder for `config`'s projections (what peft's save_pretrained writes)."""
    h, hd = config.hidden_size, config.head_dim
    widths = {  # module: (out, in)
        "q_proj": (config.num_attention_heads * hd, h),
        "k_proj": (config.num_key_value_heads * hd, h),
        "v_proj": (config.num_key_value_heads * hd, h),
        "o_proj": (h, config.num_attention_heads * hd),
        "gate_proj": (config.intermediate_size, h),
        "up_proj": (config.intermediate_size, h),
        "down_proj": (h, config.intermediate_size),
    }
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module in modules:
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            out, inp = widths[module]
            name = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{name}.lora_A.weight"] = (rng.standard_normal((rank, inp)) * 0.01).astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = (rng.standard_normal((out, rank)) * 0.01).astype(np.float32)
    folder.mkdir(parents=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    peft_config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(modules)}
    (folder / "adapter_config.json").write_text(json.dumps(peft_config))
    return folder


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--weights", default="q4_1")
    args = parser.parse_args()
    greedy = SamplingParams(temperature=0.0)
    with tempfile.TemporaryDirectory() as tmp:
        probe = doppler_py.load(weights=args.weights, progress=False, max_seq=512)
        config = probe.model.config
        probe.close()
        folders = {
            name: write_adapter(Path(tmp) / name, config, rank, modules, seed)
            for seed, (name, (rank, modules)) in enumerate(VARIANTS.items())
        }
        engine = doppler_py.load(weights=args.weights, progress=False, max_seq=512, kv_cache_mb=0, lora=folders)
    spec = engine.speculative_engine("none")
    prompt = engine.encode_prompt(PROMPT, chat=True)
    names: list[str | None] = [None, *VARIANTS]
    for name in names:  # every pipeline compiled before the timings
        spec.generate(prompt, 8, greedy, adapter=name)
    step_ms: dict[str | None, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            result = spec.generate(prompt, args.new_tokens, greedy, adapter=name)
            decode_s = time.perf_counter() - start - result.stats.prefill_s
            step_ms[name].append(1000 * decode_s / (result.stats.steps + result.stats.plain_steps))
    adapter = engine.model.gpu.summary()["adapter"]
    engine.close()
    rows = {
        name or "base": {
            "step_ms": round(statistics.median(times), 2),
            "ratio_vs_base": round(statistics.median(t / b for t, b in zip(times, step_ms[None], strict=True)), 3),
        }
        for name, times in step_ms.items()
    }
    print("| adapter | decode step (ms, median) | step time vs base (median of per-round ratios) |")
    print("|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['step_ms']} | {row['ratio_vs_base']}x |")
    report = {"weights": args.weights, "new_tokens": args.new_tokens, "rounds": args.rounds, "variants": rows}
    print(json.dumps(report | {"adapter": adapter, "cpu": cpu_name()}))


if __name__ == "__main__":
    main()
