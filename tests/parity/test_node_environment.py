"""The environment the JS original's Node process runs Dawn under: Mesa 25's lavapipe at Dawn's own vector width,
never below the width the JS original's subgroup kernels need.

Cheap (no Node, no Dawn): the lane's runs start Node with exactly `node_environment()`. In a pytest process the
engine has set LP_NATIVE_VECTOR_WIDTH=512 for the system's Mesa 22.3 on AVX-512 hosts by then; Mesa 25 compiles
several times slower at 512 bits (gpu/webgpu.py).
"""

from __future__ import annotations

import pytest

from doppler_py.errors import WebGpuImplementationError
from doppler_py.gpu import webgpu
from doppler_py.parity import doppler_model


@pytest.fixture
def unpacked_mesa25(tmp_path, monkeypatch):
    """A Mesa 25 folder with its ICD json, the system driver's width at 512, and no npm fetch (the module folder
    Node is told about is not what these tests check)."""
    (tmp_path / "lvp_icd.json").write_text("{}")
    monkeypatch.setattr(doppler_model, "MESA25_DIR", tmp_path)
    monkeypatch.setattr(doppler_model, "fetch_package", lambda package: tmp_path)
    for variable in ("DOPPLER_DAWN_VK_ICD", doppler_model.DRIVER_CHOICE, webgpu.MESA25_WIDTH_ENV):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv(webgpu.LAVAPIPE_WIDTH_ENV, "512")
    return tmp_path


def node_width() -> str:
    return doppler_model.node_environment()[webgpu.LAVAPIPE_WIDTH_ENV]


def test_node_gets_mesa25_at_the_js_originals_floor_not_the_system_drivers_width(unpacked_mesa25):
    # Dawn's default 128 is below the 256 the JS original's RMSNorm needs: the floor, not the environment's 512.
    assert int(webgpu.mesa25_vector_width()) < doppler_model.MESA25_MIN_VECTOR_BITS
    env = doppler_model.node_environment()
    assert env["VK_ICD_FILENAMES"] == str(unpacked_mesa25 / "lvp_icd.json")
    assert env[webgpu.LAVAPIPE_WIDTH_ENV] == str(doppler_model.MESA25_MIN_VECTOR_BITS)


@pytest.mark.parametrize(("dawn", "node"), [("128", "256"), ("256", "256"), ("512", "512")])
def test_node_follows_the_mesa25_width_dawn_runs_at(unpacked_mesa25, monkeypatch, dawn, node):
    monkeypatch.setenv(webgpu.LAVAPIPE_WIDTH_ENV, "256")  # the system driver's, whatever it is, does not leak
    monkeypatch.setenv(webgpu.MESA25_WIDTH_ENV, dawn)
    assert node_width() == node


def test_a_width_llvmpipe_does_not_have_is_a_typed_error_naming_the_variable(unpacked_mesa25, monkeypatch):
    monkeypatch.setenv(webgpu.MESA25_WIDTH_ENV, "wide")
    with pytest.raises(WebGpuImplementationError, match=f"{webgpu.MESA25_WIDTH_ENV}='wide'"):
        node_width()


def test_swiftshader_keeps_the_environment_width(unpacked_mesa25):
    # SwiftShader does not read Mesa's variable; the lane changes nothing it does not need to.
    icd = unpacked_mesa25 / "swiftshader_icd.json"
    icd.write_text("{}")
    env = doppler_model.node_environment(doppler_model.DawnDriver("swiftshader", icd, None))
    assert env[webgpu.LAVAPIPE_WIDTH_ENV] == "512"
