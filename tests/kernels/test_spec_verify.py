"""GPU verification of a speculative step (`SpecVerify`, `shaders/sample.wgsl` spec_*) against the numpy reference
in `doppler_py.testing.verify_reference`, and statistically against the target distribution itself.

Tolerance. Greedy decisions and top-k sets are decided on integer keys of the logits, so they must match
exactly. The rest compares float quantities with a threshold, computed in float32 on the GPU (with WGSL's
`exp` and division a few ulp off) and in float64 in the reference:
* the accept test u * q(d) < p(d): p(d) and q(d) are each a weight over a sum, off by ~1e-6 relatively, so
  a u within MARGIN = 1e-5 (relative) of the boundary p/q may be decided either way;
* the final draw: running masses of normalised distributions (total 1) are off by ~1e-6 absolutely, so a
  goal u * R (R the residual's mass) within MARGIN of a CDF step may land either side;
* top-p's cut, as in tests/kernels/test_sample.py: a kept mass within MARGIN of its target may keep one
  logit value more or less; such a case is accepted whatever valid answer it gives.
`allowed_outcomes` lists every (n, token) those margins allow; the tests count the cases with more than one
and require them to be rare, so the comparison stays strict.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from support.distribution import assert_histograms_converge, total_variation
from support.float_margins import MARGIN, SWEPT_OPTIONS, draws, less_than_decisions, top_p_near_tie

from doppler_py.errors import GenerationOptionError
from doppler_py.gpu.tensor import Tensor
from doppler_py.ops.speculative import (
    STATUS_DRAFT_NONFINITE,
    STATUS_DRAFT_TOKEN_OUT_OF_RANGE,
    STATUS_TARGET_NONFINITE,
    SpecVerify,
    result_size,
)
from doppler_py.sampling import SamplingParams
from doppler_py.testing.sampling_reference import clean_logits, filtered_probs
from doppler_py.testing.verify_reference import residual, verify_reference

INF = np.inf


@dataclass
class Step:
    """One speculative step's inputs, as the host uploads them."""

    target: np.ndarray  # f32 [k+1, vocab]
    draft: np.ndarray  # f32 [k, vocab]
    drafts: np.ndarray  # d_0..d_{k-1}
    randoms: np.ndarray  # f32 [2k+1]; [k:2k] test the drafts, [2k] is the final draw

    @property
    def k(self) -> int:
        return len(self.drafts)


class Verifier:
    """A SpecVerify op over its own buffers; `run` uploads one step, submits and returns `result[:k+3]`."""

    def __init__(self, gpu, registry, vocab: int, max_k: int):
        self.registry = registry
        self.target = Tensor.empty(gpu, (max_k + 1, vocab))
        self.draft = Tensor.empty(gpu, (max_k, vocab))
        self.tokens = Tensor.empty(gpu, max_k + 1, "u32")
        self.randoms = Tensor.empty(gpu, 2 * max_k + 1)
        self.result = Tensor.empty(gpu, result_size(max_k), "u32")
        self.op = SpecVerify(
            registry, self.target, self.draft, self.tokens, self.randoms, self.result, vocab=vocab, max_k=max_k
        )
        self.vocab, self.max_k = vocab, max_k

    def run(self, step: Step, **options) -> np.ndarray:
        k = step.k
        target = np.zeros((self.max_k + 1, self.vocab), np.float32)
        target[: k + 1] = step.target
        draft = np.zeros((self.max_k, self.vocab), np.float32)
        draft[:k] = step.draft
        self.target.write(target)
        self.draft.write(draft)
        self.tokens.write(np.concatenate([[7], step.drafts, np.zeros(self.max_k - k)]).astype(np.uint32))
        self.randoms.write(np.concatenate([step.randoms, np.zeros(2 * (self.max_k - k))]).astype(np.float32))
        rec = self.registry.recorder()
        self.op.record(rec, k, **options)
        rec.submit()
        return self.result.numpy()[: k + 3]


# -- which outcomes float rounding allows ----------------------------------------------------------------------
def accept_decisions(p: np.ndarray, q: np.ndarray | None, token: int, u: float) -> set[bool]:
    if not 0 <= token < p.size:
        return {False}
    return less_than_decisions(u * (1.0 if q is None else q[token]), p[token])


