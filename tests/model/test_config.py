"""ModelConfig: what a config.json must say, what it may leave out, and what we refuse."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import doppler_py
from doppler_py.errors import ModelFormatError, UnsupportedModelError
from doppler_py.model.config import GEMMA4_ROPE_DEFAULTS, ModelConfig
from doppler_py.testing.tiny import TinySpec, write_tiny_model

SOURCE = "test-config.json"
SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}


def config(**changes):
    data = {**SMOLLM2, **changes}
    return ModelConfig.from_dict({k: v for k, v in data.items() if v is not None}, source=SOURCE)


def test_smollm2_config_reads_every_field():
    cfg = config()
    assert (cfg.architecture, cfg.model_type) == ("LlamaForCausalLM", "llama")
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (49152, 576, 1536, 30)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert (cfg.rms_norm_eps, cfg.rope_theta, cfg.rope_scaling) == (1e-5, 100000.0, None)
    assert cfg.max_position_embeddings == 8192
    assert cfg.tie_word_embeddings and not cfg.attention_bias and not cfg.attention_out_bias
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.torch_dtype) == (1, (2,), "bfloat16")


def test_omitted_fields_take_transformers_defaults():
    cfg = config(
        num_key_value_heads=None,
        rms_norm_eps=None,
        rope_theta=None,
        max_position_embeddings=None,
        tie_word_embeddings=None,
        bos_token_id=None,
        eos_token_id=None,
        torch_dtype=None,
    )
    assert cfg.num_key_value_heads == cfg.num_attention_heads
    assert cfg.head_dim == 576 // 9
    assert (cfg.rms_norm_eps, cfg.rope_theta, cfg.max_position_embeddings) == (1e-6, 10000.0, 2048)
    assert not cfg.tie_word_embeddings
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.torch_dtype) == (None, (), None)


def test_architecture_can_come_from_model_type_alone():
    assert config(architectures=None, model_type="qwen2").architecture == "Qwen2ForCausalLM"


def test_qwen2_has_qkv_biases_without_saying_so():
    cfg = config(architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    assert cfg.attention_bias and not cfg.attention_out_bias
    assert cfg.max_position_embeddings == 8192


def test_llama_attention_bias_covers_the_output_projection():
    cfg = config(attention_bias=True)
    assert cfg.attention_bias and cfg.attention_out_bias


def test_mistral_without_a_sliding_window_is_supported():
    cfg = config(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None)
    assert cfg.model_type == "mistral"


def test_explicit_head_dim_need_not_divide_hidden():
    cfg = config(hidden_size=5120, num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    assert cfg.head_dim == 128


def test_eos_may_be_a_list():
    assert config(eos_token_id=[2, 0]).eos_token_ids == (2, 0)


def test_transformers5_rope_parameters_are_read():
    cfg = config(rope_theta=None, rope_parameters={"rope_theta": 5e5, "rope_type": "default"})
    assert (cfg.rope_theta, cfg.rope_scaling) == (5e5, None)


@pytest.mark.parametrize("spelling", ["rope_scaling", "rope_parameters"])
def test_llama3_rope_scaling_is_kept_with_its_parameters(spelling):
    scaling = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cfg = config(**{spelling: scaling})
    assert cfg.rope_scaling == scaling


def test_linear_rope_scaling_with_the_old_type_key():
    assert config(rope_scaling={"type": "linear", "factor": 2.0}).rope_scaling == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize("kind", ["yarn", "dynamic", "longrope"])
def test_unknown_rope_scaling_is_unsupported(kind):
    with pytest.raises(UnsupportedModelError, match=kind):
        config(rope_scaling={"rope_type": kind, "factor": 4.0})


def test_rope_scaling_without_its_parameters_is_a_format_error():
    with pytest.raises(ModelFormatError, match=r"config.json.*rope_scaling\.low_freq_factor"):
        config(rope_scaling={"rope_type": "llama3", "factor": 8.0})


@pytest.mark.parametrize(
    "changes",
    [
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
        {"architectures": None, "model_type": "gemma"},
        {"hidden_act": "gelu"},
        {"mlp_bias": True},
        {"layer_types": ["full_attention", "sliding_attention"]},
    ],
    ids=["architecture", "model_type", "activation", "mlp_bias", "llama_layer_types"],
)
def test_unsupported_models_are_refused(changes):
    with pytest.raises(UnsupportedModelError, match=re.escape(SOURCE)):
        config(**changes)


def test_a_window_that_is_switched_off_leaves_every_layer_full():
    qwen = config(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=False, sliding_window=4096)
    mistral = config(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None)
    assert qwen.layer_types == mistral.layer_types == () and qwen.layer_window(3) == mistral.layer_window(3) == 0


def test_sliding_windows_of_mistral_and_qwen_layers_as_transformers_reads_them():
    """Mistral slides every layer; Qwen2 / Qwen3 with use_sliding_window the layers from max_window_layers on."""
    mistral = config(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=4096)
    assert {mistral.layer_window(i) for i in range(30)} == {4096}
    for arch, model_type in (("Qwen2ForCausalLM", "qwen2"), ("Qwen3ForCausalLM", "qwen3")):
        qwen = config(
            architectures=[arch], model_type=model_type, head_dim=64, use_sliding_window=True, max_window_layers=28
        )
        assert [qwen.layer_window(i) for i in range(30)] == [0] * 28 + [4096] * 2


@pytest.mark.parametrize(
    "field", ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
)
def test_missing_required_field_is_named(field):
    with pytest.raises(ModelFormatError, match=rf"{SOURCE}: required field '{field}' is missing"):
        config(**{field: None})


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"num_key_value_heads": 4}, "num_key_value_heads"),
        ({"num_attention_heads": 7, "num_key_value_heads": 7}, "num_attention_heads"),
        ({"head_dim": 63}, "head_dim"),
        ({"hidden_size": "576"}, "hidden_size"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"vocab_size": True}, "vocab_size"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
        ({"eos_token_id": 49152}, "eos_token_id"),
        ({"bos_token_id": [1, 2]}, "bos_token_id"),
        ({"model_type": "qwen2"}, "model_type"),
    ],
)
def test_inconsistent_values_name_the_file_and_field(changes, field):
    with pytest.raises(ModelFormatError, match=rf"{SOURCE}: field '{field}'"):
        config(**changes)


def test_from_file_names_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**SMOLLM2, "num_key_value_heads": 2}))
    with pytest.raises(ModelFormatError, match=re.escape(str(path))):
        ModelConfig.from_file(path)


@pytest.mark.parametrize("content", [None, "{not json", "[1, 2]"], ids=["missing", "malformed", "not_an_object"])
def test_unreadable_config_file_is_a_format_error(tmp_path, content):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ModelFormatError, match=re.escape(str(path))):
        ModelConfig.from_file(path)


# --- shapes the kernels cannot run ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            TinySpec(num_attention_heads=8, num_key_value_heads=2),
            "head_dim = hidden_size / num_attention_heads = 64 / 8 = 8 (no 'head_dim' field) is not supported",
        ),
        (
            TinySpec(hidden_size=576, num_attention_heads=1, num_key_value_heads=1),
            "head_dim = hidden_size / num_attention_heads = 576 / 1 = 576 (no 'head_dim' field) is not supported",
        ),
        (
            TinySpec(hidden_size=48, num_attention_heads=3, num_key_value_heads=1),
            "field 'hidden_size' = 48 is not supported",
        ),
        (TinySpec(intermediate_size=100), "field 'intermediate_size' = 100 is not supported"),
    ],
    ids=["head_dim-8", "head_dim-576", "hidden-48", "intermediate-100"],
)
def test_loading_a_model_the_kernels_cannot_run_names_the_field(tmp_path, gpu, spec, message):
    # Before: head dims failed with a bare ValueError at the first forward, K widths with a ModelFormatError
    # calling the files damaged. Now load() refuses the config itself, before any weights reach the GPU.
    folder = write_tiny_model(tmp_path, spec)
    with pytest.raises(UnsupportedModelError, match=re.escape(f"{folder / 'config.json'}: {message}")):
        doppler_py.load(folder, weights="f32", gpu=gpu, max_seq=None, progress=False)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"head_dim": 528},
            "field 'head_dim' = 528 is not supported: the attention kernel runs head dims that are "
            "multiples of 16 from 16 to 512",
        ),
        ({"head_dim": 40}, "field 'head_dim' = 40 is not supported"),
        (
            {"head_dim": 48},
            "num_attention_heads * head_dim = 9 * 48 = 432 is not supported: the matmul kernels need a multiple of 32",
        ),
        ({"vocab_size": 1 << 24}, "field 'vocab_size' = 16777216 is not supported"),
    ],
    ids=["head_dim-above-512", "head_dim-not-16n", "o_proj-width", "vocab"],
)
def test_unsupported_shapes_are_refused_naming_the_field(changes, message):
    with pytest.raises(UnsupportedModelError, match=re.escape(f"{SOURCE}: {message}")):
        config(**changes)


def test_the_supported_head_dims_reach_from_16_to_512():
    assert config(num_attention_heads=36, num_key_value_heads=3).head_dim == 16
    cfg = config(hidden_size=4096, num_attention_heads=16, num_key_value_heads=16, head_dim=256)
    assert cfg.head_dim == 256
    assert config(num_attention_heads=8, num_key_value_heads=1, head_dim=512).head_dim == 512  # Gemma 4's global


@pytest.mark.slow
@pytest.mark.parametrize("name", ["LlamaConfig", "Qwen2Config", "MistralConfig"])
def test_configs_saved_by_transformers_read_back_the_same(tmp_path, name):
    transformers = pytest.importorskip("transformers")
    extra = {"sliding_window": None} if name == "MistralConfig" else {}
    reference = getattr(transformers, name)(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=5e5,
        tie_word_embeddings=True,
        **extra,
    )
    reference.save_pretrained(tmp_path)
    cfg = ModelConfig.from_file(tmp_path / "config.json")
    assert cfg.model_type == reference.model_type
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        assert getattr(cfg, field) == getattr(reference, field), field
    assert (cfg.num_key_value_heads, cfg.head_dim) == (2, 16)
    assert cfg.rms_norm_eps == reference.rms_norm_eps
    assert cfg.rope_theta == 5e5
    assert cfg.max_position_embeddings == reference.max_position_embeddings
    assert cfg.tie_word_embeddings


@pytest.mark.slow
def test_qwen3_and_gemma3_configs_saved_by_transformers_read_back_the_same(tmp_path):
    transformers = pytest.importorskip("transformers")
    shape = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
    transformers.Qwen3Config(**shape, num_hidden_layers=2, head_dim=32).save_pretrained(tmp_path / "qwen3")
    qwen3 = ModelConfig.from_file(tmp_path / "qwen3" / "config.json")
    assert (qwen3.model_type, qwen3.head_dim, qwen3.qk_norm, qwen3.norm_offset) == ("qwen3", 32, True, 0.0)
    assert (qwen3.attention_bias, qwen3.sliding_window, qwen3.layer_types) == (False, None, ())

    gemma = transformers.Gemma3TextConfig(
        **shape, num_hidden_layers=7, head_dim=32, sliding_window=16, query_pre_attn_scalar=48
    )
    gemma.save_pretrained(tmp_path / "gemma3")
    cfg = ModelConfig.from_file(tmp_path / "gemma3" / "config.json")
    assert cfg.model_type == "gemma3_text" and cfg.tie_word_embeddings and cfg.qk_norm and cfg.sandwich_norms
    assert cfg.layer_types == tuple(gemma.layer_types)  # every 6th layer global
    assert [cfg.layer_window(i) for i in range(7)] == [16] * 5 + [0, 16]
    assert cfg.layer_rope(0) == (10_000.0, None) and cfg.layer_rope(5) == (1_000_000.0, None)
    assert cfg.attention_scale == 48**-0.5 and cfg.embed_scale == 8.0
    assert (cfg.norm_offset, cfg.hidden_act, cfg.rms_norm_eps) == (1.0, "gelu_pytorch_tanh", 1e-6)


def test_a_bidirectional_gemma3_reads_its_window_as_transformers_does():
    """EmbeddingGemma's config: use_bidirectional_attention, sliding_window 512 spanning both ways; transformers'
    Gemma3TextConfig reads it as 512 // 2 + 1 = 257 (keys less than 257 positions away either way)."""
    gemma3 = dict(architectures=["Gemma3TextModel"], model_type="gemma3_text", head_dim=64, sliding_window=512)
    cfg = config(**gemma3, use_bidirectional_attention=True)
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.bidirectional_attention and cfg.sliding_window == 257
    causal = config(**gemma3)
    assert not causal.bidirectional_attention and causal.sliding_window == 512
    with pytest.raises(UnsupportedModelError, match="Gemma 2"):
        config(architectures=["Gemma2ForCausalLM"], model_type="gemma2", head_dim=64, use_bidirectional_attention=True)


