"""LoRA adapters (model/lora.py, model/adapters.py, ops/lora.py) against PEFT on tiny random models, with the adapters
made by peft itself: logits through a prefill and decode steps, greedy tokens; rows of different adapters (and of
none) in one batched forward, each as it is alone; speculation with an adapter as plain decoding with it; and every
kind of bad adapter as a typed error.

Tolerance: 1e-4 max abs on logits, as the base model's forward against transformers (tests/model/test_forward_vs_hf.py):
the update adds two float32 dot products (over k ≤ 160 and r = 4) per output, well inside it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from support.decode import reference_decode
from support.lora import ALL_MODULES, make_adapter, peft_greedy, peft_logits

from doppler_py.api import load
from doppler_py.errors import AdapterError, GenerationOptionError, UnknownAdapterError
from doppler_py.model.loader import load_weights
from doppler_py.model.lora import merged_deltas, read_adapter
from doppler_py.model.prefix_cache import PrefixCache
from doppler_py.model.transformer import Transformer
from doppler_py.sampling import SamplingParams
from doppler_py.speculative import DraftModelDrafter, PromptLookupDrafter
from doppler_py.speculative.engine import SpeculativeEngine
from doppler_py.testing.tiny import draft_spec

GREEDY = SamplingParams(temperature=0.0)
PREFILL, DECODE = 12, 8
PROMPT = [3, 17, 5, 9, 3, 17, 5, 22, 40, 3, 17, 5, 9, 1, 30, 3, 17]  # repeats: prompt lookup drafts


@pytest.fixture(scope="module")
def adapted(named_folder, registry, tmp_path_factory, reference):
    """name -> (base folder, {"a": adapter folder, "b": ...}, Transformer with both loaded), made once."""
    made = {}

    def build(name: str):
        if name not in made:
            folder = named_folder(name)
            out = tmp_path_factory.mktemp(f"lora-{name}")
            adapters = {
                "a": make_adapter(folder, out / "a", rank=4, seed=1),
                "b": make_adapter(
                    folder, out / "b", rank=2, alpha=3.0, rslora=True, seed=2, modules=("q_proj", "v_proj", "down_proj")
                ),
            }
            model = Transformer(load_weights(folder, registry.gpu, "f32"), registry, max_rows=32)
            for adapter, path in adapters.items():
                model.adapters.add(adapter, path)
            made[name] = (folder, adapters, model)
        return made[name]

    yield build
    for _, _, model in made.values():
        model.close()
        model.weights.destroy()


def logits_with(model: Transformer, ids: list[int], adapter: str | None) -> np.ndarray:
    cache = model.new_cache(len(ids) + 4)
    cache.adapter = adapter
    try:
        rows = [model.forward(ids[:PREFILL], cache, 0, logits="all")]
        for t in range(PREFILL, len(ids)):
            rows.append(model.forward([ids[t]], cache, t, logits="last")[None, :])
    finally:
        model.release_cache(cache)
    return np.concatenate(rows).astype(np.float64)


@pytest.mark.parametrize("adapter", ["a", "b"])
@pytest.mark.parametrize("name", ["llama-tied-gqa", "qwen3-qknorm-gqa", "gemma3-sliding"])
def test_logits_equal_pefts_through_prefill_and_decode(adapted, name, adapter):
    folder, adapters, model = adapted(name)
    ids = np.random.default_rng(3).integers(0, model.config.vocab_size, PREFILL + DECODE).tolist()
    ours = logits_with(model, ids, adapter)
    expected = peft_logits(folder, adapters[adapter], ids)
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)
    # The adapter changes the logits (else this test could not fail), the base rows stay the base model's.
    assert np.abs(ours - logits_with(model, ids, None)).max() > 1e-2


LINEAR_ATTENTION = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


@pytest.mark.parametrize(
    ("name", "modules"),
    [("qwen3_5-hybrid", ALL_MODULES + LINEAR_ATTENTION), ("gemma4", ALL_MODULES)],
    ids=["qwen3_5-hybrid", "gemma4"],
)
def test_logits_equal_pefts_on_qwen3_5_and_gemma4(named_folder, registry, tmp_path, reference, name, modules):
    """Qwen 3.5: q_proj's [q | gate] rows split and partial-RoPE dims reordered as the loader does, and the Gated
    DeltaNet layers' projections; Gemma 4: per-layer head dims, KV-shared layers (their k/v updates never run)."""
    folder = named_folder(name)
    adapter = make_adapter(folder, tmp_path / "a", rank=4, seed=4, modules=modules)
    model = Transformer(load_weights(folder, registry.gpu, "f32"), registry, max_rows=32)
    try:
        assert {module.split(".")[1] for module in model.adapters.add("a", adapter).modules} == set(modules)
        ids = np.random.default_rng(5).integers(0, model.config.vocab_size, PREFILL + DECODE).tolist()
        ours = logits_with(model, ids, "a")
        np.testing.assert_allclose(ours, peft_logits(folder, adapter, ids), atol=1e-4, rtol=0)
        assert np.abs(ours - logits_with(model, ids, None)).max() > 1e-2
    finally:
        model.close()
        model.weights.destroy()


