"""Token-tree verification, KV compaction and a greedy drafter's branches on the GPU (shaders/sample.wgsl's tree_*
and top_tokens entries, kv_compact.wgsl) against their numpy references (doppler_py/testing/tree_reference.py).

Greedy verification, branches and compaction are exact: token ids and copied floats. Sampled verification compares float
quantities with thresholds (a child's p against u times the mass its earlier siblings left, the residual draw),
so, as in tests/kernels/test_spec_verify.py, a decision within `float_margins.MARGIN` of its boundary may go
either way: `allowed_walks` lists every outcome the margins allow, and cases with more than one must be rare.
The statistical tests check the emitted tokens against the target's filtered distributions directly.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.distribution import assert_samples_follow
from support.float_margins import MARGIN, SWEPT_OPTIONS, draws, less_than_decisions, top_p_near_tie
from support.trees import path_rows

from doppler_py.gpu.tensor import Tensor
from doppler_py.ops.kv_compact import KVCompact
from doppler_py.ops.speculative import STATUS_DRAFT_TOKEN_OUT_OF_RANGE, STATUS_TARGET_NONFINITE
from doppler_py.ops.top_tokens import MAX_TOP_TOKENS, TopTokens
from doppler_py.ops.tree import MAX_TREE_ROWS, compaction_moves, layout_words
from doppler_py.ops.tree_verify import TreeVerify, random_words, result_words
from doppler_py.sampling import SamplingParams
from doppler_py.testing.sampling_reference import filtered_probs
from doppler_py.testing.tree_reference import apply_moves, greedy_walk, sampled_walk, top_tokens

TREES = {
    "one-node": [-1],
    "chain": [-1, 0, 1, 2],
    "star": [-1, -1, -1, -1, -1],
    "two-branches": [-1, 0, 1, -1, 3, 0, 5],
    "deep-and-wide": [-1, 0, 0, 1, 1, 2, 5, 6, -1, 8, 9, 3, 11, 12, 4],
    "widest": [-1] * (MAX_TREE_ROWS - 1),
}
GREEDY = SamplingParams()


class Verifier:
    def __init__(self, gpu, registry, vocab: int):
        self.vocab = vocab
        self.logits = Tensor.empty(gpu, (MAX_TREE_ROWS, vocab))
        self.tokens = Tensor.empty(gpu, MAX_TREE_ROWS, "u32")
        self.tree = Tensor.empty(gpu, (MAX_TREE_ROWS, 2), "u32")
        self.randoms = Tensor.empty(gpu, MAX_TREE_ROWS)
        self.result = Tensor.empty(gpu, result_words(MAX_TREE_ROWS), "u32")
        self.op = TreeVerify(registry, self.logits, self.tokens, self.tree, self.randoms, self.result, vocab=vocab)

    def run(self, registry, logits, tokens, parents, params=GREEDY, u=(), u_final=0.0):
        """(accepted tokens, their rows, final token, status); u[i] tests node i (row i + 1)."""
        rows = len(parents) + 1
        self.logits.view(logits.shape).write(logits.astype(np.float32))
        self.tokens.view((rows,)).write(np.asarray(tokens, np.uint32))
        self.tree.view((rows, 2)).write(layout_words(parents))
        if not params.greedy:
            self.randoms.view((random_words(rows),)).write(np.array([*u, u_final], np.float32))
        rec = registry.recorder()
        self.op.record(rec, rows, params)
        rec.submit()
        out = self.result.numpy()[: result_words(rows)].tolist()
        n = out[0]
        return out[3 : 3 + 2 * n : 2], out[4 : 4 + 2 * n : 2], out[1], out[2]


def matching_tokens(rng, logits: np.ndarray, parents: list[int], hit_rate: float) -> list[int]:
    """Node tokens: the parent row's argmax with probability hit_rate (siblings kept distinct), else random."""
    vocab = logits.shape[1]
    tokens = [int(rng.integers(vocab))]  # row 0's token is never read
    for i, parent in enumerate(parents):
        siblings = {tokens[j + 1] for j in range(i) if parents[j] == parent}
        want = int(np.argmax(logits[parent + 1]))
        token = want if rng.random() < hit_rate and want not in siblings else int(rng.integers(vocab))
        tokens.append(token)
    return tokens


@pytest.mark.parametrize("vocab", [1, 63, 1000, 4099])
@pytest.mark.parametrize("tree", sorted(TREES))
def test_greedy_walk_matches_the_reference(gpu, registry, rng, vocab, tree):
    verifier = Verifier(gpu, registry, vocab)
    parents = TREES[tree]
    for hit_rate in (0.0, 0.5, 0.9, 1.0):
        logits = rng.standard_normal((len(parents) + 1, vocab))
        tokens = matching_tokens(rng, logits, parents, hit_rate)
        accepted, rows, final, status = verifier.run(registry, logits, tokens, parents)
        assert (accepted, rows, final) == greedy_walk(logits.astype(np.float32), tokens, parents)
        assert (accepted, rows, final) == sampled_walk(logits, tokens, parents, [0.5] * len(parents), 0.5, GREEDY)
        assert status == 0
        assert rows == path_rows(parents, rows[-1]) if rows else True


