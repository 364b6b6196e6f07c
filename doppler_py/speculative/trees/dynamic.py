"""EAGLE-2's dynamic draft tree (Li et al., 2024): grow the tree where the draft is confident, then keep the
nodes the draft thinks likeliest. The host side: which nodes to expand, the head's tree layout, the proposal.

Every candidate node carries its path's cumulative draft log-probability (the sum, down the path, of the log
softmax at temperature 1 of the head's row that proposed each token), which depends on the context, unlike
the average acceptance per depth and rank that `ranked_trees` uses. Depth 0's candidates are the `width`
best tokens of the root's row (the head's prediction after the last committed token). At each depth the
`width` candidates with the highest cumulative log-probability are *expanded*: the head runs one row for each
(in its own cache, seeing the committed pairs and its own expanded ancestors) and each row's `width` best
tokens become candidates one depth down. Finally the `budget` candidates with the highest cumulative
log-probability form the proposal, best-first, with values exp(score): the draft's own probability of the
path. A child never scores above its parent and ties go to the shallower node, so every parent comes before
its children and every leading run of nodes is a tree (`policy.tree_budget` may verify fewer).

Expansion stops early once `budget` candidates rank ahead of anything the newest depth's children could
score: nothing deeper could enter the proposal.

The head's rows are laid out as a token tree for `Transformer.record_forward(tree=True)` (`ops/tree.py`'s
words: depth, ancestor mask), row r at position start + the depth of its node. Ancestor masks are relative to
the forward's first row, so each expansion re-runs the head over every expanded row so far (the rows already
run give the same outputs again): a depth-d forward costs width · d rows instead of width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from doppler_py.ops.tree import MAX_TREE_ROWS, is_chain
from doppler_py.speculative.contract import Proposal

DYNAMIC_TREE_WIDTH = 4  # tokens per expanded row, and rows expanded per depth


def log_softmax(row: np.ndarray) -> np.ndarray:
    """float64 log softmax of one logits row (-inf entries stay -inf; a row of -inf gives all -inf)."""
    row = row.astype(np.float64)
    top = row.max()
    if not np.isfinite(top):
        return np.full_like(row, -np.inf)
    shifted = row - top
    return shifted - np.log(np.exp(shifted).sum())


@dataclass
class DraftTree:
    """The candidates found so far: node c is token tokens[c] under parents[c] (-1: the last committed token),
    at depth depths[c], with cumulative draft log-probability scores[c]. rows[r] is the candidate behind the
    head's row r (the expanded ones, in the order they were expanded)."""

    width: int = DYNAMIC_TREE_WIDTH
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    row_of: dict[int, int] = field(default_factory=dict)

    def add_children(self, parent: int, logits_row: np.ndarray, to_target: np.ndarray | None = None) -> None:
        """The `width` best tokens of the head's row for `parent` (-1: the root) as candidates; `to_target` maps
        the row's (draft-vocabulary) indices to target ids. -inf entries are never candidates."""
        logp = log_softmax(np.asarray(logits_row))
        order = np.argsort(-logp, kind="stable")[: self.width]
        base, depth = (0.0, 0) if parent < 0 else (self.scores[parent], self.depths[parent] + 1)
        for index in order:
            if not np.isfinite(logp[index]):
                break
            self.tokens.append(int(to_target[index]) if to_target is not None else int(index))
            self.parents.append(parent)
            self.depths.append(depth)
            self.scores.append(base + float(logp[index]))

    def _ranked(self, candidates) -> list[int]:
        """Best first: highest score, then shallowest, then first found."""
        return sorted(candidates, key=lambda c: (-self.scores[c], self.depths[c], c))

    def frontier(self, depth: int) -> list[int]:
        return self._ranked(c for c in range(len(self.tokens)) if self.depths[c] == depth)

    def worth_expanding(self, depth: int, budget: int) -> bool:
        """Whether expanding depth `depth` could change the `budget`-node proposal: its children score at most
        its best candidate's score and rank after every candidate at least as high at depth <= `depth`."""
        frontier = self.frontier(depth)
        if not frontier:
            return False
        best = self.scores[frontier[0]]
        ahead = sum(1 for c in range(len(self.tokens)) if self.scores[c] >= best)
        return ahead < budget

    def expand(self, depth: int, max_rows: int = MAX_TREE_ROWS) -> list[int]:
        """Give the best `width` candidates at `depth` head rows (at most `max_rows` rows in all); returns them."""
        room = max(0, max_rows - len(self.rows))
        chosen = self.frontier(depth)[: min(self.width, room)]
        for c in chosen:
            self.row_of[c] = len(self.rows)
            self.rows.append(c)
        return chosen

    def row_tokens(self) -> list[int]:
        return [self.tokens[c] for c in self.rows]

    def parent_row(self, row: int) -> int:
        """The head row of row `row`'s parent (-1: the root, the head's prediction from the committed pairs)."""
        parent = self.parents[self.rows[row]]
        return -1 if parent < 0 else self.row_of[parent]

    def layout(self) -> np.ndarray:
        """u32 [rows, 2]: (depth, ancestor mask) of every head row, as `ops/tree.py`'s `layout_words`."""
        masks: list[int] = []
        for r in range(len(self.rows)):
            above = self.parent_row(r)
            masks.append((1 << r) | (masks[above] if above >= 0 else 0))
        return np.array([(self.depths[c], mask) for c, mask in zip(self.rows, masks, strict=True)], dtype=np.uint32)

    def grow(
        self,
        budget: int,
        root: np.ndarray,
        run_rows: Callable[[int], np.ndarray],
        *,
        to_target: np.ndarray | None = None,
        max_rows: int = MAX_TREE_ROWS,
    ) -> Proposal:
        """The proposal of at most `budget` nodes grown from the root's logits row `root`. `run_rows(first)`
        runs the head over all rows so far (`row_tokens`, `layout`, `parent_row`) and returns the logits of
        rows first.. (the new ones); at most `max_rows` head rows."""
        self.add_children(-1, root, to_target)
        for depth in range(budget - 1):
            if not self.worth_expanding(depth, budget):
                break
            first = len(self.rows)
            if not self.expand(depth, max_rows):
                break
            for row, logits in enumerate(run_rows(first), start=first):
                self.add_children(self.rows[row], logits, to_target)
        return self.proposal(budget)

    def proposal(self, budget: int) -> Proposal:
        """The `budget` best candidates (at most MAX_TREE_ROWS - 1), best-first, values = exp(score)."""
        chosen = self._ranked(range(len(self.tokens)))[: min(budget, MAX_TREE_ROWS - 1)]
        node_of = {c: i for i, c in enumerate(chosen)}
        parents = [node_of[self.parents[c]] if self.parents[c] >= 0 else -1 for c in chosen]
        return Proposal(
            len(chosen),
            [self.tokens[c] for c in chosen],
            parents=None if is_chain(parents) else parents,
            values=[float(np.exp(self.scores[c])) for c in chosen],
        )
