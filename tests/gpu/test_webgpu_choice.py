"""The WebGPU implementation switch: names, the typed errors, and a device on each implementation."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from doppler_py.cli import build_parser
from doppler_py.errors import WebGpuImplementationError
from doppler_py.gpu import webgpu
from doppler_py.gpu.device import create_gpu
from doppler_py.gpu.tensor import Tensor


def test_the_default_is_wgpu_native_and_the_variable_chooses(monkeypatch):
    monkeypatch.delenv(webgpu.ENV_VAR, raising=False)
    assert webgpu.chosen() == "wgpu-native"
    monkeypatch.setenv(webgpu.ENV_VAR, "Dawn")
    assert webgpu.chosen() == "dawn"
    assert webgpu.chosen("wgpu-native") == "wgpu-native"  # an explicit choice beats the variable


def test_an_unknown_implementation_is_a_typed_error_naming_the_choices(monkeypatch):
    monkeypatch.setenv(webgpu.ENV_VAR, "vulkan")  # a backend, which DOPPLER_BACKEND picks, not an implementation
    with pytest.raises(WebGpuImplementationError, match=r"DOPPLER_WEBGPU='vulkan'.*wgpu-native, dawn"):
        webgpu.chosen()
    with pytest.raises(WebGpuImplementationError, match=r"webgpu='chrome'"):
        create_gpu(webgpu="chrome")


def test_a_missing_wgpudawn_is_a_typed_error_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "wgpudawn", None)  # what `import` does when the package is absent
    with pytest.raises(WebGpuImplementationError, match=r"pip install 'doppler-py\[dawn\]'"):
        webgpu.api("dawn")


def test_a_missing_mesa25_names_the_command_that_unpacks_it(monkeypatch, tmp_path):
    monkeypatch.setattr(webgpu, "MESA25_DIR", tmp_path / "absent")
    monkeypatch.setattr(webgpu, "_MESA25_SCRIPT", tmp_path / "no-script.sh")
    with pytest.raises(Exception, match=r"tools/mesa25.sh"):
        webgpu.mesa25_icd()


def test_every_command_takes_webgpu():
    parser = build_parser()
    for argv in (["generate", "hi"], ["info"], ["serve"], ["models"], ["parity", "doppler", "folder"]):
        assert parser.parse_args([*argv, "--webgpu", "dawn"]).webgpu == "dawn"


@pytest.mark.parametrize("name", webgpu.IMPLEMENTATIONS)
def test_a_device_on_each_implementation_moves_data(name):
    gpu = create_gpu(browser_limits=True, webgpu=name)
    assert gpu.webgpu == name and gpu.summary()["webgpu"] == name
    assert gpu.api.__name__ == {"wgpu-native": "wgpu", "dawn": "wgpudawn"}[name]
    # Each names subgroups its own way ("subgroup", "subgroups"); the engine gets them from both.
    assert gpu.has_subgroups == bool({"subgroup", "subgroups"} & set(gpu.adapter.features))
    values = np.arange(37, dtype=np.float32)
    assert np.array_equal(Tensor.from_numpy(gpu, values, label="x").numpy(), values)


@pytest.mark.skipif(
    not webgpu.dawn_uses_mesa25() or webgpu.driver_to_unpack("dawn") is not None,
    reason="Dawn does not run on Mesa 25 here (a GPU, or the Vulkan drivers the user named), or it is not unpacked",
)
def test_dawn_gets_mesa25_at_its_own_vector_width_and_wgpu_native_keeps_its_own(monkeypatch):
    # Both drivers load in this process: Mesa 25's while Dawn lists its adapters, the system's for wgpu-native.
    monkeypatch.delenv("DOPPLER_MESA25_VECTOR_WIDTH", raising=False)
    native = create_gpu(webgpu="wgpu-native")
    before = os.environ.get("LP_NATIVE_VECTOR_WIDTH")  # the system driver's: the user's or device.py's, if set
    dawn = create_gpu(webgpu="dawn")
    assert f"{webgpu.MESA25_VECTOR_BITS} bits" in dawn.name and "Mesa 25" in str(dawn.info.get("description"))
    assert os.environ.get("LP_NATIVE_VECTOR_WIDTH") == before
    assert f"{before or 256} bits" in native.name  # 256: llvmpipe's own default