def test_ties_pick_the_lowest_index_and_minus_infinity_is_a_value(gpu, registry, rng):
    verifier = Verifier(gpu, registry, 300)
    logits = np.full((3, 300), -np.inf, np.float32)
    logits[0, [7, 150, 299]] = 2.0  # tie: 7
    logits[1, 40:] = 1.0  # tie over 260 entries: 40
    tokens, parents = [0, 7, 40], [-1, 0]
    accepted, rows, final, status = verifier.run(registry, logits, tokens, parents)
    assert (accepted, rows, final, status) == ([7, 40], [1, 2], 0, 0)  # row 2 all -inf: index 0


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_logits_set_the_status_and_clear_for_the_next_step(gpu, registry, rng, bad):
    verifier = Verifier(gpu, registry, 64)
    logits = rng.standard_normal((3, 64)).astype(np.float32)
    logits[2, 5] = bad
    assert verifier.run(registry, logits, [0, 1, 2], [-1, -1])[3] == STATUS_TARGET_NONFINITE
    logits[2, 5] = 0.0
    assert verifier.run(registry, logits, [0, 1, 2], [-1, -1])[3] == 0


def test_rows_outside_a_tree_are_refused(gpu, registry):
    verifier = Verifier(gpu, registry, 8)
    for rows in (1, MAX_TREE_ROWS + 1):
        with pytest.raises(ValueError, match="rows"):
            verifier.op.record(registry.recorder(), rows, GREEDY)


# -- sampled verification -------------------------------------------------------------------------------------
def allowed_walks(logits, tokens, parents, u, u_final, params) -> set[tuple[tuple[int, ...], int]] | None:
    """Every (accepted rows, final token) `sampled_walk` could give within the float margins; None when a
    top-p kept set itself is unsure."""
    if any(top_p_near_tie(row, params) for row in logits):
        return None
    outcomes: set[tuple[tuple[int, ...], int]] = set()

    def walk(node: int, path: tuple[int, ...]) -> None:
        p = filtered_probs(np.asarray(logits[node], np.float32), params)
        remaining = p.copy()
        children = [c for c in range(1, len(parents) + 1) if parents[c - 1] + 1 == node]
        for child in children:
            token = int(tokens[child])
            if not 0 <= token < p.size:
                continue
            decisions = less_than_decisions(float(np.float32(u[child - 1])) * remaining.sum(), remaining[token])
            if True in decisions and remaining[token] > 0:
                walk(child, (*path, child))
            if False not in decisions:
                return
            remaining[token] = 0.0
        residual = remaining if children else p
        picks = draws(residual, u_final) if residual.sum() > 0 else set()
        if residual.sum() < MARGIN:  # the GPU's residual may be empty where the reference's is not
            picks |= draws(p, u_final)
        outcomes.update((path, t) for t in picks)

    walk(0, ())
    return outcomes


def sampled_tokens(rng, logits: np.ndarray, parents: list[int], params: SamplingParams) -> list[int]:
    """Node tokens as a drafter might propose them: mostly likely ones (a draw from the parent row's filtered
    distribution, distinct among siblings), some uniform (possibly impossible), a few repeats of a sibling."""
    vocab = logits.shape[1]
    tokens = [0]
    for i, parent in enumerate(parents):
        siblings = [tokens[j + 1] for j in range(i) if parents[j] == parent]
        source = rng.choice(["likely", "uniform", "repeat"], p=[0.75, 0.2, 0.05])
        if source == "repeat" and siblings:
            tokens.append(int(rng.choice(siblings)))
            continue
        if source == "likely":
            p = filtered_probs(logits[parent + 1], params)
            p[siblings] = 0.0
            if p.sum() > 0:
                tokens.append(int(rng.choice(vocab, p=p / p.sum())))
                continue
        tokens.append(int(rng.integers(vocab)))
    return tokens


SAMPLED_OPTIONS = [options for options in SWEPT_OPTIONS if options["temperature"] > 0]


