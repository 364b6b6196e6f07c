"""A draft's confidence (its probability under the head) and its calibration to measured acceptance."""

from __future__ import annotations

import numpy as np
import pytest

from doppler_py.sampling import SamplingParams
from doppler_py.speculative.policy.confidence import (
    BINS,
    DECAY,
    DEPTHS,
    PRIOR_WEIGHT,
    ConfidenceCalibration,
    draft_confidence,
)

GREEDY = SamplingParams()


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def test_a_greedy_drafts_confidence_is_its_softmax_probability():
    row = np.array([0.5, 2.0, -1.0, 2.0 - 1e-3], np.float32)
    assert draft_confidence(row, 1, GREEDY) == pytest.approx(softmax(row.astype(np.float64))[1], rel=1e-9)


def test_a_sampled_drafts_confidence_is_taken_at_the_sampling_temperature():
    row = np.array([1.0, 0.0, 3.0], np.float32)
    params = SamplingParams(temperature=0.5, top_k=2)
    assert draft_confidence(row, 0, params) == pytest.approx(softmax(row / 0.5)[0])


def test_minus_infinity_logits_take_no_share_and_a_token_outside_the_row_has_none():
    row = np.array([-np.inf, 0.0, -np.inf, 0.0], np.float32)
    assert draft_confidence(row, 1, GREEDY) == pytest.approx(0.5)
    assert draft_confidence(row, 0, GREEDY) == 0.0
    assert draft_confidence(row, -1, GREEDY) == 0.0  # the pick mapped to no draft id
    assert draft_confidence(np.array([7.0], np.float32), 0, GREEDY) == 1.0  # a vocabulary of one


def test_an_unobserved_calibration_reads_a_confidence_as_its_bins_centre():
    calibration = ConfidenceCalibration()
    assert calibration.rate(0.0) == pytest.approx(0.5 / BINS)
    assert calibration.rate(0.97) == calibration.rate(1.0) == pytest.approx(1 - 0.5 / BINS)
    assert calibration.values([0.55, 0.95]) == pytest.approx([0.55, 0.55 * 0.95])


def test_observed_drafts_move_their_depths_bin_and_a_chain_is_read_up_to_its_first_miss():
    calibration = ConfidenceCalibration()
    calibration.observe([0.15, 0.15, 0.15], [True, False, True])  # the third draft was never tested
    assert calibration.trials[0, 1] == calibration.trials[1, 1] == pytest.approx(PRIOR_WEIGHT * DECAY + 1)
    assert calibration.trials[2, 1] == PRIOR_WEIGHT
    assert calibration.rate(0.15, 0) == pytest.approx((0.15 * PRIOR_WEIGHT * DECAY + 1) / (PRIOR_WEIGHT * DECAY + 1))
    assert calibration.rate(0.15, 1) == pytest.approx(0.15 * PRIOR_WEIGHT * DECAY / (PRIOR_WEIGHT * DECAY + 1))
    assert calibration.rate(0.15, 7) == calibration.rate(0.15, DEPTHS - 1)  # later drafts share the last depth


def test_a_bin_follows_the_latest_drafts_of_the_text_at_hand():
    calibration = ConfidenceCalibration()
    for _ in range(200):  # an under-confident head is read as it is
        calibration.observe([0.35], [True])
    assert calibration.rate(0.35) > 0.99
    for _ in range(40):  # then a text where the same confidence is mostly wrong
        calibration.observe([0.35], [False])
    assert calibration.rate(0.35) < 0.15


def test_a_chains_values_are_the_running_products_of_its_depths_rates():
    calibration = ConfidenceCalibration()
    for _ in range(100):  # confident second drafts that are wrong: only the second depth learns it
        calibration.observe([0.95, 0.95], [True, False])
    first, second = calibration.rate(0.95, 0), calibration.rate(0.95, 1)
    assert first > 0.99 and second < 0.01
    assert calibration.values([0.95, 0.95, 0.95]) == pytest.approx([first, first * second, first * second * 0.95])
