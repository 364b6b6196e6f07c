"""The GPU speculative engine on tiny models: exactness (greedy and sampled), reproducibility, bookkeeping."""

from __future__ import annotations

import pytest
from speculative.conftest import check_drafts_follow_their_reported_rows, check_two_token_joint
from support.decode import reference_decode

from doppler_py.errors import GenerationOptionError, VocabularyMismatchError
from doppler_py.sampling import SamplingParams
from doppler_py.speculative import DraftModelDrafter, LayerSkipDrafter, PromptLookupDrafter
from doppler_py.speculative.engine import SpeculativeEngine
from doppler_py.speculative.stats import SpecStats

GREEDY = SamplingParams(temperature=0.0)
# A prompt with repeats, so prompt lookup finds matches and some drafts are accepted.
PROMPT = [3, 17, 5, 9, 3, 17, 5, 22, 40, 3, 17, 5, 9, 1, 30, 3, 17]


def drafter_for(name, models):
    return {
        "prompt-lookup": lambda: PromptLookupDrafter(),
        "layer-skip": lambda: LayerSkipDrafter(models["target"], 2),
        "draft-model": lambda: DraftModelDrafter(models["draft"], 48),
        "self-draft": lambda: DraftModelDrafter(models["target"], 48),
        "padded-draft": lambda: DraftModelDrafter(models["padded_draft"], 48),
    }[name]()


@pytest.fixture(scope="module")
def plain_greedy(models):
    return reference_decode(models["target"], PROMPT, 40, GREEDY)


@pytest.mark.parametrize("k", [1, 4, 8])  # the boundaries of the draft length, and one between
@pytest.mark.parametrize("drafter", ["prompt-lookup", "layer-skip", "draft-model", "padded-draft"])
def test_greedy_speculative_equals_plain_greedy(models, plain_greedy, drafter, k):
    engine = SpeculativeEngine(models["target"], drafter_for(drafter, models))
    result = engine.generate(PROMPT, 40, GREEDY, k=k)
    engine.close()
    assert result.tokens == plain_greedy
    stats = result.stats
    assert stats.steps > 0, "nothing was ever drafted"
    # Every step commits its accepted drafts plus one target token, and a pinned k never overshoots the budget.
    assert len(result.tokens) == stats.accepted + stats.steps + stats.plain_steps
    assert all(d <= k for d in result.stats.k_history)


def test_a_draft_identical_to_the_target_is_always_accepted(models, plain_greedy):
    engine = SpeculativeEngine(models["target"], drafter_for("self-draft", models))
    result = engine.generate(PROMPT, 40, GREEDY, k=4)
    engine.close()
    assert result.tokens == plain_greedy
    assert result.stats.accepted == result.stats.drafted > 0
    assert result.stats.tokens_per_step == pytest.approx(5.0, abs=0.5)


@pytest.mark.parametrize("drafter", ["prompt-lookup", "draft-model", "layer-skip"])
def test_same_seed_gives_the_same_tokens_and_another_seed_differs(models, drafter):
    engine = SpeculativeEngine(models["target"], drafter_for(drafter, models))
    runs = [engine.generate(PROMPT, 30, SamplingParams(temperature=1.0, top_k=20, seed=s)).tokens for s in (7, 7, 8)]
    engine.close()
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_unseeded_sampled_generations_differ_from_each_other(models):
    engine = SpeculativeEngine(models["target"], None)  # plain decoding: its draws do not depend on timing
    runs = [engine.generate(PROMPT, 30, SamplingParams(temperature=1.0)).tokens for _ in range(3)]
    engine.close()
    # Three 30-token draws from the tiny model's near-flat distributions: a repeat would mean a shared stream.
    assert len({tuple(run) for run in runs}) == 3


def test_stop_token_ends_generation_after_it(models, plain_greedy):
    stop = plain_greedy[10]
    engine = SpeculativeEngine(models["target"], drafter_for("self-draft", models))
    result = engine.generate(PROMPT, 40, GREEDY, k=4, stop_ids=[stop])
    engine.close()
    assert result.tokens == plain_greedy[: plain_greedy.index(stop) + 1]
    assert result.stopped_by == "eos"


def test_cancelled_stream_releases_its_caches(models, registry):
    engine = SpeculativeEngine(models["target"], drafter_for("draft-model", models))
    before = len(models["target"]._cache_ops), len(models["draft"]._cache_ops)
    stats_iter = engine.iter_generate(PROMPT, 40, GREEDY, stats=SpecStats(), k=3)
    next(stats_iter)
    stats_iter.close()
    assert (len(models["target"]._cache_ops), len(models["draft"]._cache_ops)) == before
    engine.close()


def test_a_draft_with_another_vocabulary_is_refused(models):
    with pytest.raises(VocabularyMismatchError, match="vocabulary"):
        DraftModelDrafter(models["draft"], 48 + 5000)


def test_layer_skip_depth_is_validated(models):
    with pytest.raises(GenerationOptionError, match="layers"):
        LayerSkipDrafter(models["target"], 4)


def test_prompt_lookup_continues_the_latest_match_of_the_longest_ngram():
    lookup = PromptLookupDrafter(max_ngram=3, min_ngram=1)
    assert lookup.propose_ids([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3], 3) == [7, 8, 1]
    assert lookup.propose_ids([5, 6, 7], 2) == []
    assert lookup.propose_ids([4, 4], 3) == [4]
    # By default a single matching token is not enough evidence to propose anything.
    assert PromptLookupDrafter().propose_ids([4, 5, 6, 9, 6], 3) == []
    assert PromptLookupDrafter().propose_ids([4, 5, 6, 9, 5, 6], 3) == [9, 5, 6]


@pytest.mark.slow
def test_two_token_joint_distribution_matches_the_target(models):
    """Speculative samples of (t1, t2) against the exact joint p(t1) p(t2 | t1) of the target: the verification
    of a chain with draft rows (every GPU drafter's chains; the trees' and cut chains' paths:
    trees/test_tree_steps.py and drafters/heads/test_eagle.py)."""
    check_two_token_joint(models["target"], drafter_for("draft-model", models))


@pytest.mark.parametrize("drafter", ["draft-model", "layer-skip", "padded-draft"])
def test_sampled_drafts_follow_the_rows_they_report(models, drafter, monkeypatch):
    seen = check_drafts_follow_their_reported_rows(models["target"], drafter_for(drafter, models), monkeypatch)
    assert seen["sampled"] > 0


def test_gpu_drafters_live_steps_price_their_verification_where_the_gpu_stamps_time(models):
    """With timestamps, a GPU drafter's step is split into its drafting and the rest, so the cost of verifying
    k + 1 rows follows the live steps instead of staying at its calibration (here a stale 100 s)."""
    engine = SpeculativeEngine(models["target"], drafter_for("draft-model", models))
    if not engine.clock.gpu_timing:
        engine.close()
        pytest.skip("this adapter has no timestamp queries")
    costs = engine.policy.costs
    costs.observe_verify(1, 0.01)
    costs.observe_verify(4, 100.0)
    result = engine.generate(PROMPT, 40, GREEDY, k=3)
    trusted = engine.clock.gpu_timing  # the stamps passed their checks throughout
    engine.close()
    assert result.stats.steps >= 5 and trusted
    assert costs.verify[4] < 100.0 * 0.7**5 + 1.0  # each live step's measure weighs 0.3
    assert 0 < costs.draft_per_token < 1.0
