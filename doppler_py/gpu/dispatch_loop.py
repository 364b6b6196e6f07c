"""A compiled loop that records a run of dispatches into a compute pass with one call from Python.

A decode step plays ~180 dispatches from a tape. Called from Python through cffi, wgpu-native's three pass
functions (set pipeline, set bind group, dispatch) cost ~3 µs per dispatch on a slow 2-core machine, about
0.5 ms of a step's host time; the same calls made from a C loop cost ~0.2 µs each. The loop is 15 lines of C
with no headers beyond the C library's, compiled once per machine with the system's C compiler through cffi
(a wgpu-py dependency) into `cache_dir("dispatch-loop")`, keyed by the source, the Python ABI and the platform.

The build starts in a background thread at the first `start()` (a kernel registry's creation), so it never
delays a first token: until it is ready, and wherever no compiler is found or the build fails, recorders keep
the Python loop, which records the same commands. `DOPPLER_COMPILED_LOOP=0` turns the compiled loop off.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
import sysconfig
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from doppler_py.paths import cache_dir

_log = logging.getLogger(__name__)

_MODULE = "_doppler_dispatch_loop"
_CDEF = (
    "void play_dispatches(uintptr_t pass, uintptr_t set_pipeline, uintptr_t set_group, uintptr_t dispatch, "
    "size_t n, const uintptr_t *pipelines, const uintptr_t *groups, const uint32_t *grids);"
)
# Handles are opaque pointers, so the function pointer types below match wgpu-native's webgpu.h without it.
_SOURCE = r"""
#include <stddef.h>
#include <stdint.h>
typedef void (*set_pipeline_fn)(void *pass, void *pipeline);
typedef void (*set_group_fn)(void *pass, uint32_t index, void *group, size_t offset_count, const uint32_t *offsets);
typedef void (*dispatch_fn)(void *pass, uint32_t x, uint32_t y, uint32_t z);

void play_dispatches(uintptr_t pass, uintptr_t set_pipeline, uintptr_t set_group, uintptr_t dispatch,
                     size_t n, const uintptr_t *pipelines, const uintptr_t *groups, const uint32_t *grids) {
    uintptr_t last_pipeline = 0, last_group = 0;
    for (size_t i = 0; i < n; i++) {
        if (pipelines[i] != last_pipeline) {
            ((set_pipeline_fn)set_pipeline)((void *)pass, (void *)pipelines[i]);
            last_pipeline = pipelines[i];
        }
        if (groups[i] != last_group) {
            ((set_group_fn)set_group)((void *)pass, 0, (void *)groups[i], 0, NULL);
            last_group = groups[i];
        }
        ((dispatch_fn)dispatch)((void *)pass, grids[3 * i], grids[3 * i + 1], grids[3 * i + 2]);
    }
}
"""


@dataclass
class _State:
    started: bool = False
    done: threading.Event = field(default_factory=threading.Event)  # set once built, failed or switched off
    module: object | None = None  # the built extension, once ready
    reason: str = "not started"  # why the Python loop is used (while `module` is None)


_state = _State()
_lock = threading.Lock()


def _build_folder() -> Path:
    tag = sysconfig.get_config_var("SOABI") or f"py{sys.version_info[0]}{sys.version_info[1]}"
    digest = hashlib.sha256(f"{_CDEF}\n{_SOURCE}\n{sys.platform}".encode()).hexdigest()[:16]
    return cache_dir("dispatch-loop", f"{digest}-{tag}")


def _built_file(folder: Path) -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = folder / f"{_MODULE}{suffix}"
        if path.is_file():
            return path
    return None


def _compile(folder: Path) -> Path:
    import cffi

    ffi = cffi.FFI()
    ffi.cdef(_CDEF)
    ffi.set_source(_MODULE, _SOURCE)
    # Built aside and moved into place, so another process never loads a half-written file.
    with tempfile.TemporaryDirectory(dir=folder) as work:
        built = Path(ffi.compile(tmpdir=work, verbose=False))
        final = folder / built.name
        os.replace(built, final)
    return final


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(_MODULE, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build() -> None:
    try:
        folder = _build_folder()
        path = _built_file(folder) or _compile(folder)
        _state.module = _load(path)
        _state.reason = ""
    except Exception as exc:  # no compiler, no setuptools, an unwritable cache: the Python loop stays
        lines = str(exc).strip().splitlines()
        _state.reason = f"build failed: {type(exc).__name__}: {lines[-1] if lines else ''}"
        _log.info("compiled dispatch loop unavailable (%s); recording dispatches from Python", _state.reason)
    finally:
        _state.done.set()


def start() -> None:
    """Start building (or loading the built) loop in the background, once per process."""
    with _lock:
        if _state.started:
            return
        _state.started = True
        if os.environ.get("DOPPLER_COMPILED_LOOP") == "0":
            _state.reason = "off: DOPPLER_COMPILED_LOOP=0"
            _state.done.set()
            return
        _state.reason = "building"
        threading.Thread(target=_build, name="doppler-dispatch-loop", daemon=True).start()


def wait(timeout: float | None = None) -> bool:
    """Block until the build has finished (tests, benches); True when the compiled loop is in use."""
    start()
    _state.done.wait(timeout)
    return _state.module is not None


def loop():
    """The compiled `play_dispatches` (cffi lib), or None while building or where it could not be built."""
    module = _state.module
    return None if module is None else module.lib


def ffi():
    """The compiled module's cffi instance, for the arrays `play_dispatches` reads."""
    return _state.module.ffi


def status() -> str:
    """'compiled' or 'python (why)', for benches and reports."""
    return "compiled" if _state.module is not None else f"python ({_state.reason})"