def test_an_adapter_merged_into_the_weights_gives_pefts_logits(adapted, registry):
    folder, adapters, model = adapted("qwen3-qknorm-gqa")
    adapter = read_adapter(adapters["a"])
    merged = Transformer(
        load_weights(folder, registry.gpu, "f32", deltas=merged_deltas(adapter, model.config)), registry, max_rows=32
    )
    try:
        ids = np.random.default_rng(6).integers(0, model.config.vocab_size, PREFILL + DECODE).tolist()
        np.testing.assert_allclose(logits_with(merged, ids, None), peft_logits(folder, adapters["a"], ids), atol=1e-4)
    finally:
        merged.close()
        merged.weights.destroy()
    with pytest.raises(GenerationOptionError, match="merges one LoRA adapter"):
        load(folder, "f32", progress=False, lora={"a": adapters["a"], "b": adapters["b"]}, merge=True)


@pytest.mark.parametrize("name", ["llama-tied-gqa", "qwen3-qknorm-gqa"])
def test_greedy_tokens_equal_pefts(adapted, name):
    folder, adapters, model = adapted(name)
    assert reference_decode(model, PROMPT, 16, GREEDY, adapter="a") == peft_greedy(folder, adapters["a"], PROMPT, 16)


def dispatches(model: Transformer, adapter: str | None) -> int:
    """Dispatches one recorded decode forward runs (a played tape counts its own)."""
    cache = model.new_cache(8)
    cache.adapter = adapter
    try:
        rec = model.registry.recorder()
        model.record_forward(rec, 1, cache, 0)
        rec.submit()
        return rec.dispatches
    finally:
        model.release_cache(cache)


def test_a_forward_without_adapted_rows_records_no_lora_dispatch(adapted):
    _, _, model = adapted("llama-tied-gqa")
    layers = model.config.num_hidden_layers
    # Adapter "a" adapts the four matmuls of each layer: a LoRA dispatch each (normalising x itself where the base
    # fuses a norm), and the down projection's input act(gate)·up, which the fused base kernel never wrote.
    assert dispatches(model, "a") - dispatches(model, None) == layers * (4 + 1)


def test_rows_of_two_adapters_and_none_in_one_forward_each_equal_their_own_forward(adapted):
    _, _, model = adapted("llama-tied-gqa")
    prompts = {"a": PROMPT[:9], None: PROMPT[2:13], "b": PROMPT[5:11]}
    alone = {name: logits_with(model, ids + [1] * DECODE, name)[: len(ids)] for name, ids in prompts.items()}
    caches = []
    for name in prompts:
        caches.append(model.new_cache(32))
        caches[-1].adapter = name
    try:
        stacked = np.concatenate([np.asarray(ids, np.uint32) for ids in prompts.values()])
        model.ids.view((stacked.size,)).write(stacked)
        rec = model.registry.recorder()
        model.record_batch(rec, [(cache, 0, len(ids)) for cache, ids in zip(caches, prompts.values(), strict=True)])
        rec.submit()
        together = model.read_logits(stacked.size).astype(np.float64)
    finally:
        for cache in caches:
            model.release_cache(cache)
    row0 = 0
    for name, ids in prompts.items():
        np.testing.assert_array_equal(together[row0 : row0 + len(ids)], alone[name], err_msg=f"adapter {name}")
        row0 += len(ids)


@pytest.mark.parametrize("drafter", ["prompt-lookup", "draft-model"])
def test_speculative_greedy_with_an_adapter_equals_plain_greedy_with_it(adapted, tiny_model, drafter):
    _, _, model = adapted("llama-tied-gqa")
    if drafter == "prompt-lookup":
        engine = SpeculativeEngine(model, PromptLookupDrafter())
    else:
        draft = tiny_model(draft_spec(model.config.vocab_size, seed=11))
        engine = SpeculativeEngine(model, DraftModelDrafter(draft, model.config.vocab_size))
    try:
        result = engine.generate(PROMPT, 24, GREEDY, k=3, adapter="a")
    finally:
        engine.close()
    assert result.tokens == reference_decode(model, PROMPT, 24, GREEDY, adapter="a")
    assert result.stats.steps > 0, "nothing was ever drafted"


