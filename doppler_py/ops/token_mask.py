"""Allowed tokens as a bitmask per row (`shaders/token_mask.wgsl`): the tokens a constraint forbids become -inf
in the logits, before any sampling, verification or log-probs reads them."""

from __future__ import annotations

import numpy as np

from doppler_py.gpu.kernels import KernelRegistry, workgroups
from doppler_py.gpu.recorder import Recorder
from doppler_py.gpu.tensor import Tensor
from doppler_py.ops.elementwise import require_f32, require_rows

MAX_MASK_WORKGROUPS = 65535  # WebGPU's default per-dimension limit; token_mask.wgsl strides past it


def mask_words(vocab: int) -> int:
    """u32 words of one row's mask: token t is bit t % 32 of word t // 32."""
    return -(-vocab // 32)


class TokenMask:
    """logits[:rows] masked in place by `mask`'s rows (u32 [max_rows, mask_words(vocab)], written by the host with
    `write` before the step that records this)."""

    def __init__(self, registry: KernelRegistry, logits: Tensor, *, vocab: int, max_rows: int):
        require_f32(logits, max_rows * vocab, "TokenMask logits")
        self.vocab, self.max_rows, self.words = vocab, max_rows, mask_words(vocab)
        self.mask = Tensor.empty(logits.gpu, (max_rows, self.words), "u32", "token mask")
        params = {"vocab": vocab, "words": self.words}
        self.bound = registry.bind(registry.kernel("token_mask"), params=params, mask=self.mask, logits=logits)

    def write(self, rows: np.ndarray) -> None:
        """Upload mask rows (u32 [rows, words]); queued before any later submit."""
        require_rows(rows.shape[0], self.max_rows, "TokenMask")
        if rows.dtype != np.uint32 or rows.shape[1:] != (self.words,):
            raise ValueError(f"TokenMask.write: expected u32 rows of {self.words} words, got {rows.dtype} {rows.shape}")
        self.mask.view(rows.shape).write(np.ascontiguousarray(rows))

    def record(self, rec: Recorder, rows: int) -> None:
        require_rows(rows, self.max_rows, "TokenMask")
        n = rows * self.vocab
        self.bound.params.set(n=n)
        rec.dispatch(self.bound, min(workgroups(n, 256), MAX_MASK_WORKGROUPS))

    def release(self, registry: KernelRegistry) -> None:
        registry.release_tensors(self.mask)
        registry.release_slot(self.bound.params)
