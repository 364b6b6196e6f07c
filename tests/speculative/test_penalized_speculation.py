"""Penalties, logit bias and min-p under speculation, end to end on the tiny models: exact against plain decoding
with the same options applied on the host token by token (`testing.penalty_reference`), greedy with every kind of
drafter on chains and trees, sampled by the two-token joint distribution, and per sequence inside a batch."""

from __future__ import annotations

import numpy as np
import pytest
from speculative.test_engine import PROMPT, drafter_for
from speculative.trees.test_tree_steps import PROMPT as TREE_PROMPT
from speculative.trees.test_tree_steps import Counting, SideBranchOracle
from support.decode import reference_decode
from support.distribution import assert_samples_follow

from doppler_py.errors import GenerationOptionError
from doppler_py.sampling import SamplingParams
from doppler_py.speculative.contract import NoOpHooks, Proposal
from doppler_py.speculative.drafters.draft_model import DraftModelDrafter
from doppler_py.speculative.engine import SpeculativeEngine
from doppler_py.speculative.stats import SpecStats
from doppler_py.speculative.step import Stepper
from doppler_py.testing.penalty_reference import sampler_logits
from doppler_py.testing.sampling_reference import filtered_probs

# Strong enough to change the tiny target's greedy answer (checked), mild enough that drafts still get accepted.
PENALIZED = {
    "frequency": SamplingParams(frequency_penalty=0.8, presence_penalty=0.3),
    "repetition": SamplingParams(repetition_penalty=1.6, repeat_last_n=6, logit_bias={17: 2.5, 5: -100.0}),
    "all": SamplingParams(
        frequency_penalty=0.4, presence_penalty=-0.2, repetition_penalty=1.2, repeat_last_n=-1, logit_bias={9: 1.0}
    ),
}


def generate(target, drafter, prompt, n, params, k):
    engine = SpeculativeEngine(target, drafter)
    try:
        return engine.generate(prompt, n, params, k=k)
    finally:
        engine.close()


class ChainOracle(NoOpHooks):
    """Knows the answer and drafts it, wrong at every third draft: every step verifies rows after accepted drafts
    (which a row must count) and rejects one now and then."""

    name = "chain-oracle"

    def __init__(self, answer: list[int], prompt_len: int, vocab: int):
        self.answer, self.prompt_len, self.vocab = answer, prompt_len, vocab

    def propose(self, ctx, k):
        done = len(ctx.tokens) - self.prompt_len
        tokens = list(self.answer[done : done + k])
        if len(tokens) > 2:
            tokens[2] = (tokens[2] + 1) % self.vocab
        return Proposal(len(tokens), tokens)


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("penalty", PENALIZED)
@pytest.mark.parametrize("drafter", ["prompt-lookup", "draft-model", "self-draft", "layer-skip"])
def test_greedy_with_penalties_equals_plain_decoding_with_host_penalties(models, drafter, penalty, k):
    target, params = models["target"], PENALIZED[penalty]
    expected = reference_decode(target, PROMPT, 40, params)
    assert expected != reference_decode(target, PROMPT, 40, SamplingParams()), "the penalties change nothing"
    result = generate(target, drafter_for(drafter, models), PROMPT, 40, params, k)
    assert result.tokens == expected


@pytest.mark.parametrize("penalty", PENALIZED)
def test_a_target_drafting_for_itself_under_penalties_has_every_draft_accepted(models, penalty):
    """A GPU drafter's row for draft i is penalised as the target's row i will be (committed tokens and drafts
    0..i-1): the target as its own draft model proposes the penalised answer, so greedy accepts every draft. From
    unpenalised rows it would propose what the penalties have moved away from."""
    target, params = models["target"], PENALIZED[penalty]
    result = generate(target, drafter_for("self-draft", models), PROMPT, 40, params, 4)
    assert result.tokens == reference_decode(target, PROMPT, 40, params)
    assert result.stats.accepted == result.stats.drafted > 0


@pytest.mark.parametrize("penalty", PENALIZED)
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_rows_after_accepted_drafts_count_them(models, penalty, shape):
    """Drafters that know the penalised answer (a chain wrong at its third draft; a tree hiding it in a side branch):
    most rows verified follow accepted drafts, whose counts they must include."""
    target, params = models["target"], PENALIZED[penalty]
    expected = reference_decode(target, PROMPT, 40, params)
    oracle = ChainOracle if shape == "chain" else SideBranchOracle
    result = generate(target, oracle(expected, len(PROMPT), 48), PROMPT, 40, params, 5)
    assert result.tokens == expected
    assert result.stats.accepted >= 20 and (shape == "chain" or result.stats.tree_steps > 0)


