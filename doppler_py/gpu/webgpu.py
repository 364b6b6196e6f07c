"""Which WebGPU implementation a device is created on: wgpu-native (wgpu-py, naga compiling WGSL) or Dawn
(`wgpudawn`, the wgpu-py API on the implementation Chrome ships, Tint compiling WGSL).

Both expose the same wgpu-py 0.32 API and both load into one process (wgpu-native through cffi, Dawn as its own
extension module), so the choice is per device: `create_gpu(webgpu=...)`. Every engine object reaches the
implementation through its device (`Gpu.api`), never through a module-wide `import wgpu`.

Dawn refuses Debian 12's Mesa 22.3 lavapipe (it lacks Vulkan's shaderUniform*ArrayDynamicIndexing). On a machine
without a GPU (no /dev/dri render node), Dawn is pointed at the Mesa 25 lavapipe that tools/mesa25.sh unpacks (run
here from a source checkout when missing), while Dawn lists its adapters only: the environment is restored right
after, so a wgpu-native device in the same process keeps the system's driver.

Environment variables:
  DOPPLER_WEBGPU      wgpu-native (the default) or dawn
  DOPPLER_MESA25_DIR  where tools/mesa25.sh unpacked Mesa 25's lavapipe (default ~/.cache/doppler-py/mesa25)
  DOPPLER_MESA25_VECTOR_WIDTH  the vector width (bits) Mesa 25's lavapipe compiles Dawn's kernels for (default 128;
                      see MESA25_VECTOR_BITS); wgpu-native's driver keeps LP_NATIVE_VECTOR_WIDTH
  VK_ICD_FILENAMES    (the Vulkan loader's own) when set, Dawn uses the drivers it names and nothing is changed
"""

from __future__ import annotations

import ctypes
import glob
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import ModuleType

from doppler_py.errors import NoAdapterError, WebGpuImplementationError

WGPU_NATIVE = "wgpu-native"
DAWN = "dawn"
IMPLEMENTATIONS = (WGPU_NATIVE, DAWN)
ENV_VAR = "DOPPLER_WEBGPU"

MESA25_DIR = Path(os.environ.get("DOPPLER_MESA25_DIR", Path.home() / ".cache/doppler-py/mesa25"))
_MESA25_SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "mesa25.sh"
_LOADER_ENV = ("VK_ICD_FILENAMES", "VK_DRIVER_FILES")
# Mesa's own variable: the vector width (bits) llvmpipe compiles kernels for, read once when the driver loads.
LAVAPIPE_WIDTH_ENV = "LP_NATIVE_VECTOR_WIDTH"
MESA25_WIDTH_ENV = "DOPPLER_MESA25_VECTOR_WIDTH"
# Mesa 25's llvmpipe compiles a kernel in a time that grows with its vector width and, faster than linearly, with
# the storage loads the kernel spells out: a kernel of 128 unrolled vec4 loads took 35 s of CPU at 512 bits, 12 s at
# 256 and 4 s at 128 (Mesa 22.3: 0.7 s at 512). Our f32 matmul (64 loads per block) took 28 s at 512 bits, 5.4 s at
# 256 and 3.2 s at 128; attention at head dim 256, 36.5 s and 6.8 s (Mesa 22.3 at 512: 1.4 s and 2.6 s). Dawn on
# a CPU is there to check the kernels on Chrome's implementation, not to be fast, so its driver gets 4 lanes.
MESA25_VECTOR_BITS = 128
_LLVMPIPE_WIDTHS = ("128", "256", "512")


def mesa25_vector_width() -> str:
    """The LAVAPIPE_WIDTH_ENV value Mesa 25's lavapipe gets wherever Dawn runs on it (this process's Dawn devices,
    the JS original's Node process): $DOPPLER_MESA25_VECTOR_WIDTH, else MESA25_VECTOR_BITS."""
    value = os.environ.get(MESA25_WIDTH_ENV, str(MESA25_VECTOR_BITS)).strip()
    if value not in _LLVMPIPE_WIDTHS:
        raise WebGpuImplementationError(
            f"{MESA25_WIDTH_ENV}={value!r} is not a vector width llvmpipe compiles for",
            advice=f"set it to one of {', '.join(_LLVMPIPE_WIDTHS)} (bits), or unset it for {MESA25_VECTOR_BITS}",
        )
    return value


# Guards the environment while Dawn lists its adapters.
_DAWN_LOCK = threading.Lock()


def chosen(name: str | None = None) -> str:
    """`name`, else $DOPPLER_WEBGPU, else wgpu-native; anything else is a `WebGpuImplementationError`."""
    value = (name or os.environ.get(ENV_VAR) or WGPU_NATIVE).strip().lower()
    if value not in IMPLEMENTATIONS:
        source = "webgpu=" if name else f"{ENV_VAR}="
        raise WebGpuImplementationError(
            f"unknown WebGPU implementation {source}{value!r}", advice=f"choose one of {', '.join(IMPLEMENTATIONS)}"
        )
    return value


def api(name: str) -> ModuleType:
    """The wgpu-py API module of implementation `name`."""
    if name == WGPU_NATIVE:
        import wgpu

        return wgpu
    try:
        import wgpudawn
    except ImportError as exc:
        raise WebGpuImplementationError(
            f"the Dawn WebGPU implementation is not installed ({exc})",
            advice="pip install 'doppler-py[dawn]' (or pip install wgpudawn), or use --webgpu wgpu-native",
        ) from exc
    return wgpudawn