def test_gemma3_in_the_transformers_4_spelling():
    """rope_theta / rope_local_base_freq and no layer_types (transformers 4 files, e.g. gemma-3-270m's)."""
    cfg = config(
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        head_dim=64,
        num_hidden_layers=6,
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        sliding_window=512,
        query_pre_attn_scalar=256,
        hidden_activation="gelu_pytorch_tanh",
    )
    assert [cfg.layer_window(i) for i in range(6)] == [512] * 5 + [0]
    assert cfg.layer_rope(0) == (1e4, None) and cfg.layer_rope(5) == (1e6, None)
    assert cfg.embed_scale == float(np.float32(np.sqrt(576))) and cfg.attention_scale == 1 / 16


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"hidden_activation": "relu"}, "hidden_activation"),
        ({"layer_types": ["sliding_attention"]}, "layer_types"),
    ],
)
def test_gemma3_features_we_do_not_run_are_refused(extra, message):
    with pytest.raises((UnsupportedModelError, ModelFormatError), match=message):
        config(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", head_dim=64, **extra)


def test_gemma2_defaults_alternate_windows_share_one_rope_and_cap_scores_and_logits():
    gemma2 = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "head_dim": 64}
    cfg = config(**gemma2, num_hidden_layers=4)
    assert [cfg.layer_window(i) for i in range(4)] == [4096, 0, 4096, 0]
    assert cfg.layer_rope(0) == cfg.layer_rope(1) == (100000.0, None)  # rope_theta for every layer
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (50.0, 30.0)
    assert not cfg.qk_norm and cfg.sandwich_norms and cfg.norm_offset == 1.0
    data = {**SMOLLM2, **gemma2, "attn_logit_softcapping": None, "final_logit_softcapping": None}
    uncapped = ModelConfig.from_dict(data, source=SOURCE)  # explicit nulls: not capped
    assert uncapped.attn_logit_softcapping is None and uncapped.final_logit_softcapping is None
    with pytest.raises(ModelFormatError, match="final_logit_softcapping"):
        config(**gemma2, final_logit_softcapping=-1.0)


