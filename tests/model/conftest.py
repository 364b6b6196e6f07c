"""Tiny random models (written with numpy, no download) for model-level tests."""

from __future__ import annotations

import os

import pytest

from doppler_py.testing.tiny import TINY_SPECS


@pytest.fixture(scope="session")
def named_folder(tiny_folder):
    """A function name -> folder of that TINY_SPECS model, each written once per session."""
    return lambda name: tiny_folder(TINY_SPECS[name])


@pytest.fixture(scope="session")
def reference():
    """HF transformers on torch CPU: skipped locally when missing, a failure under CI=true."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the reference implementation is missing in CI: {exc}")
        pytest.skip(f"HF transformers / torch not installed ({exc}); `pip install -e .[reference]`")
    from doppler_py.testing import reference as module

    return module
