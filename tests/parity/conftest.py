"""Fixtures of the JS-original lane: Node, and doppler-gpu@0.5.1 fetched with npm and verified.

Locally, a missing node/npm or an unreachable registry skips these tests with the reason; under CI=true it
fails them, so CI cannot pass without having compared anything. A tarball whose sha512 does not match the
pinned integrity is always an error.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import NoReturn

import pytest

from doppler_py.parity import doppler_model
from doppler_py.parity.doppler_model import DopplerParityError
from doppler_py.parity.npm import DOPPLER_GPU, NpmUnavailableError, fetch_package


def skip_unless_ci(reason: str) -> NoReturn:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (CI=true: the parity lane must run)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def node_executable() -> str:
    node = shutil.which("node")
    if node is None:
        skip_unless_ci("node is not installed (Node 20+ runs the JS original)")
    return node


@pytest.fixture(scope="session")
def doppler_gpu_dir() -> Path:
    """The unpacked doppler-gpu package (the folder holding its package.json and src/)."""
    try:
        return fetch_package(DOPPLER_GPU)
    except NpmUnavailableError as exc:
        skip_unless_ci(f"cannot fetch {DOPPLER_GPU.spec}: {exc}")


@pytest.fixture(scope="session")
def doppler_ready(node_executable, doppler_gpu_dir) -> Path:
    """Node, the package and a Vulkan driver Dawn accepts (lavapipe 25 or SwiftShader), or a skip (a failure under
    CI); the package's folder."""
    try:
        doppler_model.node_environment()
    except DopplerParityError as exc:
        skip_unless_ci(str(exc))
    return doppler_gpu_dir
