"""Our forward pass against HF transformers on tiny random models: a 20-token prefill, then 20 single-token
decode steps through the GPU KV cache. The families: LLaMA, Mistral, Qwen2, Qwen3 (q/k norms, head_dim
apart from hidden / heads), Gemma 2 (soft-capped scores and logits), Gemma 3 (sliding layers with an 8-key
window, shorter than the prompt and the output) and Gemma 4 (a 6-key window, full layers with wider heads and
partial RoPE, two last layers reading earlier layers' K/V, per-layer inputs, layer scalars, soft-capped
logits). Greedy decoding then matches HF token for token, and speculative greedy decoding matches plain greedy
decoding (drafts verified k + 1 rows at a time, rejected ones rolled back).

Tolerance: 1e-4 max abs on logits for f32 weights (the model-families issue's bound; logits here are O(1–10)
and float32 accumulation over K ≤ 224 and 2-3 layers differs from torch's by at most 1.4e-5, measured over
every tiny model but Gemma 4, whose 5 layers, each with a per-layer input and a layer scalar up to 1.45, reach
4.8e-5 over three sequences, 3.1e-5 from a float64 forward of the same weights). Reduced-precision weights
are checked against HF running the SAME rounded weights (so the kernels' dequantisation must be exact), with
1e-3.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from support.decode import reference_decode

from doppler_py.sampling import SamplingParams
from doppler_py.speculative import DraftModelDrafter, LayerSkipDrafter, PromptLookupDrafter
from doppler_py.speculative.engine import SpeculativeEngine
from doppler_py.testing.tiny import TINY_SPECS, TinySpec

PREFILL, DECODE = 20, 20


def sequence(vocab: int, length: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, size=length).tolist()


def our_logits(model, ids: list[int]) -> np.ndarray:
    cache = model.new_cache(len(ids) + 4)
    rows = [model.forward(ids[:PREFILL], cache, 0, logits="all")]
    for t in range(PREFILL, len(ids)):
        rows.append(model.forward([ids[t]], cache, t, logits="last")[None, :])
    assert cache.length == len(ids)
    model.release_cache(cache)
    return np.concatenate(rows).astype(np.float64)


@pytest.mark.parametrize("name", sorted(TINY_SPECS))
def test_f32_logits_match_transformers_through_prefill_and_decode(tiny_model, named_folder, reference, name):
    folder = named_folder(name)
    ids = sequence(TINY_SPECS[name].vocab_size, PREFILL + DECODE)
    model = tiny_model(folder, "f32", max_rows=32)
    ours = our_logits(model, ids)
    ref = reference.hf_logits(folder, ids)
    assert ours.shape == ref.shape
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["llama-tied-gqa", "gemma3-sliding", "gemma4", "qwen3_5-hybrid"])
def test_chunked_prefill_equals_one_pass(tiny_model, named_folder, name):
    """A prompt longer than max_rows is run in chunks; the logits must not depend on the chunking (for Gemma,
    chunks of 8 rows whose windows reach back into the previous chunk; for Qwen 3.5, recurrent states committed
    between chunks)."""
    folder = named_folder(name)
    ids = sequence(TINY_SPECS[name].vocab_size, 45, seed=5)
    small = tiny_model(folder, max_rows=8)
    big = tiny_model(folder, max_rows=64)
    c1, c2 = small.new_cache(64), big.new_cache(64)
    np.testing.assert_allclose(small.forward(ids, c1), big.forward(ids, c2), atol=1e-4)
    assert c1.length == c2.length == 45


# Families whose layers differ from LLaMA's; the Gemma 3 model's window (8) is shorter than every prompt here.
NEW_FAMILIES = ["qwen3-qknorm-gqa", "gemma3-sliding", "gemma2-softcap", "gemma4"]
GREEDY = SamplingParams(temperature=0.0)
# Repeats, so prompt lookup drafts tokens: some accepted, some rejected and rolled back.
PROMPT = [3, 17, 5, 9, 3, 17, 5, 22, 40, 3, 17, 5, 9, 1, 30, 3, 17]


def hf_greedy(folder, ids: list[int], steps: int) -> list[int]:
    """HF's greedy continuation, each step over the whole sequence again (no HF KV cache involved)."""
    import torch

    from doppler_py.testing.reference import hf_model

    model, seq = hf_model(folder), list(ids)
    with torch.no_grad():
        for _ in range(steps):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids) :]


