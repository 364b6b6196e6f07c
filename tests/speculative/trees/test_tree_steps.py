"""Token trees end to end: the tree forward (rows at their depths, each seeing its ancestors), tree verification
with the accepted path moved into place, and prompt lookup proposing several continuations.

Exactness: greedy tree decoding must give plain greedy decoding's tokens, for every budget and model family
(a sliding window included); sampled tree steps must keep the target's joint distribution of two tokens. The
tree forward is held to chain forwards along each root-to-node path."""

from __future__ import annotations

import numpy as np
import pytest
from speculative.conftest import JOINT_TRIALS, check_drafts_follow_their_reported_rows, check_two_token_joint
from support.decode import reference_decode

from doppler_py.errors import GenerationOptionError
from doppler_py.ops.tree import layout_words, row_depths
from doppler_py.sampling import SamplingParams
from doppler_py.speculative import PromptLookupDrafter
from doppler_py.speculative.contract import NoOpHooks, Proposal
from doppler_py.speculative.drafters.draft_model import DraftModelDrafter
from doppler_py.speculative.drafters.gpu_drafting import CHAIN_PRIOR_TOP1, matching_prefix
from doppler_py.speculative.engine import SpeculativeEngine
from doppler_py.speculative.trees.ranked import chain_with_leaves, prior_rates
from doppler_py.testing.tiny import TINY_SPECS

GREEDY = SamplingParams(temperature=0.0)
# Repeats with different continuations after the same bigrams, so lookup finds several branches.
PROMPT = [3, 17, 5, 9, 3, 17, 5, 22, 40, 3, 17, 8, 9, 1, 30, 3, 17, 5, 9, 2, 3, 17]
TREE = [-1, 0, 1, -1, 3, 0, 5, 2]  # 8 nodes: three branches at the root, one at depth 1


class Counting(PromptLookupDrafter):
    """Prompt lookup that counts its tree proposals."""

    def __init__(self, **options):
        super().__init__(**options)
        self.trees = 0

    def propose(self, ctx, k):
        proposal = super().propose(ctx, k)
        self.trees += proposal.parents is not None
        return proposal


@pytest.mark.parametrize("name", ["llama-tied-gqa", "qwen3-qknorm-gqa", "gemma3-sliding", "gemma4"])
def test_a_tree_forward_gives_each_row_its_paths_chain_logits(tiny_model, name):
    model = tiny_model(TINY_SPECS[name], max_rows=32)
    tokens = [11, 5, 7, 30, 2, 19, 44, 8]  # one per node
    start = len(PROMPT) - 1
    cache = model.new_cache(64)
    model.forward(PROMPT[:-1], cache, 0, logits="none")
    model.tree.view((len(TREE) + 1, 2)).write(layout_words(TREE))
    model.ids.view((len(TREE) + 1,)).write(np.array([PROMPT[-1], *tokens], np.uint32))
    rec = model.registry.recorder()
    model.record_forward(rec, len(TREE) + 1, cache, start, logits="all", tree=True)
    rec.submit()
    got = model.read_logits(len(TREE) + 1)
    depths = row_depths(TREE)
    for row in range(len(TREE) + 1):
        path, node = [], row - 1
        while node >= 0:
            path.append(tokens[node])
            node = TREE[node]
        chain = model.new_cache(64)
        want = model.forward(PROMPT + path[::-1], chain, 0)
        model.release_cache(chain)
        assert depths[row] == len(path)
        np.testing.assert_allclose(got[row], want, atol=1e-4, rtol=0, err_msg=f"row {row}")
    model.release_cache(cache)


@pytest.mark.parametrize("name", ["llama-tied-gqa", "qwen3-qknorm-gqa", "gemma3-sliding", "gemma4"])
@pytest.mark.parametrize("k", [2, 5, 12])
def test_greedy_tree_decoding_is_plain_greedy_decoding(tiny_model, name, k):
    model = tiny_model(TINY_SPECS[name], max_rows=32)
    plain = reference_decode(model, PROMPT, 40, GREEDY)
    drafter = Counting(min_ngram=1, branches=4)
    engine = SpeculativeEngine(model, drafter)
    try:
        assert engine.generate(PROMPT, 40, GREEDY, k=k).tokens == plain
    finally:
        engine.close()
    assert drafter.trees > 0, "no step proposed a tree"