@pytest.mark.parametrize(("vocab", "cases"), [(1, 12), (2, 24), (7, 48), (1000, 48), (4099, 36)])
def test_sampled_walk_matches_the_reference_up_to_float_near_ties(gpu, registry, rng, vocab, cases):
    verifier = Verifier(gpu, registry, vocab)
    names = sorted(TREES)
    unsure = 0
    for case in range(cases):
        options = SAMPLED_OPTIONS[case % len(SAMPLED_OPTIONS)]
        params = SamplingParams(**options)
        parents = TREES[names[case % len(names)]]
        logits = (rng.standard_normal((len(parents) + 1, vocab)) * rng.uniform(0.5, 3.0)).astype(np.float32)
        if case % 3 == 2:  # a coarse grid: ties at the maximum and at every cut
            logits = np.round(logits * 2) / 2
        tokens = sampled_tokens(rng, logits, parents, params)
        u, u_final = rng.random(len(parents)).astype(np.float32), float(np.float32(rng.random()))
        accepted, rows, final, status = verifier.run(registry, logits, tokens, parents, params, u, u_final)
        allowed = allowed_walks(logits, tokens, parents, u, u_final, params)
        if allowed is None or len(allowed) > 1:
            unsure += 1
        assert allowed is None or (tuple(rows), final) in allowed, (case, options, rows, final, allowed)
        assert accepted == [tokens[r] for r in rows] and rows == path_rows(parents, rows[-1]) if rows else True
        assert 0 <= final < vocab
        assert status == 0
    assert unsure <= max(2, 0.2 * cases)


def test_a_sampled_draft_token_outside_the_vocabulary_is_never_accepted_and_flagged(gpu, registry, rng):
    verifier = Verifier(gpu, registry, 50)
    logits = rng.standard_normal((3, 50)).astype(np.float32)
    params = SamplingParams(temperature=1.0)
    _, rows, final, status = verifier.run(registry, logits, [0, 50, 7], [-1, -1], params, [0.0, 1.0], 0.3)
    assert rows == [] and status == STATUS_DRAFT_TOKEN_OUT_OF_RANGE and final != 7
    assert (rows, final) == sampled_walk(logits, [0, 50, 7], [-1, -1], [0.0, 1.0], 0.3, params)[1:]


def test_a_residual_without_mass_falls_back_to_the_row(gpu, registry):
    # Top-k 2 keeps tokens 3 and 4; both are children and both rejected (u = 1): nothing is left, so the final
    # token is drawn from p itself, as the reference does.
    verifier = Verifier(gpu, registry, 8)
    logits = np.zeros((3, 8), np.float32)
    logits[0, [3, 4]] = 5.0
    params = SamplingParams(temperature=1.0, top_k=2)
    got = verifier.run(registry, logits, [0, 3, 4], [-1, -1], params, [1.0, 1.0], 0.75)
    assert got[:3] == ([], [], 4) == sampled_walk(logits, [0, 3, 4], [-1, -1], [1.0, 1.0], 0.75, params)


class TreeTrials:
    """`size` TreeVerify ops over one shared tree (logits, tokens, layout), each with its own randoms and result
    in a slot of two shared buffers: one submit runs `size` independent trials, one readback returns them."""

    SLOT = 128  # words per trial: the largest result (65 words), rounded to the 256-byte offset alignment

    def __init__(self, gpu, registry, logits: np.ndarray, tokens: list[int], parents: list[int], size: int):
        rows, vocab = logits.shape
        self.registry, self.rows, self.size = registry, rows, size
        shared = (
            Tensor.from_numpy(gpu, logits.astype(np.float32)),
            Tensor.from_numpy(gpu, np.asarray(tokens, np.uint32)),
            Tensor.from_numpy(gpu, layout_words(parents)),
        )
        self.randoms = Tensor.empty(gpu, (size, self.SLOT))
        self.results = Tensor.empty(gpu, (size, self.SLOT), "u32")
        nbytes = 4 * self.SLOT
        self.ops = [
            TreeVerify(
                registry,
                *shared,
                self.randoms.view((self.SLOT,), offset_bytes=j * nbytes),
                self.results.view((self.SLOT,), offset_bytes=j * nbytes),
                vocab=vocab,
            )
            for j in range(size)
        ]

    def run(self, rng, params: SamplingParams) -> np.ndarray:
        """The results [size, SLOT] of `size` trials with fresh uniforms."""
        self.randoms.write(rng.random((self.size, self.SLOT)).astype(np.float32))
        rec = self.registry.recorder()
        for op in self.ops:
            op.record(rec, self.rows, params)
        rec.submit()
        return self.results.numpy()


# Root children: tokens 3, 7, 5 (rows 1, 4, 6); row 1 has children 2, 9 (rows 2, 3); row 4 has child 3 (row 5).
DIST_PARENTS = [-1, 0, 0, -1, 3, -1]
DIST_TOKENS = [0, 3, 2, 9, 7, 3, 5]


