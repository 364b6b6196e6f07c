"""Penalties, logit bias and min-p (shaders/penalties.wgsl, shaders/min_p.wgsl) vs their numpy reference
(`doppler_py.testing.penalty_reference`), in place on a step's rows.

Each row r of a step is penalised after the committed context plus the drafts on its own path (a chain's rows
1..r, a tree row's ancestors), which is how the reference is called here: one row at a time, with the path's
tokens appended to the context. Tolerance: at most 1 ulp per logit (a device may fuse frequency * count into the
subtraction); min-p's kept sets exactly (both sides compare with one f32 threshold). Vocabularies of 1, 37 and 300
(no multiple of the workgroup size), -inf, +inf and NaN logits, ties at the max, drafts repeating committed tokens
and each other, a bias on a token nobody generated, and windows shorter than a path.
"""

from __future__ import annotations

import numpy as np
import pytest

from doppler_py.gpu.tensor import Tensor
from doppler_py.ops.penalties import Penalties
from doppler_py.ops.tree import layout_words
from doppler_py.sampling import SamplingParams
from doppler_py.testing.penalty_reference import min_p_filter, penalize


def path_rows(parents: list[int] | None, rows: int) -> list[list[int]]:
    """Per row, the rows of its path (ancestors and itself, the root excluded), in row order."""
    parents = list(range(-1, rows - 2)) if parents is None else parents
    paths = [[]]
    for i, parent in enumerate(parents):
        paths.append([*paths[parent + 1], i + 1])
    return paths


def run(registry, gpu, logits, context, n_prompt, drafts, parents, params):
    rows, vocab = logits.shape
    tensor = Tensor.from_numpy(gpu, logits)
    tokens = Tensor.from_numpy(gpu, np.array([context[-1], *drafts, *([0] * (32 - 1 - len(drafts)))], np.uint32))
    layout_array = np.zeros((32, 2), np.uint32)
    if parents is not None:
        layout_array[:rows] = layout_words(parents)
    layout = Tensor.from_numpy(gpu, layout_array)
    op = Penalties(registry, params, context[:n_prompt], vocab=vocab, logits=tensor, tokens=tokens, layout=layout)
    try:
        op.update(context)
        rec = registry.recorder()
        op.record_penalties(rec, rows, tree=parents is not None)
        op.record_min_p(rec, rows)
        rec.submit()
        return tensor.numpy().reshape(rows, vocab)
    finally:
        op.release()
        registry.release_tensors(tensor, tokens, layout)


def reference(logits, context, n_prompt, drafts, parents, params):
    out = []
    for r, path in enumerate(path_rows(parents, logits.shape[0])):
        row_context = [*context, *(drafts[j - 1] for j in path)]
        out.append(min_p_filter(penalize(logits[r], row_context, n_prompt, params), params))
    return np.stack(out)


def assert_within_an_ulp(got, want):
    assert np.array_equal(np.isnan(got), np.isnan(want))
    finite = ~np.isnan(want)
    assert np.array_equal(np.isinf(got[finite]), np.isinf(want[finite]))
    assert np.array_equal(got[np.isinf(want)], want[np.isinf(want)])
    both = np.isfinite(want)
    np.testing.assert_array_max_ulp(got[both], want[both], maxulp=1)


def awkward_logits(rng, rows, vocab):
    logits = rng.normal(0, 3, size=(rows, vocab)).astype(np.float32)
    if vocab > 5:
        logits[0, 1] = -np.inf
        logits[1 % rows, 2] = np.nan
        logits[:, 3] = logits[:, 4] = logits.max() + 1  # ties at the max
        logits[:, 5] = 0.0
    return logits


PARAMS = [
    SamplingParams(temperature=1.0, frequency_penalty=0.7, presence_penalty=-0.4),
    SamplingParams(temperature=0.8, repetition_penalty=1.3, repeat_last_n=5, logit_bias={7: 3.0, 0: -100.0}),
    SamplingParams(temperature=1.5, repetition_penalty=0.7, repeat_last_n=-1, frequency_penalty=-2.0, min_p=0.2),
    SamplingParams(temperature=0.0, presence_penalty=2.0, logit_bias={5: 100.0}, min_p=0.5),  # greedy: no min-p
    SamplingParams(temperature=2.0, min_p=1.0),  # min-p alone: only the ties at the max stay
]
TREE = [-1, 0, 0, 1, -1, 4, 2]  # rows 1..7: two roots, a repeated token on one path


