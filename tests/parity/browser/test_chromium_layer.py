"""End to end in a browser: headless Chromium runs our kernels for one decoder layer of a tiny model and gets the
Python engine's residual stream.

The forward is captured from the engine itself (the Dawn lane's replay recorder, tests/parity/dawn/trace.py):
every dispatch's WGSL (exactly what the registry compiles, with `enable subgroups;` kept for Tint), entry
point, override constants, explicit bind group layout, bindings, uniform bytes and workgroup counts, plus
the bytes of every buffer the submit touches as they were before it. layer.js replays that in one command
encoder on a device with the WebGPU default limits and posts the written buffers back to the harness's
loopback server. Chromium's flags, and why each is there, are in harness.py.

Locally the test skips when Chromium is missing; under CI=true that is a failure (CI installs it).
"""

from __future__ import annotations

import base64
import os
from typing import NoReturn

import numpy as np
import pytest
from parity.browser.harness import ChromiumUnavailable, PageRun, find_chromium, run_page
from parity.dawn.trace import DawnReplay, RegionDifference, ReplayPlan, compare_written

from doppler_py.gpu.kernels import KernelRegistry, source_for_naga
from doppler_py.model.loader import load_weights
from doppler_py.model.transformer import Transformer
from doppler_py.testing.tiny import TinySpec, random_weights, write_tiny_model

pytestmark = [pytest.mark.parity, pytest.mark.browser]

SPEC = TinySpec()  # hidden 64, 4 query heads over 2 KV heads (GQA), FFN 160; only its first layer is loaded
CACHED = [5, 17, 42]  # tokens already in the KV cache before the captured forward
TOKENS = [9, 63, 100, 7, 31]  # the captured forward: 5 rows at positions 3..7, attending to the cache too
WEBGPU_DEFAULT_LIMITS = {
    "maxStorageBuffersPerShaderStage": 8,
    "maxComputeWorkgroupStorageSize": 16384,
    "maxComputeInvocationsPerWorkgroup": 256,
    "maxComputeWorkgroupsPerDimension": 65535,
    "maxStorageBufferBindingSize": 134217728,
    "maxBufferSize": 268435456,
}


def skip_or_fail(reason: str) -> NoReturn:
    if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
        pytest.fail(f"the Chromium check cannot run under CI=true: {reason}", pytrace=False)
    pytest.skip(reason)


def find_chromium_or_skip() -> None:
    try:
        find_chromium()
    except ChromiumUnavailable as exc:
        skip_or_fail(str(exc))


class _Capture(DawnReplay):
    """Keeps each submit's plan (its dispatch sequence and starting buffers) instead of replaying it under Dawn."""

    def __init__(self):
        super().__init__(worker=None)
        self.plans: list[ReplayPlan] = []

    def check(self, registry: KernelRegistry, plan: ReplayPlan) -> None:
        self.plans.append(plan)


class CapturedLayer:
    """One layer's forward as the engine ran it, and its plan for the page (compared before any later submit)."""

    def __init__(self, gpu, folder):
        capture = _Capture()
        self.registry = KernelRegistry(gpu)
        self.registry.recorder_class = capture.recorder_class
        self.model = Transformer(load_weights(folder, gpu, "f32", num_layers=1), self.registry, max_rows=len(TOKENS))
        cache = self.model.new_cache(64)
        self.model.forward(CACHED, cache, logits="none")
        self.model.forward(TOKENS, cache, logits="none")
        self.plan = capture.plans[-1]
        assert self.plan.skip is None, self.plan.skip

    def close(self) -> None:
        self.model.close()
        self.registry.close()


@pytest.fixture(scope="module")
def layer(gpu, tmp_path_factory):
    find_chromium_or_skip()
    captured = CapturedLayer(gpu, write_tiny_model(tmp_path_factory.mktemp("tiny-layer"), SPEC))
    yield captured
    captured.close()


@pytest.fixture(scope="module")
def page(layer) -> PageRun:
    run = run_page(layer.plan.job)
    assert run.result["ok"], "the page failed:\n" + "\n".join(run.result["errors"])
    return run


@pytest.fixture(scope="module")
def differences(layer, page) -> list[RegionDifference]:
    buffers = {k: base64.b64decode(v) for k, v in page.result["buffers"].items()}
    return compare_written(layer.registry, layer.plan, buffers)


def _summary(differences: list[RegionDifference]) -> str:
    return "\n".join(
        f"  {d.region.tensor.label:>18} ({d.label}): max |chromium - wgpu| {d.difference.max_abs:.3e} "
        f"(allowed {d.difference.limit:.3e})"
        for d in differences
    )


def test_page_gets_each_shader_as_the_registry_compiles_it_with_enable_subgroups_kept(layer):
    modules = layer.plan.job["modules"]
    # The layer's norms run inside its matmuls (RMS_NORM) and SwiGLU for a 5-row call inside the down projection
    # (GLU), so rmsnorm.wgsl and swiglu.wgsl have no dispatch of their own here; nor has rope.wgsl: a 5-row call
    # has one attention workgroup per kv head, which applies RoPE and writes the cache itself (rope == 2).
    assert set(modules) == {"embedding", "matmul", "attention"}
    for name, source in modules.items():
        assert source_for_naga(source) == source_for_naga(layer.registry.source(name))
        assert source == layer.registry.source(name)
    assert "enable subgroups;" in modules["matmul"]


def test_page_device_has_the_webgpu_default_limits(page):
    assert page.result["limits"] == WEBGPU_DEFAULT_LIMITS, page.result["adapter"]


def test_residual_stream_after_the_layer_matches_the_python_engine(layer, page, differences):
    x = layer.model.x
    (stream,) = [d for d in differences if d.region.tensor is x]
    rows = len(TOKENS)
    print(
        f"\nChromium ({page.result['adapter']}) ran {len(layer.plan.job['steps'])} dispatches of one layer in "
        f"{page.seconds:.2f} s (browser start to answer; GPU work {page.result['ms']:.0f} ms)\n{_summary(differences)}"
    )
    assert stream.difference.ok, stream.describe("chromium")
    # The check means something only if the layer moved the stream away from the token embeddings.
    embeddings = random_weights(SPEC)["model.embed_tokens.weight"][TOKENS]
    after = stream.actual.reshape(x.shape)[:rows]
    assert np.abs(after - embeddings).max() > 0.1


def test_every_buffer_the_layer_writes_matches_the_python_engine(differences):
    failed = [d.describe("chromium") for d in differences if not d.difference.ok]
    assert not failed, "\n".join(failed)
    written = {d.region.tensor.label for d in differences}
    assert written >= {"x", "qkv", "attn", "gate_up", "kv.k0", "kv.v0"}  # act: fused into the down projection
