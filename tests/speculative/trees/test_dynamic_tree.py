"""EAGLE-2's dynamic tree on the host (`speculative/trees/dynamic.py`), held to a brute-force reference: a
synthetic draft whose row for every path is a seeded random function of the path."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from speculative.conftest import proposal_paths

from doppler_py.ops.tree import MAX_TREE_ROWS
from doppler_py.speculative.trees.dynamic import DraftTree, log_softmax

VOCAB = 7


def draft_row(seed: int, path: tuple[int, ...]) -> np.ndarray:
    """The synthetic draft's logits after `path` (a tuple of tokens under the root); peaked so some paths are
    likely and others are not, with a -inf entry (a token outside the draft vocabulary)."""
    rng = np.random.default_rng([seed, len(path), *path])
    row = rng.normal(0.0, 2.5, VOCAB).astype(np.float32)
    row[rng.integers(VOCAB)] = -np.inf
    return row


def grow(seed: int, budget: int, width: int, max_rows: int = MAX_TREE_ROWS):
    """The tree grown as the EAGLE drafter grows it, with the synthetic draft standing in for the head (each
    row's logits from its path, found through the tree's own parent rows, as the GPU rows see ancestors)."""
    tree = DraftTree(width)
    runs: list[int] = []

    def path_of_row(row: int) -> tuple[int, ...]:
        path = []
        while row >= 0:
            path.append(tree.tokens[tree.rows[row]])
            row = tree.parent_row(row)
        return tuple(path[::-1])

    def run_rows(first: int) -> np.ndarray:
        runs.append(len(tree.rows))
        return np.stack([draft_row(seed, path_of_row(r)) for r in range(first, len(tree.rows))])

    return tree.grow(budget, draft_row(seed, ()), run_rows, max_rows=max_rows), tree, runs


def reference(seed: int, budget: int, width: int) -> dict[tuple[int, ...], float]:
    """EAGLE-2 without early stopping: expand the `width` best candidates of every depth down to depth
    budget - 1 (MAX_TREE_ROWS expanded in all), then keep the `budget` best of all candidates (score, then
    depth, then order found)."""
    found: list[tuple[tuple[int, ...], float]] = []  # (path, log-probability)
    newest, expanded = [((), 0.0)], 0
    for _depth in range(budget):
        children = []
        for path, score in newest:
            logp = log_softmax(draft_row(seed, path))
            best = [t for t in np.argsort(-logp, kind="stable")[:width] if np.isfinite(logp[t])]
            children += [((*path, int(t)), score + float(logp[t])) for t in best]
        start = len(found)
        found += children
        order = sorted(range(len(children)), key=lambda i: (-children[i][1], start + i))
        newest = [children[i] for i in order[: min(width, MAX_TREE_ROWS - expanded)]]
        expanded += len(newest)
    ranked = sorted(range(len(found)), key=lambda i: (-found[i][1], len(found[i][0]), i))[:budget]
    return {found[i][0]: found[i][1] for i in ranked}


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize(("budget", "width"), [(1, 4), (2, 2), (6, 4), (12, 4), (20, 3), (31, 4)])
def test_the_tree_is_eagle_2s_and_stopping_early_changes_nothing(seed, budget, width):
    proposal, _, _ = grow(seed, budget, width)
    expected = reference(seed, budget, width)
    got = proposal_paths(proposal)
    assert got.keys() == expected.keys()
    for path, score in expected.items():
        assert got[path] == pytest.approx(score, abs=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_nodes_come_best_first_parents_before_children_and_every_leading_run_is_a_tree(seed):
    proposal, _, _ = grow(seed, 16, 4)
    values = list(proposal.values)
    assert values == sorted(values, reverse=True) and values[-1] > 0 and values[0] <= 1
    parents = list(proposal.parents) if proposal.parents is not None else list(range(-1, proposal.count - 1))
    assert all(-1 <= p < i for i, p in enumerate(parents))
    for n in range(1, proposal.count + 1):
        assert proposal.leading(n).count == n
    siblings = {}
    for token, parent in zip(proposal.tokens, parents, strict=True):
        assert token not in siblings.setdefault(parent, set())
        siblings[parent].add(token)


def test_the_head_rows_see_exactly_their_ancestors_at_their_depth():
    _, tree, runs = grow(3, 24, 4)
    assert runs and all(b > a for a, b in itertools.pairwise(runs))  # each forward re-runs every row so far
    layout = tree.layout()
    assert layout.shape == (len(tree.rows), 2)
    for row, (depth, mask) in enumerate(layout):
        ancestors, above = {row}, tree.parent_row(row)
        while above >= 0:
            ancestors.add(above)
            above = tree.parent_row(above)
        assert mask == sum(1 << a for a in ancestors)
        assert depth == len(ancestors) - 1 == tree.depths[tree.rows[row]]


def test_rows_stop_at_the_limit_and_expansion_stops_when_nothing_deeper_could_enter():
    _, tree, runs = grow(5, 31, 4, max_rows=10)
    assert len(tree.rows) == 10 and runs[-1] == 10
    # A draft sure of one path: budget 3 takes the chain, expanding only the best row of each depth matters.
    tree = DraftTree(3)
    sure = np.array([0.0, -40.0, -40.0], np.float32)
    calls = []

    def run_rows(first):
        calls.append(first)
        return np.stack([sure] * (len(tree.rows) - first))

    proposal = tree.grow(3, sure, run_rows)
    assert list(proposal.tokens) == [0, 0, 0] and proposal.parents is None
    assert len(calls) == 2  # depths 0 and 1 expanded; depth 2's children could not enter a 3-node tree


def test_awkward_rows_a_single_token_all_minus_inf_and_ties():
    tree = DraftTree(4)
    one = np.array([-np.inf, 2.0, -np.inf], np.float32)
    proposal = tree.grow(5, one, lambda first: np.stack([one] * (len(tree.rows) - first)))
    assert list(proposal.tokens) == [1, 1, 1, 1, 1] and proposal.values == pytest.approx([1.0] * 5)
    empty = DraftTree(4)
    assert empty.grow(4, np.full(3, -np.inf, np.float32), lambda first: pytest.fail("nothing to expand")).count == 0
    tied = DraftTree(2)
    flat = np.zeros(4, np.float32)
    proposal = tied.grow(4, flat, lambda first: np.stack([flat] * (len(tied.rows) - first)))
    # equal scores at a depth: the first found wins; the two depth-0 nodes before any depth-1 node
    assert list(proposal.tokens)[:2] == [0, 1] and list(proposal.parents)[:2] == [-1, -1]
    to_target = np.array([10, 20, 30, 40])
    mapped = DraftTree(2)
    mapped.add_children(-1, np.array([0.0, 3.0, 1.0, 2.0], np.float32), to_target)
    assert mapped.tokens == [20, 40]