@pytest.mark.parametrize("name", NEW_FAMILIES)
def test_greedy_tokens_match_transformers(tiny_model, named_folder, reference, name):
    folder = named_folder(name)
    model = tiny_model(folder, "f32", max_rows=32)
    assert reference_decode(model, PROMPT, 24, GREEDY) == hf_greedy(folder, PROMPT, 24)


def test_gemma4_greedy_tokens_match_transformers_for_64_tokens(tiny_model, named_folder, reference):
    """64 tokens: the shared layers' caches (their sources') and the 6-key windows roll far past the prompt."""
    folder = named_folder("gemma4")
    model = tiny_model(folder, "f32", max_rows=32)
    assert reference_decode(model, PROMPT, 64, GREEDY) == hf_greedy(folder, PROMPT, 64)


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("drafter", ["prompt-lookup", "layer-skip"])
@pytest.mark.parametrize("name", NEW_FAMILIES)
def test_greedy_speculative_equals_plain_greedy(tiny_model, named_folder, name, drafter, k):
    """Prompt lookup drafts rarely and is mostly rejected; the target's first layer drafts every step, so
    k + 1 rows are verified (over windows that start inside the drafts) and rolled back again and again."""
    model = tiny_model(named_folder(name), "f32", max_rows=32)
    engine = SpeculativeEngine(
        model, PromptLookupDrafter() if drafter == "prompt-lookup" else LayerSkipDrafter(model, 1)
    )
    result = engine.generate(PROMPT, 32, GREEDY, k=k)
    engine.close()
    assert result.tokens == reference_decode(model, PROMPT, 32, GREEDY)
    assert result.stats.steps > 0, "nothing was ever drafted"


# gemma-3-270m's vocabulary; at hidden 160 the f32 embedding / tied LM head is 168 MB, beyond the 128 MiB a
# storage binding may hold under the default (browser) limits the test GPU runs with.
BIG_VOCAB = TinySpec(
    arch="gemma3",
    vocab_size=262_144,
    hidden_size=160,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=1,
    explicit_head_dim=32,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    seed=7,
    embed_std=0.02,
    sliding_window=8,
)


@pytest.mark.slow
def test_a_gemma_vocabulary_beyond_one_storage_binding_matches_transformers(tiny_model, tiny_folder, reference):
    folder = tiny_folder(BIG_VOCAB)
    model = tiny_model(folder, "f32", max_rows=32)
    assert len(model.weights.embed.parts) > 1, "the table should not fit one binding"
    ids = sequence(BIG_VOCAB.vocab_size, PREFILL + DECODE, seed=3)
    ours = our_logits(model, ids)
    np.testing.assert_allclose(ours, reference.hf_logits(folder, ids), atol=1e-3, rtol=0)
    plain = reference_decode(model, PROMPT, 8, GREEDY)
    assert plain == hf_greedy(folder, PROMPT, 8)
    engine = SpeculativeEngine(model, LayerSkipDrafter(model, 1))  # the GPU sampler and verifier over 262,144
    assert engine.generate(PROMPT, 8, GREEDY, k=4).tokens == plain
    engine.close()


def test_gemma4_with_values_equal_to_keys_matches_transformers(tiny_model, tiny_folder, reference):
    """attention_k_eq_v: full layers have no v_proj; their values are the k projection, v-normalised; and they have
    num_global_key_value_heads (2) KV heads where sliding layers have 1 (caches of two head counts)."""
    spec = dataclasses.replace(TINY_SPECS["gemma4"], attention_k_eq_v=True, num_global_key_value_heads=2, seed=12)
    folder = tiny_folder(spec)
    ids = sequence(spec.vocab_size, PREFILL + DECODE, seed=1)
    ours = our_logits(tiny_model(folder, "f32", max_rows=32), ids)
    np.testing.assert_allclose(ours, reference.hf_logits(folder, ids), atol=1e-4, rtol=0)


