"""What an unmerged LoRA adapter costs a decode step: SmolLM2's decode forward with adapters of rank 8 and 16 on q, k,
v, o or on every projection, against the base model, interleaved in one process.

    python tools/bench_lora.py --rounds 60 [--steps 4 --weights q4_1]

The adapters are random PEFT folders written here (numpy, adapter_config.json + adapter_model.safetensors; the cost
does not depend on the values) and loaded beside the base weights, in f32. Each variant has its own sequence, the
prompt prefilled with its adapter; what is timed is a decode step's target forward (one row, every layer, the LM
head; submitted and waited for), `--steps` of them at the same position, per variant per round, the order
alternating between rounds, so that every variant sees the same phase of a noisy shared machine. What counts is each
round's time ratio against the base model (its median over the rounds). Prints a Markdown table, then one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from host_cpu import describe_cpu

import doppler_py
from doppler_py.model.config import ModelConfig

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--steps", type=int, default=4, help="decode forwards per variant per round")
    parser.add_argument("--weights", default="q4_1")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        probe = doppler_py.load(weights=args.weights, progress=False, max_seq=512)
        config = probe.model.config
        probe.close()
        folders = {
            name: write_adapter(Path(tmp) / name, config, rank, modules, seed)
            for seed, (name, (rank, modules)) in enumerate(VARIANTS.items())
        }
        engine = doppler_py.load(weights=args.weights, progress=False, max_seq=512, kv_cache_mb=0, lora=folders)
    model = engine.model
    prompt = engine.encode_prompt(PROMPT, chat=True)
    names: list[str | None] = [None, *VARIANTS]
    caches = {}
    for name in names:  # each variant's sequence: the prompt prefilled with its adapter, every pipeline compiled
        caches[name] = model.new_cache(len(prompt) + 1)
        caches[name].adapter = name
        model.forward(prompt[:-1], caches[name], 0, logits="none")
    model.ids.view((1,)).write(np.asarray(prompt[-1:], np.uint32))

    def decode_ms(name: str | None) -> float:
        """One decode forward at the prompt's end (the same position every time), waited for."""
        start = time.perf_counter()
        for _ in range(args.steps):
            rec = model.registry.recorder()
            model.record_forward(rec, 1, caches[name], len(prompt) - 1)
            rec.submit()
        model.gpu.wait_idle()
        return 1000 * (time.perf_counter() - start) / args.steps

    for name in names:
        decode_ms(name)
    step_ms: dict[str | None, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            step_ms[name].append(decode_ms(name))
    adapter = model.gpu.summary()["adapter"]
    for cache in caches.values():
        model.release_cache(cache)
    engine.close()
    rows = {
        name or "base": {
            "step_ms": round(statistics.median(times), 2),
            "ratio_vs_base": round(statistics.median(t / b for t, b in zip(times, step_ms[None], strict=True)), 3),
        }
        for name, times in step_ms.items()
    }
    print("| adapter | decode forward (ms, median) | vs base (median of per-round ratios) |")
    print("|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['step_ms']} | {row['ratio_vs_base']}x |")
    report = {"weights": args.weights, "rounds": args.rounds, "steps": args.steps, "variants": rows}
    print(json.dumps(report | {"adapter": adapter, "cpu": describe_cpu()}))


if __name__ == "__main__":
    main()
