"""Random speculative configurations never put a KV cache out of step with the committed tokens.

After every step of every generation: the target cache holds exactly the committed tokens but the last (which
the next step feeds), a draft model's cache holds exactly what its drafter says it consumed, and every token
is inside the vocabulary. At temperature 0 the output must also be plain greedy decoding's, cut after the
first stop token: a cache off by one position would change it. The engine checks the target cache itself
(`InternalError`); the last test breaks a rollback on purpose to see that check fire.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from reliability.helpers import ExampleTally, fuzz_settings
from support.decode import reference_decode

from doppler_py.errors import InternalError
from doppler_py.model.kv_cache import KVCache
from doppler_py.sampling import SamplingParams
from doppler_py.speculative import DraftModelDrafter, LayerSkipDrafter, PromptLookupDrafter
from doppler_py.speculative.engine import SpeculativeEngine
from doppler_py.testing.tiny import TinySpec, draft_spec

VOCAB = 64
TARGET = TinySpec(vocab_size=VOCAB, num_hidden_layers=3, weight_std=0.25, max_position_embeddings=256, seed=41)


# Drafts with the target's vocabulary, with padding rows beyond it, and stopping short of it.
DRAFTS = {"draft": draft_spec(VOCAB, 42), "wide_draft": draft_spec(VOCAB + 16, 43), "narrow_draft": draft_spec(60, 44)}
DRAFTERS = ["none", "prompt-lookup", "layer-skip", "draft", "wide_draft", "narrow_draft", "self"]
EXAMPLES = ExampleTally()


@pytest.fixture(scope="module")
def models(tiny_model):
    return {name: tiny_model(spec, max_rows=32) for name, spec in {"target": TARGET, **DRAFTS}.items()}


@pytest.fixture(scope="module", autouse=True)
def example_counts(request):
    yield
    EXAMPLES.report(request.config, "KV-sync fuzz examples")


def make_drafter(name: str, models):
    target = models["target"]
    if name == "none":
        return None
    if name == "prompt-lookup":
        return PromptLookupDrafter()
    if name == "layer-skip":
        return LayerSkipDrafter(target, 1)
    return DraftModelDrafter(target if name == "self" else models[name], VOCAB)


def checked_steps(engine: SpeculativeEngine, vocab: int, log: list[int]):
    """Wrap the engine's step (plain steps batched in one submit too) so the caches are checked after every one
    (log: committed tokens after each)."""
    step = engine.steps.step

    def check(ctx, new):
        committed = len(ctx.tokens)
        assert ctx.target_cache.length == committed - 1
        drafter = engine.drafter
        if isinstance(drafter, DraftModelDrafter):
            assert drafter.draft_cache.length == drafter.consumed <= committed - 1
        assert all(0 <= t < vocab for t in new)
        log.append(committed)

    def run(ctx, k, **options):
        outcome = step(ctx, k, **options)
        check(ctx, outcome.new)
        return outcome

    engine.steps.step = run


PROMPTS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24).map(
    lambda ids: ids + ids[: len(ids) // 2]  # repeats give prompt lookup something to propose
)


@fuzz_settings(60)
@given(
    drafter=st.sampled_from(DRAFTERS),
    k=st.integers(1, 8),
    pin_k=st.booleans(),
    temperature=st.sampled_from([0.0, 0.0, 0.6, 1.0, 2.5]),
    top_k=st.sampled_from([0, 1, 5]),
    top_p=st.sampled_from([1.0, 0.8]),
    seed=st.integers(0, 2**32 - 1),
    stop=st.lists(st.integers(0, VOCAB - 1), max_size=3),
    max_new=st.integers(1, 40),
    prompt=PROMPTS,
)
def test_random_speculative_runs_keep_every_cache_in_step(
    models, drafter, k, pin_k, temperature, top_k, top_p, seed, stop, max_new, prompt
):
    target = models["target"]
    engine = SpeculativeEngine(target, make_drafter(drafter, models))
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    steps: list[int] = []
    checked_steps(engine, VOCAB, steps)
    caches_before = {name: len(m._cache_ops) for name, m in models.items()}
    try:
        result = engine.generate(prompt, max_new, params, stop_ids=stop, k=k if pin_k else None)
    finally:
        engine.close()
    tokens = result.tokens
    assert 1 <= len(tokens) <= max_new
    assert steps and steps[-1] >= len(prompt) + len(tokens)
    assert not any(t in stop for t in tokens[:-1]), "generation went on past a stop token"
    if params.greedy:
        expected = reference_decode(target, prompt, max_new, params, stop_ids=stop)
        assert tokens == expected
    assert {name: len(m._cache_ops) for name, m in models.items()} == caches_before  # every cache released
    EXAMPLES.add(drafter)


def test_a_rollback_that_leaves_the_cache_out_of_step_is_caught(models, monkeypatch):
    """A cache that ignored a truncation would hold rejected drafts as context: the engine stops instead."""
    monkeypatch.setattr(KVCache, "truncate", lambda self, length: None)
    engine = SpeculativeEngine(models["target"], LayerSkipDrafter(models["target"], 1))
    prompt = np.random.default_rng(5).integers(0, VOCAB, 12).tolist()
    try:
        with pytest.raises(InternalError, match=r"target KV cache holds \d+ positions.*report it"):
            engine.generate(prompt, 30, SamplingParams(), k=4)
    finally:
        engine.close()
