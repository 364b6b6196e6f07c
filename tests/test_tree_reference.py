"""The sampled token-tree verification contract (doppler_py/testing/tree_reference.py, `sampled_walk`) keeps
the target's distribution: the first emitted token follows row 0's filtered distribution, and after an
accepted child the next token follows that child's row. Chi-square per case (`assert_samples_follow`)."""

from __future__ import annotations

import numpy as np
import pytest
from support.distribution import assert_samples_follow

from doppler_py.sampling import SamplingParams
from doppler_py.testing.sampling_reference import filtered_probs
from doppler_py.testing.tree_reference import greedy_walk, sampled_walk

VOCAB = 12
# Root children: tokens 3, 7, 5 (rows 1, 4, 6); row 1 has children 2, 9 (rows 2, 3); row 4 has child 3 (row 5).
PARENTS = [-1, 0, 0, -1, 3, -1]
TOKENS = [0, 3, 2, 9, 7, 3, 5]
TRIALS = 6000


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=6),
        SamplingParams(temperature=1.3, top_p=0.8),
    ],
    ids=["t1", "t0.7-topk6", "t1.3-topp0.8"],
)
def test_sampled_tree_walk_keeps_the_targets_distribution(params):
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((len(TOKENS), VOCAB)) * 1.5
    logits[0, [3, 7]] = logits[0].max() + 0.5  # likely root candidates, so every branch is taken often
    first = np.zeros(VOCAB)
    after = {row: np.zeros(VOCAB) for row in (1, 4)}  # the token after accepting root child row 1 or row 4
    for _ in range(TRIALS):
        u = rng.random(len(PARENTS))
        accepted, rows, final = sampled_walk(logits, TOKENS, PARENTS, u, rng.random(), params)
        emitted = [*accepted, final]
        first[emitted[0]] += 1
        if rows and rows[0] in after:
            after[rows[0]][emitted[1]] += 1
    assert_samples_follow(first, filtered_probs(logits[0].astype(np.float32), params), rng=rng)
    for row, counts in after.items():
        assert counts.sum() > 300, f"row {row} was accepted too rarely to test"
        assert_samples_follow(counts, filtered_probs(logits[row].astype(np.float32), params), rng=rng)


def test_sampled_walk_is_the_greedy_walk_at_temperature_zero():
    rng = np.random.default_rng(3)
    for _ in range(50):
        logits = rng.standard_normal((len(TOKENS), VOCAB))
        tokens = [0, *rng.integers(0, VOCAB, len(PARENTS)).tolist()]
        tokens[1] = int(np.argmax(logits[0]))
        got = sampled_walk(logits, tokens, PARENTS, rng.random(len(PARENTS)), rng.random(), SamplingParams())
        assert got == greedy_walk(logits.astype(np.float32), tokens, PARENTS)
