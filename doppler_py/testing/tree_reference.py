"""numpy references of token-tree verification and KV compaction (doppler_py/ops/tree_verify.py, kv_compact.py)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


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


def apply_moves(cache: np.ndarray, start_pos: int, moves: Sequence[tuple[int, int]]) -> np.ndarray:
    """The cache [slots, ...] after copying row start_pos + src to start_pos + dst for each move, in order."""
    out = cache.copy()
    for src, dst in moves:
        out[start_pos + dst] = out[start_pos + src]
    return out