def test_gemma3_caps_only_where_its_config_sets_a_cap():
    gemma3 = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "head_dim": 64}
    cfg = config(**gemma3)
    assert cfg.attn_logit_softcapping is None and cfg.final_logit_softcapping is None
    assert config(**gemma3, final_logit_softcapping=30.0).final_logit_softcapping == 30.0


# A Qwen 3.5 text config at a small model's scale (transformers' Qwen3_5TextConfig fields as config.json spells them).
QWEN3_5 = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,
    "hidden_size": 1024,
    "intermediate_size": 3584,
    "num_hidden_layers": 24,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 16,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
}


def qwen3_5(**changes):
    data = {**QWEN3_5, **changes}
    return ModelConfig.from_dict({k: v for k, v in data.items() if v is not None}, source=SOURCE)


def test_qwen3_5_reads_its_hybrid_layers_and_partial_rope():
    cfg = qwen3_5()
    assert [cfg.is_linear(i) for i in range(8)] == [True, True, True, False] * 2  # every 4th layer attends
    assert [i for i in range(24) if not cfg.is_linear(i)] == [3, 7, 11, 15, 19, 23]
    assert cfg.rotary_dim == 64 and cfg.attention_gate and cfg.norm_offset == 1.0 and cfg.rope_theta == 1e7
    shape = cfg.linear_attention
    assert (shape.channels, shape.value_width, shape.mix_width) == (6144, 2048, 6144 + 2048 + 32)
    assert cfg.weights_prefix == "model." and not cfg.tie_word_embeddings


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"linear_key_head_dim": 256}, "field 'linear_key_head_dim' = 256 is not supported"),
        ({"linear_value_head_dim": 192}, "field 'linear_value_head_dim' = 192 is not supported"),
        ({"linear_conv_kernel_dim": 32}, "field 'linear_conv_kernel_dim' = 32 is not supported"),
        (
            {"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": None},
            "architecture 'Qwen3_5MoeForCausalLM' is not supported: doppler-py lacks its mixture-of-experts MLP",
        ),
    ],
    ids=["key-dim", "value-dim", "conv-taps", "moe"],
)
def test_qwen3_5_variants_beyond_the_kernels_are_refused_naming_what(changes, message):
    with pytest.raises(UnsupportedModelError, match=re.escape(f"{SOURCE}: {message}")):
        qwen3_5(**changes)


