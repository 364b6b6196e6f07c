"""Token trees: the shape of a tree proposal and how its rows sit in one target forward.

A proposal of n nodes hangs under the last committed token (the root). Node i has a parent index
parents[i] (-1: the root) that comes before it (parents[i] < i), so rows are in topological order. The
target forward runs n + 1 rows: row 0 is the root, row i + 1 is node i. Row r sits at position
start_pos + depth(r) (RoPE and the sliding window use it) and sees the committed cache plus its own
ancestors and itself; its K/V go to cache slot start_pos + r. After verification the accepted path's rows
are moved to slots start_pos + 1, start_pos + 2, ... (`compaction_moves`) and the cache truncated.

The GPU reads the layout from one u32 buffer, two words per row: (depth, ancestor mask), bit j of the mask
set when row j is the row itself or one of its ancestors (`layout_words`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from doppler_py.errors import InternalError

MAX_TREE_ROWS = 32  # ancestor masks are one u32


def check_parents(parents: Sequence[int], n: int) -> list[int]:
    """`parents` as a list, after refusing a shape the verification cannot take."""
    parents = [int(p) for p in parents]
    if len(parents) != n:
        raise InternalError(f"a tree of {n} nodes came with {len(parents)} parent indices")
    if n + 1 > MAX_TREE_ROWS:
        raise InternalError(f"a tree of {n} nodes needs {n + 1} rows; at most {MAX_TREE_ROWS} are supported")
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise InternalError(f"tree node {i} has parent {parent}: parents must come before their children")
    return parents


def is_chain(parents: Sequence[int]) -> bool:
    return list(parents) == list(range(-1, len(parents) - 1))


def row_depths(parents: Sequence[int]) -> list[int]:
    """Depth of every row: 0 for the root, 1 + its parent's for node i (row i + 1)."""
    depths = [0]
    for parent in parents:
        depths.append(depths[parent + 1] + 1)
    return depths


def ancestor_masks(parents: Sequence[int]) -> list[int]:
    """Per row, the bit mask of the rows it attends to among the tree's: itself and its ancestors."""
    masks = [1]
    for i, parent in enumerate(parents):
        masks.append(masks[parent + 1] | (1 << (i + 1)))
    return masks


def layout_words(parents: Sequence[int]) -> np.ndarray:
    """u32 [rows, 2]: (depth, ancestor mask) per row, as attention.wgsl and rope.wgsl read them."""
    return np.array(list(zip(row_depths(parents), ancestor_masks(parents), strict=True)), dtype=np.uint32)


def compaction_moves(path: Sequence[int]) -> list[tuple[int, int]]:
    """(source row, destination row) moves that bring an accepted path's K/V to rows 1, 2, ...; rows already in
    place are left out. Applied in order, no move overwrites a row a later move reads (path rows increase)."""
    return [(row, depth) for depth, row in enumerate(path, start=1) if row != depth]