def test_a_gemma4_multimodal_folder_runs_its_text_model(tiny_model, named_folder, tmp_path):
    """Gemma4ForConditionalGeneration: config.json's text_config, tensors under model.language_model. (the
    vision tower's are left alone); the same logits as the text model's own folder."""
    folder = named_folder("gemma4")
    text = json.loads((folder / "config.json").read_text())
    outer = {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": {**text, "architectures": None},
        "vision_config": {"model_type": "gemma4_vision"},
        "tie_word_embeddings": text["tie_word_embeddings"],
    }
    (tmp_path / "config.json").write_text(json.dumps(outer))
    tensors = {
        name.replace("model.", "model.language_model.", 1): value
        for name, value in load_file(folder / "model.safetensors").items()
    }
    tensors["model.vision_tower.patch_embedder.weight"] = np.zeros((4, 4), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ids = sequence(128, PREFILL + DECODE, seed=2)
    expected = our_logits(tiny_model(folder, "f32", max_rows=32), ids)
    np.testing.assert_array_equal(our_logits(tiny_model(tmp_path, "f32", max_rows=32), ids), expected)


def test_gemma4_f16_weights_match_transformers_on_the_same_rounded_weights(
    tiny_model, named_folder, tmp_path, reference
):
    """f16 matrices (the per-layer input table and projections included) against transformers running the same
    matrices rounded to f16; vectors (norms, layer scalars) stay f32 on both sides."""
    folder = named_folder("gemma4")
    rounded = {
        name: value.astype(np.float16).astype(np.float32) if value.ndim == 2 else value
        for name, value in load_file(folder / "model.safetensors").items()
    }
    save_file(rounded, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    ids = sequence(128, PREFILL + DECODE, seed=4)
    ours = our_logits(tiny_model(folder, "f16", max_rows=32), ids)
    np.testing.assert_allclose(ours, reference.hf_logits(tmp_path, ids), atol=1e-3, rtol=0)


def test_gemma4_sequences_batched_in_one_forward_equal_each_alone(tiny_model, named_folder):
    """record_batch: each sequence's rows attend over its own cache in every layer, the KV-shared ones included,
    and the per-layer inputs follow the stacked rows."""
    model = tiny_model(named_folder("gemma4"), "f32", max_rows=32)
    a, b = sequence(128, 14, seed=7), sequence(128, 9, seed=8)
    alone = []
    for ids, new in ((a, 3), (b, 2)):
        cache = model.new_cache(32)
        model.forward(ids[:-new], cache, 0, logits="none")
        alone.append(model.forward(ids[-new:], cache, logits="all"))
        model.release_cache(cache)
    caches = [model.new_cache(32), model.new_cache(32)]
    model.forward(a[:-3], caches[0], 0, logits="none")
    model.forward(b[:-2], caches[1], 0, logits="none")
    model.ids.view((5,)).write(np.array(a[-3:] + b[-2:], np.uint32))
    rec = model.registry.recorder()
    model.record_batch(rec, [(caches[0], len(a) - 3, 3), (caches[1], len(b) - 2, 2)])
    rec.submit()
    np.testing.assert_allclose(model.read_logits(5), np.concatenate(alone), atol=1e-5, rtol=0)
    for cache in caches:
        model.release_cache(cache)


def test_a_gemma4_prefill_may_stop_before_the_kv_shared_layers(tiny_model, named_folder):
    """The KV-shared layers write no K/V: a prefill whose outputs nobody reads (the engine's, unless its drafter
    reads the prompt's features) runs the first 3 of 5 layers and leaves the same cache, so the next step's logits
    are the same bits."""
    model = tiny_model(named_folder("gemma4"), "f32", max_rows=32)
    assert model.prefill_layers == 3
    ids = sequence(128, 30, seed=9)
    logits = []
    for layers in (None, model.prefill_layers):
        cache = model.new_cache(32)
        model.forward(ids[:-1], cache, 0, logits="none", num_layers=layers)
        logits.append(model.forward(ids[-1:], cache))
        model.release_cache(cache)
    np.testing.assert_array_equal(logits[0], logits[1])


def test_a_gemma4_draft_model_keeps_greedy_output(tiny_model, tiny_folder, named_folder):
    """A Gemma 4 draft (its own weights) for the Gemma 4 target: its prompt prefill stops before its KV-shared
    layers, its drafts come from all of them, and the output is the target's plain greedy output."""
    model = tiny_model(named_folder("gemma4"), "f32", max_rows=32)
    draft = tiny_model(tiny_folder(dataclasses.replace(TINY_SPECS["gemma4"], seed=13)), "f32", max_rows=32)
    engine = SpeculativeEngine(model, DraftModelDrafter(draft, model.config.vocab_size))
    result = engine.generate(PROMPT, 32, GREEDY, k=4)
    engine.close()
    assert result.tokens == reference_decode(model, PROMPT, 32, GREEDY)
    assert result.stats.steps > 0