def test_qwen3_5_layer_types_must_name_known_kinds():
    with pytest.raises(ModelFormatError, match="'linear_attention'"):
        qwen3_5(num_hidden_layers=2, layer_types=["linear_attention", "mamba"])


GEMMA4 = {
    "architectures": ["Gemma4ForCausalLM"],
    "model_type": "gemma4_text",
    "head_dim": 32,
    "global_head_dim": 64,
    "num_hidden_layers": 6,
    "num_key_value_heads": 1,
    "hidden_size_per_layer_input": 32,
    "vocab_size_per_layer_input": 49152,
}


def gemma4(**changes):
    return config(**{**GEMMA4, **changes})


def test_gemma4_layers_take_their_type_s_head_dim_rope_and_kv_source():
    cfg = gemma4(layer_types=None)
    # transformers' default pattern: every 6th layer full, the last one forced full
    assert cfg.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    cfg = gemma4(
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        layer_types=["sliding_attention", "full_attention"] * 3,
        final_logit_softcapping=30.0,
    )
    assert [cfg.layer_head_dim(i) for i in range(6)] == [32, 64] * 3
    assert [cfg.kv_source(i) for i in range(6)] == [0, 1, 2, 3, 2, 3]  # the last layer of each type before them
    assert [cfg.layer_intermediate_size(i) for i in range(6)] == [1536] * 4 + [3072] * 2
    assert cfg.layer_rope(0) == (10_000.0, None)
    assert cfg.layer_rope(1) == (1e6, {"rope_type": "proportional", "partial_rotary_factor": 0.25, "factor": 1.0})
    assert (cfg.norm_offset, cfg.attention_scale, cfg.embed_scale) == (0.0, 1.0, float(np.float32(576**0.5)))
    assert cfg.v_norm and cfg.sandwich_norms and cfg.qk_norm and cfg.tie_word_embeddings
    assert (cfg.hidden_size_per_layer_input, cfg.final_logit_softcapping, cfg.attn_logit_softcapping) == (
        32,
        30.0,
        None,
    )
    assert (cfg.sliding_window, cfg.weights_prefix) == (512, "model.")


