"""The subgroup size kernels may rely on for one device, and the SIMD width of CPU adapters."""

from __future__ import annotations

import os
import weakref

import numpy as np

from doppler_py.gpu.kernels import KernelRegistry
from doppler_py.gpu.recorder import Recorder
from doppler_py.gpu.tensor import Tensor

WEBGPU_MIN_SUBGROUP_SIZE = 4
LLVMPIPE_DEFAULT_BITS = 256
PROBE_INVOCATIONS = 64  # shaders/subgroup_size.wgsl's workgroup size
_measured: weakref.WeakKeyDictionary[KernelRegistry, int] = weakref.WeakKeyDictionary()


def probe_subgroup_sizes(registry: KernelRegistry) -> np.ndarray:
    """The subgroup size each of PROBE_INVOCATIONS invocations ran with (needs subgroups)."""
    sizes = Tensor.empty(registry.gpu, PROBE_INVOCATIONS, dtype="u32", label="subgroup sizes")
    # A plain Recorder: the probe asks about this device, so it is not a computation for the Dawn replay
    # (tests/parity/dawn/trace.py) to compare with another implementation's.
    rec = Recorder(registry)
    rec.dispatch(registry.bind(registry.kernel("subgroup_size"), sizes=sizes), 1)
    rec.submit()
    measured = sizes.numpy()
    registry.release_tensors(sizes)
    return measured


def smallest_subgroup_size(registry: KernelRegistry) -> int:
    """The smallest subgroup size a compute pipeline on this device can get (0 without subgroups).

    CPU adapters (lavapipe, SwiftShader) run every pipeline at their fixed SIMD width, so one probe dispatch
    measures it. GPU drivers may choose a size per pipeline, so there the answer is WebGPU's minimum, 4.
    """
    gpu = registry.gpu
    if not gpu.has_subgroups:
        return 0
    if not gpu.on_cpu:
        return WEBGPU_MIN_SUBGROUP_SIZE
    if registry not in _measured:
        _measured[registry] = max(WEBGPU_MIN_SUBGROUP_SIZE, int(np.min(probe_subgroup_sizes(registry))))
    return _measured[registry]


def simd_lanes(registry: KernelRegistry) -> int:
    """How many invocations run together as the lanes of one vector loop on a CPU adapter (1 on GPUs).

    CPU adapters run every pipeline at their fixed SIMD width, which is their subgroup size. Without subgroups
    it cannot be measured, so it is taken from the vector width lavapipe was given (doppler_py/gpu/device.py;
    256 bits, 8 lanes, is llvmpipe's default). Only speed depends on it (matmul.wgsl first_col).
    """
    if not registry.gpu.on_cpu:
        return 1
    measured = smallest_subgroup_size(registry)
    if measured:
        return measured
    width = os.environ.get("LP_NATIVE_VECTOR_WIDTH", "")
    return max(1, int(width) // 32) if width.isdigit() else LLVMPIPE_DEFAULT_BITS // 32
