"""Tiny random models (written with numpy, no download) for model-level tests."""

from __future__ import annotations

import os

import pytest

from doppler_py.model.loader import load_weights
from doppler_py.model.transformer import Transformer
from doppler_py.testing.tiny import TINY_SPECS, write_tiny_model


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """A function name -> folder of that TINY_SPECS model, each written once per session."""
    made = {}

    def make(name: str):
        if name not in made:
            made[name] = write_tiny_model(tmp_path_factory.mktemp(name), TINY_SPECS[name])
        return made[name]

    return make


@pytest.fixture
def build(registry):
    """A function (folder, precision="f32", **Transformer options) -> Transformer, closed after the test."""
    models = []

    def make(folder, precision: str = "f32", **kwargs) -> Transformer:
        model = Transformer(load_weights(folder, registry.gpu, precision), registry, **kwargs)
        models.append(model)
        return model

    yield make
    for model in models:
        model.close()


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
