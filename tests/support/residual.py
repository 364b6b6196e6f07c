"""The standalone residual add (`shaders/residual.wgsl`), which only the tests run: the forward pass folds its
residual adds into the matmuls (`Linear(accumulate=True)`). The shader stays in shaders/, where the Tint lane
validates it with every other kernel."""

from __future__ import annotations

from doppler_py.gpu.kernels import KernelRegistry, Recorder, workgroups
from doppler_py.gpu.tensor import Tensor
from doppler_py.ops.elementwise import require_f32, require_rows


class Residual:
    """acc[t, :] += delta[t, :] for the first `rows` rows of [max_rows, dim] tensors, in place."""

    def __init__(self, registry: KernelRegistry, delta: Tensor, acc: Tensor, *, dim: int, max_rows: int):
        require_f32(delta, max_rows * dim, "Residual delta")
        require_f32(acc, max_rows * dim, "Residual acc")
        self.dim = dim
        self.max_rows = max_rows
        self.bound = registry.bind(registry.kernel("residual"), params={"n": 0}, delta=delta, acc=acc)

    def record(self, rec: Recorder, rows: int) -> None:
        require_rows(rows, self.max_rows, "Residual")
        n = rows * self.dim
        self.bound.params.set(n=n)
        rec.dispatch(self.bound, workgroups(n, 256))
