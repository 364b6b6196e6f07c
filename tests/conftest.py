"""Shared fixtures: one browser-limits WebGPU device and kernel registry for the whole session.

Kernel tests run under the WebGPU default limits (what a browser gives), so a kernel that needs more
storage buffers or workgroup memory than Chrome allows fails here too.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from doppler_py.gpu.device import default_gpu
from doppler_py.gpu.kernels import KernelRegistry


@pytest.fixture(scope="session")
def gpu():
    return default_gpu(browser_limits=True)


@pytest.fixture(scope="session")
def registry(gpu):
    return KernelRegistry(gpu)


@pytest.fixture
def rng(request):
    # A per-test seed derived from the test name: reproducible, and different across tests.
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
