"""The JS-compatible SpeculativeDecoder: its API, its quirks, and the temperature flaw `correct=True` fixes.

Token-for-token agreement with the JS original is tested in tests/parity/test_speculative_js.py; these tests
state the behaviour on its own terms and run without Node.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from doppler_py.errors import DopplerError, GenerationOptionError
from doppler_py.parity import SpeculativeDecoder
from doppler_py.rng import Mulberry32


class FixedModel:
    """Returns the same logits for every context; records each call's (length of ids, kv cache)."""

    def __init__(self, logits, new_cache=None) -> None:
        self.logits = logits
        self.new_cache = new_cache
        self.calls: list[tuple[int, object]] = []

    def forward(self, input_ids, kv_cache=None):
        self.calls.append((len(input_ids), kv_cache))
        return {"logits": self.logits, "new_kv_cache": self.new_cache}


class Cache:
    def __init__(self, label: str) -> None:
        self.label = label
        self.clones = 0

    def clone(self) -> Cache:
        self.clones += 1
        return Cache(f"{self.label}'")


def decoder(k=3, temperature=1.0, seed=0, correct=False, main=None, draft=None) -> SpeculativeDecoder:
    dec = SpeculativeDecoder(
        num_draft_tokens=k,
        max_rejection_retries=2,
        enable_tree_draft=False,
        temperature=temperature,
        random_seed=seed,
        correct=correct,
    )
    if main is not None:
        dec.set_main_model(main)
    if draft is not None:
        dec.set_draft_model(draft)
    return dec


def fixed_draws(dec: SpeculativeDecoder, values: list[float]) -> list[float]:
    """Makes `dec` draw `values` in order; returns the list, which empties as draws happen."""
    pending = list(values)
    dec.random = lambda: pending.pop(0)
    return pending


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max())
    return shifted / shifted.sum()


# --- construction --------------------------------------------------------------------------------------
OPTIONS = {
    "num_draft_tokens": 3,
    "max_rejection_retries": 1,
    "enable_tree_draft": False,
    "temperature": 1.0,
    "random_seed": 0,
}


@pytest.mark.parametrize("missing", ["num_draft_tokens", "max_rejection_retries", "enable_tree_draft", "temperature"])
def test_each_required_option_is_named_when_missing(missing):
    with pytest.raises(GenerationOptionError, match=f"requires {missing}"):
        SpeculativeDecoder(**{name: value for name, value in OPTIONS.items() if name != missing})


@pytest.mark.parametrize("seed", [None, math.nan, math.inf, -math.inf, "1", True, 10**400])
def test_random_seed_must_be_a_finite_number(seed):
    with pytest.raises(GenerationOptionError, match="random_seed"):
        SpeculativeDecoder(**{**OPTIONS, "random_seed": seed})


@pytest.mark.parametrize("temperature", [0, 0.0, -1.0, math.nan, math.inf, "1"])
def test_temperature_must_be_positive_and_finite(temperature):
    with pytest.raises(GenerationOptionError, match="positive finite"):
        SpeculativeDecoder(**{**OPTIONS, "temperature": temperature})


@pytest.mark.parametrize(
    ("seed", "same_as"), [(1.9, 1), (-0.5, 2**32 - 1), (-1, 2**32 - 1), (2**32, 0), (2**40 + 3, 3)]
)
def test_seed_is_floored_and_wrapped_to_32_bits_as_in_js(seed, same_as):
    ours, reference = decoder(seed=seed), Mulberry32(same_as)
    assert [ours.random() for _ in range(5)] == [reference.random() for _ in range(5)]


# --- logits and log-softmax ----------------------------------------------------------------------------
def test_logits_may_be_float32_float64_lists_or_rows_with_the_last_row_used():
    row = [0.3, -1.25, 2.0, 0.1]
    expected = decoder().log_softmax(np.array(row, dtype=np.float32))
    for form in (
        row,
        tuple(row),
        np.array(row),
        np.array([[9.0, 9.0, 9.0, 9.0], row], dtype=np.float32),
        [np.zeros(4), np.array(row)],
        [[5.0, 5.0, 5.0, 5.0], row],
    ):
        assert np.array_equal(decoder().log_softmax(form), expected), form


@pytest.mark.parametrize(
    "logits",
    [
        [],
        np.zeros(0),
        np.zeros((0, 3)),
        np.zeros((2, 0)),
        [[]],
        [np.zeros(0)],
        None,
        "abc",
        [["a"]],
        np.zeros((2, 2, 2)),
    ],
)
def test_empty_or_non_numeric_logits_are_rejected(logits):
    with pytest.raises(GenerationOptionError, match=r"must not be empty|numeric logits vector"):
        decoder().log_softmax(logits)


