"""Streaming a buffer in: the sums `shaders/stream_read.wgsl` computes while reading all of it, one per workgroup.

The op exists to measure the adapter (doppler_py/bandwidth.py): what it computes is only there so that the
compiler keeps every load, and so that a test can check that every element was read exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from doppler_py.gpu.kernels import KernelRegistry, workgroups
from doppler_py.gpu.recorder import Recorder
from doppler_py.gpu.tensor import Tensor


@dataclass(frozen=True)
class Load:
    """One load type of the kernel: its entry point, the binding it reads, its sum type and element size."""

    entry: str
    src: str
    out: str  # "sums" (f32) or "words" (u32)
    dtype: str  # the tensor dtype it reads
    lanes: int  # scalars per element (1 or 4)

    @property
    def element_bytes(self) -> int:
        return 4 * self.lanes


LOADS: dict[str, Load] = {
    "f32": Load("read_f32", "src_f32", "sums", "f32", 1),
    "vec4<f32>": Load("read_vec4_f32", "src_vec4", "sums", "f32", 4),
    "u32": Load("read_u32", "src_u32", "words", "u32", 1),
    "vec4<u32>": Load("read_vec4_u32", "src_vec4u", "words", "u32", 4),
}
PATTERNS = {"contiguous": 0, "interleaved": 1}  # the PATTERN override
UNROLLS = (1, 4)  # the UNROLL override: loads per loop iteration
MAX_WORKGROUP = 256  # the kernel's workgroup memory holds one sum per invocation, up to this many


def min_per_invocation(elements: int, workgroup_size: int, max_workgroups: int) -> int:
    """The fewest elements per invocation that cover `elements` within `max_workgroups` workgroups."""
    return max(1, -(-elements // (workgroup_size * max_workgroups)))


class StreamRead:
    """partial[w] = the sum of src's elements w * span .. (w + 1) * span - 1 (span = workgroup_size *
    per_invocation), read as `load` (a key of LOADS) and shared out among the workgroup by `pattern`, `unroll`
    loads per loop iteration.

    f32 loads sum in f32 (each invocation into `unroll` running sums, then the workgroup's sums as a tree), u32
    loads modulo 2^32. src: a tensor of the load's dtype whose size is a whole number of elements (any view)."""

    def __init__(
        self,
        registry: KernelRegistry,
        src: Tensor,
        load: str,
        *,
        workgroup_size: int = 64,
        pattern: str = "contiguous",
        per_invocation: int = 64,
        unroll: int = 1,
    ):
        if load not in LOADS:
            raise ValueError(f"StreamRead: unknown load {load!r}; choose one of {', '.join(LOADS)}")
        if pattern not in PATTERNS:
            raise ValueError(f"StreamRead: unknown pattern {pattern!r}; choose one of {', '.join(PATTERNS)}")
        if not 1 <= workgroup_size <= MAX_WORKGROUP:
            raise ValueError(f"StreamRead: workgroup_size must be in 1..{MAX_WORKGROUP}, got {workgroup_size}")
        if unroll not in UNROLLS:
            raise ValueError(f"StreamRead: unroll must be one of {UNROLLS}, got {unroll}")
        if per_invocation < 1:
            raise ValueError(f"StreamRead: per_invocation must be at least 1, got {per_invocation}")
        self.load = LOADS[load]
        if src.dtype != self.load.dtype or src.numel % self.load.lanes or src.numel == 0:
            raise ValueError(
                f"StreamRead: a {load} load reads a non-empty {self.load.dtype} tensor of whole "
                f"{self.load.lanes}-scalar elements, got {src.numel} {src.dtype}"
            )
        self.elements = src.numel // self.load.lanes
        self.nbytes = self.elements * self.load.element_bytes
        self.workgroups = workgroups(self.elements, workgroup_size * per_invocation)
        if self.workgroups > registry.max_workgroups:
            raise ValueError(
                f"StreamRead: {self.workgroups} workgroups exceed the device's {registry.max_workgroups}; read at "
                f"least {min_per_invocation(self.elements, workgroup_size, registry.max_workgroups)} per invocation"
            )
        self.registry = registry
        self.out = Tensor.empty(registry.gpu, self.workgroups, "f32" if self.load.out == "sums" else "u32")
        kernel = registry.kernel(
            "stream_read", self.load.entry, WORKGROUP_SIZE=workgroup_size, PATTERN=PATTERNS[pattern], UNROLL=unroll
        )
        params = {"n": self.elements, "per_invocation": per_invocation}
        self.bound = registry.bind(kernel, params, **{self.load.src: src, self.load.out: self.out})

    def record(self, rec: Recorder) -> None:
        rec.dispatch(self.bound, self.workgroups)

    def partials(self) -> np.ndarray:
        """Each workgroup's sum (f32 or u32); waits for the GPU."""
        return self.out.numpy()

    def release(self) -> None:
        self.registry.release_slot(self.bound.params)
        self.registry.release_tensors(self.out)
