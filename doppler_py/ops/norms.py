"""RMSNorm (HF LlamaRMSNorm semantics, computed in f32)."""

from __future__ import annotations

from doppler_py.gpu.kernels import KernelRegistry, Recorder
from doppler_py.gpu.tensor import Tensor
from doppler_py.ops.elementwise import require_f32, require_rows


class RMSNorm:
    """out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight, for rows t < rows of [max_rows, dim] tensors."""

    def __init__(
        self, registry: KernelRegistry, x: Tensor, weight: Tensor, out: Tensor, *, dim: int, eps: float, max_rows: int
    ):
        require_f32(x, max_rows * dim, "RMSNorm x")
        require_f32(weight, dim, "RMSNorm weight")
        require_f32(out, max_rows * dim, "RMSNorm out")
        self.max_rows = max_rows
        self.bound = registry.bind(
            registry.kernel("rmsnorm"), params={"dim": dim, "eps": eps}, x=x, weight=weight, out=out
        )

    def record(self, rec: Recorder, rows: int) -> None:
        require_rows(rows, self.max_rows, "RMSNorm")
        rec.dispatch(self.bound, rows)
