"""Kernel tests: with DOPPLER_DAWN_REPLAY=1 (opt-in: CI runs these tests in process on Dawn instead, tools/test.sh),
each submit that dispatches a pipeline not replayed before also runs under Dawn/Tint on SwiftShader and must match
wgpu-py (tests/parity/dawn/trace.py)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def dawn_replay_of_new_pipelines(request, registry, monkeypatch):
    if os.environ.get("DOPPLER_DAWN_REPLAY", "") in ("", "0"):
        return
    from parity.dawn.trace import replaying_recorder

    recorder = replaying_recorder(request.config)
    if recorder is not None:
        monkeypatch.setattr(registry, "recorder_class", recorder)