@pytest.mark.parametrize("vocab", [37, 300])
@pytest.mark.parametrize("shape", ["plain", "chain", "tree"])
@pytest.mark.parametrize("p", range(len(PARAMS)))
def test_penalties_match_the_reference_per_row_with_its_paths_drafts(registry, gpu, vocab, shape, p):
    rng = np.random.default_rng(vocab * 10 + p)
    params = PARAMS[p]
    prompt = [int(t) for t in rng.integers(0, vocab, 9)]
    generated = [int(t) for t in rng.integers(0, min(vocab, 12), 14)]
    context = prompt + generated
    parents = {"plain": None, "chain": None, "tree": TREE}[shape]
    n = {"plain": 0, "chain": 6, "tree": len(TREE)}[shape]
    drafts = [int(t) for t in rng.integers(0, min(vocab, 12), n)]
    if n:
        drafts[-1] = drafts[0] = generated[-1]  # drafts repeating a committed token and each other
    logits = awkward_logits(rng, n + 1, vocab)
    got = run(registry, gpu, logits, context, len(prompt), drafts, parents, params)
    want = reference(logits, context, len(prompt), drafts, parents, params)
    assert_within_an_ulp(got, want)
    assert not np.array_equal(np.nan_to_num(want), np.nan_to_num(logits)), "the case changes nothing"


def test_the_longest_chain_penalises_its_last_rows_after_every_draft(registry, gpu):
    """31 drafts, a path for every row up to the 32 rows a step has: longer than any SIMD group a CPU adapter runs
    a workgroup's invocations in (lavapipe's 16 at 512 bits, SwiftShader's 4), so that an invocation clearing the
    workgroup's path after it was written would leave late rows without their last drafts."""
    rng = np.random.default_rng(31)
    vocab, params = 300, SamplingParams(temperature=1.0, frequency_penalty=0.7, presence_penalty=-0.4)
    context = [int(t) for t in rng.integers(0, vocab, 12)]
    fresh = [int(t) for t in rng.permutation(vocab) if t not in context]  # path tokens only: no entry holds them
    drafts = fresh[:28] + fresh[:3]  # three repeats at the end
    logits = rng.normal(0, 3, size=(len(drafts) + 1, vocab)).astype(np.float32)
    got = run(registry, gpu, logits, context, 4, drafts, None, params)
    assert_within_an_ulp(got, reference(logits, context, 4, drafts, None, params))


def test_a_vocabulary_of_one_token(registry, gpu):
    params = SamplingParams(temperature=1.0, frequency_penalty=1.0, repetition_penalty=2.0, min_p=0.9)
    logits = np.array([[3.0], [-2.0], [np.inf]], np.float32)
    got = run(registry, gpu, logits, [0, 0, 0], 1, [0, 0], None, params)
    assert_within_an_ulp(got, reference(logits, [0, 0, 0], 1, [0, 0], None, params))
    np.testing.assert_array_equal(got[2], [np.inf])  # +inf is left for the verifier to report


def test_min_p_keeps_exactly_the_tokens_at_least_min_p_as_likely_as_the_likeliest(registry, gpu):
    """Away from the rounding of the offset, the kept set is {p >= min_p * p_max} after temperature."""
    params = SamplingParams(temperature=2.0, min_p=0.3)
    logits = np.array([[0.0, 2.0, 2.0 * np.log(0.29) + 2.0, 2.0 * np.log(0.31) + 2.0, -np.inf, -50.0]], np.float32)
    got = run(registry, gpu, logits, [1], 1, [], None, params)
    kept = np.isfinite(got[0])
    assert kept.tolist() == [True, True, False, True, False, False]
    np.testing.assert_array_equal(got[0, kept], logits[0, kept])


