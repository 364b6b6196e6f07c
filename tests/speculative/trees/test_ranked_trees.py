"""Medusa's static tree builder against brute force, and its measured acceptance per head and rank (host only)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from doppler_py.errors import ModelFormatError
from doppler_py.ops.tree import row_depths
from doppler_py.speculative.contract import Proposal
from doppler_py.speculative.drafters.heads.medusa import card_top1
from doppler_py.speculative.policy.draft_length import CostModel, tree_budget
from doppler_py.speculative.trees.ranked import (
    PRIOR_WEIGHT,
    RankAcceptance,
    chain_with_leaves,
    medusa_tree,
    prior_rates,
)


def expected_accepted(paths: list[tuple[int, ...]], rates: np.ndarray) -> float:
    return sum(float(np.prod([rates[d, r] for d, r in enumerate(path)])) for path in paths)


def best_by_brute_force(nodes: list[tuple[int, ...]], rates: np.ndarray, budget: int) -> float:
    """The most expected accepted tokens of any prefix-closed set of at most `budget` of these rank paths."""
    best = 0.0
    for size in range(1, budget + 1):
        for subset in itertools.combinations(nodes, size):
            chosen = set(subset)
            if all(len(path) == 1 or path[:-1] in chosen for path in chosen):
                best = max(best, expected_accepted(list(chosen), rates))
    return best


def rank_paths(top: np.ndarray, tokens: list[int], parents: list[int]) -> list[tuple[int, ...]]:
    """Each node's ranks from the root, read back from its tokens (distinct within a head's row)."""
    paths: list[tuple[int, ...]] = []
    for node, (token, parent) in enumerate(zip(tokens, parents, strict=True)):
        assert parent < node  # parents come before their children
        head = len(paths[parent]) if parent >= 0 else 0
        rank = int(np.flatnonzero(top[head] == token)[0])
        paths.append((paths[parent] if parent >= 0 else ()) + (rank,))
    return paths


def random_candidates(seed: int, depth: int, tops: int, vocab: int = 50) -> tuple[np.ndarray, np.random.Generator]:
    """[depth, tops] distinct token ids per depth, and the generator for the rates."""
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(vocab, tops, replace=False) for _ in range(depth)]).astype(np.uint32), rng


def proposal_paths(top: np.ndarray, proposal) -> tuple[list[int], list[tuple[int, ...]]]:
    """A proposal's parents (a chain's written out) and each node's rank path."""
    parents = list(proposal.parents) if proposal.parents is not None else list(range(-1, proposal.count - 1))
    return parents, rank_paths(top, list(proposal.tokens), parents)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget", [1, 2, 4, 5])
def test_the_tree_has_the_most_expected_accepted_tokens_a_budget_allows(seed, budget):
    depth, tops = 3, 2
    top, rng = random_candidates(seed, depth, tops)
    rates = np.sort(rng.uniform(0, 0.9, (depth, tops)), axis=1)[:, ::-1]
    proposal = medusa_tree(top, rates, budget, 50)
    parents, paths = proposal_paths(top, proposal)
    assert proposal.count == len(set(paths)) == budget
    assert [len(p) - 1 for p in paths] == [d - 1 for d in row_depths(parents)[1:]]
    every = [path for n in range(1, depth + 1) for path in itertools.product(range(tops), repeat=n)]
    assert expected_accepted(paths, rates) == pytest.approx(best_by_brute_force(every, rates, budget))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget", [1, 3, 5, 7])
def test_a_chain_with_leaves_has_the_most_expected_accepted_tokens_a_budget_allows(seed, budget):
    """Only the chain's nodes (rank 0 all the way) have children: its candidates were drafted after them."""
    depth, tops = 4, 3
    best, rng = random_candidates(seed, depth, tops)
    rates = rng.uniform(0, 0.9, (depth, tops))
    proposal = chain_with_leaves(best, budget, 50, rates)
    _, paths = proposal_paths(best, proposal)
    assert proposal.count == len(set(paths)) == budget and all(set(p[:-1]) <= {0} for p in paths)
    assert list(proposal.values) == pytest.approx([expected_accepted([p], rates) for p in paths])
    candidates = [(0,) * d + (r,) for d in range(depth) for r in range(tops)]
    assert expected_accepted(paths, rates) == pytest.approx(best_by_brute_force(candidates, rates, budget))


def test_siblings_are_distinct_padding_is_never_proposed_and_a_chain_comes_out_as_one():
    vocab = 10
    top = np.array([[3, 4, vocab], [5, vocab, vocab]], np.uint32)  # head 0 has two tokens, head 1 one
    rates = np.array([[0.9, 0.5, 0.4], [0.8, 0.3, 0.2]])
    tree = medusa_tree(top, rates, 8, vocab)
    assert list(tree.tokens) == [3, 5, 4, 5] and list(tree.parents) == [-1, 0, -1, 2]
    chain = medusa_tree(top, rates, 2, vocab)  # 0.9 · 0.8 beats 0.5: the best ranks' chain
    assert chain.parents is None and list(chain.tokens) == [3, 5]


