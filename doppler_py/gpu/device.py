"""Adapter selection and device creation.

One `Gpu` wraps a wgpu adapter + device with the features and limits we asked for. Two modes:

* native limits: what the adapter offers for the limits that matter to compute (buffer sizes, storage
  buffers per stage, workgroup memory), so big models fit;
* browser limits: exactly the WebGPU default limits a browser gives a page that asks for nothing, so a
  kernel that would fail in Chrome fails in our tests too.

The device is created on wgpu-native (the default) or Dawn: see webgpu.py for the choice and DOPPLER_WEBGPU.

Environment variables:
  DOPPLER_BACKEND         force a backend: vulkan, metal, d3d12, gl
  DOPPLER_ADAPTER         substring of the adapter name/description to pick (case-insensitive)
  DOPPLER_BROWSER_LIMITS  "1" makes `default_gpu()` use browser limits
  DOPPLER_DISABLE_FEATURES  comma-separated optional features not to request (e.g. "subgroup,shader-f16"),
                          to run the fallback paths a device without them takes
  LP_NATIVE_VECTOR_WIDTH  Mesa's own: the vector width lavapipe compiles kernels for. Left to the user when
                          set; otherwise 512 on CPUs with AVX-512 (see `_widen_lavapipe_vectors`)
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field

from doppler_py.errors import DeviceLimitError, NoAdapterError
from doppler_py.gpu import webgpu as webgpu_impl

OPTIONAL_FEATURES = ("shader-f16", "subgroup", "timestamp-query")

# The WebGPU specification's default limits (https://www.w3.org/TR/webgpu/#limits) for compute.
BROWSER_LIMITS: dict[str, int] = {
    "max-bind-groups": 4,
    "max-buffer-size": 268_435_456,
    "max-storage-buffer-binding-size": 134_217_728,
    "max-uniform-buffer-binding-size": 65_536,
    "max-storage-buffers-per-shader-stage": 8,
    "max-uniform-buffers-per-shader-stage": 12,
    "max-compute-workgroup-storage-size": 16_384,
    "max-compute-invocations-per-workgroup": 256,
    "max-compute-workgroup-size-x": 256,
    "max-compute-workgroup-size-y": 256,
    "max-compute-workgroup-size-z": 64,
    "max-compute-workgroups-per-dimension": 65_535,
    "min-uniform-buffer-offset-alignment": 256,
    "min-storage-buffer-offset-alignment": 256,
}

# Backends in order of preference: native APIs before the OpenGL fallback (which lacks f16/subgroups).
_BACKEND_RANK = {"vulkan": 0, "metal": 0, "d3d12": 0, "opengl": 2, "gl": 2}
_TYPE_RANK = {"discretegpu": 0, "integratedgpu": 1, "virtualgpu": 2, "cpu": 3}

INSTALL_HINT = (
    "Install a WebGPU-capable driver. On Debian/Ubuntu without a GPU: "
    "`sudo apt-get install -y mesa-vulkan-drivers` (the lavapipe software Vulkan adapter)."
)


def _quiet_vulkan_loader() -> None:
    # The Vulkan loader warns "XDG_RUNTIME_DIR is invalid" on every start when the variable is unset.
    if not os.environ.get("XDG_RUNTIME_DIR") or not os.path.isdir(os.environ["XDG_RUNTIME_DIR"]):
        path = os.path.join(tempfile.gettempdir(), f"doppler-xdg-{os.getuid()}")
        os.makedirs(path, mode=0o700, exist_ok=True)
        os.environ["XDG_RUNTIME_DIR"] = path


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def _widen_lavapipe_vectors() -> None:
    """Let lavapipe use AVX-512's 16 lanes instead of its default of 8 (only where the CPU has AVX-512).

    llvmpipe caps its vectors at 256 bits unless LP_NATIVE_VECTOR_WIDTH says otherwise, and reads the
    variable once, when the Vulkan driver loads, so it is set before the first adapter query. Measured on
    AMD EPYC (Zen 5, 2 cores) with tools/bench_kernels.py and tools/bench_model.py: verifying 5 rows over
    the LM head 1.35x faster, prefill 1.3x faster, decode unchanged; the test suite passes at both widths.
    The variable only matters to Mesa's CPU driver, so GPUs are unaffected; LP_NATIVE_VECTOR_WIDTH=256 keeps
    the old width.
    """
    if "LP_NATIVE_VECTOR_WIDTH" not in os.environ and "avx512f" in _cpu_flags():
        os.environ["LP_NATIVE_VECTOR_WIDTH"] = "512"


@dataclass
class Gpu:
    """A WebGPU device plus what we know about it."""

    adapter: object
    device: object
    features: frozenset[str]
    limits: dict[str, int]
    browser_limits: bool
    info: dict = field(default_factory=dict)
    webgpu: str = webgpu_impl.WGPU_NATIVE  # the implementation the device is on (webgpu.IMPLEMENTATIONS)
    _sync_buffer: object = field(default=None, repr=False)
    # shader folder -> its gpu.kernels.PipelineCache: the pipelines compiled on this device, for every registry
    pipeline_caches: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def queue(self):
        return self.device.queue

    @property
    def api(self):
        """The wgpu-py API module of this device's implementation (its flags, enums and classes)."""
        return webgpu_impl.api(self.webgpu)

    @property
    def backend(self) -> str:
        return str(self.info.get("backend_type", "unknown"))

    @property
    def name(self) -> str:
        return str(self.info.get("device") or self.info.get("description") or "unknown adapter")

    @property
    def has_subgroups(self) -> bool:
        return "subgroup" in self.features

    @property
    def on_cpu(self) -> bool:
        """A software adapter (lavapipe, SwiftShader): invocations run as SIMD lanes on a few CPU cores."""
        return str(self.info.get("adapter_type", "")).lower() == "cpu"

    @property
    def uniform_alignment(self) -> int:
        return int(self.limits["min-uniform-buffer-offset-alignment"])

    @property
    def max_binding_bytes(self) -> int:
        return int(self.limits["max-storage-buffer-binding-size"])

    def wait_idle(self) -> None:
        """Block until every submitted command has finished (a 4-byte readback queued behind them)."""
        if self._sync_buffer is None:
            self._sync_buffer = self.device.create_buffer(size=4, usage=self.api.BufferUsage.COPY_SRC, label="sync")
        self.queue.read_buffer(self._sync_buffer, 0, 4)

    def check_buffer_size(self, nbytes: int, what: str, advice: str | None = None) -> None:
        """Raise `DeviceLimitError` naming `what` when one buffer of `nbytes` cannot exist on this device."""
        limit = int(self.limits["max-buffer-size"])
        if nbytes > limit:
            raise DeviceLimitError(
                f"{what} needs a {nbytes:,}-byte buffer but this device allows at most {limit:,} bytes "
                f"per buffer ({self.name}, {'browser' if self.browser_limits else 'native'} limits)",
                advice=advice,
            )

    def summary(self) -> dict:
        return {
            "webgpu": self.webgpu,
            "adapter": self.name,
            "backend": self.backend,
            "adapter_type": str(self.info.get("adapter_type", "")),
            "driver": str(self.info.get("description", "")),
            "features": sorted(f for f in self.features if f in OPTIONAL_FEATURES),
            "limits_mode": "browser" if self.browser_limits else "native",
            "limits": dict(self.limits),
        }