def test_log_softmax_is_float32_and_matches_a_float64_reference(rng):
    logits = rng.normal(0, 4, 1001).astype(np.float32)
    ours = decoder().log_softmax(logits)
    wide = logits.astype(np.float64)
    reference = wide - (wide.max() + np.log(np.exp(wide - wide.max()).sum()))
    assert ours.dtype == np.float32
    # The only rounding that matters is the final store to float32: within one float32 ulp of the reference.
    np.testing.assert_array_max_ulp(ours, reference.astype(np.float32), maxulp=1)


def test_log_softmax_gives_nan_everywhere_when_any_logit_is_nan_or_all_are_minus_infinity():
    assert np.isnan(decoder().log_softmax([1.0, math.nan, 2.0])).all()
    assert np.isnan(decoder().log_softmax([-math.inf, -math.inf])).all()


def test_minus_infinity_logits_get_zero_probability():
    logprobs = decoder().log_softmax([0.0, -math.inf, 0.0])
    assert logprobs[1] == -math.inf and np.allclose(np.exp(logprobs[[0, 2]]), 0.5)


# --- sampling ------------------------------------------------------------------------------------------
def test_sample_token_draws_once_and_returns_the_tempered_log_probs():
    dec = decoder()
    pending = fixed_draws(dec, [0.3])
    logits = np.array([1.0, 2.0, 0.5], dtype=np.float32)
    token, logprobs = dec.sample_token(logits, 0.7)
    assert pending == []
    assert np.array_equal(logprobs, dec.log_softmax((logits.astype(np.float64) / 0.7).astype(np.float32)))
    cumulative = np.cumsum(np.exp(logprobs.astype(np.float64)))
    assert token == int(np.argmax(cumulative > 0.3))


def test_the_sampling_comparison_is_strict():
    # Two equal logits give probabilities of exactly 0.5 in float32: r = 0.5 is not below the first.
    dec = decoder()
    fixed_draws(dec, [0.5, 0.49999999])
    assert dec.sample_token([0.0, 0.0], 1.0)[0] == 1
    assert dec.sample_token([0.0, 0.0], 1.0)[0] == 0


def test_a_sampler_that_finds_no_token_returns_the_last_id():
    dec = decoder()
    fixed_draws(dec, [0.1])
    assert dec.sample_token([1.0, math.nan, 0.0, 2.0], 1.0)[0] == 3


@pytest.mark.parametrize("temperature", [0.0, -2.0, math.nan])
def test_sample_token_rejects_a_bad_temperature(temperature):
    with pytest.raises(GenerationOptionError, match="positive finite"):
        decoder().sample_token([0.0, 1.0], temperature)


def test_residual_samples_only_where_main_exceeds_draft():
    dec = decoder()
    main = np.log(np.array([0.1, 0.65, 0.25], dtype=np.float32))
    draft = dec.log_softmax(np.log(np.array([0.5, 0.2, 0.3])))
    draws = np.linspace(0, 0.999, 50)
    fixed_draws(dec, list(draws))
    assert {dec.sample_from_residual(main, draft, True) for _ in draws} == {1}


def test_residual_with_no_mass_falls_back_to_one_tempered_main_sample():
    dec = decoder()
    logits = np.array([0.0, 3.0], dtype=np.float32)
    pending = fixed_draws(dec, [0.2])
    assert dec.sample_from_residual(logits, dec.log_softmax(logits), True) == 1
    assert pending == []


def test_residual_when_not_rejected_is_a_plain_tempered_sample():
    dec = decoder(temperature=0.5)
    fixed_draws(dec, [0.99])
    assert dec.sample_from_residual([0.0, 1.0], None, False) == 1


def test_residual_lengths_must_match():
    with pytest.raises(GenerationOptionError, match="length mismatch"):
        decoder().sample_from_residual([0.0, 1.0], [0.0, 0.0, 0.0], True)


# --- drafting and verification -------------------------------------------------------------------------
def test_models_must_be_set_before_use():
    with pytest.raises(DopplerError, match="draft model not set"):
        decoder().generate_draft_tokens([1])
    with pytest.raises(DopplerError, match="main model not set"):
        decoder().verify_draft_tokens([1], [0], [[0.0]])


def test_drafting_appends_each_token_and_chains_the_draft_cache():
    returned = Cache("returned")
    draft = FixedModel(np.array([0.0, 1.0, 2.0], dtype=np.float32), new_cache=returned)
    given = Cache("given")
    result = decoder(draft=draft).generate_draft_tokens([5, 6], given, num_tokens=4)
    assert len(result["tokens"]) == len(result["logprobs"]) == 4
    assert [length for length, _ in draft.calls] == [2, 3, 4, 5]
    assert given.clones == 1 and draft.calls[0][1].label == "given'"
    assert all(cache is returned for _, cache in draft.calls[1:])


