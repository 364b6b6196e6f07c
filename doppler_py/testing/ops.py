"""Ops whose kernels the model never runs, kept for the kernel tests, the JS-parity lane and selfchecks.

The forward pass folds its residual adds into the matmuls (`Linear(accumulate=True)`) and samples from raw
logits (the sampler applies temperature itself), so `residual.wgsl` and `softmax.wgsl` run only here. The
shaders stay in shaders/ (the Tint lane validates every shader; softmax is also compared with the JS
original's softmax).
"""

from __future__ import annotations

import math

from doppler_py.errors import GenerationOptionError
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


class Softmax:
    """out[t] = softmax(logits[t] / temperature), or log_softmax with `log=True`, over `cols` columns; one
    workgroup per row.

    Masking convention: a logit of -inf gets probability exactly 0 (log-probability -inf). A row whose logits
    are ALL -inf has no distribution; it comes out as all-zero probabilities (all -inf log-probabilities), so a
    sampler recognises it by its zero total mass. +inf and NaN logits are not supported.
    """

    def __init__(
        self, registry: KernelRegistry, logits: Tensor, out: Tensor, *, cols: int, max_rows: int, log: bool = False
    ):
        require_f32(logits, max_rows * cols, "Softmax logits")
        require_f32(out, max_rows * cols, "Softmax out")
        self.max_rows = max_rows
        kernel = registry.kernel("softmax", LOG_SOFTMAX=log)
        self.bound = registry.bind(kernel, params={"cols": cols, "temperature": 1.0}, logits=logits, out=out)

    def record(self, rec: Recorder, rows: int, temperature: float = 1.0) -> None:
        require_rows(rows, self.max_rows, "Softmax")
        if not (math.isfinite(temperature) and temperature > 0):
            raise GenerationOptionError(f"temperature must be a finite number > 0, got {temperature}")
        self.bound.params.set(temperature=temperature)
        rec.dispatch(self.bound, rows)
