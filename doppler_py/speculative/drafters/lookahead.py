"""Lookahead decoding (Fu et al., 2024): n-grams from a Jacobi iteration's trajectory, verified as a token tree in
the same target forward that advances the iteration. No draft model and no training: it works for any model.

The window: N - 1 levels of W guesses. Level j's slot i guesses the token at depth i + 1 + j after the last
committed token (depth 1: the next token). In the tree, slot i of level 0 follows slot i - 1 (slot 0 follows
the root) and slot i of level j follows slot i of level j - 1, so the row of (j, i) sees (0, 0..i), (1, i), ...,
(j, i) before it: a row's ancestors are exactly the tokens in front of it, as a tree row needs. The target's
greedy token at row (N-2, i) is its guess for depth i + N after the n-gram (0, i), (1, i), ..., (N-2, i): that
n-gram and the guess go into the pool, keyed by their first token. The last level's guesses become the newest
level and the oldest level is dropped: one Jacobi iteration per step. Positions move on as if each step
committed one token, as in the paper; after a longer accepted run the window's guesses sit further right than
they should, which costs acceptance, never exactness.

The verification branch: up to G n-grams from the pool that start with the last committed token; their N - 1
other tokens are candidates for depths 1 .. N - 1, the most recently found first. Candidates and window are
merged into one trie (siblings distinct, as the sampled tree verification needs), candidates first, so the
newest candidate's chain is rows 1, 2, ... and needs no cache moves when accepted. Every node is a
deterministic draft, so the engine's tree verification keeps the output the target's: greedy output is plain
greedy output, and sampled output has the target's distribution. A window path the target agrees with is
accepted too: it is as valid a draft as any.

Cost per step: up to (W + G)(N - 1) verified rows, and a second small readback after the verification's: the
window rows' greedy tokens (`ops.top_tokens`). On a CPU adapter those rows cost several plain steps, so the
policy takes lookahead's steps at a fixed shape and pauses them while the measured tokens per step do not pay
for the rows (`policy.DraftLengthPolicy`, fixed mode).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from doppler_py.errors import GenerationOptionError
from doppler_py.gpu.tensor import Tensor
from doppler_py.model.transformer import Transformer
from doppler_py.ops.speculative import MAX_DRAFT_TOKENS
from doppler_py.ops.top_tokens import TopTokens
from doppler_py.speculative.contract import NoOpHooks, Proposal, StepContext
from doppler_py.speculative.trees.trie import Trie

POOL_PER_KEY = 8  # n-grams kept per first token, the most recently found first
INIT_SEED = 0  # the window's first guesses: tokens of the prompt picked by a fixed seed


@dataclass(frozen=True)
class LookaheadShape:
    """window W (guesses per level), ngram N (levels = N - 1, candidates N - 1 tokens), guesses G (candidates
    verified per step)."""

    # Of the 16-node shapes tried on SmolLM2 (4 open-ended prompts, 48 tokens, greedy), W = 6, N = 3, G = 2 made
    # the most tokens per target forward: 1.31, against 1.24 for (4, 3, 4), 1.23 for (3, 4, 2) and (5, 2, 11),
    # and 1.09 for (2, 5, 2).
    window: int = 6
    ngram: int = 3
    guesses: int = 2

    @property
    def levels(self) -> int:
        return self.ngram - 1

    @property
    def nodes(self) -> int:
        """Nodes of a full step: every window guess and G whole candidates."""
        return (self.window + self.guesses) * self.levels

    def check(self) -> None:
        if self.window < 1 or self.ngram < 2 or self.guesses < 0:
            raise GenerationOptionError(
                f"lookahead needs window >= 1, ngram >= 2 and guesses >= 0, got {self.window}, {self.ngram}, "
                f"{self.guesses}"
            )
        if self.nodes > MAX_DRAFT_TOKENS:
            raise GenerationOptionError(
                f"lookahead's (window + guesses) * (ngram - 1) = {self.nodes} nodes; a step verifies at most "
                f"{MAX_DRAFT_TOKENS}"
            )


class LookaheadDrafter(NoOpHooks):
    """Lookahead decoding's drafts for `target` (see the module docstring). `fixed_nodes` is its step shape,
    which the engine's policy asks for whole (fewer nodes only where a step may not verify so many)."""

    name = "lookahead"
    reads_step_rows = False
    reads_verified_logits = True  # its next level is the target's best token at each verified window row

    def __init__(self, target: Transformer, shape: LookaheadShape = LookaheadShape()):
        shape.check()
        self.shape = shape
        self.fixed_nodes = shape.nodes
        self.registry = target.registry
        rows = min(shape.nodes + 1, target.max_logit_rows)
        self.guess_ids = Tensor.empty(target.gpu, rows, "u32", "lookahead guesses")
        self.top = TopTokens(
            self.registry, target.logits, self.guess_ids, vocab=target.config.vocab_size, max_rows=rows, count=1
        )
        self.levels: list[list[int]] = []
        self.pool: dict[int, list[tuple[int, ...]]] = {}
        self.pending: list[int | None] | None = None  # per window slot: the row of its last level, if verified

    def start(self, ctx: StepContext) -> None:
        picks = np.random.default_rng(INIT_SEED).choice(ctx.tokens, size=(self.shape.levels, self.shape.window))
        self.levels = picks.tolist()
        self.pool = {}
        self.pending = None

    def candidates(self, last: int) -> list[tuple[int, ...]]:
        return self.pool.get(last, [])[: self.shape.guesses]

    def propose(self, ctx: StepContext, k: int) -> Proposal:
        levels = self.shape.levels
        trie = Trie(k)
        # Candidates first, leaving room for the window's first slot (without it the window would stall).
        trie.budget = max(0, k - levels)
        for candidate in self.candidates(ctx.tokens[-1]):
            node = -1
            for token in candidate:
                node = trie.add(node, token)
                if node is None:
                    break
        trie.budget = k
        slot_rows: list[int | None] = []
        previous = -1  # the node of level 0's previous slot
        for i in range(self.shape.window):
            node = previous = trie.add(previous, self.levels[0][i]) if previous is not None else None
            for j in range(1, levels):
                node = trie.add(node, self.levels[j][i]) if node is not None else None
            slot_rows.append(None if node is None else node + 1)
        self.pending = slot_rows
        return trie.proposal()

    def commit(self, ctx: StepContext, accepted: int) -> None:
        slot_rows, self.pending = self.pending, None
        if slot_rows is None:  # a plain step: no window rows were verified
            return
        verified = [row for row in slot_rows if row is not None]
        if not verified:
            return
        rows = max(verified) + 1
        rec = self.registry.recorder()
        self.top.record(rec, rows)
        rec.submit()
        guesses = np.frombuffer(self.registry.gpu.queue.read_buffer(self.guess_ids.buffer, 0, 4 * rows), np.uint32)
        self.advance([None if row is None else int(guesses[row]) for row in slot_rows])

    def advance(self, newest: Sequence[int | None]) -> None:
        """One Jacobi iteration: each verified slot's n-gram and the target's guess after it join the pool, and
        the guesses become the newest level (an unverified slot keeps its last guess)."""
        for i, guess in enumerate(newest):
            if guess is None:
                continue
            ngram = (*(level[i] for level in self.levels), guess)
            found = self.pool.setdefault(ngram[0], [])
            if ngram[1:] in found:
                found.remove(ngram[1:])
            found.insert(0, ngram[1:])
            del found[POOL_PER_KEY:]
        last = self.levels[-1]
        self.levels = [*self.levels[1:], [last[i] if guess is None else guess for i, guess in enumerate(newest)]]

    def finish(self) -> None:
        self.pending = None

    def close(self) -> None:
        self.top.release(self.registry)
        self.registry.release_tensors(self.guess_ids)