def test_verification_runs_one_main_forward_per_draft_token_plus_one_for_the_bonus():
    logits = np.array([0.5, 1.0, -1.0], dtype=np.float32)
    main, draft = FixedModel(logits), FixedModel(logits)
    dec = decoder(k=4, main=main, draft=draft)
    result = dec.step([1, 2, 3])
    # Identical models at T = 1: every acceptance probability is exactly 1.
    assert len(result["new_tokens"]) == 5 and result["accept_rate"] == 1.0
    assert [length for length, _ in main.calls] == [3, 4, 5, 6, 7]
    assert [length for length, _ in draft.calls] == [3, 4, 5, 6]


def test_a_rejection_ends_verification_and_the_residual_samples_where_main_has_mass():
    main = FixedModel(np.array([0.0, -math.inf], dtype=np.float32))
    draft = FixedModel(np.array([-math.inf, 0.0], dtype=np.float32))
    dec = decoder(k=3, main=main, draft=draft)
    result = dec.verify_draft_tokens([1], [1, 1, 1], [dec.log_softmax(draft.logits)] * 3)
    assert result == {"accepted_count": 0, "accepted_tokens": [], "sampled_token": 0, "all_accepted": False}
    assert len(main.calls) == 1


def test_an_acceptance_probability_of_zero_rejects_even_a_zero_draw():
    main = FixedModel(np.array([0.0, -math.inf], dtype=np.float32))
    dec = decoder(main=main)
    fixed_draws(dec, [0.0, 0.0])
    assert dec.verify_draft_tokens([1], [1], [np.log(np.array([0.5, 0.5], dtype=np.float32))])["accepted_count"] == 0


def test_a_nan_acceptance_probability_rejects():
    main = FixedModel(np.array([0.0, 0.0], dtype=np.float32))
    dec = decoder(main=main)
    fixed_draws(dec, [0.0, 0.0, 0.0])
    assert dec.verify_draft_tokens([1], [1], [[math.nan, math.nan]])["accepted_count"] == 0


@pytest.mark.parametrize(
    ("tokens", "logprobs", "message"),
    [
        ((3,), [[0.0, 0.0]], "out of vocabulary"),
        ([-1], [[0.0, 0.0]], "out of vocabulary"),
        ([0.5], [[0.0, 0.0]], "out of vocabulary"),
        ([True], [[0.0, 0.0]], "out of vocabulary"),
        ([0], [[0.0, 0.0, 0.0]], "does not match main logits length"),
        ([0, 1], [[0.0, 0.0]], "length mismatch"),
        (np.array([0]), [[0.0, 0.0]], "must be lists"),
    ],
)
def test_draft_tokens_and_logprobs_are_validated(tokens, logprobs, message):
    dec = decoder(main=FixedModel([0.0, 0.0]))
    with pytest.raises(GenerationOptionError, match=message):
        dec.verify_draft_tokens([1], tokens, logprobs)


def test_integral_float_draft_tokens_are_accepted_as_ids():
    dec = decoder(main=FixedModel([0.0, 0.0]))
    fixed_draws(dec, [0.0, 0.0])
    assert dec.verify_draft_tokens([1], [1.0], [[-0.6931472, -0.6931472]])["accepted_tokens"] == [1]


def test_forward_may_return_an_object_with_attributes():
    class Output:
        logits = np.array([0.0, 5.0], dtype=np.float32)
        new_kv_cache = None

    class Model:
        def forward(self, input_ids, kv_cache=None):
            return Output()

    assert decoder(k=1, main=Model(), draft=Model()).step([0])["new_tokens"]


@pytest.mark.parametrize("output", [None, 3, "logits"])
def test_forward_must_return_a_dict_or_an_object(output):
    class Model:
        def forward(self, input_ids, kv_cache=None):
            return output

    with pytest.raises(DopplerError, match="must return"):
        decoder(draft=Model()).generate_draft_tokens([0])


def test_a_forward_result_without_logits_is_rejected():
    with pytest.raises(GenerationOptionError, match="draft step 0 logits"):
        decoder(draft=FixedModel(None)).generate_draft_tokens([0])


# --- steps, draws and stats ----------------------------------------------------------------------------
def test_step_returns_the_callers_main_cache_and_clones_both_caches():
    main_cache, draft_cache = Cache("main"), Cache("draft")
    dec = decoder(main=FixedModel([0.0, 1.0], new_cache=Cache("new")), draft=FixedModel([1.0, 0.0]))
    result = dec.step([1], main_cache, draft_cache)
    assert result["main_kv_cache"] is main_cache
    assert main_cache.clones == 1 and draft_cache.clones == 1