def dawn_uses_mesa25() -> bool:
    """Whether Dawn runs on Mesa 25's lavapipe here: a Linux machine whose only Vulkan driver is a lavapipe, and the
    user has not named the Vulkan drivers (the loader's own variables: then Dawn takes those, as they are)."""
    return sys.platform == "linux" and not any(os.environ.get(v) for v in _LOADER_ENV) and _cpu_only()


def enumerate_adapters(name: str) -> list:
    """Every adapter implementation `name` offers. Dawn's are listed, on a machine whose only Vulkan driver is a
    lavapipe (no GPU render node), with Mesa 25's lavapipe as the only Vulkan driver; the environment is as it was
    afterwards. A Dawn adapter serves one device, so each device needs a listing of its own."""
    module = api(name)
    if name == WGPU_NATIVE or not dawn_uses_mesa25():
        return module.gpu.enumerate_adapters_sync()
    icd = mesa25_icd()
    with _DAWN_LOCK:
        _load_mesa25_libraries(icd)
        saved = {v: os.environ.get(v) for v in (*_LOADER_ENV, LAVAPIPE_WIDTH_ENV)}
        os.environ["VK_ICD_FILENAMES"] = os.environ["VK_DRIVER_FILES"] = str(icd)
        # llvmpipe reads its width once, when this listing loads it; the system's driver (another library) keeps
        # the width device.py gives it when it loads.
        os.environ[LAVAPIPE_WIDTH_ENV] = mesa25_vector_width()
        try:
            return module.gpu.enumerate_adapters_sync()
        finally:
            for variable, value in saved.items():
                if value is None:
                    os.environ.pop(variable, None)
                else:
                    os.environ[variable] = value


# Dawn names a few features by their WebGPU spelling where wgpu-native 0.32 does not.
_DAWN_FEATURE_NAMES = {"subgroup": "subgroups"}


# Features the engine needs of an implementation whatever it runs: Dawn's device is safe to call from several threads
# (the engine's loop, its background compiles, the server's workers) only with this one, which wgpu-native's always is.
_REQUIRED_FEATURES = {DAWN: ("implicit-device-synchronization",)}


def required_features(name: str) -> tuple[str, ...]:
    """The implementation's own features every device of the engine asks for (see _REQUIRED_FEATURES)."""
    return _REQUIRED_FEATURES.get(name, ())


def feature_name(name: str, feature: str) -> str:
    """The name implementation `name` gives the engine's optional `feature`."""
    return _DAWN_FEATURE_NAMES.get(feature, feature) if name == DAWN else feature


def driver_to_unpack(name: str) -> Path | None:
    """The Mesa 25 folder implementation `name` would unpack on its first device here, if it would (None: none)."""
    if name != DAWN or not dawn_uses_mesa25():
        return None
    return None if (MESA25_DIR / "lvp_icd.json").is_file() else MESA25_DIR


def use_mesa25_everywhere() -> Path:
    """Make Mesa 25's lavapipe the only Vulkan driver of every implementation in this process (so wgpu-native and
    Dawn run on the same adapter, e.g. to compare them); call before any device exists. Returns its ICD file."""
    icd = mesa25_icd()
    _load_mesa25_libraries(icd)
    os.environ["VK_ICD_FILENAMES"] = os.environ["VK_DRIVER_FILES"] = str(icd)
    return icd


def _load_mesa25_libraries(icd: Path) -> None:
    for library in ("libdrm.so.2", "libdrm_amdgpu.so.1"):
        # The driver links a newer libdrm than Debian 12's; ld.so reads LD_LIBRARY_PATH only at process start,
        # so the newer one is loaded by path first and satisfies the driver's dependency by its soname.
        path = icd.parent / "lib" / library
        if path.is_file():
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)


def _cpu_only() -> bool:
    """No GPU render node: the machine's Vulkan drivers can only be a CPU one (lavapipe)."""
    return not glob.glob("/dev/dri/renderD*")


def mesa25_icd() -> Path:
    """Mesa 25 lavapipe's ICD file, unpacked by tools/mesa25.sh (run now from a source checkout if missing)."""
    icd = MESA25_DIR / "lvp_icd.json"
    if icd.is_file():
        return icd
    fix = f"bash {_MESA25_SCRIPT}" if _MESA25_SCRIPT.is_file() else "tools/mesa25.sh from the doppler-py repository"
    if _MESA25_SCRIPT.is_file():
        print(f"doppler-py: Dawn needs Mesa 25's lavapipe; unpacking it into {MESA25_DIR}", file=sys.stderr)
        result = subprocess.run(
            ["bash", str(_MESA25_SCRIPT), str(MESA25_DIR)], stdout=sys.stderr, stderr=subprocess.PIPE, text=True
        )
        if result.returncode == 0 and icd.is_file():
            return icd
        detail = result.stderr.strip().splitlines()[-1:] or [f"exit status {result.returncode}"]
        raise NoAdapterError(
            f"Dawn refuses Debian's Mesa 22.3 lavapipe and unpacking Mesa 25's failed: {detail[0]}",
            advice=f"run `{fix}` (it needs apt-get and Debian's servers), or use --webgpu wgpu-native",
        )
    raise NoAdapterError(
        f"Dawn refuses Debian's Mesa 22.3 lavapipe and Mesa 25's is not unpacked in {MESA25_DIR}",
        advice=f"run {fix} (or point VK_ICD_FILENAMES at a Vulkan driver Dawn accepts), or use --webgpu wgpu-native",
    )
