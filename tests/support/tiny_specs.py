"""The tiny models the speculative and training tests share (written with numpy; no download)."""

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

DRAFT = draft_spec(vocab_size=48, seed=12)

PADDED_DRAFT = draft_spec(vocab_size=64, seed=13)

CORPUS_OPTIONS = {"seed_prompts": 16, "magpie_prompts": 2, "max_new_tokens": 24}
