"""The log-probs op (`doppler_py.ops.logprobs.LogProbs`, shaders/logprobs.wgsl) against numpy: the chosen
token of each row (as the verifier's result names it) and the top-n alternatives of log_softmax(logits / T).

Tolerance as test_softmax's log-probabilities: atol 2e-5 + rtol 1e-6. The top-n ids must match exactly: the
order is by decreasing logit, ties by increasing id (the inputs' values are distinct or exactly equal)."""

from __future__ import annotations

import numpy as np
import pytest

from doppler_py.gpu.tensor import Tensor
from doppler_py.ops.logprobs import MAX_TOP_LOGPROBS, LogProbs
from doppler_py.sampling import SamplingParams
from doppler_py.testing.references import log_softmax


def reference_top(row_logprobs: np.ndarray, top_n: int) -> list[int]:
    order = sorted(range(len(row_logprobs)), key=lambda i: (-row_logprobs[i], i))  # -inf entries last, by id
    return order[:top_n]


def run_logprobs(gpu, registry, logits, result, *, temperature, top_n):
    rows, vocab = logits.shape
    op = LogProbs(
        registry,
        Tensor.from_numpy(gpu, logits),
        Tensor.from_numpy(gpu, np.asarray(result, np.uint32)),
        vocab=vocab,
        max_rows=rows,
    )
    try:
        rec = registry.recorder()
        op.record_distribution(rec, rows, SamplingParams(temperature=temperature))
        op.record_pick(rec, rows, top_n)
        rec.submit()
        return op.read(rows, top_n)
    finally:
        op.release(registry)


def check(out, logits, chosen, temperature, top_n):
    expected = log_softmax(logits, temperature if temperature > 0 else 1.0)
    for r, entry in enumerate(out):
        assert entry.token == chosen[r]
        want = expected[r, chosen[r]]
        assert (entry.logprob == want == -np.inf) or entry.logprob == pytest.approx(want, rel=1e-6, abs=2e-5)
        ids = [i for i, _ in entry.top]
        assert ids == reference_top(expected[r], top_n)
        for i, lp in entry.top:
            assert (lp == expected[r, i] == -np.inf) or lp == pytest.approx(expected[r, i], rel=1e-6, abs=2e-5)


@pytest.mark.parametrize("vocab", [1, 7, 255, 257, 1000, 49152])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_matches_numpy_for_awkward_sizes(gpu, registry, rng, vocab, temperature):
    rows, accepted = 3, 1
    logits = (rng.standard_normal((rows, vocab)) * 4).astype(np.float32)
    drafts = rng.integers(0, vocab, rows - 1)
    final = int(rng.integers(0, vocab))
    result = [accepted, final, 0, *drafts]
    out = run_logprobs(gpu, registry, logits, result, temperature=temperature, top_n=5)
    # Rows 0..accepted are the committed ones: the drafts that were accepted, then the final token.
    check(out[: accepted + 1], logits[: accepted + 1], [*drafts[:accepted], final], temperature, 5)


def test_masked_logits_and_ties(gpu, registry):
    logits = np.array(
        [[-np.inf, 2.0, 2.0, -np.inf, 1.0, 2.0], [-np.inf] * 6, [0.5, -np.inf, 0.5, 0.5, -np.inf, 3.0]],
        np.float32,
    )
    out = run_logprobs(gpu, registry, logits, [2, 4, 0, 0, 3], temperature=1.0, top_n=MAX_TOP_LOGPROBS)
    check(out[:1], logits[:1], [0], 1.0, MAX_TOP_LOGPROBS)  # a -inf chosen token: -inf
    assert out[0].logprob == -np.inf and [i for i, _ in out[0].top] == [1, 2, 5, 4, 0, 3]
    assert all(lp == -np.inf for _, lp in out[1].top) and out[1].logprob == -np.inf  # no finite entry
    check(out[2:], logits[2:], [4], 1.0, MAX_TOP_LOGPROBS)
    assert [i for i, _ in out[2].top] == [5, 0, 2, 3, 1, 4]


def test_vocab_of_one_and_no_alternatives(gpu, registry):
    logits = np.array([[3.0], [-1.0]], np.float32)
    out = run_logprobs(gpu, registry, logits, [1, 0, 0, 0], temperature=0.5, top_n=20)
    assert [(e.token, e.logprob, e.top) for e in out] == [(0, 0.0, [(0, 0.0)]), (0, 0.0, [(0, 0.0)])]
    assert run_logprobs(gpu, registry, logits, [0, 0, 0, 0], temperature=1.0, top_n=0)[0].top == []
