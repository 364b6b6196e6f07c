"""Lookahead decoding: the window's tree, the Jacobi update and the n-gram pool on the host; greedy output equal
to plain greedy decoding and the sampled joint distribution kept on tiny models; the policy's fixed mode."""

from __future__ import annotations

import numpy as np
import pytest
from speculative.conftest import check_drafts_follow_their_reported_rows
from support.decode import reference_decode

from doppler_py.errors import GenerationOptionError
from doppler_py.ops.tree import row_depths
from doppler_py.sampling import SamplingParams
from doppler_py.speculative.contract import StepContext
from doppler_py.speculative.drafters.lookahead import LookaheadDrafter, LookaheadShape
from doppler_py.speculative.engine import SpeculativeEngine
from doppler_py.speculative.policy.draft_length import CostModel, DraftLengthPolicy
from doppler_py.testing.tiny import TINY_SPECS

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [3, 17, 5, 9, 3, 17, 5, 22, 40, 3, 17, 8, 9, 1, 30, 3, 17, 5, 9, 2, 3, 17]


def row_path(tokens: list[int], parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


def context(tokens: list[int]) -> StepContext:
    return StepContext(list(tokens), None, None, GREEDY, None, 0)  # propose reads only the tokens


@pytest.fixture
def drafter(models):
    made = LookaheadDrafter(models["target"], LookaheadShape(window=4, ngram=4, guesses=1))
    yield made
    made.close()


def test_each_window_row_sees_level_0_up_to_its_slot_then_its_slots_column(drafter):
    drafter.levels = [[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]]
    proposal = drafter.propose(context([1, 2]), 15)
    tokens, parents = list(proposal.tokens), list(proposal.parents)
    depths = row_depths(parents)
    assert proposal.count == 12  # no candidates: the pool is empty
    for i, row in enumerate(drafter.pending):
        assert row_path(tokens, parents, row - 1) == [*[10, 11, 12, 13][: i + 1], 20 + i, 30 + i]
        assert depths[row] == i + 3  # level 2 of slot i guesses depth i + 3


def test_candidates_come_first_and_shared_prefixes_are_merged(drafter):
    drafter.levels = [[7, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]]
    drafter.pool = {2: [(7, 20, 99), (8, 1, 1)]}
    proposal = drafter.propose(context([1, 2]), 15)
    tokens, parents = list(proposal.tokens), list(proposal.parents)
    assert tokens[:3] == [7, 20, 99] and parents[:3] == [-1, 0, 1]  # guesses = 1: only the newest candidate
    # Window slot 0 is 7, 20, 30: its first two nodes are the candidate's.
    assert row_path(tokens, parents, drafter.pending[0] - 1) == [7, 20, 30]
    assert proposal.count == 3 + 10
    siblings = {}
    for node, parent in enumerate(parents):
        assert tokens[node] not in siblings.setdefault(parent, set()), "two siblings with one token"
        siblings[parent].add(tokens[node])


def test_a_small_budget_keeps_the_first_window_slot_and_drops_later_ones(drafter):
    drafter.levels = [[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]]
    drafter.pool = {2: [(7, 8, 9)]}
    proposal = drafter.propose(context([1, 2]), 5)
    assert proposal.count == 5
    assert list(proposal.tokens)[:2] == [7, 8]  # room is left for slot 0's three nodes
    assert drafter.pending[0] is not None and drafter.pending[1:] == [None, None, None]


def test_an_iteration_pools_each_slots_ngram_and_makes_the_guesses_the_newest_level(drafter):
    drafter.levels = [[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]]
    drafter.pool = {11: [(21, 31, 40)]}
    drafter.advance([40, 41, None, 43])
    assert drafter.levels == [[20, 21, 22, 23], [30, 31, 32, 33], [40, 41, 32, 43]]
    assert drafter.pool[10] == [(20, 30, 40)]
    assert drafter.pool[11] == [(21, 31, 41), (21, 31, 40)]  # the newest first
    assert 12 not in drafter.pool
    drafter.advance([40, 41, None, 43])
    assert drafter.pool[20] == [(30, 40, 40)]


def test_the_shape_is_checked():
    with pytest.raises(GenerationOptionError, match="ngram >= 2"):
        LookaheadShape(ngram=1).check()
    with pytest.raises(GenerationOptionError, match="at most 16"):
        LookaheadShape(window=6, ngram=4, guesses=3).check()


@pytest.mark.parametrize("name", ["llama-tied-gqa", "qwen3-qknorm-gqa", "gemma3-sliding"])
@pytest.mark.parametrize(
    ("shape", "k"), [(LookaheadShape(), None), (LookaheadShape(3, 4, 2), 15), (LookaheadShape(2, 2, 3), 3)]
)
def test_greedy_lookahead_is_plain_greedy_decoding(tiny_model, name, shape, k):
    model = tiny_model(TINY_SPECS[name], max_rows=32)
    plain = reference_decode(model, PROMPT, 48, GREEDY)
    engine = SpeculativeEngine(model, LookaheadDrafter(model, shape))
    try:
        result = engine.generate(PROMPT, 48, GREEDY, k=k)
    finally:
        engine.close()
    assert result.tokens == plain
    assert result.stats.tree_steps > 0


def test_the_jacobi_iterations_find_ngrams_the_target_goes_on_to_write(models):
    """Over 96 greedy tokens of the tiny target, prompt lookup gets 2 drafts accepted; lookahead's candidates,
    from its own Jacobi iterations, 22 (this shape). A Jacobi update that kept its old guesses got 0."""
    target = models["target"]
    engine = SpeculativeEngine(target, LookaheadDrafter(target, LookaheadShape(window=4, ngram=3, guesses=4)))
    try:
        result = engine.generate([3, 17, 5], 96, GREEDY, k=16)
    finally:
        engine.close()
    assert result.tokens == reference_decode(target, [3, 17, 5], 96, GREEDY)
    assert result.stats.accepted >= 20, result.stats


def test_sampled_lookahead_proposes_trees_that_ignore_the_random_stream(models, monkeypatch):
    """Its trees are verified as deterministic nodes (the tree path's joint distribution:
    trees/test_tree_steps.py), which holds only if drawing them took nothing from the generation's random numbers."""
    drafter = LookaheadDrafter(models["target"])
    seen = check_drafts_follow_their_reported_rows(models["target"], drafter, monkeypatch)
    assert seen["sampled"] == 0 and seen["trees"] > 0


def fixed_policy(plain: float, wide: float, nodes: int = 16) -> DraftLengthPolicy:
    policy = DraftLengthPolicy(capacity=16, costs=CostModel(verify={1: plain, nodes + 1: wide}))
    policy.reset(fixed=nodes)
    return policy


def test_fixed_mode_keeps_the_shape_and_pauses_only_where_the_measured_rate_does_not_pay():
    gpu_like = fixed_policy(plain=1.0, wide=1.3)
    assert gpu_like.next_k(100) == 16  # not capped at K_CEILING, not START_K
    gpu_like.observe(16, 1)  # 2 tokens for 1.3 plain steps' time
    assert gpu_like.next_k(100) == 16 and gpu_like.pause_steps == 0
    cpu_like = fixed_policy(plain=1.0, wide=6.0)
    cpu_like.observe(16, 2)  # 3 tokens for 6 plain steps' time
    assert cpu_like.pause_steps > 0 and cpu_like.next_k(100) == 0
    assert cpu_like.k == 16 and not cpu_like.should_speculate()
    pinned = fixed_policy(plain=1.0, wide=6.0)
    pinned.reset(12, fixed=16)
    pinned.observe(12, 0)
    assert pinned.pause_steps == 0 and pinned.next_k(100) == 12


def test_fixed_mode_measures_tokens_per_step():
    policy = fixed_policy(plain=1.0, wide=2.0)
    for accepted in (3, 3, 3, 3, 3, 3, 3, 3, 3, 3):
        policy.observe(16, accepted)
    assert policy.tokens_per_step == pytest.approx(4.0, abs=0.2)
    assert policy.fixed_speedup() == pytest.approx(2.0, abs=0.1)


def test_window_guesses_start_from_prompt_tokens(models):
    drafter = LookaheadDrafter(models["target"])
    try:
        drafter.start(context(PROMPT))
        assert np.isin(drafter.levels, PROMPT).all()
        assert np.array(drafter.levels).shape == (2, 6)
    finally:
        drafter.close()


@pytest.fixture(scope="module")
def api_engine(tiny_folder):
    from doppler_py.api import load
    from doppler_py.testing.tiny import TinySpec

    with load(
        tiny_folder(TinySpec(num_hidden_layers=2, seed=5)), weights="f32", progress=False, warmup="now"
    ) as engine:
        yield engine


def test_the_api_runs_lookahead_and_refuses_what_does_not_apply(api_engine):
    options = dict(max_tokens=32, chat=False)
    plain = api_engine.generate("abcabdabcab", speculative=None, **options).tokens
    assert api_engine.generate("abcabdabcab", speculative="lookahead", k=16, **options).tokens == plain
    assert api_engine.last_result.stats["tree_steps"] > 0
    assert api_engine.generate("abcabdabcab", speculative="lookahead", **options).tokens == plain
    for refused, match in (
        ({"tree": True}, "does not apply to lookahead"),
        ({"tree": False}, "lookahead"),
        ({"logprobs": 2}, "log-probs"),
    ):
        with pytest.raises(GenerationOptionError, match=match):
            api_engine.generate("abc", speculative="lookahead", **options | refused)


def test_fixed_mode_remembers_across_generations_where_its_shape_did_not_pay():
    cpu_like = fixed_policy(plain=1.0, wide=6.0)
    cpu_like.observe(16, 2)
    cpu_like.reset(fixed=16)  # the next generation starts paused, with its measured rate kept
    assert cpu_like.next_k(100) == 0 and cpu_like.tokens_per_step == 3.0
    gpu_like = fixed_policy(plain=1.0, wide=1.3)
    gpu_like.observe(16, 1)
    gpu_like.reset(fixed=16)
    assert gpu_like.next_k(100) == 16
    other = fixed_policy(plain=1.0, wide=6.0)
    other.observe(16, 2)
    other.reset(fixed=12)  # another shape: measured afresh
    assert other.next_k(100) == 12 and other.tokens_per_step is None
