"""GPU token sampler: logits [rows, vocab] → token ids [rows] (`shaders/sample.wgsl`).

Greedy when the temperature is 0, else temperature + exact top-k + top-p sampling by inverse CDF with one
host-drawn uniform per row; the exact contract and its numpy reference live in
`doppler_py.testing.sampling_reference`. Only ids leave the kernel, never the distribution. Drafters sample
with it (`speculative.drafters.gpu_drafting`); the target's tokens are chosen by the verifier (`ops.speculative`).
"""

from __future__ import annotations

from doppler_py.gpu.kernels import KernelRegistry
from doppler_py.gpu.recorder import Recorder
from doppler_py.gpu.tensor import Tensor
from doppler_py.sampling import SamplingParams

# Token counts are summed in f32 inside the kernel, exact below 2^24.
MAX_VOCAB = (1 << 24) - 1


class Sampler:
    """Samples one token id per row of `logits` into `out_ids`, using `randoms[row]` as that row's u.

    logits: f32 [>= max_rows * vocab]; randoms: f32 [>= max_rows], values in [0, 1) written by the host
    each step; out_ids: u32 [>= max_rows].
    """

    def __init__(
        self,
        registry: KernelRegistry,
        logits: Tensor,
        randoms: Tensor,
        out_ids: Tensor,
        *,
        vocab: int,
        max_rows: int,
    ):
        if not 1 <= vocab <= MAX_VOCAB:
            raise ValueError(f"vocab must be in [1, {MAX_VOCAB}], got {vocab}")
        for name, tensor, dtype, needed in (
            ("logits", logits, "f32", max_rows * vocab),
            ("randoms", randoms, "f32", max_rows),
            ("out_ids", out_ids, "u32", max_rows),
        ):
            if tensor.dtype != dtype or tensor.numel < needed:
                raise ValueError(
                    f"Sampler {name}: need a {dtype} tensor of >= {needed} elements, got {tensor.dtype} {tensor.shape}"
                )
        self.vocab = vocab
        self.max_rows = max_rows
        self.bound = registry.bind(
            registry.kernel("sample"), params={"vocab": vocab}, logits=logits, randoms=randoms, out_ids=out_ids
        )

    def record(self, rec: Recorder, rows: int, temperature: float, top_k: int = 0, top_p: float = 1.0) -> None:
        """Record sampling of the first `rows` rows (greedy when temperature is 0; top_k 0 / top_p 1 = off)."""
        if not 0 <= rows <= self.max_rows:
            raise ValueError(f"Sampler.record: rows must be in [0, {self.max_rows}], got {rows}")
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        self.bound.params.set(
            temperature=params.temperature,
            top_k=params.top_k if params.top_k < self.vocab else 0,
            top_p=params.top_p,
        )
        rec.dispatch(self.bound, rows)
