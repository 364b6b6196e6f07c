"""Softmax and log-softmax with temperature over rows (`shaders/softmax.wgsl`, the one online softmax).

The log-probs op (`doppler_py.ops.logprobs.LogProbs`) runs its log-softmax over the verified rows before
selecting from them; the sampler needs no softmax (it applies temperature to raw logits itself).
"""

from __future__ import annotations

import math

from doppler_py.errors import GenerationOptionError
from doppler_py.gpu.kernels import KernelRegistry
from doppler_py.gpu.recorder import Recorder
from doppler_py.gpu.tensor import Tensor
from doppler_py.ops.elementwise import require_f32, require_rows


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

    def release(self, registry: KernelRegistry) -> None:
        """Give back the op's uniform slot; `logits` and `out` are the caller's."""
        registry.release_slot(self.bound.params)
