"""The spark trainer: Platt scaling, and the confidence head rescaled on the held-out sequences."""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.trained_heads import BLOCK

torch = pytest.importorskip("torch")
from doppler_py.training.spark import platt, sigmoid  # noqa: E402


def test_platt_scaling_recovers_a_known_calibration():
    rng = np.random.default_rng(0)
    z = rng.normal(0.0, 2.0, 20000)
    right = (rng.random(z.size) < sigmoid(0.5 * z - 1.0)).astype(np.float64)
    a, b = platt(z, right)
    assert a == pytest.approx(0.5, abs=0.05) and b == pytest.approx(-1.0, abs=0.05)
    a, b = platt(z[:10], np.ones(10))  # one class only: finite, still increasing in z
    assert np.isfinite([a, b]).all() and a > 0
    # A head far too sure (logits around 2.5, right 37% of the time): a full Newton step from (1, 0) overshoots
    # to a ~ 1000; the fitted map must bring the mean confidence down to the rate.
    z = rng.normal(2.5, 1.0, 1600)
    right = (rng.random(z.size) < 0.37).astype(np.float64)
    a, b = platt(z, right)
    assert abs(a) < 1 and sigmoid(a * z + b).mean() == pytest.approx(right.mean(), abs=0.02)


def test_the_confidence_head_is_rescaled_on_the_held_out_sequences(block_dir):
    """The exported confidence head is the trained one (the work folder's checkpoint) with the card's
    per-position affine map folded in, fitted on the held-out split; the card reports the cross-fitted result."""
    from safetensors.numpy import load_file

    card = json.loads((block_dir / "training_card.json").read_text())
    trained = torch.load(block_dir.parent / "work" / "spark.pt")["head"]
    exported = load_file(str(block_dir / "spark.safetensors"))
    scale, shift = np.array(card["confidence_scale"]), np.array(card["confidence_shift"])
    assert card["validation_sequences"] >= 2 and scale.shape == shift.shape == (BLOCK,)
    assert (scale != 1).any() and (shift != 0).any()
    raw_w, raw_b = trained["confidence.weight"].numpy(), trained["confidence.bias"].numpy()
    np.testing.assert_allclose(exported["confidence.weight"], scale[:, None] * raw_w, rtol=2e-3, atol=2e-4)
    np.testing.assert_allclose(exported["confidence.bias"], scale * raw_b + shift, rtol=2e-3, atol=2e-3)
    assert all(0 < c < 1 for c in card["validation_calibrated_confidence_by_position"])