@pytest.mark.parametrize("seed", range(6))
def test_a_step_draws_k_plus_the_verified_positions_plus_one(seed, rng):
    vocab = 5
    main = FixedModel(rng.normal(0, 1, vocab).astype(np.float32))
    draft = FixedModel(rng.normal(0, 1, vocab).astype(np.float32))
    dec = decoder(k=4, temperature=1.5, seed=seed, main=main, draft=draft)
    draw = dec.random
    draws = []
    dec.random = lambda: draws.append(1) or draw()
    for _ in range(5):
        draws.clear()
        main.calls.clear()
        accepted = len(dec.step([0])["new_tokens"]) - 1
        verified = min(accepted + 1, 4)
        assert len(draws) == 4 + verified + 1
        assert len(main.calls) == verified + (accepted == 4)


def test_stats_accumulate_and_speedup_is_the_js_estimate():
    logits = np.array([0.0, 1.0, 2.0], dtype=np.float32)
    dec = decoder(k=4, main=FixedModel(logits), draft=FixedModel(logits[::-1].copy()), seed=9)
    assert dec.get_stats() == {
        "total_drafted": 0,
        "total_accepted": 0,
        "total_rejected": 0,
        "average_accept_rate": 0.0,
        "speedup": 1.0,
    }
    accepted = sum(len(dec.step([0])["new_tokens"]) - 1 for _ in range(6))
    stats = dec.get_stats()
    assert (stats["total_drafted"], stats["total_accepted"], stats["total_rejected"]) == (24, accepted, 24 - accepted)
    assert stats["average_accept_rate"] == accepted / 24
    assert stats["speedup"] == (1 + accepted / 24 * 4) / (1 + 0.1 * 4)
    dec.reset_stats()
    assert dec.get_stats()["total_drafted"] == 0 and dec.get_stats()["speedup"] == 1.0


# --- the temperature flaw ------------------------------------------------------------------------------
MAIN_LOGITS = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.5], dtype=np.float32)
DRAFT_LOGITS = np.array([0.5, 1.5, 0.0, 1.0, -1.0, 0.0], dtype=np.float32)
SAMPLES = 4000


def first_token_frequencies(correct: bool, temperature: float, seed: int) -> np.ndarray:
    """How often each token comes first in a step, over SAMPLES steps of context-free models with k = 1."""
    dec = decoder(k=1, temperature=temperature, seed=seed, correct=correct)
    dec.set_main_model(FixedModel(MAIN_LOGITS))
    dec.set_draft_model(FixedModel(DRAFT_LOGITS))
    counts = np.bincount([dec.step([0])["new_tokens"][0] for _ in range(SAMPLES)], minlength=MAIN_LOGITS.size)
    return counts / SAMPLES


def tv_bound(p: np.ndarray, n: int, failure: float = 1e-6) -> float:
    """A total-variation distance that n samples from p exceed with probability below `failure`.

    E[TV] <= ½ Σ sqrt(p(1-p)/n) (Jensen, per cell), and one sample moves TV by at most 1/n, so by McDiarmid
    P(TV > E[TV] + t) <= exp(-2 n t²).
    """
    return 0.5 * np.sqrt(p * (1 - p) / n).sum() + math.sqrt(math.log(1 / failure) / (2 * n))


def total_variation(p: np.ndarray, q: np.ndarray) -> float:
    return 0.5 * float(np.abs(p - q).sum())


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_correct_mode_samples_the_tempered_main_distribution(temperature):
    target = softmax(MAIN_LOGITS.astype(np.float64) / temperature)
    observed = first_token_frequencies(correct=True, temperature=temperature, seed=11)
    assert total_variation(observed, target) < tv_bound(target, SAMPLES)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_js_mode_samples_the_untempered_main_distribution_instead(temperature):
    target = softmax(MAIN_LOGITS.astype(np.float64) / temperature)
    untempered = softmax(MAIN_LOGITS.astype(np.float64))
    # The two candidates are further apart than both noise bounds together, so the test tells them apart.
    assert total_variation(target, untempered) > tv_bound(target, SAMPLES) + tv_bound(untempered, SAMPLES)
    observed = first_token_frequencies(correct=False, temperature=temperature, seed=11)
    assert total_variation(observed, untempered) < tv_bound(untempered, SAMPLES)
    assert total_variation(observed, target) > tv_bound(target, SAMPLES)


def test_both_modes_give_the_same_tokens_at_temperature_one():
    def tokens(correct: bool) -> list[list[int]]:
        dec = decoder(k=3, seed=5, correct=correct, main=FixedModel(MAIN_LOGITS), draft=FixedModel(DRAFT_LOGITS))
        return [dec.step([0])["new_tokens"] for _ in range(50)]

    assert tokens(correct=True) == tokens(correct=False)
