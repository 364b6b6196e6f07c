"""Greedy speculative decoding on SmolLM2-135M equals plain greedy decoding, once per drafter and per tree variant
(the trained heads: those shipped with the package, on open-ended prompts). Every draft length is the tiny models'
business (tests/speculative/test_engine.py, trees/test_tree_steps.py and each head's tests take the boundary lengths
and a middle one); here each drafter's wiring meets the real model, its 30 layers, Q4_1 blocks and 49,152-token
vocabulary.
"""

from __future__ import annotations

import pytest
from support.decode import reference_decode

from doppler_py.model.catalog import DEFAULT_MODEL, known_head
from doppler_py.model.transformer import Transformer
from doppler_py.sampling import SamplingParams
from doppler_py.speculative import DraftModelDrafter, LayerSkipDrafter, PromptLookupDrafter
from doppler_py.speculative.drafters.heads.eagle import EagleDrafter, load_head
from doppler_py.speculative.drafters.heads.medusa import MedusaDrafter, load_medusa
from doppler_py.speculative.drafters.heads.spark import SparkDrafter, load_spark
from doppler_py.speculative.drafters.lookahead import LookaheadDrafter
from doppler_py.speculative.engine import SpeculativeEngine

pytestmark = [pytest.mark.realmodel, pytest.mark.slow]

NEW_TOKENS = 24
GREEDY = SamplingParams()
PROMPT = [
    {
        "role": "user",
        "content": "Repeat exactly: the cat sat on the mat, the cat sat on the mat, the dog sat on the log.",
    }
]
OPEN_ENDED = [
    [{"role": "user", "content": "Write a short story about a girl who finds a lost kite."}],
    [{"role": "user", "content": "Explain why leaves change colour in autumn."}],
]


@pytest.fixture(scope="module")
def setup(smollm2_engine):
    target = smollm2_engine.model
    # The draft model: a second, independent copy (own weights, own KV cache) of the same network.
    draft = Transformer(type(target.weights)(**vars(target.weights)), target.registry, max_positions=256)
    ids = smollm2_engine.encode_prompt(PROMPT)
    plain = reference_decode(target, ids, NEW_TOKENS, GREEDY, stop_ids=(2,))
    yield target, draft, ids, plain
    draft.close()


@pytest.mark.parametrize(
    ("drafter", "k"),
    [
        ("prompt-lookup", 5),
        ("layer-skip", 3),
        ("draft-model", 8),
        ("prompt-lookup-tree", 6),  # min n-gram 1: the repeated phrases give it alternatives
        ("draft-model-tree", 5),  # its chain with the second-best tokens as side leaves
        ("lookahead", 16),  # every step a tree of Jacobi window and n-gram candidates
    ],
)
def test_greedy_speculative_equals_plain_greedy_on_smollm2(setup, drafter, k):
    target, draft, ids, plain = setup
    made = {
        "prompt-lookup": PromptLookupDrafter,
        "layer-skip": lambda: LayerSkipDrafter(target, 10),
        "draft-model": lambda: DraftModelDrafter(draft, target.config.vocab_size),
        "prompt-lookup-tree": lambda: PromptLookupDrafter(min_ngram=1, branches=4),
        "draft-model-tree": lambda: DraftModelDrafter(
            draft, target.config.vocab_size, branches=DraftModelDrafter.tree_branches
        ),
        "lookahead": lambda: LookaheadDrafter(target),
    }[drafter]()
    engine = SpeculativeEngine(target, made)
    result = engine.generate(ids, NEW_TOKENS, GREEDY, stop_ids=(2,), k=k)
    engine.close()
    assert result.tokens == plain
    assert result.stats.drafted > 0
    assert result.stats.tree_steps > 0 or not (drafter.endswith("tree") or drafter == "lookahead")


@pytest.fixture(scope="module")
def open_ended_plain(smollm2_engine):
    """Each open-ended prompt's ids and plain greedy tokens, decoded once for every head."""
    target = smollm2_engine.model
    prompts = [smollm2_engine.encode_prompt(prompt) for prompt in OPEN_ENDED]
    return [(ids, reference_decode(target, ids, NEW_TOKENS, GREEDY)) for ids in prompts]


@pytest.mark.parametrize(
    ("kind", "k", "tree"),
    [
        ("eagle", 3, False),
        ("eagle", 8, True),  # EAGLE-2's dynamic tree
        ("medusa", 4, False),
        ("medusa", 8, True),  # each head's best tokens, by measured acceptance per head and rank
        ("spark", 4, False),
    ],
)
def test_greedy_with_the_shipped_heads_equals_plain_greedy_on_open_ended_prompts(
    smollm2_engine, open_ended_plain, kind, k, tree
):
    if known_head(DEFAULT_MODEL, kind) is None:
        pytest.skip(f"no {kind} head is shipped for {DEFAULT_MODEL}")
    target = smollm2_engine.model
    loader = {"eagle": load_head, "medusa": load_medusa, "spark": load_spark}[kind]
    heads = loader(known_head(DEFAULT_MODEL, kind), target, "q4_1")
    drafter = {"eagle": EagleDrafter, "medusa": MedusaDrafter, "spark": SparkDrafter}[kind](target, heads)
    if tree:
        drafter.branches = drafter.tree_branches
    engine = SpeculativeEngine(target, drafter)
    try:
        for ids, plain in open_ended_plain:
            result = engine.generate(ids, NEW_TOKENS, GREEDY, k=k)
            assert result.tokens == plain, ids
            assert result.stats.drafted > 0
            assert result.stats.tree_steps > 0 or not tree
    finally:
        engine.close()
        heads.close()
