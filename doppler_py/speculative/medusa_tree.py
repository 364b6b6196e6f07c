"""Medusa's static token trees: the best few tokens of every head, combined into the tree of at most `budget`
nodes with the most expected accepted tokens, by measured acceptance per head and rank.

Head d (d = 0..K-1) proposes the token d + 1 places after the last committed one, and its top tokens are the
same whatever comes before them in the tree (the heads do not see each other's drafts). A node is a path of
ranks (r_0, ..., r_d): its token is head d's r_d-th best, and it is accepted only if every node on its path is,
so its expected contribution is the product of rate[j, r_j] over the path, where rate[d, r] is how often head
d's rank-r token was the target's token at depth d when the walk got that far. Every node's value is at most
its parent's, so taking the best nodes one by one (best-first from the root) gives the tree of `budget` nodes
with the largest expected accepted length under those rates, with every parent taken before its children.

The rates start from a prior (the head's own validation top-1 per head from its training card, when it has
one, falling off geometrically with rank) and are updated after every tree step from what the target
committed: at every depth the walk reached, the target's token is looked up among that head's top tokens.
That sees every rank at every reached depth, in the tree or not, so it is not biased by the tree's own shape.
They are reset per generation, so that a seeded generation gives the same tokens whatever ran before it.

The nodes are deterministic given the context, so the tree is verified exactly at any temperature
(`ops.tree_verify`).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from doppler_py.ops.tree import MAX_TREE_ROWS, is_chain
from doppler_py.speculative.contract import Proposal

MEDUSA_TREE_TOPS = 4  # candidate tokens per head when trees are on
RANK_FALLOFF = 0.3  # prior: each rank down is accepted this much as often as the one above it
DEFAULT_TOP1 = (0.4, 0.3, 0.25, 0.2)  # prior top-1 per head without a training card (the last one repeats)
PRIOR_WEIGHT = 8.0  # the prior counts as this many observations of each head


def prior_rates(heads: int, tops: int, top1_by_head: Sequence[float] | None = None) -> np.ndarray:
    """[heads, tops]: the prior acceptance of head d's rank-r token: top1[d] · RANK_FALLOFF**r."""
    top1 = list(top1_by_head) if top1_by_head is not None else list(DEFAULT_TOP1)
    top1 = (top1 + [top1[-1]] * heads)[:heads]
    return np.array(top1, np.float64)[:, None] * RANK_FALLOFF ** np.arange(tops)[None, :]


class RankAcceptance:
    """Measured acceptance per (head, rank), over one generation (see the module docstring)."""

    def __init__(self, heads: int, tops: int = MEDUSA_TREE_TOPS, top1_by_head: Sequence[float] | None = None):
        self.prior = prior_rates(heads, tops, top1_by_head)
        self.reset()

    def reset(self) -> None:
        self.hits = np.zeros_like(self.prior)
        self.seen = np.zeros(self.prior.shape[0])

    @property
    def rates(self) -> np.ndarray:
        return (self.hits + PRIOR_WEIGHT * self.prior) / (self.seen[:, None] + PRIOR_WEIGHT)

    def observe(self, top: np.ndarray, committed: Sequence[int]) -> None:
        """After a step whose heads' best tokens were `top` [depth, tops]: `committed` is what the target gave at
        depths 0, 1, ... (the accepted path and the final token)."""
        for d, token in enumerate(list(committed)[: top.shape[0]]):
            self.seen[d] += 1
            ranks = np.flatnonzero(top[d] == token)
            if ranks.size:
                self.hits[d, ranks[0]] += 1


def medusa_tree(top: np.ndarray, rates: np.ndarray, budget: int, vocab: int) -> Proposal:
    """The tree of at most `budget` nodes from `top` [depth, tops] (each head's best tokens, in order; `vocab`
    pads a head with fewer) that maximises the expected accepted length under `rates` [>= depth, tops], in
    best-first order with each node's expected accepted tokens (`Proposal.values`)."""
    depth, tops = top.shape
    budget = min(budget, MAX_TREE_ROWS - 1)
    tokens: list[int] = []
    parents: list[int] = []
    values: list[float] = []
    # (-value, tie-break order, parent node, depth, rank): equal values keep the order they were found in
    frontier = [(-rates[0, r], r, -1, 0, r) for r in range(tops) if top[0, r] < vocab]
    heapq.heapify(frontier)
    found = tops
    while frontier and len(tokens) < budget:
        value, _, parent, d, r = heapq.heappop(frontier)
        node = len(tokens)
        tokens.append(int(top[d, r]))
        parents.append(parent)
        values.append(-value)
        if d + 1 < depth:
            for child in range(tops):
                if top[d + 1, child] < vocab:
                    heapq.heappush(frontier, (value * rates[d + 1, child], found, node, d + 1, child))
                    found += 1
    return Proposal(len(tokens), tokens, parents=None if is_chain(parents) else parents, values=values)
