"""The tiny models the speculative and training tests share (written with numpy; no download)."""

from dataclasses import replace

from doppler_py.testing.tiny import TINY_SPECS, TinySpec, draft_spec

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

# The targets trained heads are tested on, by family: TARGET, and the families whose features reach a head through
# more of the engine: Qwen 3.5 (recurrent states that rows verification rejects must not move) and Gemma 4
# (per-layer inputs, KV-shared layers, a 6-key sliding window), with TARGET's vocabulary and spread of weights, so
# that small heads learn something to propose.
HEAD_TARGETS = {
    "llama": TARGET,
    "qwen3_5": replace(TINY_SPECS["qwen3_5-hybrid"], vocab_size=48, weight_std=0.25),
    "gemma4": replace(TINY_SPECS["gemma4"], vocab_size=48, weight_std=0.25),
}