@pytest.mark.parametrize("penalty", PENALIZED)
@pytest.mark.parametrize("drafter", ["prompt-lookup", "draft-model"])
def test_greedy_trees_with_penalties_equal_plain_decoding_with_host_penalties(models, drafter, penalty):
    target, params = models["target"], PENALIZED[penalty]
    expected = reference_decode(target, TREE_PROMPT, 40, params)
    if drafter == "prompt-lookup":
        made = Counting(min_ngram=1, branches=4)
    else:
        made = DraftModelDrafter(models["target"], 48, branches=DraftModelDrafter.tree_branches)
    result = generate(target, made, TREE_PROMPT, 40, params, 6)
    assert result.tokens == expected
    assert result.stats.tree_steps > 0  # accepted drafts: test_rows_after_accepted_drafts_count_them


def test_a_bias_counts_before_top_p(models):
    """Seeded plain decoding draws exactly as the host reference (bias, then min-p, temperature, top-p); a token
    outside the unbiased top-p set is lifted into it by its bias and gets sampled, which a bias applied after top-p
    could never do."""
    target = models["target"]
    cache = target.new_cache(len(PROMPT))
    try:
        target.forward(PROMPT[:-1], cache, 0, logits="none")
        first = target.forward(PROMPT[-1:], cache)
    finally:
        target.release_cache(cache)
    unbiased = filtered_probs(first, SamplingParams(temperature=1.0, top_p=0.5))
    outside = int(np.argsort(first)[len(first) // 2])  # a middling token, far outside the top half of the mass
    assert unbiased[outside] == 0
    firsts = []
    for seed in range(12):
        params = SamplingParams(temperature=1.0, top_p=0.5, logit_bias={outside: 4.0}, min_p=0.01, seed=seed)
        tokens = generate(target, None, PROMPT, 6, params, None).tokens
        assert tokens == reference_decode(target, PROMPT, 6, params)
        firsts.append(tokens[0])
    assert outside in firsts


def test_min_p_alone_keeps_plain_steps_several_per_submit(models, monkeypatch):
    """Min-p depends on no earlier token, so plain decoding still batches its steps (each step's dispatch with the
    same uniforms), and seeded output is the host reference's, draw for draw."""
    target, submits = models["target"], []
    step = Stepper.step
    monkeypatch.setattr(
        Stepper, "step", lambda self, *a, **kw: submits.append(kw.get("plain_steps", 1)) or step(self, *a, **kw)
    )
    for seed in range(3):
        params = SamplingParams(temperature=1.3, min_p=0.25, seed=seed)
        assert generate(target, None, PROMPT, 12, params, None).tokens == reference_decode(target, PROMPT, 12, params)
    assert max(submits) > 1, submits


@pytest.mark.parametrize("penalty", PENALIZED)
def test_penalised_plain_decoding_takes_several_steps_per_submit(models, penalty, monkeypatch):
    """Plain step j of a submit is penalised with the tokens steps 0..j-1 chose (read on the GPU), so penalised plain
    decoding batches its steps and still equals the host reference, greedy and seeded draw for draw."""
    target, submits = models["target"], []
    step = Stepper.step
    monkeypatch.setattr(
        Stepper, "step", lambda self, *a, **kw: submits.append(kw.get("plain_steps", 1)) or step(self, *a, **kw)
    )
    for params in (
        PENALIZED[penalty],
        SamplingParams(**{**PENALIZED[penalty].__dict__, "temperature": 1.2, "seed": 4}),
    ):
        assert generate(target, None, PROMPT, 30, params, None).tokens == reference_decode(target, PROMPT, 30, params)
    assert max(submits) > 1, submits


def test_plain_decoding_with_penalties_and_logprobs_reports_the_penalised_distribution(models):
    """Plain steps (one per submit under penalties) and the log-probs of the distribution after the penalties."""
    target, params = models["target"], SamplingParams(temperature=0.7, frequency_penalty=1.0, min_p=0.1, seed=4)
    engine, entries, tokens = SpeculativeEngine(target, None), [], []
    try:
        for new in engine.iter_generate(PROMPT, 12, params, stats=SpecStats(), logprobs=2, logprob_entries=entries):
            tokens.extend(new)
    finally:
        engine.close()
    assert tokens == reference_decode(target, PROMPT, 12, params)
    cache, ids = target.new_cache(len(PROMPT) + 12), list(PROMPT)
    try:
        target.forward(ids[:-1], cache, 0, logits="none")
        logits = target.forward(ids[-1:], cache)
        for token, entry in zip(tokens, entries, strict=True):
            penalized = sampler_logits(logits, ids, len(PROMPT), SamplingParams(frequency_penalty=1.0))
            scaled = penalized.astype(np.float64) / 0.7
            log_p = scaled - scaled.max() - np.log(np.exp(scaled - scaled.max()).sum())
            assert entry.token == token and entry.logprob == pytest.approx(log_p[token], abs=1e-4)
            ids.append(token)
            logits = target.forward([token], cache)
    finally:
        target.release_cache(cache)


# Negative penalties make a repeat of the first token much likelier: a row that missed its drafts shows at once.
SAMPLED = SamplingParams(
    temperature=1.5,
    top_p=0.95,
    frequency_penalty=-2.0,
    presence_penalty=-1.0,
    logit_bias={3: 1.5, 17: -100.0},
    min_p=0.08,
)


def exact_penalized_joint(target, prompt, params):
    """p(t1) p(t2 | t1) of plain decoding with `params` (penalties on the host), after `prompt`."""
    vocab = target.config.vocab_size
    cache = target.new_cache(len(prompt) + 2)
    try:
        first = target.forward(prompt, cache, 0)
        p1 = filtered_probs(sampler_logits(first, prompt, len(prompt), params), params)
        joint = np.zeros((vocab, vocab))
        for t1 in np.flatnonzero(p1):
            cache.truncate(len(prompt))
            row = sampler_logits(target.forward([int(t1)], cache), [*prompt, int(t1)], len(prompt), params)
            joint[t1] = p1[t1] * filtered_probs(row, params)
    finally:
        target.release_cache(cache)
    return joint


def sampled_pairs(target, drafter, prompt, params, trials, k=2):
    """(t1, t2) counts of `trials` seeded generations of k + 1 tokens (so the first step may verify k drafts), the
    drafts accepted and the token trees verified."""
    engine = SpeculativeEngine(target, drafter)
    counts, accepted, trees = np.zeros((target.config.vocab_size,) * 2), 0, 0
    try:
        for seed in range(trials):
            seeded = SamplingParams(**{**params.__dict__, "seed": seed})
            result = engine.generate(prompt, k + 1, seeded, k=k)
            counts[result.tokens[0], result.tokens[1]] += 1
            accepted += result.stats.accepted
            trees += result.stats.tree_steps
    finally:
        engine.close()
    return counts, accepted, trees


JOINT = 600


def test_sampled_chains_with_penalties_bias_and_min_p_keep_the_joint_distribution(models):
    """The draft model samples its chain of 2 from its own distribution; each verified row is penalised with the
    drafts before it, so (t1, t2) follows plain decoding's penalised, biased, min-p-filtered joint."""
    target, prompt = models["target"], [3, 17, 5]
    joint = exact_penalized_joint(target, prompt, SAMPLED)
    counts, accepted, _ = sampled_pairs(target, DraftModelDrafter(models["draft"], 48), prompt, SAMPLED, JOINT)
    assert_samples_follow(counts, joint)
    assert accepted > JOINT // 2, "too few drafts accepted to test the rows after them"


class RepeatTree(NoOpHooks):
    """At the first step, a tree of the 3 first tokens likeliest to be repeated (by the exact joint), each with itself
    as its leaf: deterministic nodes; a leaf is accepted as often as the penalties (negative here) make a repeat
    likely, which a row that missed its ancestor would not."""

    name = "repeat-tree"

    def __init__(self, joint: np.ndarray, prompt_len: int):
        roots = [int(t) for t in np.argsort(-np.diag(joint), kind="stable")[:3]]
        self.tokens, self.parents = roots + roots, [-1, -1, -1, 0, 1, 2]
        self.prompt_len = prompt_len

    def propose(self, ctx, k):
        if len(ctx.tokens) != self.prompt_len or k < len(self.tokens):
            return Proposal(0)
        return Proposal(len(self.tokens), self.tokens, parents=self.parents)


def test_sampled_trees_with_penalties_bias_and_min_p_keep_the_joint_distribution(models):
    """Every first step verifies a tree of 6 nodes (three roots, a leaf under each; generations of 7 tokens, so the
    step may verify 6); each row is penalised with its own ancestors."""
    target, prompt = models["target"], [3, 17, 5]
    joint = exact_penalized_joint(target, prompt, SAMPLED)
    counts, accepted, trees = sampled_pairs(target, RepeatTree(joint, len(prompt)), prompt, SAMPLED, JOINT, k=6)
    assert_samples_follow(counts, joint)
    assert trees == JOINT and accepted > JOINT // 5


def test_a_bias_on_a_token_outside_the_vocabulary_is_refused(models):
    params = SamplingParams(frequency_penalty=0.1, logit_bias={48: 1.0})
    with pytest.raises(GenerationOptionError, match="logit_bias") as caught:
        generate(models["target"], None, PROMPT, 4, params, None)
    assert caught.value.option == "logit_bias"


BATCHED = [
    PENALIZED["frequency"],
    SamplingParams(temperature=1.1, top_k=12, seed=3, repetition_penalty=1.5, logit_bias={9: 2.0}, min_p=0.05),
    PENALIZED["all"],
    SamplingParams(),  # no penalties beside penalised generations
]


@pytest.mark.parametrize("drafter", ["none", "prompt-lookup"])
def test_batched_generations_each_keep_their_own_penalties(models, drafter, monkeypatch):
    """Four generations with different penalties (one with none) share forwards: each equals its solo run."""
    from speculative import test_batch

    monkeypatch.setattr(test_batch, "params_for", lambda name, i: BATCHED[i])
    target = models["target"]
    outputs, batch = test_batch.batched_runs(target, drafter, "greedy", staggered=False)
    assert outputs == test_batch.solo_runs(target, drafter, "greedy")
    assert sum(count for size, count in batch.sizes.items() if size > 1) > 0, batch.sizes