def test_measured_acceptance_counts_every_reached_depth_and_rank():
    acceptance = RankAcceptance(depths=3, tops=2, top1_by_depth=[0.5, 0.4, 0.3])
    np.testing.assert_allclose(acceptance.rates, prior_rates(3, 2, [0.5, 0.4, 0.3]))
    top = np.array([[7, 8], [9, 10], [11, 12]], np.uint32)
    acceptance.observe(top, [8, 9])  # the target gave head 0's second token, then head 1's first; depth 2 unseen
    assert acceptance.seen.tolist() == [1, 1, 0]
    assert acceptance.hits.tolist() == [[0, 1], [1, 0], [0, 0]]
    acceptance.observe(top, [1])  # none of head 0's tokens
    rates = acceptance.rates
    assert rates[0, 1] == pytest.approx((1 + PRIOR_WEIGHT * 0.5 * 0.3) / (2 + PRIOR_WEIGHT))
    assert rates[2].tolist() == pytest.approx(prior_rates(3, 2, [0.5, 0.4, 0.3])[2].tolist())
    for _ in range(400):  # measured beats the prior: head 2 is always right at rank 1
        acceptance.observe(top, [7, 9, 12])
    assert acceptance.rates[2, 1] > 0.95 and acceptance.rates[2, 0] < 0.05
    acceptance.reset()
    np.testing.assert_allclose(acceptance.rates, prior_rates(3, 2, [0.5, 0.4, 0.3]))


def test_the_training_card_gives_the_prior_and_a_malformed_one_is_refused(tmp_path):
    card = tmp_path / "training_card.json"
    assert card_top1(card, 2) is None  # no card: the default prior
    card.write_text(json.dumps({"steps": 3}))
    assert card_top1(card, 2) is None
    card.write_text(json.dumps({"validation_top1_by_head": [0.5, 0.25]}))
    assert card_top1(card, 2) == [0.5, 0.25]
    for bad in ([0.5], [0.5, 1.5], [0.5, "x"], [True, 0.2], "0.5"):
        card.write_text(json.dumps({"validation_top1_by_head": bad}))
        with pytest.raises(ModelFormatError, match=r"training_card\.json: validation_top1_by_head"):
            card_top1(card, 2)
    card.write_text("[1, 2")
    with pytest.raises(ModelFormatError, match=r"training_card\.json"):
        card_top1(card, 2)


GPU_LIKE = CostModel(verify={1: 1.0e-3, 9: 1.1e-3, 17: 1.3e-3})  # rows nearly free
CPU_LIKE = CostModel(verify={1: 1.0e-3, 9: 3.2e-3, 17: 6.0e-3})  # lavapipe-like: cost grows with the rows


def test_the_node_budget_comes_from_measured_costs_and_acceptance():
    top = np.arange(16, dtype=np.uint32).reshape(4, 4)
    tree = medusa_tree(top, prior_rates(4, 4, [0.6, 0.45, 0.35, 0.3]), 16, 100)
    values = list(tree.values)
    assert tree.count == 16 and values == sorted(values, reverse=True)

    def best(costs: CostModel) -> int:  # brute force over every leading run, at plain decoding's throughput
        return max(range(1, 17), key=lambda n: 1 + sum(values[:n]) - costs.verify_cost(n + 1) / costs.verify_cost(1))

    flat = CostModel(verify={1: 1.0e-3, 17: 1.0e-3})
    assert tree_budget(values, flat) == 16  # free rows: every node that may be accepted
    gpu, cpu = tree_budget(values, GPU_LIKE), tree_budget(values, CPU_LIKE)
    assert (gpu, cpu) == (best(GPU_LIKE), best(CPU_LIKE)) and 16 > gpu > cpu, (gpu, cpu)
    assert tree_budget(values, CostModel()) == 16  # nothing measured yet: the budget asked for
    strong = medusa_tree(top, prior_rates(4, 4, [0.95, 0.95, 0.95, 0.95]), 16, 100).values
    assert tree_budget(strong, CPU_LIKE) > tree_budget(values, CPU_LIKE)  # better heads earn more rows


def test_a_best_first_tree_cut_to_its_leading_nodes_is_a_tree():
    vocab = 10
    top = np.array([[3, 4], [5, 6]], np.uint32)
    tree = medusa_tree(top, np.array([[0.5, 0.45], [0.3, 0.2]]), 5, vocab)
    assert list(tree.tokens) == [3, 4, 5, 5, 6] and list(tree.parents) == [-1, -1, 0, 1, 0]
    cut = tree.leading(3)
    assert list(cut.tokens) == [3, 4, 5] and list(cut.parents) == [-1, -1, 0] and len(cut.values) == 3
    assert tree.leading(1).parents is None  # one node: a chain
    with pytest.raises(ValueError, match="node values"):
        Proposal(2, [1, 2]).leading(1)  # no values: nothing says which nodes matter most