class SideBranchOracle(NoOpHooks):
    """Knows the greedy answer and hides it in a side branch: the first chain is wrong from its first token, a
    second root branch holds the next `depth` true tokens (wrong after that), so every step accepts a path that
    must be moved into place, ending at a chosen depth."""

    name = "side-branch-oracle"

    def __init__(self, answer: list[int], prompt_len: int, vocab: int):
        self.answer, self.prompt_len, self.vocab, self.step = answer, prompt_len, vocab, 0

    def propose(self, ctx, k):
        done = len(ctx.tokens) - self.prompt_len
        truth = self.answer[done : done + k]
        if len(truth) < 2 or k < 3:
            return Proposal(0)
        self.step += 1
        depth = 1 + self.step % (min(len(truth), k - 1))  # true tokens in the side branch, 1 .. k - 1
        decoy = (truth[0] + 1) % self.vocab
        side = [*truth[:depth], (truth[depth] + 1) % self.vocab] if depth < len(truth) else truth[:depth]
        side = side[: k - 1]
        tokens = [decoy, *side]
        parents = [-1, -1, *range(1, len(side))]
        return Proposal(len(tokens), tokens, parents=parents)


@pytest.mark.parametrize("name", ["llama-tied-gqa", "gemma3-sliding", "qwen3_5-hybrid"])
def test_accepted_side_branches_are_moved_into_place(tiny_model, name):
    """Every step's accepted path is a side branch, so the K/V of each accepted node are moved in every layer;
    any mistake in the move shows in later tokens (the Gemma model's 8-key window included)."""
    model = tiny_model(TINY_SPECS[name], max_rows=32)
    plain = reference_decode(model, PROMPT, 40, GREEDY)
    drafter = SideBranchOracle(plain, len(PROMPT), model.config.vocab_size)
    engine = SpeculativeEngine(model, drafter)
    moves = []
    compact = model.compact
    model.compact = lambda rec, cache, start, m: (moves.append(len(m)), compact(rec, cache, start, m))
    try:
        result = engine.generate(PROMPT, 40, GREEDY, k=6)
    finally:
        del model.compact
        engine.close()
    assert result.tokens == plain
    assert result.stats.accepted > 20 and len(moves) > 5 and max(moves) >= 3
    assert result.stats.tree_steps == len(moves) and result.stats.as_dict()["tree_steps"] == len(moves)


class FeatureCheckingOracle(SideBranchOracle):
    """After every step, ctx.hidden must hold the features a chain over the committed tokens gives: the root's
    and the accepted path's rows, in order (moved into place after a side branch), as a head reads them."""

    def __init__(self, *args):
        super().__init__(*args)
        self.checked = 0

    def commit(self, ctx, accepted):
        model, rows = ctx.target, ctx.hidden_rows
        assert rows == accepted + 1
        got = ctx.hidden.numpy()[:rows]
        cache = model.new_cache(len(ctx.tokens))
        before = ctx.tokens[: -1 - rows]
        for begin in range(0, len(before), model.max_rows):
            model.forward(before[begin : begin + model.max_rows], cache, begin, logits="none")
        model.forward(ctx.tokens[-1 - rows : -1], cache, len(before), logits="none")
        want = ctx.hidden.numpy()[:rows]
        model.release_cache(cache)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
        self.checked += accepted > 0


def test_after_a_tree_step_the_features_are_the_accepted_paths_in_order(tiny_model):
    model = tiny_model(TINY_SPECS["llama-tied-gqa"], max_rows=32)
    plain = reference_decode(model, PROMPT, 30, GREEDY)
    drafter = FeatureCheckingOracle(plain, len(PROMPT), model.config.vocab_size)
    engine = SpeculativeEngine(model, drafter)
    try:
        assert engine.generate(PROMPT, 30, GREEDY, k=6).tokens == plain
    finally:
        engine.close()
    assert drafter.checked > 5


