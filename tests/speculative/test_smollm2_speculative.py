"""Greedy speculative decoding on SmolLM2-135M equals plain greedy decoding, for every drafter over k from 1 to 8
(the trained heads: those shipped with the package, on open-ended prompts), token trees and lookahead included. The tiny
models' tests (tests/speculative/test_engine.py) take every k in 1..8."""

from __future__ import annotations

import pytest

from doppler_py.api import load
from doppler_py.model.catalog import DEFAULT_MODEL
from doppler_py.model.transformer import Transformer
from doppler_py.sampling import SamplingParams
from doppler_py.speculative import DraftModelDrafter, LayerSkipDrafter, PromptLookupDrafter
from doppler_py.speculative.eagle import EagleDrafter, load_head
from doppler_py.speculative.engine import SpeculativeEngine
from doppler_py.speculative.lookahead import LookaheadDrafter
from doppler_py.speculative.medusa import MedusaDrafter, load_medusa
from doppler_py.speculative.spark import SparkDrafter, load_spark
from doppler_py.testing.decode import reference_decode

pytestmark = [pytest.mark.realmodel, pytest.mark.slow]

NEW_TOKENS = 24
PROMPT = [
    {
        "role": "user",
        "content": "Repeat exactly: the cat sat on the mat, the cat sat on the mat, the dog sat on the log.",
    }
]


@pytest.fixture(scope="module")
def setup():
    with load(DEFAULT_MODEL, weights="q4_1", progress=False, max_seq=256) as engine:
        target = engine.model
        # The draft model: a second, independent copy (own weights, own KV cache) of the same network.
        draft = Transformer(type(target.weights)(**vars(target.weights)), target.registry, max_positions=256)
        ids = engine.encode_prompt(PROMPT)
        plain = engine.generate(PROMPT, max_tokens=NEW_TOKENS, speculative=None).tokens
        yield target, draft, ids, plain, engine.encode_prompt
        draft.close()


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("drafter", ["prompt-lookup", "layer-skip", "draft-model"])
def test_greedy_speculative_equals_plain_greedy_on_smollm2(setup, drafter, k):
    target, draft, ids, plain, _ = setup
    make = {
        "prompt-lookup": PromptLookupDrafter,
        "layer-skip": lambda: LayerSkipDrafter(target, 10),
        "draft-model": lambda: DraftModelDrafter(draft, target.config.vocab_size),
    }[drafter]
    engine = SpeculativeEngine(target, make())
    result = engine.generate(ids, NEW_TOKENS, SamplingParams(), stop_ids=(2,), k=k)
    engine.close()
    assert result.tokens == plain[: len(result.tokens)]
    assert len(result.tokens) == len(plain)


@pytest.mark.parametrize("k", [3, 16])
def test_greedy_lookahead_equals_plain_greedy_on_smollm2(setup, k):
    target, _, ids, plain, _ = setup
    engine = SpeculativeEngine(target, LookaheadDrafter(target))
    result = engine.generate(ids, NEW_TOKENS, SamplingParams(), stop_ids=(2,), k=k)
    engine.close()
    assert result.tokens == plain
    assert result.stats.tree_steps > 0


@pytest.mark.parametrize(
    ("drafter", "k"), [("prompt-lookup", 3), ("prompt-lookup", 6), ("prompt-lookup", 12), ("draft-model", 5)]
)
def test_greedy_token_trees_equal_plain_greedy_on_smollm2(setup, drafter, k):
    """Prompt lookup with several branches (min n-gram 1, so the repeated phrases give it alternatives), and the
    draft model's chain with its second-best tokens as side leaves."""
    target, draft, ids, plain, _ = setup
    if drafter == "prompt-lookup":
        made = PromptLookupDrafter(min_ngram=1, branches=4)
    else:
        made = DraftModelDrafter(draft, target.config.vocab_size, branches=DraftModelDrafter.tree_branches)
    engine = SpeculativeEngine(target, made)
    result = engine.generate(ids, NEW_TOKENS, SamplingParams(), stop_ids=(2,), k=k)
    engine.close()
    assert result.tokens == plain
    assert result.stats.tree_steps > 0


OPEN_ENDED = [
    [{"role": "user", "content": "Write a short story about a girl who finds a lost kite."}],
    [{"role": "user", "content": "Explain why leaves change colour in autumn."}],
]


@pytest.mark.parametrize(
    ("kind", "k", "tree"),
    [
        ("eagle", 1, False),
        ("eagle", 3, False),
        ("eagle", 8, False),
        ("eagle", 8, True),  # EAGLE-2's dynamic tree
        ("medusa", 1, False),
        ("medusa", 4, False),
        ("medusa", 8, False),
        ("medusa", 8, True),  # each head's best tokens, by measured acceptance per head and rank
        ("spark", 2, False),
        ("spark", 4, False),
    ],
)
def test_greedy_with_the_shipped_heads_equals_plain_greedy_on_open_ended_prompts(setup, kind, k, tree):
    from doppler_py.model.catalog import known_head

    if known_head(DEFAULT_MODEL, kind) is None:
        pytest.skip(f"no {kind} head is shipped for {DEFAULT_MODEL}")
    target, encode = setup[0], setup[4]
    loader = {"eagle": load_head, "medusa": load_medusa, "spark": load_spark}[kind]
    heads = loader(known_head(DEFAULT_MODEL, kind), target, "q4_1")
    drafter = {"eagle": EagleDrafter, "medusa": MedusaDrafter, "spark": SparkDrafter}[kind](target, heads)
    if tree:
        drafter.branches = drafter.tree_branches
    engine = SpeculativeEngine(target, drafter)
    for prompt in OPEN_ENDED:
        ids = encode(prompt)
        plain = reference_decode(target, ids, NEW_TOKENS, SamplingParams())
        result = engine.generate(ids, NEW_TOKENS, SamplingParams(), k=k)
        assert result.tokens == plain, prompt
        assert result.stats.drafted > 0
        assert result.stats.tree_steps > 0 or not tree
    engine.close()
    heads.close()
