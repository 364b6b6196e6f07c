"""Property tests of the sampler and the speculative verification kernel over hostile logits.

Rows mix ordinary values with -inf, +inf, NaN, values near the float32 limit and long runs of ties, at
vocabulary sizes from 1 up (including sizes around the 256-wide workgroup). Whatever the row, a kernel must
return ids inside the vocabulary, never pick a token its filters exclude exactly, report NaN/+inf in its
status word, and write nothing outside its outputs. Reads past a row are caught by poison: the buffers hold
+inf after the last row, which any stray read would turn into a pick outside the vocabulary.

Greedy answers are exact (keys are compared, not sums), so they are checked against the numpy references
token for token; sampled answers are checked for membership in the exactly-defined kept set (float sums
may move a top-p cut or an inverse-CDF pick by rounding, see tests/kernels/test_sample.py).
"""

from __future__ import annotations

import abc

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from reliability.helpers import ExampleTally, fuzz_settings

from doppler_py.gpu.tensor import Tensor
from doppler_py.ops.sampling import Sampler
from doppler_py.ops.speculative import (
    STATUS_DRAFT_NONFINITE,
    STATUS_DRAFT_TOKEN_OUT_OF_RANGE,
    STATUS_TARGET_NONFINITE,
    SpecVerify,
    result_size,
)
from doppler_py.sampling import SamplingParams
from doppler_py.testing.sampling_reference import filtered_weights
from doppler_py.testing.verify_reference import verify_reference

FUZZ = fuzz_settings(400)
VOCABS = [1, 2, 3, 17, 255, 256, 257, 700]
MAX_ROWS = 3
MAX_K = 4
SENTINEL = 0xDEADBEEF
POISON_TAIL = 1024
F32_MAX = float(np.finfo(np.float32).max)

EXAMPLES = ExampleTally()


@pytest.fixture(scope="module", autouse=True)
def example_counts(request):
    yield
    EXAMPLES.report(request.config, "kernel fuzz examples")


# --- hostile rows ----------------------------------------------------------------------------------------------

STYLES = ["normal", "ties", "huge", "inf", "neg-inf", "nan", "mixed"]


def hostile_rows(rng: np.random.Generator, rows: int, vocab: int, style: str) -> np.ndarray:
    x = rng.standard_normal((rows, vocab)).astype(np.float32) * 3
    if style == "ties":
        x = rng.integers(0, 3, (rows, vocab)).astype(np.float32)
    elif style == "huge":
        x = rng.choice(np.float32([F32_MAX, -F32_MAX, 3e38, -3e38, 0.0]), (rows, vocab))
    elif style in ("inf", "neg-inf", "nan"):
        value = {"inf": np.inf, "neg-inf": -np.inf, "nan": np.nan}[style]
        x[rng.random((rows, vocab)) < rng.choice([0.05, 0.5, 1.0])] = value
    elif style == "mixed":
        specials = np.float32([np.inf, -np.inf, np.nan, F32_MAX, -F32_MAX, 0.0, -0.0, 1e-45])
        mask = rng.random((rows, vocab)) < 0.3
        x[mask] = rng.choice(specials, mask.sum())
    return x


OPTIONS = st.fixed_dictionaries(
    {
        "temperature": st.sampled_from([0.0, 1e-3, 0.7, 1.0, 5.0, 1e30]),
        "top_k": st.sampled_from([0, 1, 2, 5, 255, 10_000]),
        "top_p": st.sampled_from([1.0, 0.95, 0.5, 1e-6]),
    }
)


def is_nan_or_pos_inf(x: np.ndarray) -> np.ndarray:
    return np.isnan(x) | (x == np.inf)


def write_poisoned(tensor: Tensor, rows: np.ndarray) -> None:
    """`rows` at the start of `tensor` and +inf after them, the poison a stray read would pick."""
    data = np.full(tensor.numel, np.inf, np.float32)
    data[: rows.size] = rows.reshape(-1)
    tensor.write(data)


class Rig(abc.ABC):
    """Buffers shared by every example and one op per vocab, built on first use (`make_op`)."""

    def __init__(self, gpu, registry):
        self.gpu, self.registry = gpu, registry
        self.ops: dict[int, object] = {}

    @abc.abstractmethod
    def make_op(self, vocab: int): ...

    def dispatch(self, vocab: int, *args, **options) -> None:
        if vocab not in self.ops:
            self.ops[vocab] = self.make_op(vocab)
        rec = self.registry.recorder()
        self.ops[vocab].record(rec, *args, **options)
        rec.submit()


# --- the sampler -------------------------------------------------------------------------------------------------


class SamplerRig(Rig):
    """Poison after the logit rows, sentinels after the ids."""

    def __init__(self, gpu, registry):
        super().__init__(gpu, registry)
        self.logits = Tensor.empty(gpu, MAX_ROWS * max(VOCABS) + POISON_TAIL, "f32", "fuzz logits")
        self.randoms = Tensor.empty(gpu, MAX_ROWS, "f32", "fuzz randoms")
        self.out = Tensor.empty(gpu, MAX_ROWS + 4, "u32", "fuzz ids")

    def make_op(self, vocab: int) -> Sampler:
        return Sampler(self.registry, self.logits, self.randoms, self.out, vocab=vocab, max_rows=MAX_ROWS)

    def run(self, logits: np.ndarray, us: np.ndarray, **options) -> np.ndarray:
        rows, vocab = logits.shape
        write_poisoned(self.logits, logits)
        self.randoms.write(np.resize(us.astype(np.float32), MAX_ROWS))
        self.out.write(np.full(self.out.numel, SENTINEL, np.uint32))
        self.dispatch(vocab, rows, **options)
        return self.out.numpy()