def final_draws(p: np.ndarray, q: np.ndarray | None, token: int, u: float) -> set[int]:
    r = residual(p, q, token)
    mass = r.sum()
    picks = draws(r, u) if mass > 0 else set()
    if mass < MARGIN:  # the GPU's residual may be empty where the reference's is not, or the other way
        picks |= draws(p, u)
    return picks


def allowed_outcomes(step: Step, params: SamplingParams, onehot: bool) -> set[tuple[int, int]] | None:
    """Every (n, final token) the margins allow; None when top-p's kept set itself is unsure."""
    k = step.k
    rows = [*step.target, *([] if onehot or params.greedy else step.draft)]
    if any(top_p_near_tie(row, params) for row in rows):
        return None
    if params.greedy:
        return {verify_reference(step.target, None, step.drafts, step.randoms[k : 2 * k], 0.0, params)}
    u_final = float(step.randoms[2 * k])
    outcomes = set()
    for i in range(k + 1):
        p = filtered_probs(step.target[i], params)
        if i == k:
            outcomes |= {(k, t) for t in draws(p, u_final)}
            break
        q = None if onehot else filtered_probs(step.draft[i], params)
        decisions = accept_decisions(p, q, int(step.drafts[i]), float(step.randoms[k + i]))
        if False in decisions:
            outcomes |= {(i, t) for t in final_draws(p, q, int(step.drafts[i]), u_final)}
        if True not in decisions:
            break
    return outcomes


# -- random steps -------------------------------------------------------------------------------------------
def random_logits(rng, rows: int, vocab: int, style: str) -> np.ndarray:
    x = rng.standard_normal((rows, vocab)) * rng.uniform(0.5, 3.0)
    if style == "ties":  # a coarse grid: many equal logits, at the maximum and at every cut
        x = np.round(x * 2) / 2
    elif style == "minus-inf":
        x[rng.random(x.shape) < 0.3] = -INF
    return x.astype(np.float32)


def random_step(rng, vocab: int, k: int, params: SamplingParams, onehot: bool) -> Step:
    style = rng.choice(["plain", "ties", "minus-inf"])
    target = random_logits(rng, k + 1, vocab, style)
    # The draft is the target plus noise of a random size, so every acceptance rate shows up.
    noise = rng.choice([0.0, 0.3, 1.0, 3.0]) * rng.standard_normal((k, vocab))
    draft = np.where(np.isfinite(target[:k]), target[:k] + noise, target[:k]).astype(np.float32)
    drafts = []
    for i in range(k):
        source = rng.choice(["proposal", "argmax", "uniform"], p=[0.6, 0.25, 0.15])
        if source == "argmax":
            drafts.append(int(np.argmax(clean_logits(target[i]))))
        elif source == "uniform":
            drafts.append(int(rng.integers(vocab)))
        else:  # what a real drafter proposes: a draw from q (from p for a deterministic drafter)
            proposal = filtered_probs(target[i] if onehot else draft[i], params)
            drafts.append(int(rng.choice(vocab, p=proposal)))
    return Step(target, draft, np.array(drafts), rng.random(2 * k + 1).astype(np.float32))


OPTIONS = SWEPT_OPTIONS


