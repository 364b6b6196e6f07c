"""`doppler-py selfcheck`: does this WebGPU device run our forward pass correctly?

A one-layer tiny random model (doppler_py.testing.tiny) is written to a temporary folder, loaded in f32 and run
over a short prompt on the GPU, then compared stage by stage with a float64 numpy forward of the same
safetensors file (doppler_py.testing.references.forward_stages): q as the qkv buffer holds it (rotated where a
RoPE dispatch runs before attention, before RoPE where attention rotates q as it loads it: GPUs), k after
RoPE and v (as the KV cache holds them), attention, the [gate | up] projection, the residual stream and the
logits. SwiGLU runs inside the down projection, so no buffer holds it; the residual stream after the MLP
covers it. Each stage
passes when max |gpu - numpy| <= TOLERANCE * max |numpy|: the GPU computes in f32 over sums of at most a few
hundred terms (rounding ~1e-6 relative), while a wrong index, mask or kernel moves results by 1e-2 or more.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from doppler_py.gpu.device import Gpu, default_gpu
from doppler_py.gpu.kernels import KernelRegistry
from doppler_py.model.config import ModelConfig
from doppler_py.model.loader import load_weights
from doppler_py.model.transformer import Transformer
from doppler_py.testing.references import forward_stages, load_tensors
from doppler_py.testing.tiny import TinySpec, write_tiny_model

TOLERANCE = 1e-4  # of the stage's largest magnitude
SPEC = TinySpec(num_hidden_layers=1)
PROMPT = [1, 40, 73, 5, 88, 17, 60, 2, 99, 31, 31, 12]


def run_selfcheck(say: Callable[[str], None], *, tamper: Callable[[dict[str, np.ndarray]], None] | None = None) -> bool:
    """Run the check, reporting through `say`; True when every stage is within tolerance.

    `tamper` edits the weights (by HF name, in place) before the GPU loads them while numpy keeps the
    originals: a test's way to see that a wrong weight is caught.
    """
    gpu = default_gpu()
    say(f"adapter: {gpu.name} via {gpu.backend}; features: {sorted(gpu.features)}")
    with tempfile.TemporaryDirectory(prefix="doppler-selfcheck-") as tmp:
        folder = write_tiny_model(tmp, SPEC)
        config = ModelConfig.from_file(folder / "config.json")
        tensors = load_tensors(folder)
        if tamper is not None:
            from safetensors.numpy import save_file

            tampered = {name: t.copy() for name, t in tensors.items()}
            tamper(tampered)
            save_file(tampered, str(folder / "model.safetensors"), metadata={"format": "pt"})
        say(
            f"model: 1 layer, hidden {config.hidden_size}, {config.num_attention_heads} heads over "
            f"{config.num_key_value_heads} KV heads, vocab {config.vocab_size}, f32; {len(PROMPT)} tokens"
        )
        expected = forward_stages(tensors, config, PROMPT)
        got, q_rotated = _gpu_stages(gpu, folder, config)
        q_proj = expected.pop("q_proj")
        if not q_rotated:
            expected["q"] = q_proj
        del expected["mlp"]  # computed inside the down projection's loads
    ok = True
    for stage, want in expected.items():
        error = float(np.abs(got[stage] - want).max())
        limit = TOLERANCE * float(np.abs(want).max())
        ok &= error <= limit
        say(f"  {stage:10s} max abs error {error:.2e} (limit {limit:.2e}) {'ok' if error <= limit else 'FAIL'}")
    say(f"forward vs numpy: {'ok' if ok else 'FAIL'}")
    return ok


def _gpu_stages(gpu: Gpu, folder: Path, config: ModelConfig) -> tuple[dict[str, np.ndarray], bool]:
    """The GPU's forward over PROMPT: logits, and the last layer's intermediates read from the model's buffers
    (one forward call: T rows fit one chunk, so every buffer holds this prompt's rows); and whether the qkv
    buffer's q is rotated (False where attention applies RoPE as it loads q)."""
    rows, hd = len(PROMPT), config.head_dim
    q_size, kv_shape = config.num_attention_heads * hd, (rows, config.num_key_value_heads, hd)
    registry = KernelRegistry(gpu)
    weights = load_weights(folder, gpu, "f32")
    model = Transformer(weights, registry, max_rows=rows, max_positions=rows)
    try:
        cache = model.new_cache(rows)
        logits = model.forward(PROMPT, cache, 0, logits="all")
        qkv = model.qkv.numpy()[:rows]
        stages = {
            "q": qkv[:, :q_size],  # k and v reach the cache
            "k": cache.keys[-1].numpy()[:rows].reshape(kv_shape),
            "v": cache.values[-1].numpy()[:rows].reshape(kv_shape),
            "attention": model.attn.numpy()[:rows],
            "gate_up": model.gate_up.numpy()[:rows],
            "hidden": model.x.numpy()[:rows],
            "logits": logits,
        }
        return stages, "rope" in model.attention_ops(cache)[-1].call(rows, 0)[0]  # a rope.wgsl dispatch went first
    finally:
        model.close()
        weights.destroy()
        registry.close()