@pytest.mark.slow
def test_sampled_prompt_lookup_trees_keep_the_targets_two_token_distribution(models):
    """Lookup's tries when sampling: the prompt ends in '3 17', seen before with three continuations, so every
    generation's first step verifies a tree (5 and 8 under the root, k = 2)."""
    drafter = Counting(min_ngram=1, branches=4)
    assert check_two_token_joint(models["target"], drafter, prompt=PROMPT, new_tokens=3) >= JOINT_TRIALS


@pytest.mark.parametrize("draft", ["draft", "padded_draft", "target"])
@pytest.mark.parametrize("k", [2, 5, 9])
def test_greedy_draft_model_trees_are_plain_greedy_decoding(models, draft, k):
    """The draft's chain plus its second-best tokens as side leaves: accepted side leaves leave the draft cache
    behind the committed tokens, which it must catch up on. The target drafting for itself accepts its chain."""
    target = models["target"]
    plain = reference_decode(target, PROMPT, 40, GREEDY)
    drafter = DraftModelDrafter(models[draft], 48, branches=DraftModelDrafter.tree_branches)
    engine = SpeculativeEngine(target, drafter)
    try:
        result = engine.generate(PROMPT, 40, GREEDY, k=k)
    finally:
        engine.close()
    assert result.tokens == plain
    assert result.stats.tree_steps > 0
    if draft == "target":
        assert result.stats.accepted >= 40 - 2 * result.stats.steps
        measured = drafter.branching.acceptance  # every chain token right: no second-best ever is
        assert measured.seen[0] >= result.stats.tree_steps and measured.hits[:, 1].sum() == 0
        assert (measured.hits[:, 0] == measured.seen).all()


class CheckedDraftModel(DraftModelDrafter):
    """Holds every tree's chain to the draft model's own greedy continuation of the committed tokens (decoded
    from scratch), so a draft cache left wrong after an accepted side leaf shows; counts those steps."""

    def __init__(self, *args, **options):
        super().__init__(*args, **options)
        self.side_steps = 0
        self.chains = 0

    def propose(self, ctx, k):
        proposal = super().propose(ctx, k)
        if self.chain is not None:
            self.chains += 1
            assert self.chain == reference_decode(self.model, ctx.tokens, len(self.chain), GREEDY)
        return proposal

    def commit(self, ctx, accepted):
        if self.chain is not None and accepted:
            path = ctx.tokens[len(ctx.tokens) - accepted - 1 : -1]
            self.side_steps += matching_prefix(path, self.chain) < accepted
        super().commit(ctx, accepted)


def test_the_draft_cache_follows_an_accepted_side_leaf(models):
    drafter = CheckedDraftModel(models["draft"], 48, branches=DraftModelDrafter.tree_branches)
    engine = SpeculativeEngine(models["target"], drafter)
    try:
        engine.generate(PROMPT, 40, GREEDY, k=6)
    finally:
        engine.close()
    assert drafter.side_steps > 0 and drafter.chains > 10


def test_sampled_draft_model_trees_are_nodes_that_ignore_the_random_stream(models, monkeypatch):
    """A GPU drafter's tree (its greedy chain and side leaves) is verified as deterministic nodes, whose joint
    distribution the prompt-lookup trees above check; that holds only if the picks drawing it were greedy."""
    drafter = DraftModelDrafter(models["draft"], 48, branches=DraftModelDrafter.tree_branches)
    assert check_drafts_follow_their_reported_rows(models["target"], drafter, monkeypatch)["trees"] > 0


def test_a_chain_drafters_tree_takes_its_likeliest_chain_nodes_and_leaves_first():
    best = np.array([[5, 6], [7, 8], [9, 10], [11, 48]])  # 48: no second token (a vocabulary of 48)
    prior = prior_rates(4, 2, CHAIN_PRIOR_TOP1)  # chain 0.6 per depth, a second-best 0.18
    tree = chain_with_leaves(best, 7, 48, prior)
    # values .6 .36 .216 .18 .1296 .108 .0648: the chain, and its leaves by depth, interleaved by value
    assert tree.tokens == [5, 7, 9, 6, 11, 8, 10] and tree.parents == [-1, 0, 1, -1, 2, 0, 1]
    assert chain_with_leaves(best, 9, 48, prior).count == 7  # nothing past the vocabulary
    assert chain_with_leaves(best[:1], 1, 48, prior).parents is None  # no room for a leaf: a chain
    measured = prior.copy()
    measured[0] = [0.1, 0.8]  # the draft's second choice is usually the target's first token
    assert chain_with_leaves(best, 3, 48, measured).tokens == [6, 5, 7]  # that leaf first, the deep chain out