def _adapter_rank(adapter) -> tuple[int, int]:
    info = adapter.info
    backend = str(info.get("backend_type", "")).lower()
    kind = str(info.get("adapter_type", "")).lower()
    return (_BACKEND_RANK.get(backend, 1), _TYPE_RANK.get(kind, 2))


def list_adapters(webgpu: str | None = None) -> list:
    """All adapters implementation `webgpu` (default: `webgpu.chosen()`) can see, best first."""
    _quiet_vulkan_loader()
    _widen_lavapipe_vectors()
    return sorted(webgpu_impl.enumerate_adapters(webgpu_impl.chosen(webgpu)), key=_adapter_rank)


def select_adapter(backend: str | None = None, name: str | None = None, webgpu: str | None = None):
    """Pick the best adapter of implementation `webgpu`, optionally forcing a backend and/or a name substring."""
    webgpu = webgpu_impl.chosen(webgpu)
    backend = (backend or os.environ.get("DOPPLER_BACKEND") or "").strip().lower() or None
    name = (name or os.environ.get("DOPPLER_ADAPTER") or "").strip().lower() or None
    adapters = list_adapters(webgpu)
    if not adapters:
        raise NoAdapterError(f"No WebGPU adapter found on {webgpu}. {INSTALL_HINT}")
    wanted = adapters
    if backend:
        aliases = {"gl": "opengl", "opengl": "opengl"}
        target = aliases.get(backend, backend)
        wanted = [a for a in wanted if str(a.info.get("backend_type", "")).lower() == target]
    if name:
        wanted = [a for a in wanted if name in f"{a.info.get('device', '')} {a.info.get('description', '')}".lower()]
    if not wanted:
        seen = ", ".join(f"{a.info.get('device')} via {a.info.get('backend_type')}" for a in adapters)
        raise NoAdapterError(
            f"No WebGPU adapter matches DOPPLER_BACKEND={backend!r} DOPPLER_ADAPTER={name!r}; "
            f"available: {seen}. Unset the variables or pick one of those."
        )
    return wanted[0]


