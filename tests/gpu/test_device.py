"""Device layer: adapter choice, features, explicit limits, typed errors."""

from __future__ import annotations

import pytest

from doppler_py.errors import DeviceLimitError, NoAdapterError
from doppler_py.gpu import device as device_mod
from doppler_py.gpu.device import BROWSER_LIMITS, create_gpu, select_adapter
from doppler_py.gpu.webgpu import feature_name


def test_browser_limits_mode_gets_exactly_the_webgpu_defaults(gpu):
    assert gpu.browser_limits
    for name, value in BROWSER_LIMITS.items():
        if name in gpu.limits:
            assert gpu.limits[name] == value, name


def test_native_mode_requests_the_adapters_buffer_limits():
    native = create_gpu(browser_limits=False)
    offered = native.adapter.limits
    assert native.limits["max-buffer-size"] == offered["max-buffer-size"]
    assert native.limits["max-storage-buffers-per-shader-stage"] == offered["max-storage-buffers-per-shader-stage"]


def test_optional_features_are_requested_when_the_adapter_has_them(gpu):
    for feature in device_mod.OPTIONAL_FEATURES:
        assert (feature in gpu.features) == (feature_name(gpu.webgpu, feature) in gpu.adapter.features)


def test_vulkan_is_preferred_over_the_gl_fallback():
    adapters = device_mod.list_adapters()
    backends = [str(a.info["backend_type"]).lower() for a in adapters]
    if "vulkan" in backends and "opengl" in backends:
        assert backends.index("vulkan") < backends.index("opengl")
    assert str(select_adapter().info["backend_type"]).lower() == backends[0]


def test_unknown_backend_gives_a_typed_error_listing_what_exists(monkeypatch):
    monkeypatch.setenv("DOPPLER_BACKEND", "no-such-backend")
    with pytest.raises(NoAdapterError, match="available"):
        select_adapter()


def test_no_adapter_error_says_how_to_install_one(monkeypatch):
    monkeypatch.setattr(device_mod, "list_adapters", lambda webgpu=None: [])
    with pytest.raises(NoAdapterError, match="mesa-vulkan-drivers"):
        select_adapter()


def test_buffer_beyond_the_device_limit_is_refused_by_name(gpu):
    with pytest.raises(DeviceLimitError, match="lm_head"):
        gpu.check_buffer_size(gpu.limits["max-buffer-size"] + 4, "lm_head")


@pytest.mark.parametrize(
    ("preset", "flags", "expected"),
    [(None, {"avx2", "avx512f"}, "512"), (None, {"avx2"}, None), ("256", {"avx512f"}, "256")],
)
def test_lavapipe_gets_avx512_vectors_only_where_the_cpu_has_them_and_the_user_chose_nothing(
    monkeypatch, preset, flags, expected
):
    # setenv first records the original state, so the value _widen_lavapipe_vectors writes is undone afterwards
    # (delenv of an unset variable records nothing, and "512" leaked into later tests on CPUs without AVX-512).
    monkeypatch.setenv("LP_NATIVE_VECTOR_WIDTH", "unset")
    monkeypatch.delenv("LP_NATIVE_VECTOR_WIDTH")
    if preset is not None:
        monkeypatch.setenv("LP_NATIVE_VECTOR_WIDTH", preset)
    monkeypatch.setattr(device_mod, "_cpu_flags", lambda: flags)
    device_mod._widen_lavapipe_vectors()
    assert device_mod.os.environ.get("LP_NATIVE_VECTOR_WIDTH") == expected


def test_lavapipe_runs_at_the_vector_width_chosen_before_it_loaded(gpu):
    description = f"{gpu.info.get('device', '')} {gpu.info.get('description', '')}"
    if "llvmpipe" not in description:
        pytest.skip("only Mesa's CPU driver reads LP_NATIVE_VECTOR_WIDTH")
    width = device_mod.os.environ.get("LP_NATIVE_VECTOR_WIDTH", "256")
    assert f"{width} bits" in description
