"""Tiny models for speculative-decoding tests (written with numpy; no download)."""

from __future__ import annotations

import pytest

from doppler_py.testing.tiny import TinySpec, draft_spec

TARGET = TinySpec(
    vocab_size=48,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    weight_std=0.25,
    seed=11,
)
# A weaker draft with the same vocabulary (fewer layers, other weights) and one that differs only by padding.
DRAFT = draft_spec(vocab_size=48, seed=12)
PADDED_DRAFT = draft_spec(vocab_size=64, seed=13)


@pytest.fixture(scope="session")
def models(tiny_model):
    """name -> Transformer for "target", "draft", "padded_draft", loaded once per session."""
    specs = {"target": TARGET, "draft": DRAFT, "padded_draft": PADDED_DRAFT}
    return {name: tiny_model(spec, max_rows=32, max_positions=256) for name, spec in specs.items()}