def test_sampled_tree_tokens_follow_the_target_distribution(gpu, registry, rng):
    """The first emitted token must follow row 0's distribution, and after accepting root child row 1 or row 4
    the next token must follow that row's: the walk keeps the target's sampling at every depth. Top-k and top-p
    rows are held to the reference walk exactly (test_sampled_walk_matches_the_reference_up_to_float_near_ties),
    and the reference walk to the distribution under each filter (tests/test_tree_reference.py)."""
    vocab, batch, submits = 12, 256, 32
    params = SamplingParams(temperature=1.0)
    logits = rng.standard_normal((len(DIST_TOKENS), vocab)) * 1.5
    logits[0, [3, 7]] = logits[0].max() + 1.0  # likely root candidates, so every branch is taken often
    trials = TreeTrials(gpu, registry, logits, DIST_TOKENS, DIST_PARENTS, batch)
    first = np.zeros(vocab)
    after = {row: np.zeros(vocab) for row in (1, 4)}
    for _ in range(submits):
        for result in trials.run(rng, params):
            n = int(result[0])
            emitted = [*result[3 : 3 + 2 * n : 2], int(result[1])]
            first[emitted[0]] += 1
            if n and int(result[4]) in after:
                after[int(result[4])][emitted[1]] += 1
    assert_samples_follow(first, filtered_probs(logits[0].astype(np.float32), params), rng=rng)
    for row, counts in after.items():
        assert counts.sum() > 2000, f"row {row} was accepted too rarely to test"
        assert_samples_follow(counts, filtered_probs(logits[row].astype(np.float32), params), rng=rng)
    for op in trials.ops:
        op.release(registry)


@pytest.mark.parametrize("tree", ["two-branches", "deep-and-wide", "widest"])
@pytest.mark.parametrize("row_floats", [4, 192, 260])
def test_compaction_moves_every_layers_accepted_rows_into_place(gpu, registry, rng, tree, row_floats):
    parents = TREES[tree]
    layers, max_seq, start_pos = 3, 80, 41
    data = [rng.standard_normal((2, max_seq, row_floats)).astype(np.float32) for _ in range(layers)]
    caches = [(Tensor.from_numpy(gpu, d[0]), Tensor.from_numpy(gpu, d[1])) for d in data]
    op = KVCompact(registry, caches, row_floats=row_floats)
    for leaf in range(1, len(parents) + 1):
        for (k, v), d in zip(caches, data, strict=True):
            k.write(d[0])
            v.write(d[1])
        moves = compaction_moves(path_rows(parents, leaf))
        rec = registry.recorder()
        op.record(rec, start_pos, moves)
        rec.submit()
        for (k, v), d in zip(caches, data, strict=True):
            np.testing.assert_array_equal(k.numpy(), apply_moves(d[0], start_pos, moves))
            np.testing.assert_array_equal(v.numpy(), apply_moves(d[1], start_pos, moves))
    op.release(registry)


def test_a_path_along_the_first_chain_needs_no_move():
    assert compaction_moves([1, 2, 3]) == []
    assert compaction_moves([1, 4, 5]) == [(4, 2), (5, 3)]


# -- a greedy drafter's branches ------------------------------------------------------------------------------
@pytest.mark.parametrize(("vocab", "count"), [(1, 1), (1, 4), (5, 3), (5, 8), (300, 2), (4099, 8), (4099, 32)])
def test_top_tokens_are_the_largest_logits_in_order_with_ties_to_the_lowest_index(gpu, registry, rng, vocab, count):
    rows = 5
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    logits[1] = np.round(logits[1])  # many ties
    logits[2, rng.random(vocab) < 0.5] = -np.inf
    logits[3, rng.random(vocab) < 0.3] = np.nan
    logits[4] = -np.inf
    source = Tensor.from_numpy(gpu, logits)
    out = Tensor.empty(gpu, rows * count, "u32")
    op = TopTokens(registry, source, out, vocab=vocab, max_rows=rows, count=count)
    rec = registry.recorder()
    op.record(rec, rows)
    rec.submit()
    np.testing.assert_array_equal(out.numpy().reshape(rows, count), top_tokens(logits, count))
    op.release(registry)


def test_top_tokens_refuses_counts_and_rows_it_cannot_take(gpu, registry):
    logits, out = Tensor.empty(gpu, (2, 8)), Tensor.empty(gpu, 2 * MAX_TOP_TOKENS, "u32")
    with pytest.raises(ValueError, match="count"):
        TopTokens(registry, logits, out, vocab=8, max_rows=2, count=MAX_TOP_TOKENS + 1)
    with pytest.raises(ValueError, match="out_ids"):
        TopTokens(registry, logits, Tensor.empty(gpu, 3, "u32"), vocab=8, max_rows=2, count=2)
    op = TopTokens(registry, logits, out, vocab=8, max_rows=2, count=2)
    with pytest.raises(ValueError, match="rows"):
        op.record(registry.recorder(), 3)
    op.release(registry)