@pytest.fixture(scope="module")
def sampler_rig(gpu, registry):
    return SamplerRig(gpu, registry)


@FUZZ
@given(
    vocab=st.sampled_from(VOCABS),
    rows=st.integers(1, MAX_ROWS),
    style=st.sampled_from(STYLES),
    seed=st.integers(0, 2**32 - 1),
    options=OPTIONS,
    u=st.sampled_from([0.0, 0.5, 0.999999]) | st.floats(0.0, 1.0),
)
def test_the_sampler_returns_a_kept_id_for_any_row(sampler_rig, vocab, rows, style, seed, options, u):
    rng = np.random.default_rng(seed)
    logits = hostile_rows(rng, rows, vocab, style)
    us = np.clip(u + rng.random(rows) * (u < 1), 0, 1) if rows > 1 else np.array([u])
    out = sampler_rig.run(logits, us, **options)
    ids, tail = out[:rows], out[rows:]
    assert ((ids >= 0) & (ids < vocab)).all(), ids
    assert (tail == SENTINEL).all(), "wrote past its rows"
    params = SamplingParams(**options)
    for row, token in zip(logits, ids.tolist(), strict=True):
        if params.greedy:
            assert token == int(np.argmax(filtered_weights(row, params)))
        else:  # inside the exactly-defined set: finite tokens beat -inf/NaN, top-k is exact
            kept = filtered_weights(row, SamplingParams(options["temperature"], options["top_k"])) > 0
            assert kept[token], (token, row[token])
    EXAMPLES.add("sampler")


# --- the speculative verification ---------------------------------------------------------------------------------


class VerifyRig(Rig):
    def __init__(self, gpu, registry):
        super().__init__(gpu, registry)
        self.target = Tensor.empty(gpu, (MAX_K + 1) * max(VOCABS) + POISON_TAIL, "f32", "fuzz target")
        self.draft = Tensor.empty(gpu, MAX_K * max(VOCABS) + POISON_TAIL, "f32", "fuzz draft")
        self.tokens = Tensor.empty(gpu, MAX_K + 1, "u32", "fuzz tokens")
        self.randoms = Tensor.empty(gpu, 2 * MAX_K + 1, "f32", "fuzz randoms")
        self.result = Tensor.empty(gpu, result_size(MAX_K) + 4, "u32", "fuzz result")

    def make_op(self, vocab: int) -> SpecVerify:
        return SpecVerify(
            self.registry, self.target, self.draft, self.tokens, self.randoms, self.result, vocab=vocab, max_k=MAX_K
        )

    def run(self, target, draft, drafts, randoms, onehot: bool, **options) -> np.ndarray:
        vocab = target.shape[1]
        write_poisoned(self.target, target)
        write_poisoned(self.draft, draft)
        self.tokens.write(np.resize(np.asarray([0, *drafts], np.uint32), MAX_K + 1))
        self.randoms.write(np.resize(np.asarray(randoms, np.float32), 2 * MAX_K + 1))
        self.result.write(np.full(self.result.numel, SENTINEL, np.uint32))
        self.dispatch(vocab, len(drafts), onehot=onehot, **options)
        return self.result.numpy()


@pytest.fixture(scope="module")
def verify_rig(gpu, registry):
    return VerifyRig(gpu, registry)


@FUZZ
@given(
    vocab=st.sampled_from(VOCABS),
    k=st.integers(1, MAX_K),
    target_style=st.sampled_from(STYLES),
    draft_style=st.sampled_from(STYLES),
    seed=st.integers(0, 2**32 - 1),
    options=OPTIONS,
    onehot=st.booleans(),
)
def test_verification_returns_a_valid_step_and_reports_what_is_wrong(
    verify_rig, vocab, k, target_style, draft_style, seed, options, onehot
):
    rng = np.random.default_rng(seed)
    target = hostile_rows(rng, k + 1, vocab, target_style)
    draft = hostile_rows(rng, k, vocab, draft_style)
    # Drafts mostly the target's argmax (so some are accepted), some random, some beyond the vocabulary.
    drafts = [
        int(rng.choice([np.argmax(np.nan_to_num(target[i], nan=-np.inf)), rng.integers(0, vocab), vocab + i]))
        for i in range(k)
    ]
    randoms = rng.random(2 * k + 1)
    out = verify_rig.run(target, draft, drafts, randoms, onehot, **options)
    n, token, status = (int(v) for v in out[:3])
    params = SamplingParams(**options)

    assert 0 <= n <= k
    assert 0 <= token < vocab
    assert all(d < vocab for d in drafts[:n]), "accepted a draft outside the vocabulary"
    assert out[3 : 3 + k].tolist() == drafts
    assert (out[3 + k :] == SENTINEL).all(), "wrote past its result"
    reads_draft = not onehot and not params.greedy
    expected_status = (
        STATUS_TARGET_NONFINITE * bool(is_nan_or_pos_inf(target).any())
        | STATUS_DRAFT_NONFINITE * bool(reads_draft and is_nan_or_pos_inf(draft).any())
        | STATUS_DRAFT_TOKEN_OUT_OF_RANGE * any(d >= vocab for d in drafts)
    )
    assert status == expected_status
    if params.greedy:
        assert (n, token) == verify_reference(target, None, drafts, randoms[k : 2 * k], randoms[2 * k], params)
    EXAMPLES.add("speculative verify")
