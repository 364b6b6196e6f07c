"""Log-probabilities of a step's committed tokens and their top alternatives.

Recorded into the verification's command encoder, as two dispatches: before the verifier, `shaders/softmax.wgsl`'s
log-softmax of the logits rows the step verifies into a scratch [max_rows, vocab]; after it,
`shaders/logprobs.wgsl`, which picks from those rows the token each row committed (the verifier's result vector
says which) and the top alternatives, and writes one small row per position; `read` fetches the rows that were
committed, once, after the step's result.

Which distribution: log_softmax(logits / T) over the whole vocabulary of the target's logits after the penalties,
the logit bias and the constraint's mask (`doppler_py.testing.penalty_reference`, steps 1-4), T being the request's
temperature (1 for greedy requests, so they report the model's own probabilities, as OpenAI does), before min-p,
top-k and top-p truncate it: a token those filters would never sample still gets its log-probability here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from doppler_py.errors import GenerationOptionError
from doppler_py.gpu.kernels import KernelRegistry
from doppler_py.gpu.recorder import Recorder
from doppler_py.gpu.tensor import Tensor
from doppler_py.ops.softmax import Softmax
from doppler_py.sampling import SamplingParams

MAX_TOP_LOGPROBS = 20  # as OpenAI's top_logprobs; the shader's MAX_TOP
_ROW_WORDS = 2 + 2 * MAX_TOP_LOGPROBS


@dataclass(frozen=True)
class TokenLogprob:
    """One committed token: its id, its log-probability, and the row's most likely tokens (id, log-prob)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def check_top_logprobs(top_n: int | None) -> None:
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or not 0 <= top_n <= 20):
        raise GenerationOptionError(f"logprobs must be None or an integer in 0..{MAX_TOP_LOGPROBS}, got {top_n!r}")


def logprob_temperature(params: SamplingParams) -> float:
    """The temperature the reported distribution uses: the request's, or 1 for greedy decoding."""
    return params.temperature if params.temperature > 0 else 1.0


class LogProbs:
    """logits: f32 [>= max_rows * vocab] (the target's verified rows); result: the verifier's u32 result
    ([accepted, token, status, d_0 ..]); each dispatch runs one workgroup per row."""

    def __init__(self, registry: KernelRegistry, logits: Tensor, result: Tensor, *, vocab: int, max_rows: int):
        if logits.dtype != "f32" or logits.numel < max_rows * vocab:
            raise ValueError(f"LogProbs logits: need f32 >= {max_rows * vocab} elements, got {logits.shape}")
        self.max_rows = max_rows
        self.log_probs = Tensor.empty(registry.gpu, (max_rows, vocab), "f32", label="logprobs log_softmax")
        self.log_softmax = Softmax(registry, logits, self.log_probs, cols=vocab, max_rows=max_rows, log=True)
        self.out = Tensor.empty(registry.gpu, (max_rows, _ROW_WORDS), "f32", label="logprobs")
        self.bound = registry.bind(
            registry.kernel("logprobs"),
            params={"vocab": vocab, "top_n": 0},
            logprobs=self.log_probs,
            result=result,
            out=self.out,
        )
        self.registry = registry

    def record_distribution(self, rec: Recorder, rows: int, params: SamplingParams) -> None:
        """The log-softmax of the first `rows` rows at the request's temperature, as the logits are now (after the
        penalties and the constraint's mask, before min-p truncates them: `ops.penalties`)."""
        if not 1 <= rows <= self.max_rows:
            raise ValueError(f"LogProbs.record: rows must be in [1, {self.max_rows}], got {rows}")
        self.log_softmax.record(rec, rows, logprob_temperature(params))

    def record_pick(self, rec: Recorder, rows: int, top_n: int) -> None:
        """After the verifier: each of the first `rows` rows' committed token and `top_n` alternatives."""
        check_top_logprobs(top_n)
        self.bound.params.set(top_n=top_n)
        rec.dispatch(self.bound, rows)

    def read(self, rows: int, top_n: int) -> list[TokenLogprob]:
        """The first `rows` rows written by the last recorded dispatch (the GPU has finished it)."""
        raw = self.registry.gpu.queue.read_buffer(self.out.buffer, 0, 4 * _ROW_WORDS * rows)
        values = np.frombuffer(raw, np.float32).reshape(rows, _ROW_WORDS)  # ids are exact in f32
        return [
            TokenLogprob(
                int(values[r, 0]),
                float(values[r, 1]),
                [
                    (int(values[r, 2 + 2 * j]), float(values[r, 3 + 2 * j]))
                    for j in range(top_n)
                    if values[r, 2 + 2 * j] >= 0
                ],
            )
            for r in range(rows)
        ]

    def release(self, registry: KernelRegistry) -> None:
        self.log_softmax.release(registry)
        registry.release_tensors(self.log_probs, self.out)
        registry.release_slot(self.bound.params)
