"""Fixtures of the Dawn/Tint lane: the shared worker, and a kernel registry whose submits replay under Dawn."""

from __future__ import annotations

import pytest
from parity.dawn.client import DawnUnavailable, DawnWorker, shared_worker, skip_or_fail
from parity.dawn.trace import DawnReplay, shared_replay

from doppler_py.gpu.kernels import KernelRegistry


@pytest.fixture(scope="session")
def dawn_worker() -> DawnWorker:
    """The worker with Dawn's null backend (Tint validation); skips locally when Node or npm webgpu is missing."""
    try:
        worker = shared_worker()
    except DawnUnavailable as exc:
        skip_or_fail(str(exc))
    worker.require("null")
    return worker


@pytest.fixture(scope="session")
def dawn_replay(request, dawn_worker) -> DawnReplay:
    """The session's replay (SwiftShader); skips locally when Debian's chromium (SwiftShader) is missing."""
    dawn_worker.require("vulkan")
    replay = shared_replay(request.config)
    if replay.unavailable:
        skip_or_fail(replay.unavailable)
    return replay


@pytest.fixture(scope="session")
def replay_registry(gpu, dawn_replay) -> KernelRegistry:
    """A registry whose every submit is replayed under Dawn, whatever DOPPLER_DAWN_REPLAY says."""
    registry = KernelRegistry(gpu)
    registry.recorder_class = dawn_replay.recorder_class
    return registry