def test_other_families_keep_one_head_dim_and_their_own_kv():
    cfg = config()
    assert [cfg.layer_head_dim(i) for i in (0, 29)] == [64, 64]
    assert [cfg.kv_source(i) for i in (0, 29)] == [0, 29]
    assert cfg.layer_intermediate_size(29) == 1536 and cfg.hidden_size_per_layer_input == 0


def test_gemma4_k_eq_v_models_give_full_layers_the_global_kv_heads():
    cfg = gemma4(num_attention_heads=8, attention_k_eq_v=True, num_global_key_value_heads=2, num_key_value_heads=4)
    assert [cfg.layer_num_kv_heads(i) for i in range(6)] == [4] * 5 + [2]
    # without k_eq_v transformers ignores num_global_key_value_heads
    assert gemma4(num_attention_heads=8, num_global_key_value_heads=2).layer_num_kv_heads(5) == 1


def test_gemma4_multimodal_folder_reads_its_text_config():
    text = {k: v for k, v in {**SMOLLM2, **GEMMA4}.items() if k not in ("architectures", "eos_token_id")}
    data = {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": text,
        "vision_config": {"model_type": "gemma4_vision"},
        "eos_token_id": [1, 106],
    }
    cfg = ModelConfig.from_dict(data, source=SOURCE)
    assert (cfg.architecture, cfg.weights_prefix, cfg.eos_token_ids) == (
        "Gemma4ForCausalLM",
        "model.language_model.",
        (1, 106),
    )
    assert cfg.layer_head_dims == gemma4().layer_head_dims
    with pytest.raises(ModelFormatError, match="text_config"):
        ModelConfig.from_dict({**data, "text_config": None}, source=SOURCE)


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"enable_moe_block": True, "num_experts": 8}, UnsupportedModelError, "mixture-of-experts"),
        ({"use_bidirectional_attention": "all"}, UnsupportedModelError, "bidirectional"),
        ({"num_kv_shared_layers": 6}, UnsupportedModelError, "gemma4_assistant"),
        ({"global_head_dim": 528}, UnsupportedModelError, "layer 5's head_dim = 528"),
        (
            {"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1e6}}},
            UnsupportedModelError,
            "yarn",
        ),
        ({"hidden_size_per_layer_input": 48}, UnsupportedModelError, "hidden_size_per_layer_input"),
        ({"vocab_size_per_layer_input": 100}, UnsupportedModelError, "vocab_size_per_layer_input"),
        ({"per_layer_config": {"5": {"sliding_window": 3}}}, UnsupportedModelError, "sliding_window"),
        (
            {"num_kv_shared_layers": 1, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]},
            ModelFormatError,
            "KV-shared",
        ),
        (
            {"rope_parameters": {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 2}}},
            ModelFormatError,
            "partial_rotary_factor",
        ),
        (
            {
                "num_kv_shared_layers": 1,
                "layer_types": ["sliding_attention", "full_attention"] * 3,
                "per_layer_config": {"3": {"head_dim": 64}},
            },
            ModelFormatError,
            "KV-shared layer 5 has 1 KV heads of 32 but reads the K/V of layer 3, which has 1 of 64",
        ),
    ],
)
def test_gemma4_variants_we_do_not_run_are_refused(changes, error, message):
    with pytest.raises(error, match=message):
        gemma4(**changes)


