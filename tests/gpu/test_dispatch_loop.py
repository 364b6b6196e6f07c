"""The compiled dispatch loop's build (doppler_py/gpu/dispatch_loop.py): built once per machine into the cache,
loaded from it after, and where it cannot be built (no compiler, switched off) the Python loop is used and the
status says why. That tapes play the same through either loop is tests/gpu/test_kernels_registry.py's and
tests/model/test_forward_tapes.py's (the `tape_loop` fixture)."""

from __future__ import annotations

import shutil

import pytest

from doppler_py.gpu import dispatch_loop


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A process that has not started the build yet, with an empty cache."""
    monkeypatch.setattr(dispatch_loop, "_state", dispatch_loop._State())
    monkeypatch.setenv("DOPPLER_CACHE", str(tmp_path))
    monkeypatch.delenv("DOPPLER_COMPILED_LOOP", raising=False)
    return tmp_path / "dispatch-loop"


def test_the_loop_is_built_once_into_the_cache_and_loaded_from_it_after(fresh, monkeypatch):
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler here")
    assert dispatch_loop.wait(), dispatch_loop.status()
    assert dispatch_loop.status() == "compiled" and dispatch_loop.loop() is not None
    built = [p for p in fresh.rglob("_doppler_dispatch_loop*") if p.is_file()]
    assert len(built) == 1, built
    assert not [p for p in built[0].parent.iterdir() if p.is_dir()], "the build folder is cleaned up"

    def no_compiling(folder):
        raise AssertionError("compiled again although the cache holds the loop")

    monkeypatch.setattr(dispatch_loop, "_state", dispatch_loop._State())
    monkeypatch.setattr(dispatch_loop, "_compile", no_compiling)
    assert dispatch_loop.wait(), dispatch_loop.status()


def test_without_a_working_compiler_the_python_loop_is_used_and_the_status_says_why(fresh, monkeypatch):
    monkeypatch.setenv("CC", str(fresh / "no-such-compiler"))
    assert not dispatch_loop.wait()
    assert dispatch_loop.loop() is None
    assert dispatch_loop.status().startswith("python (build failed: "), dispatch_loop.status()
    assert not [p for p in fresh.rglob("_doppler_dispatch_loop*") if p.is_file()]


def test_the_loop_can_be_switched_off(fresh, monkeypatch):
    monkeypatch.setenv("DOPPLER_COMPILED_LOOP", "0")
    assert not dispatch_loop.wait()
    assert dispatch_loop.status() == "python (off: DOPPLER_COMPILED_LOOP=0)"
    assert not fresh.exists() or not any(fresh.iterdir())