@pytest.mark.parametrize(("vocab", "steps"), [(1, 14), (2, 28), (7, 56), (1000, 70), (4099, 56)])
def test_each_step_matches_the_reference_up_to_float_near_ties(gpu, registry, rng, vocab, steps):
    verifier = Verifier(gpu, registry, vocab, max_k=8)
    unsure = 0
    for case in range(steps):
        options = OPTIONS[case % len(OPTIONS)]
        onehot = bool(case // len(OPTIONS) % 2)
        params = SamplingParams(**options)
        step = random_step(rng, vocab, int(rng.integers(1, 9)), params, onehot)
        got = verifier.run(step, onehot=onehot, **options)
        allowed = allowed_outcomes(step, params, onehot)
        n, token = int(got[0]), int(got[1])
        assert 0 <= token < vocab and 0 <= n <= step.k
        if allowed is None or len(allowed) > 1:
            unsure += 1
        assert allowed is None or (n, token) in allowed, (case, options, onehot, (n, token), allowed)
        assert got[2] == 0
        np.testing.assert_array_equal(got[3:], step.drafts)
    # A draw is unsure when u * mass lies within MARGIN of one of the CDF's steps: for a flat 4099-token row,
    # 4099 * 2 * MARGIN ~ 8% of the u range; top-p cuts add about as much. Peaked rows have far fewer.
    assert unsure <= max(2, 0.15 * steps)


@pytest.mark.parametrize("options", [{"temperature": 0.0}, {"temperature": 1.0, "top_k": 50}])
def test_a_49152_token_vocabulary_matches_the_reference(gpu, registry, rng, options):
    vocab, k = 49152, 4
    params = SamplingParams(**options)
    verifier = Verifier(gpu, registry, vocab, max_k=k)
    step = random_step(rng, vocab, k, params, onehot=False)
    got = verifier.run(step, **options)
    assert (int(got[0]), int(got[1])) in allowed_outcomes(step, params, onehot=False)


# -- the distribution of the emitted tokens ---------------------------------------------------------------
class TrialBatch:
    """`size` SpecVerify ops over one shared pair of logits, each with its own drafts, randoms and result in a
    256-byte slot of three shared buffers: one submit runs `size` independent trials and one readback returns
    them all."""

    SLOT = 64  # u32 / f32 words per trial: the storage offset alignment of 256 bytes

    def __init__(self, gpu, registry, target: np.ndarray, draft: np.ndarray, size: int):
        k, vocab = draft.shape
        self.registry, self.k, self.size = registry, k, size
        shared_target, shared_draft = Tensor.from_numpy(gpu, target), Tensor.from_numpy(gpu, draft)
        self.tokens = Tensor.empty(gpu, (size, self.SLOT), "u32")
        self.randoms = Tensor.empty(gpu, (size, self.SLOT))
        self.results = Tensor.empty(gpu, (size, self.SLOT), "u32")
        nbytes = 4 * self.SLOT
        self.ops = [
            SpecVerify(
                registry,
                shared_target,
                shared_draft,
                self.tokens.view((k + 1,), offset_bytes=j * nbytes),
                self.randoms.view((2 * k + 1,), offset_bytes=j * nbytes),
                self.results.view((result_size(k),), offset_bytes=j * nbytes),
                vocab=vocab,
                max_k=k,
            )
            for j in range(size)
        ]

    def run(self, drafts: np.ndarray, randoms: np.ndarray, **options) -> np.ndarray:
        """drafts [size, k], randoms [size, 2k+1] → the results [size, k+3]."""
        tokens = np.zeros((self.size, self.SLOT), np.uint32)
        tokens[:, 1 : self.k + 1] = drafts
        slots = np.zeros((self.size, self.SLOT), np.float32)
        slots[:, : 2 * self.k + 1] = randoms
        self.tokens.write(tokens)
        self.randoms.write(slots)
        rec = self.registry.recorder()
        for op in self.ops:
            op.record(rec, self.k, **options)
        rec.submit()
        return self.results.numpy()[:, : self.k + 3]


def emitted_tokens(results: np.ndarray) -> list[np.ndarray]:
    """Each step's emitted tokens: its n accepted drafts, then its final token."""
    return [np.append(r[3 : 3 + r[0]], r[1]) for r in results]


STATISTICAL_CASES = [
    pytest.param({"temperature": 1.0}, False, 32, id="draft-T1"),
    pytest.param({"temperature": 0.7, "top_k": 15, "top_p": 0.9}, False, 12, id="draft-T0.7-topk-topp"),
    pytest.param({"temperature": 0.7, "top_k": 15, "top_p": 0.9}, True, 12, id="onehot-T0.7-topk-topp"),
]


@pytest.mark.parametrize(("options", "onehot", "submits"), STATISTICAL_CASES)
def test_the_first_emitted_token_follows_the_target_distribution(gpu, registry, rng, options, onehot, submits):
    # 256 trials per submit; filtered rows cost ~4x more kernel time, hence fewer submits there.
    vocab, batch = 24, 256
    params = SamplingParams(**options)
    target = (rng.standard_normal((2, vocab)) * 1.5).astype(np.float32)
    draft = (rng.standard_normal((1, vocab)) * 1.5).astype(np.float32)
    p, q = filtered_probs(target[0], params), filtered_probs(draft[0], params)
    assert total_variation(q, p) > 0.3  # the draft alone would fail the test below
    trials = TrialBatch(gpu, registry, target, draft, batch)
    first = []
    for _ in range(submits):
        # One-hot mode: proposals come from anywhere (prompt lookup), here uniformly, even outside p's support.
        drafts = rng.integers(vocab, size=(batch, 1)) if onehot else rng.choice(vocab, size=(batch, 1), p=q)
        results = trials.run(drafts, rng.random((batch, 3)), onehot=onehot, **options)
        first.append(np.where(results[:, 0] == 1, results[:, 3], results[:, 1]))
    assert_histograms_converge(np.concatenate(first), p, rng)


def test_every_emitted_token_of_multi_token_steps_follows_the_target_distribution(gpu, registry, rng):
    # Rows that ignore their context make the target's output i.i.d. draws from one p, so every token of
    # every step (accepted drafts, residual and bonus draws alike) must follow p.
    vocab, k, batch, submits = 16, 4, 64, 20
    options = {"temperature": 0.8, "top_k": 12}
    params = SamplingParams(**options)
    row = (rng.standard_normal(vocab) * 1.5).astype(np.float32)
    draft_row = (row + 0.7 * rng.standard_normal(vocab)).astype(np.float32)
    p, q = filtered_probs(row, params), filtered_probs(draft_row, params)
    trials = TrialBatch(gpu, registry, np.tile(row, (k + 1, 1)), np.tile(draft_row, (k, 1)), batch)
    emitted = []
    for _ in range(submits):
        results = trials.run(rng.choice(vocab, size=(batch, k), p=q), rng.random((batch, 2 * k + 1)), **options)
        emitted += emitted_tokens(results)
    samples = np.concatenate(emitted)
    assert samples.size > 2 * batch * submits  # steps emit several tokens: drafts were accepted
    assert_histograms_converge(samples, p, rng)


# -- greedy -------------------------------------------------------------------------------------------------
def tied_rows(rng, rows: int, vocab: int) -> np.ndarray:
    x = rng.standard_normal((rows, vocab)).astype(np.float32)
    for r in range(rows):  # the maximum appears three times; the lowest index is the argmax
        x[r, rng.choice(vocab, size=3, replace=False)] = 5.0
    return x


@pytest.mark.parametrize("onehot", [False, True])
def test_greedy_accepts_drafts_equal_to_the_target_argmax_and_adds_the_argmax_of_row_k(gpu, registry, rng, onehot):
    vocab, k = 1000, 6
    target = tied_rows(rng, k + 1, vocab)
    argmax = np.argmax(target, axis=1)
    step = Step(target, rng.standard_normal((k, vocab)).astype(np.float32), argmax[:k], rng.random(2 * k + 1))
    got = Verifier(gpu, registry, vocab, max_k=8).run(step, temperature=0.0, onehot=onehot)
    assert got[:3].tolist() == [k, argmax[k], 0]


@pytest.mark.parametrize("mismatch", [0, 2, 5])
def test_greedy_stops_at_the_first_mismatch_and_emits_that_rows_argmax(gpu, registry, rng, mismatch):
    vocab, k = 1000, 6
    target = tied_rows(rng, k + 1, vocab)
    argmax = np.argmax(target, axis=1)
    drafts = argmax[:k].copy()
    drafts[mismatch] = (drafts[mismatch] + 1) % vocab
    drafts[mismatch + 1 :] = (drafts[mismatch + 1 :] + 3) % vocab  # later rows do not matter
    step = Step(target, np.zeros((k, vocab), np.float32), drafts, rng.random(2 * k + 1))
    got = Verifier(gpu, registry, vocab, max_k=k).run(step, temperature=0.0)
    assert got[:3].tolist() == [mismatch, argmax[mismatch], 0]


def test_a_draft_equal_to_the_target_is_always_accepted(gpu, registry, rng):
    vocab, k = 4099, 5
    options = {"temperature": 0.9, "top_k": 100, "top_p": 0.95}
    target = random_logits(rng, k + 1, vocab, "plain")
    drafts = np.array([rng.choice(vocab, p=filtered_probs(target[i], SamplingParams(**options))) for i in range(k)])
    last_u = np.nextafter(np.float32(1.0), np.float32(0.0))
    step = Step(target, target[:k].copy(), drafts, np.full(2 * k + 1, last_u, np.float32))
    # p = q exactly (same logits, same arithmetic), so u < 1 = p/q accepts every draft.
    assert Verifier(gpu, registry, vocab, max_k=k).run(step, **options)[0] == k


def test_one_hot_mode_never_emits_the_rejected_draft_after_a_rejection(gpu, registry, rng):
    vocab, n = 50, 200
    target = random_logits(rng, 2, vocab, "plain")
    target[0, 3] = target[0].max() + 0.5  # the draft is the likeliest token, so both branches occur
    verifier = Verifier(gpu, registry, vocab, max_k=1)
    outcomes = []
    for u in (np.arange(n) + 0.5) / n:
        step = Step(target, np.zeros((1, vocab), np.float32), np.array([3]), np.array([0.0, u, 1 - u], np.float32))
        outcomes.append(tuple(verifier.run(step, temperature=1.0, onehot=True)[:2]))
    rejected = [token for accepted, token in outcomes if accepted == 0]
    assert 0 < len(rejected) < n
    assert 3 not in rejected


# -- status and range ------------------------------------------------------------------------------------
STATUS_CASES = [
    # (where, value, options, onehot, expected status)
    ("target", np.nan, {"temperature": 1.0}, False, STATUS_TARGET_NONFINITE),
    ("target", INF, {"temperature": 0.0}, False, STATUS_TARGET_NONFINITE),
    ("bonus", np.nan, {"temperature": 0.7, "top_k": 5}, True, STATUS_TARGET_NONFINITE),
    ("draft", np.nan, {"temperature": 1.0}, False, STATUS_DRAFT_NONFINITE),
    ("draft", INF, {"temperature": 0.5, "top_p": 0.9}, False, STATUS_DRAFT_NONFINITE),
    ("draft", np.nan, {"temperature": 0.0}, False, 0),  # greedy never reads the draft's logits
    ("draft", np.nan, {"temperature": 1.0}, True, 0),  # nor does one-hot mode
    ("target", -INF, {"temperature": 1.0}, False, 0),  # -inf is a valid logit
    ("draft", -INF, {"temperature": 1.0}, False, 0),
]


@pytest.mark.parametrize(("where", "value", "options", "onehot", "status"), STATUS_CASES)
def test_non_finite_logits_set_the_status_and_ids_stay_in_the_vocabulary(
    gpu, registry, rng, where, value, options, onehot, status
):
    vocab, k = 300, 3
    target = random_logits(rng, k + 1, vocab, "plain")
    draft = random_logits(rng, k, vocab, "plain")
    row = {"target": 1, "bonus": k, "draft": 2}[where]
    rows = draft if where == "draft" else target
    rows[row, rng.choice(vocab, size=4, replace=False)] = value
    step = Step(target, draft, rng.integers(vocab, size=k), rng.random(2 * k + 1).astype(np.float32))
    got = Verifier(gpu, registry, vocab, max_k=k).run(step, onehot=onehot, **options)
    assert got[2] == status
    assert 0 <= got[1] < vocab and 0 <= got[0] <= k


def test_rows_of_only_nan_still_give_a_valid_token(gpu, registry):
    vocab, k = 7, 2
    target = np.full((k + 1, vocab), np.nan, np.float32)
    step = Step(target, target[:k].copy(), np.array([0, 6]), np.full(2 * k + 1, 0.5, np.float32))
    for options in ({"temperature": 0.0}, {"temperature": 1.0}, {"temperature": 1.0, "top_p": 0.5}):
        got = Verifier(gpu, registry, vocab, max_k=k).run(step, **options)
        assert got[2] == STATUS_TARGET_NONFINITE | (0 if options["temperature"] == 0 else STATUS_DRAFT_NONFINITE)
        assert 0 <= got[1] < vocab


@pytest.mark.parametrize("options", [{"temperature": 0.0}, {"temperature": 1.0}])
def test_a_draft_token_outside_the_vocabulary_is_rejected_and_flagged(gpu, registry, rng, options):
    vocab, k = 100, 3
    target = random_logits(rng, k + 1, vocab, "plain")
    drafts = np.array([int(np.argmax(target[0])), vocab + 5, 2])
    step = Step(target, target[:k].copy(), drafts, np.zeros(2 * k + 1, np.float32))
    got = Verifier(gpu, registry, vocab, max_k=k).run(step, **options)
    assert got[0] == 1 and 0 <= got[1] < vocab
    assert got[2] == STATUS_DRAFT_TOKEN_OUT_OF_RANGE
    np.testing.assert_array_equal(got[3:], drafts)  # copied as given, so the host sees what was wrong


# -- the op's interface ------------------------------------------------------------------------------------
def test_record_validates_k_and_options(gpu, registry):
    verifier = Verifier(gpu, registry, 10, max_k=3)
    rec = registry.recorder()
    for k in (0, 4):
        with pytest.raises(ValueError, match="k must be"):
            verifier.op.record(rec, k, temperature=0.0)
    with pytest.raises(GenerationOptionError, match="top_p"):
        verifier.op.record(rec, 1, temperature=1.0, top_p=1.5)
    with pytest.raises(GenerationOptionError, match="temperature"):
        verifier.op.record(rec, 1, temperature=-1.0)
    assert rec.dispatches == 0


def test_tensors_of_the_wrong_dtype_or_size_are_rejected(gpu, registry):
    vocab, max_k = 10, 2
    target, draft = Tensor.empty(gpu, (3, vocab)), Tensor.empty(gpu, (2, vocab))
    tokens, randoms, result = Tensor.empty(gpu, 3, "u32"), Tensor.empty(gpu, 5), Tensor.empty(gpu, 5, "u32")
    SpecVerify(registry, target, draft, tokens, randoms, result, vocab=vocab, max_k=max_k)
    with pytest.raises(ValueError, match="target_logits"):
        SpecVerify(registry, target, draft, tokens, randoms, result, vocab=vocab + 1, max_k=max_k)
    with pytest.raises(ValueError, match="randoms"):
        SpecVerify(registry, target, draft, tokens, Tensor.empty(gpu, 4), result, vocab=vocab, max_k=max_k)
    with pytest.raises(ValueError, match="result"):
        SpecVerify(registry, target, draft, tokens, randoms, Tensor.empty(gpu, 5), vocab=vocab, max_k=max_k)
    with pytest.raises(ValueError, match="max_k"):
        SpecVerify(registry, target, draft, tokens, randoms, result, vocab=vocab, max_k=17)


def test_an_op_without_draft_logits_runs_one_hot_and_greedy_only(gpu, registry, rng):
    vocab, k = 50, 2
    target = random_logits(rng, k + 1, vocab, "plain")
    tokens = Tensor.from_numpy(gpu, np.array([0, 1, 2], np.uint32))
    randoms, result = Tensor.from_numpy(gpu, rng.random(5).astype(np.float32)), Tensor.empty(gpu, 5, "u32")
    op = SpecVerify(registry, Tensor.from_numpy(gpu, target), None, tokens, randoms, result, vocab=vocab, max_k=k)
    rec = registry.recorder()
    with pytest.raises(ValueError, match="onehot"):
        op.record(rec, k, temperature=1.0)
    op.record(rec, k, temperature=1.0, onehot=True)
    rec.submit()
    u = randoms.numpy()
    params = SamplingParams(temperature=1.0)
    assert tuple(result.numpy()[:2]) == verify_reference(target, None, [1, 2], u[2:4], u[4], params, onehot=True)
