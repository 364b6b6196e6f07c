"""Token-tree references the tests share."""

from __future__ import annotations

from collections.abc import Sequence


def path_rows(parents: Sequence[int], leaf_row: int) -> list[int]:
    """The rows from the root's first child down to `leaf_row` (empty for the root itself)."""
    path = []
    row = leaf_row
    while row > 0:
        path.append(row)
        row = parents[row - 1] + 1
    return path[::-1]
