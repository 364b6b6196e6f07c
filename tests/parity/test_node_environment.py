"""The environment the JS original's Node process runs Dawn under: Mesa 25's lavapipe gets Dawn's own vector width.

Cheap (no Node, no Dawn): the lane's runs start Node with exactly `node_environment()`. In a pytest process the
engine has set LP_NATIVE_VECTOR_WIDTH=512 for the system's Mesa 22.3 on AVX-512 hosts by then; Mesa 25 compiles
several times slower at 512 bits than at the 128 our Dawn devices give it (gpu/webgpu.py).
"""

from __future__ import annotations

import pytest

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


def test_node_gets_mesa25_at_dawns_vector_width_not_the_system_drivers(unpacked_mesa25):
    env = doppler_model.node_environment()
    assert env["VK_ICD_FILENAMES"] == str(unpacked_mesa25 / "lvp_icd.json")
    assert env[webgpu.LAVAPIPE_WIDTH_ENV] == str(webgpu.MESA25_VECTOR_BITS) == webgpu.mesa25_vector_width()


def test_node_follows_the_mesa25_width_the_user_chose(unpacked_mesa25, monkeypatch):
    monkeypatch.setenv(webgpu.MESA25_WIDTH_ENV, "256")
    assert doppler_model.node_environment()[webgpu.LAVAPIPE_WIDTH_ENV] == "256"


def test_swiftshader_keeps_the_environment_width(unpacked_mesa25, monkeypatch):
    # SwiftShader does not read Mesa's variable; the lane changes nothing it does not need to.
    icd = unpacked_mesa25 / "swiftshader_icd.json"
    icd.write_text("{}")
    env = doppler_model.node_environment(doppler_model.DawnDriver("swiftshader", icd, None))
    assert env[webgpu.LAVAPIPE_WIDTH_ENV] == "512"
