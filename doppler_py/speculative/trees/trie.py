"""A token tree built one path at a time: each (parent, token) becomes one node, so siblings are distinct tokens
(as the sampled tree verification needs) and shared prefixes are proposed once."""

from __future__ import annotations

from doppler_py.ops.tree import is_chain
from doppler_py.speculative.contract import NO_PROPOSAL, Proposal


class Trie:
    """Nodes in the order added (parents before children), at most `budget` of them."""

    def __init__(self, budget: int):
        self.budget = budget
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.index: dict[tuple[int, int], int] = {}

    def find(self, parent: int, token: int) -> int | None:
        return self.index.get((parent, token))

    def add(self, parent: int, token: int) -> int | None:
        """The node for `token` under `parent` (-1: the root), added if new; None when the budget is spent."""
        node = self.index.get((parent, token))
        if node is None and len(self.tokens) < self.budget:
            node = self.index[(parent, token)] = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(parent)
        return node

    def proposal(self) -> Proposal:
        """The nodes as a proposal: a chain when they form one."""
        if not self.tokens:
            return NO_PROPOSAL
        shape = None if is_chain(self.parents) else list(self.parents)
        return Proposal(len(self.tokens), list(self.tokens), parents=shape)
