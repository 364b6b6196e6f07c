"""Prompt lookup: propose the continuation of the most recent earlier occurrence of the last n-gram.

No model and no GPU work: the proposal is a host list, deterministic, so q is one-hot and the check stays exact.
With `branches` > 1 it proposes a token tree instead: the distinct continuations of several
earlier occurrences (the longest matching n-grams first, the most recent first) merged into one trie, the most
recent continuation as its first chain. They cost no model work, and a tree row is verified in the same
forward as a chain row. Siblings are distinct tokens, as the sampled tree verification requires.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from doppler_py.errors import GenerationOptionError
from doppler_py.ops.tree import MAX_TREE_ROWS
from doppler_py.speculative.contract import NO_PROPOSAL, NoOpHooks, Proposal, StepContext
from doppler_py.speculative.trees.trie import Trie


class PromptLookupDrafter(NoOpHooks):
    """Proposes the continuation of the most recent earlier match of the last n tokens (n = max..min).

    Single-token matches are not used by default: on SmolLM2 (benchmarks of 128-token answers) their
    continuations were mostly rejected, and requiring n >= 2 (up to 4) raised acceptance on the repeat,
    summarise and code prompts (e.g. repeat 0.92 → 0.98, summarise 0.29 → 0.75).

    `branches`: how many distinct continuations a step may propose as a token tree (1: always a chain).
    """

    name = "prompt-lookup"
    reads_step_rows = False  # host lists from the committed tokens
    tree_branches = 4  # continuations a tree holds when trees are on

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2, branches: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise GenerationOptionError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if not 1 <= branches < MAX_TREE_ROWS:
            raise GenerationOptionError(f"branches must be in 1..{MAX_TREE_ROWS - 1}, got {branches}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.branches = branches

    def join(self, ctx: StepContext) -> bool:
        return True  # it reads the committed tokens alone, all of them there

    def continue_tokens(self, tokens: Sequence[int], k: int) -> list[int]:
        found = self.continuations(tokens, k, 1)
        return found[0] if found else []

    def continuations(self, tokens: Sequence[int], k: int, limit: int) -> list[list[int]]:
        """Up to `limit` distinct continuations (at most k tokens each) of earlier matches of the last n-gram:
        longer n-grams first, and within one n the most recent match first."""
        seq = np.asarray(tokens, dtype=np.int64)
        n_tokens = seq.size
        found: list[list[int]] = []
        for n in range(min(self.max_ngram, n_tokens - 1), self.min_ngram - 1, -1):
            tail = seq[n_tokens - n :]
            # Windows starting at 0..n_tokens-n-1 (the tail itself is excluded).
            windows = np.lib.stride_tricks.sliding_window_view(seq[: n_tokens - 1], n)
            for hit in np.flatnonzero((windows == tail).all(axis=1))[::-1]:
                start = int(hit) + n
                continuation = seq[start : start + k].tolist()
                if continuation and continuation not in found:
                    found.append(continuation)
                    if len(found) == limit:
                        return found
        return found

    def propose_ids(self, tokens: Sequence[int], k: int) -> list[int]:
        """The chain proposal as a host list."""
        found = self.continuations(tokens, k, 1)
        return found[0] if found else []

    def propose(self, ctx: StepContext, k: int) -> Proposal:
        if self.branches > 1:
            found = self.continuations(ctx.tokens, k, self.branches)
            if len(found) > 1:
                return trie_proposal(found, k)
        ids = self.propose_ids(ctx.tokens, k)
        return Proposal(len(ids), ids) if ids else NO_PROPOSAL


def trie_proposal(continuations: list[list[int]], budget: int) -> Proposal:
    """The continuations merged into a trie of at most `budget` nodes (shared prefixes once), in the order given.
    The first one, the likeliest, is the tree's first chain (rows 1, 2, ...: no cache moves when it is the one
    accepted) and keeps half the budget or more; each later one adds at most an equal share of the rest. A trie
    that comes out a chain is proposed as one."""
    side = max(1, (budget // 2) // max(1, len(continuations) - 1))
    trie = Trie(budget)
    for rank, continuation in enumerate(continuations):
        allowance = budget - side * (len(continuations) - 1) if rank == 0 else side
        node = -1
        for token in continuation:
            child = trie.find(node, token)
            if child is None:
                child = trie.add(node, token) if allowance else None
                if child is None:
                    break
                allowance -= 1
            node = child
    return trie.proposal()
