"""SmolLM2 on Dawn (Chrome's WebGPU implementation, Tint compiling our WGSL) answers token for token as on
wgpu-native, in f32 and in its shipped q4_1 blocks. wgpu-native's answers equal HF transformers' (test_smollm2.py),
so Dawn's do too. On a CPU-only machine Dawn runs on Mesa 25's lavapipe at 128-bit vectors (webgpu.py
MESA25_VECTOR_BITS): at 512 its LLVM spent over 6 minutes in the f32 matmul pipelines here."""

from __future__ import annotations

import pytest
from model.test_smollm2 import PROMPTS

from doppler_py.api import load
from doppler_py.gpu.webgpu import IMPLEMENTATIONS

pytestmark = [pytest.mark.realmodel, pytest.mark.slow]

NEW_TOKENS = 32


@pytest.fixture(scope="module", params=["q4_1", "f32"])
def engines(request, smollm2_gguf):
    """implementation -> the default model at one precision on it (both in this process)."""
    from doppler_py.model.catalog import DEFAULT_MODEL

    loaded = {
        name: load(DEFAULT_MODEL, weights=request.param, progress=False, max_seq=256, webgpu=name, kv_cache_mb=0)
        for name in IMPLEMENTATIONS
    }
    yield loaded
    for engine in loaded.values():
        engine.close()


@pytest.mark.parametrize("prompt", sorted(PROMPTS))
def test_greedy_generation_on_dawn_equals_wgpu_native(engines, prompt):
    assert {engine.model.registry.gpu.webgpu for engine in engines.values()} == set(IMPLEMENTATIONS)
    answers = {
        name: engine.generate(PROMPTS[prompt], max_tokens=NEW_TOKENS, speculative=None).tokens
        for name, engine in engines.items()
    }
    assert answers["dawn"] == answers["wgpu-native"]
    assert len(answers["dawn"]) >= 8  # an answer, not an immediate end of turn (the shortest here has 16 tokens)