@pytest.mark.slow
def test_gemma4_config_saved_by_transformers_reads_back_the_same(tmp_path):
    """transformers writes its per-layer head dims as per_layer_config; the layers' shapes and KV sources
    come back as its model builds them."""
    transformers = pytest.importorskip("transformers")
    reference = transformers.Gemma4TextConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        global_head_dim=64,
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=32,
        vocab_size_per_layer_input=320,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"],
    )
    reference.save_pretrained(tmp_path)
    assert "per_layer_config" in json.loads((tmp_path / "config.json").read_text())
    cfg = ModelConfig.from_file(tmp_path / "config.json")
    assert [cfg.layer_head_dim(i) for i in range(5)] == [reference.per_layer_config[i].head_dim for i in range(5)]
    modes = reference.kv_sharing_modes
    assert [cfg.kv_source(i) == i for i in range(5)] == [mode != "reuse" for mode in modes]
    assert cfg.layer_rope(1)[1] == {"rope_type": "proportional", "partial_rotary_factor": 0.25, "factor": 1.0}


def test_an_e2b_sized_gemma4_config_is_accepted():
    """E2B's shape as we understand its published config (not checked against the file: nothing is downloaded):
    35 layers, four sliding then one full, the last 20 reading the K/V of layers 13 (sliding) and 14 (full),
    head dims 256 / 512, one KV head, double-wide MLPs on the shared layers, per-layer inputs of 256."""
    cfg = config(
        architectures=["Gemma4ForCausalLM"],
        model_type="gemma4_text",
        vocab_size=262_144,
        hidden_size=1536,
        intermediate_size=6144,
        num_hidden_layers=35,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=256,
        global_head_dim=512,
        num_kv_shared_layers=20,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=256,
        vocab_size_per_layer_input=262_144,
        sliding_window=512,
        final_logit_softcapping=30.0,
        layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7,
        rope_parameters=GEMMA4_ROPE_DEFAULTS,
    )
    assert {cfg.layer_head_dim(i) for i in range(35)} == {256, 512}
    assert {cfg.kv_source(i) for i in range(15, 35)} == {13, 14}
    assert [cfg.layer_intermediate_size(i) for i in (14, 15)] == [6144, 12288]