def _requested_limits(adapter, browser_limits: bool) -> dict[str, int]:
    offered = {k: int(v) for k, v in adapter.limits.items() if isinstance(v, int)}
    if browser_limits:
        limits = dict(BROWSER_LIMITS)
    else:
        limits = {k: offered.get(k, v) for k, v in BROWSER_LIMITS.items()}
        # Alignment limits are "better" when smaller; the adapter's own value is what it supports best.
    return {k: v for k, v in limits.items() if k in offered}


def create_gpu(
    *,
    browser_limits: bool = False,
    backend: str | None = None,
    adapter_name: str | None = None,
    disable_features: tuple[str, ...] | None = None,
    webgpu: str | None = None,
) -> Gpu:
    """Create a device on the selected adapter of implementation `webgpu` (default: `webgpu.chosen()`) with the
    optional features it has and explicit limits."""
    webgpu = webgpu_impl.chosen(webgpu)
    adapter = select_adapter(backend, adapter_name, webgpu)
    if disable_features is None:
        disable_features = tuple(f.strip() for f in os.environ.get("DOPPLER_DISABLE_FEATURES", "").split(",") if f)
    named = {f: webgpu_impl.feature_name(webgpu, f) for f in OPTIONAL_FEATURES}
    features = [f for f in OPTIONAL_FEATURES if named[f] in adapter.features and f not in disable_features]
    limits = _requested_limits(adapter, browser_limits)
    own = webgpu_impl.required_features(webgpu)
    if missing := [f for f in own if f not in adapter.features]:
        raise NoAdapterError(
            f"{webgpu}'s adapter {adapter.info.get('device')} lacks {', '.join(missing)}, which doppler-py needs there",
            advice="update the package of that implementation (pip install -U wgpudawn), or use --webgpu wgpu-native",
        )
    device = adapter.request_device_sync(
        label="doppler-py", required_features=[named[f] for f in features] + list(own), required_limits=limits
    )
    granted = {k: int(device.limits[k]) for k in limits}
    return Gpu(
        adapter=adapter,
        device=device,
        features=frozenset(features),
        limits=granted,
        browser_limits=browser_limits,
        info=dict(adapter.info),
        webgpu=webgpu,
    )


_DEFAULT: dict[tuple[bool, str], Gpu] = {}


def default_gpu(browser_limits: bool | None = None, webgpu: str | None = None) -> Gpu:
    """The process-wide device for the given limits mode and implementation (created on first use)."""
    if browser_limits is None:
        browser_limits = os.environ.get("DOPPLER_BROWSER_LIMITS", "") not in ("", "0")
    key = (browser_limits, webgpu_impl.chosen(webgpu))
    if key not in _DEFAULT:
        _DEFAULT[key] = create_gpu(browser_limits=browser_limits, webgpu=key[1])
    return _DEFAULT[key]