def test_lookup_trie_keeps_the_likeliest_continuation_as_its_first_chain():
    drafter = PromptLookupDrafter(branches=3)
    tokens = [5, 6, 1, 2, 5, 6, 3, 4, 5, 6, 7, 8, 5, 6]
    assert drafter.continuations(tokens, 4, 3) == [[7, 8, 5, 6], [3, 4, 5, 6], [1, 2, 5, 6]]
    from doppler_py.speculative.drafters.prompt_lookup import trie_proposal

    tree = trie_proposal(drafter.continuations(tokens, 8, 3), 8)
    assert tree.tokens[:4] == [7, 8, 5, 6] and tree.parents[:4] == [-1, 0, 1, 2]
    assert tree.count <= 8 and sorted(tree.tokens[i] for i, p in enumerate(tree.parents) if p == -1) == [1, 3, 7]
    # Shared prefixes are stored once, and a trie that is a chain is proposed as one.
    assert trie_proposal([[1, 2, 3], [1, 2, 3, 4]], 8).parents is None


# -- the policy and the API ------------------------------------------------------------------------------------
def test_trees_pay_only_where_extra_rows_are_nearly_free():
    from doppler_py.speculative.policy.draft_length import CostModel, trees_pay

    gpu_like = CostModel(verify={1: 1.0e-3, 9: 1.1e-3, 17: 1.3e-3})
    cpu_like = CostModel(verify={1: 1.0e-3, 9: 3.2e-3, 17: 6.0e-3})
    assert trees_pay(gpu_like, 17) and trees_pay(gpu_like, 9)
    assert not trees_pay(cpu_like, 17) and not trees_pay(cpu_like, 9)
    assert not trees_pay(CostModel(), 17)  # nothing measured yet: chains


@pytest.fixture(scope="module")
def api_engine(tiny_folder):
    from doppler_py.api import load
    from doppler_py.testing.tiny import TinySpec

    with load(
        tiny_folder(TinySpec(num_hidden_layers=2, seed=5)), weights="f32", progress=False, warmup="now"
    ) as engine:
        yield engine


def test_api_trees_keep_greedy_output_and_refuse_what_they_cannot_do(api_engine):
    prompt = "abcabdabcabeabcab"
    options = dict(max_tokens=24, speculative="prompt-lookup", chat=False)
    chains = api_engine.generate(prompt, tree=False, **options).tokens
    lookup = api_engine.speculative_engine("prompt-lookup").drafter
    assert lookup.branches == 1
    assert api_engine.generate(prompt, tree=True, **options).tokens == chains
    assert lookup.branches > 1
    assert api_engine.generate(prompt, tree=True, k=6, **options).tokens == chains
    # A pinned node budget: with k unpinned the budget is the policy's k, which on a machine where wide verifies
    # cost more may be 1 (a single node, so a chain). Seeded, so which steps draft does not depend on timing.
    api_engine.generate(prompt, tree=True, k=6, temperature=0.7, seed=0, **options)
    assert api_engine.last_result.stats["tree_steps"] > 0
    for budget in (6, 1):  # the node budget is k; tree is the shape only
        with pytest.raises(GenerationOptionError, match="how many nodes one step verifies is k"):
            api_engine.generate(prompt, tree=budget, **options)
    with pytest.raises(GenerationOptionError, match="Medusa drafts alone"):
        api_engine.generate(prompt, tree=True, max_tokens=4, speculative="layer-skip", chat=False)
    # Unmeasured or CPU-like costs: "auto" (None) stays on chains.
    api_engine.speculative_engine("prompt-lookup").policy.costs.verify.update({1: 1.0e-3, 17: 9.0e-3})
    api_engine.generate(prompt, tree=None, **options)
    assert lookup.branches == 1
