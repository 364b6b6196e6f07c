"""`generate(..., logprobs=N)`: per returned token, its log-probability and the N most likely tokens, equal to
numpy's log_softmax(logits / T) of the model's own logits (`Transformer.forward` over prompt + output on the
host, no HF involved), T the request's temperature (1 when greedy), before top-k/top-p filtering; whether
the token came from a plain step, an accepted draft or a step's final token."""

from __future__ import annotations

import numpy as np
import pytest

from doppler_py.api import load
from doppler_py.errors import GenerationOptionError
from doppler_py.testing.references import log_softmax
from doppler_py.testing.tiny import TinySpec

PROMPT = "the cat sat on the mat. the cat"
TOL = 2e-4  # the step's T-row forward and the reference's whole-sequence forward round differently


@pytest.fixture(scope="module")
def engine(tiny_folder):
    folder = tiny_folder(TinySpec())
    with load(
        folder, weights="f32", draft=folder, progress=False, warmup="now"
    ) as engine:  # the target drafts for itself
        yield engine


def reference_logprobs(engine, prompt_ids: list[int], tokens: list[int], temperature: float) -> np.ndarray:
    """[len(tokens), V]: row i is the distribution token i was chosen from."""
    cache = engine.model.new_cache()
    try:
        logits = engine.model.forward([*prompt_ids, *tokens], cache, 0, logits="all")
    finally:
        engine.model.release_cache(cache)
    rows = logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(tokens)].astype(np.float64)
    return log_softmax(rows, temperature if temperature > 0 else 1.0)


CASES = {
    "plain-greedy": dict(speculative=None, temperature=0.0),
    "draft-model-greedy": dict(speculative="draft-model", k=3, temperature=0.0),
    "prompt-lookup-sampled": dict(speculative="prompt-lookup", temperature=0.8, seed=7, top_k=5),
    "draft-model-sampled": dict(speculative="draft-model", k=2, temperature=1.3, seed=3, top_p=0.9),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_logprobs_equal_numpy_log_softmax_of_the_model_logits(engine, case):
    top_n = 5
    result = engine.generate(PROMPT, max_tokens=16, chat=False, logprobs=top_n, **case)
    assert len(result.logprobs) == len(result.tokens) > 0
    expected = reference_logprobs(engine, engine.encode_prompt(PROMPT, False), result.tokens, case["temperature"])
    for i, entry in enumerate(result.logprobs):
        assert entry.token == result.tokens[i]
        assert entry.logprob == pytest.approx(expected[i, entry.token], abs=TOL)
        assert len(entry.top) == top_n
        values = [lp for _, lp in entry.top]
        assert values == sorted(values, reverse=True)
        nth_best = np.sort(expected[i])[::-1][top_n - 1]
        for token, lp in entry.top:
            assert lp == pytest.approx(expected[i, token], abs=TOL) and lp >= nth_best - TOL
    if case["speculative"] == "draft-model" and case["temperature"] == 0:
        assert result.accepted > 0  # accepted drafts' rows were used, not only final tokens


def test_logprobs_follow_the_tokens_cut_by_a_stop_string(engine):
    full = engine.generate(PROMPT, max_tokens=16, chat=False)
    stop = full.text[6:8]
    result = engine.generate(PROMPT, max_tokens=16, chat=False, stop=stop, logprobs=0, speculative="draft-model")
    assert result.finish_reason == "stop"
    assert [e.token for e in result.logprobs] == result.tokens and all(e.top == [] for e in result.logprobs)


def test_no_logprobs_unless_asked_and_bad_values_refused(engine):
    assert engine.generate(PROMPT, max_tokens=2, chat=False).logprobs is None
    for bad in (-1, 21, 2.5, True):
        with pytest.raises(GenerationOptionError):
            engine.generate(PROMPT, max_tokens=2, chat=False, logprobs=bad)
