"""Token trees from a drafter's ranked candidates, chosen by measured acceptance per depth and rank.

A drafter that reads back its best few tokens at every depth (`ops.top_tokens`) offers candidate nodes: a path
of ranks (r_0, ..., r_d) from the root. A node is accepted only if every node on its path is, so its expected
contribution is the product of rate[j, r_j] over the path, where rate[d, r] is how often the rank-r candidate
at depth d was the target's token when the walk got that far. Every node's value is at most its parent's, so
taking the best nodes one by one (best-first from the root) gives the tree of `budget` nodes with the largest
expected accepted length under those rates, every parent before its children, and every leading run of nodes
a tree (`Proposal.values`: the engine may verify fewer, `policy.tree_budget`).

Two builders:
- `medusa_tree`: Medusa's heads. Head d proposes the token d + 1 places ahead, the same whatever comes before
  it in the tree (the heads do not see each other's drafts), so every combination of ranks is a candidate.
- `chain_with_leaves`: a drafter that drafts one greedy chain (a draft model). Its depth-d
  candidates were drafted after the chain's tokens, so only the chain's nodes have children: the chain and one
  leaf per other rank beside each chain node.

`RankAcceptance` measures the rates: it starts from a prior (for Medusa, the head's own validation top-1 per
head from its training card, when it has one), falling off geometrically with rank, and is updated after every
tree step from what the target committed: at every depth the walk reached (for a chain drafter: while it
followed the chain), the target's token is looked up among that depth's candidates. That sees every rank at
every reached depth, in the tree or not, so it is not biased by the tree's own shape. It is reset per
generation, so that a seeded generation gives the same tokens whatever ran before it.

The nodes are deterministic given the context, so a tree is verified exactly at any temperature
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
DEFAULT_TOP1 = (0.4, 0.3, 0.25, 0.2)  # prior top-1 per Medusa head without a training card
PRIOR_WEIGHT = 8.0  # the prior counts as this many observations of each head


def prior_rates(depths: int, tops: int, top1_by_depth: Sequence[float] | None = None) -> np.ndarray:
    """[depths, tops]: the prior acceptance of the rank-r candidate at depth d: top1[d] · RANK_FALLOFF**r (the
    last top-1 given repeats at deeper depths)."""
    top1 = list(top1_by_depth) if top1_by_depth is not None else list(DEFAULT_TOP1)
    top1 = (top1 + [top1[-1]] * depths)[:depths]
    return np.array(top1, np.float64)[:, None] * RANK_FALLOFF ** np.arange(tops)[None, :]


class RankAcceptance:
    """Measured acceptance per (depth, rank), over one generation (see the module docstring)."""

    def __init__(self, depths: int, tops: int, top1_by_depth: Sequence[float] | None = None):
        self.prior = prior_rates(depths, tops, top1_by_depth)
        self.reset()

    def reset(self) -> None:
        self.hits = np.zeros_like(self.prior)
        self.seen = np.zeros(self.prior.shape[0])

    @property
    def rates(self) -> np.ndarray:
        return (self.hits + PRIOR_WEIGHT * self.prior) / (self.seen[:, None] + PRIOR_WEIGHT)

    def observe(self, top: np.ndarray, committed: Sequence[int]) -> None:
        """After a step whose candidates were `top` [depth, tops]: `committed` is what the target gave at depths
        0, 1, ... (the accepted path and the final token), as far as the candidates were drafted for."""
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


def chain_with_leaves(best: np.ndarray, budget: int, vocab: int, rates: np.ndarray) -> Proposal:
    """A tree of at most `budget` nodes from `best` [depth, branches] (each draft row's best tokens in order):
    of the chain best[:, 0] and the other tokens of each row as leaves beside the chain's node, the nodes with
    the most expected accepted tokens under `rates` [>= depth, branches] (a chain node's value is the product
    of rank-0 rates down to it, a leaf's its parent's times its own rate), best-first with their values."""
    depth, branches = best.shape
    chain_values = np.cumprod(rates[:depth, 0])
    # (value, depth, rank): each node's parent has a value at least as large and a smaller depth
    candidates = [(float(chain_values[d]), d, 0) for d in range(depth)]
    for d in range(depth):
        above = float(chain_values[d - 1]) if d else 1.0
        candidates += [(above * rates[d, r], d, r) for r in range(1, branches) if best[d, r] < vocab]
    chosen = sorted(candidates, key=lambda c: (-c[0], c[1], c[2]))[: min(budget, MAX_TREE_ROWS - 1)]
    chain_rows = {d: i for i, (_, d, r) in enumerate(chosen) if r == 0}
    tokens = [int(best[d, r]) for _, d, r in chosen]
    parents = [chain_rows[d - 1] if d else -1 for _, d, _ in chosen]
    values = [value for value, _, _ in chosen]
    return Proposal(len(tokens), tokens, parents=None if is_chain(parents) else parents, values=values)
