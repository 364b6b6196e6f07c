"""numpy references of token-tree verification, KV compaction and a greedy drafter's branches
(doppler_py/ops/tree_verify.py, kv_compact.py, top_tokens.py).

Sampled verification of a tree of deterministic drafts (prompt lookup: each node is one token, q one-hot), the
contract the GPU walk is to follow (`sampled_walk`; greedy is `greedy_walk`): recursive rejection sampling
without replacement. At node r with children c_1, c_2, ... (distinct tokens, row order) and p the target's
filtered distribution of row r (`sampling_reference.filtered_probs`): child c_j is accepted iff
u[c_j] < p(c_j) / (1 - p(c_1) - ... - p(c_{j-1})) (the residual after rejecting the earlier siblings, each
rejection removing exactly its token's mass); an accepted child becomes the node. When every child is rejected
the token is drawn by inverse CDF with u_final from p without the children's tokens, renormalised (from p if
nothing is left, which rounding alone can cause); at a leaf, from p. Each node's test uses its own uniform
u[row - 1], so one step draws n + 1 uniforms whatever path it takes. The emitted tokens are distributed exactly
as the target samples them (tests/test_tree_reference.py checks it statistically).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from doppler_py.sampling import SamplingParams
from doppler_py.testing.sampling_reference import filtered_probs, inverse_cdf


def greedy_walk(logits: np.ndarray, tokens: Sequence[int], parents: Sequence[int]) -> tuple[list[int], list[int], int]:
    """(accepted tokens, their rows, the token after them) of greedy tree verification.

    logits [rows, V]: row r scores what follows row r's token (row 0: the last committed token, row i + 1: node
    i, whose parent row is parents[i] + 1). From the root, move to the first child (in row order) whose token is
    the row's argmax (lowest index on ties); the argmax of the row where this stops is the next token.
    """
    best = [int(np.argmax(row)) for row in logits]
    node, accepted, rows = 0, [], []
    for child in range(1, len(parents) + 1):
        if parents[child - 1] + 1 == node and tokens[child] == best[node]:
            accepted.append(int(tokens[child]))
            rows.append(child)
            node = child
    return accepted, rows, best[node]


def sampled_walk(
    logits: np.ndarray,
    tokens: Sequence[int],
    parents: Sequence[int],
    u: Sequence[float],
    u_final: float,
    params: SamplingParams,
) -> tuple[list[int], list[int], int]:
    """(accepted tokens, their rows, the token after them) of sampled tree verification (module docstring);
    `u[i]` tests node i (row i + 1)."""
    node, accepted, rows = 0, [], []
    while True:
        p = filtered_probs(np.asarray(logits[node], np.float32), params)
        remaining = p.copy()
        children = [c for c in range(1, len(parents) + 1) if parents[c - 1] + 1 == node]
        chosen = None
        for child in children:
            token = int(tokens[child])
            mass = remaining.sum()
            if 0 <= token < p.size and mass > 0 and float(np.float32(u[child - 1])) * mass < remaining[token]:
                chosen = child
                break
            if 0 <= token < p.size:
                remaining[token] = 0.0
        if chosen is None:
            final = remaining if children and remaining.sum() > 0 else p
            return accepted, rows, inverse_cdf(final, float(np.float32(u_final)))
        accepted.append(int(tokens[chosen]))
        rows.append(chosen)
        node = chosen


def top_tokens(logits: np.ndarray, count: int) -> np.ndarray:
    """int64 [rows, count]: each row's `count` largest logits' indices, best first, the lowest index first among
    equals and NaN ranked as -inf (the sampler's greedy order); padded with the vocabulary size."""
    rows, vocab = logits.shape
    out = np.full((rows, count), vocab, np.int64)
    for r, row in enumerate(np.asarray(logits, np.float32)):
        order = np.lexsort((np.arange(vocab), -np.where(np.isnan(row), -np.inf, row)))
        out[r, : min(count, vocab)] = order[:count]
    return out


def apply_moves(cache: np.ndarray, start_pos: int, moves: Sequence[tuple[int, int]]) -> np.ndarray:
    """The cache [slots, ...] after copying row start_pos + src to start_pos + dst for each move, in order."""
    out = cache.copy()
    for src, dst in moves:
        out[start_pos + dst] = out[start_pos + src]
    return out
