"""Reduced-vocabulary logits → a target-vocabulary row (`shaders/vocab_scatter.wgsl`)."""

from __future__ import annotations

import numpy as np

from doppler_py.gpu.kernels import KernelRegistry, workgroups
from doppler_py.gpu.recorder import Recorder
from doppler_py.gpu.tensor import Tensor


class VocabScatter:
    """dst[index[j]] = src[j] for the n draft tokens; the rest of `dst` holds -inf, written once here.

    src: f32 [>= n] (a head's logits row); index: the n distinct target ids, in [0, len(dst));
    dst: f32 [target vocab].
    """

    def __init__(self, registry: KernelRegistry, src: Tensor, index: np.ndarray, dst: Tensor):
        index = np.asarray(index)
        n = index.size
        if n < 1 or src.numel < n:
            raise ValueError(f"VocabScatter: src holds {src.numel} logits for {n} draft tokens")
        if np.unique(index).size != n or index.min() < 0 or index.max() >= dst.numel:
            raise ValueError(f"VocabScatter: the index must hold {n} distinct ids below {dst.numel}")
        dst.write(np.full(dst.numel, -np.inf, np.float32))
        self.index = Tensor.from_numpy(registry.gpu, index.astype(np.uint32), "u32", "vocab index")
        self.n = n
        self.bound = registry.bind(registry.kernel("vocab_scatter"), {"n": n}, src=src, index=self.index, dst=dst)

    def record(self, rec: Recorder) -> None:
        rec.dispatch(self.bound, workgroups(self.n, 256))

    def release(self, registry: KernelRegistry) -> None:
        registry.release_tensors(self.index)
        registry.release_slot(self.bound.params)