def test_entries_grow_past_the_first_buffer(registry, gpu):
    """An answer with more distinct tokens than the first entries buffer holds (256) gets a larger one."""
    vocab = 700
    params = SamplingParams(temperature=1.0, frequency_penalty=0.5)
    rng = np.random.default_rng(3)
    context = [1, 2] + list(range(vocab)) + [int(t) for t in rng.integers(0, vocab, 50)]
    logits = rng.normal(size=(3, vocab)).astype(np.float32)
    got = run(registry, gpu, logits, context, 2, [5, 5], None, params)
    assert_within_an_ulp(got, reference(logits, context, 2, [5, 5], None, params))


def draft_penalties(registry, gpu, params, prompt, vocab):
    """A generation's penalties whose verification buffers stay unused (only a drafter's rows are changed), and the
    drafter's row and drafts buffers, kept across calls as a drafter keeps them."""
    buffers = (
        Tensor.empty(gpu, (32, vocab), "f32"),
        Tensor.empty(gpu, (32,), "u32"),
        Tensor.from_numpy(gpu, np.zeros((32, 2), np.uint32)),
        Tensor.empty(gpu, (1, vocab), "f32"),
        Tensor.empty(gpu, (16,), "u32"),
    )
    logits, tokens, layout = buffers[:3]
    return Penalties(registry, params, prompt, vocab=vocab, logits=logits, tokens=tokens, layout=layout), buffers


def run_draft_rows(registry, op, buffers, logits, drafts):
    """Each logits row i as the drafter's row for its draft i (one submit per draft, as drafters do), after `drafts`."""
    row, draft_tokens = buffers[3:]
    draft_tokens.view((len(drafts),)).write(np.array(drafts, np.uint32))
    out = []
    for i in range(logits.shape[0]):
        row.write(logits[i : i + 1])
        rec = registry.recorder()
        op.record_draft(rec, row, draft_tokens, i)
        rec.submit()
        out.append(row.numpy().reshape(logits.shape[1]))
    return np.stack(out)


@pytest.mark.parametrize("vocab", [37, 300])
@pytest.mark.parametrize("p", range(len(PARAMS)))
def test_a_drafters_row_for_draft_i_is_changed_as_the_targets_row_i_will_be(registry, gpu, vocab, p):
    """`record_draft`: the row a drafter samples draft i from, penalised after the committed tokens and drafts
    0..i-1, then min-p filtered: the reference's chain row i."""
    rng = np.random.default_rng(vocab * 7 + p)
    params = PARAMS[p]
    prompt = [int(t) for t in rng.integers(0, vocab, 9)]
    context = prompt + [int(t) for t in rng.integers(0, min(vocab, 12), 14)]
    drafts = [int(t) for t in rng.integers(0, min(vocab, 12), 5)]
    drafts[3] = drafts[1]
    logits = awkward_logits(rng, len(drafts) + 1, vocab)
    op, buffers = draft_penalties(registry, gpu, params, prompt, vocab)
    try:
        op.update(context)
        got = run_draft_rows(registry, op, buffers, logits, drafts)
    finally:
        op.release()
        registry.release_tensors(*buffers)
    assert_within_an_ulp(got, reference(logits, context, len(prompt), drafts, None, params))


def test_a_drafters_rows_follow_the_entries_when_they_grow(registry, gpu):
    """The drafter's bindings read the entries buffer a longer answer grows into, not the one it replaced."""
    vocab = 700
    params = SamplingParams(temperature=1.0, frequency_penalty=0.5, presence_penalty=0.25)
    rng = np.random.default_rng(5)
    prompt = [1, 2]
    logits = rng.normal(size=(3, vocab)).astype(np.float32)
    op, buffers = draft_penalties(registry, gpu, params, prompt, vocab)
    try:
        for context in ([*prompt, 3, 4], [*prompt, 3, 4, *range(vocab), 9, 9]):  # 2 entries, then 700 (grown)
            op.update(context)
            got = run_draft_rows(registry, op, buffers, logits, [9, 9])
            assert_within_an_ulp(got, reference(logits, context, 2, [9, 9], None, params))
    finally:
        op.release()
        registry.release_tensors(*buffers)