def test_the_prefix_cache_never_gives_one_adapters_kv_to_another(adapted):
    _, _, model = adapted("llama-tied-gqa")
    engine = SpeculativeEngine(model, PromptLookupDrafter())
    engine.prefix_cache = PrefixCache(model, 1 << 24)
    try:
        for adapter in ("a", None, "b", "a"):  # the same prompt each time: a hit only for the second "a"
            result = engine.generate(PROMPT, 8, GREEDY, adapter=adapter)
            assert result.tokens == reference_decode(model, PROMPT, 8, GREEDY, adapter=adapter), adapter
        assert engine.prefix_cache.hits == 1
    finally:
        engine.prefix_cache.clear()
        engine.close()


def test_an_unknown_adapter_name_is_refused_naming_it(adapted):
    _, _, model = adapted("llama-tied-gqa")
    engine = SpeculativeEngine(model, PromptLookupDrafter())
    try:
        with pytest.raises(UnknownAdapterError, match=r"'nope'.*loaded: a, b"):
            engine.generate(PROMPT, 4, GREEDY, adapter="nope")
    finally:
        engine.close()
    with pytest.raises(UnknownAdapterError, match="'nope'"):
        model.adapters.remove("nope")


def test_adapters_come_and_go_without_touching_the_base(adapted):
    _, adapters, model = adapted("llama-tied-gqa")
    ids = PROMPT[: PREFILL + 2]
    base = logits_with(model, ids, None)
    model.adapters.add("c", adapters["a"])
    model.adapters.add("half", adapters["a"], dtype="f16")
    try:
        adapted_logits = logits_with(model, ids, "a")
        np.testing.assert_array_equal(logits_with(model, ids, "c"), adapted_logits)
        # f16 A and B: the update rounds its weights to 11 bits (|logits| ~ 10, the update a fraction of them).
        np.testing.assert_allclose(logits_with(model, ids, "half"), adapted_logits, atol=2e-2)
        with pytest.raises(AdapterError, match="'c' is loaded already"):
            model.adapters.add("c", adapters["b"])
    finally:
        model.adapters.remove("c")
        model.adapters.remove("half")
    assert "c" not in model.adapters and "half" not in model.adapters
    np.testing.assert_array_equal(logits_with(model, ids, None), base)


def rewrite(src, dst, *, config=None, tensors=None):
    """A copy of the adapter folder `src` in `dst` with its config updated by `config` and tensors by `tensors`
    (a function of the dict)."""
    dst.mkdir()
    data = json.loads((src / "adapter_config.json").read_text()) | (config or {})
    (dst / "adapter_config.json").write_text(json.dumps(data))
    weights = load_file(src / "adapter_model.safetensors")
    save_file(tensors(weights) if tensors else weights, dst / "adapter_model.safetensors")
    return dst


def test_bad_adapters_are_typed_errors_naming_what_is_wrong(adapted, tmp_path):
    _, adapters, model = adapted("llama-tied-gqa")
    _, other, _ = adapted("qwen3-qknorm-gqa")  # head_dim 32: q/k/v widths differ from the LLaMA's
    src = adapters["a"]
    with pytest.raises(AdapterError, match="no such file"):
        model.adapters.add("x", tmp_path / "missing")
    with pytest.raises(
        AdapterError, match=r"k_proj: lora_A \(4, 64\) and lora_B \(64, 4\) do not fit the base model's 32 x 64"
    ):
        model.adapters.add("x", other["a"])
    with pytest.raises(AdapterError, match="use_dora=True is not supported"):
        model.adapters.add("x", rewrite(src, tmp_path / "dora", config={"use_dora": True}))

    def past_the_layers(weights):
        return weights | {k.replace("layers.1.", "layers.7."): v for k, v in weights.items() if "layers.1." in k}

    with pytest.raises(AdapterError, match="layer 7, the model has 2 layers"):
        model.adapters.add("x", rewrite(src, tmp_path / "deep", tensors=past_the_layers))

    def on_the_embedding(weights):
        return weights | {"base_model.model.model.embed_tokens.lora_A.weight": np.zeros((4, 128), np.float32)}

    with pytest.raises(AdapterError, match=r"embed_tokens\.lora_A\.weight.*not a LoRA A/B weight"):
        model.adapters.add("x", rewrite(src, tmp_path / "embed", tensors=on_the_embedding))

    def without_a_b(weights):
        return {k: v for k, v in weights.items() if not ("layers.0.mlp.up_proj" in k and "lora_B" in k)}

    with pytest.raises(AdapterError, match=r"layer 0 mlp\.up_proj has no lora_B"):
        model.adapters.add("x", rewrite(src, tmp_path / "half", tensors=without_a_b))
    assert "x" not in model.adapters
