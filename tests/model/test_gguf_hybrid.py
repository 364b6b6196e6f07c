"""Qwen 3.5 (`qwen35`) and Gemma 4 (`gemma4`) GGUF import.

The tiny random HF models of tests/model (TINY_SPECS "qwen3_5-hybrid" and "gemma4", with a vocabulary the size of
a GGUF tokenizer below) are written into GGUF files the way llama.cpp's converter writes them: the gguf package's
own name tables (gguf.get_tensor_name_map), and the converter's value changes done here independently of the
reader (conversion/qwen.py, conversion/gemma.py; see doppler_py/model/gguf_families.py). The converted folder must
give back the HF tensors, and run like transformers on the ORIGINAL folder, with the tolerance of
test_forward_vs_hf (1e-4 on f32 logits).
"""

from __future__ import annotations

import dataclasses
import json

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from model.test_forward_vs_hf import DECODE, PREFILL, our_logits, sequence
from model.test_gguf import CHAT_TEMPLATE, MERGES, SPECIALS, TOKENS, read_folder
from model.test_gguf_gemma import vocabulary
from safetensors.numpy import load_file
from tokenizers import Tokenizer as Backend

from doppler_py.errors import UnsupportedModelError
from doppler_py.model.config import ModelConfig
from doppler_py.model.gguf import QUANT_METADATA_KEY, convert_gguf, hf_config, read_gguf, tokenizer_files
from doppler_py.model.spm_vocab import SPACE, spm_merges
from doppler_py.testing.tiny import TINY_SPECS, config_dict

QWEN35 = dataclasses.replace(TINY_SPECS["qwen3_5-hybrid"], vocab_size=len(TOKENS))
GEMMA4_PIECES, GEMMA4_SCORES, GEMMA4_TYPES = vocabulary()
GEMMA4 = dataclasses.replace(TINY_SPECS["gemma4"], vocab_size=len(GEMMA4_PIECES))


def reorder_value_heads(w: np.ndarray, key_heads: int, per_key: int, width: int, axis: int = 0) -> np.ndarray:
    """llama.cpp's _LinearAttentionVReorderBase: value heads grouped by key head -> tiled (k0 k1 k0 k1 ...)."""
    w = np.moveaxis(w, axis, 0)
    tiled = w.reshape(key_heads, per_key, width, *w.shape[1:]).swapaxes(0, 1).reshape(w.shape)
    return np.moveaxis(tiled, 0, axis)


def llama_cpp_qwen35_tensor(name: str, w: np.ndarray, cfg: dict) -> tuple[str, np.ndarray]:
    """What Qwen3_5TextModel.modify_tensors yields for one HF tensor (the HF name, renamed where it renames)."""
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    if nk != nv and ".linear_attn." in name:
        per_key, qk = nv // nk, 2 * nk * dk
        if ".in_proj_qkv." in name or ".conv1d." in name:
            w = np.concatenate([w[:qk], reorder_value_heads(w[qk:], nk, per_key, dv)])
        elif ".in_proj_z." in name:
            w = reorder_value_heads(w, nk, per_key, dv)
        elif name.endswith((".in_proj_a.weight", ".in_proj_b.weight", ".A_log", ".dt_bias")):
            w = reorder_value_heads(w, nk, per_key, 1)
        elif ".out_proj." in name:
            w = reorder_value_heads(w, nk, per_key, dv, axis=1)
    if name.endswith(".A_log"):
        w = -np.exp(w)
    elif name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif ".conv1d." in name:
        w = w.squeeze(1)
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        w = w + np.float32(1)
    return name, w


def add_tensors(writer, arch, weights: dict[str, np.ndarray], layers: int, matrix_type: Q = Q.F32) -> None:
    names = gguf.get_tensor_name_map(arch, layers)
    for hf, array in weights.items():
        name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf
        kind = matrix_type if array.ndim == 2 and array.shape[1] % 32 == 0 and "conv1d" not in name else Q.F32
        if kind == Q.F32:
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
        else:
            writer.add_tensor(name, quantize(array, kind), raw_dtype=kind)


def finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_common(writer, cfg: dict) -> None:
    """TextModel.set_gguf_parameters' part of the metadata that Gemma4Model and the MTP block do not change."""
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])


def mtp_block(cfg: dict, rng) -> dict[str, np.ndarray]:
    """Some of a multi-token-prediction block as _Qwen35MtpMixin writes it, the block after the model's own layers
    (GGUF names: the installed gguf package's name map lists nextn tensors for qwen35moe only)."""
    h, t = cfg["hidden_size"], gguf.MODEL_TENSOR
    shapes = {t.NEXTN_EH_PROJ: (h, 2 * h), t.NEXTN_ENORM: (h,), t.NEXTN_HNORM: (h,), t.ATTN_NORM: (h,)}
    return {
        gguf.TENSOR_NAMES[kind].format(bid=cfg["num_hidden_layers"]) + ".weight": rng.standard_normal(shape).astype(
            np.float32
        )
        for kind, shape in shapes.items()
    }


def write_qwen35_gguf(path, folder, matrix_type: Q = Q.F32, arch: str = "qwen35"):
    """The tiny Qwen 3.5 folder as llama.cpp's Qwen3_5TextModel writes it, with a byte-level BPE vocabulary and
    a multi-token-prediction block (which the real models have)."""
    cfg = config_dict(QWEN35)
    writer = gguf.GGUFWriter(str(path), arch)
    add_common(writer, cfg)
    writer.add_block_count(cfg["num_hidden_layers"] + 1)  # the MTP block
    writer.add_nextn_predict_layers(1)
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(cfg["linear_key_head_dim"])
    writer.add_ssm_group_count(cfg["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    writer.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    interval = cfg["layer_types"].index("full_attention") + 1
    assert all((kind == "full_attention") == ((i + 1) % interval == 0) for i, kind in enumerate(cfg["layer_types"]))
    writer.add_full_attention_interval(interval)
    writer.add_rope_dimension_count(int(cfg["head_dim"] * cfg["rope_parameters"]["partial_rotary_factor"]))
    writer.add_rope_dimension_sections([11, 11, 10, 0])  # _Qwen35MRopeMixin's default
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen35")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)
    weights = dict(llama_cpp_qwen35_tensor(n, w, cfg) for n, w in load_file(str(folder / "model.safetensors")).items())
    add_tensors(writer, gguf.MODEL_ARCH.QWEN35, weights, QWEN35.num_hidden_layers, matrix_type)
    for name, array in mtp_block(cfg, np.random.default_rng(0)).items():
        writer.add_tensor(name, array)
    finish(writer)
    return path


def write_gemma4_gguf(path, folder, *, spec=GEMMA4, extra_tensors=(), expert_count: int | None = None):
    """A tiny Gemma 4 folder as llama.cpp's Gemma4Model writes it, with a "gemma4" BPE vocabulary."""
    cfg = config_dict(spec)
    writer = gguf.GGUFWriter(str(path), "gemma4")
    add_common(writer, cfg)
    writer.add_block_count(cfg["num_hidden_layers"])
    swa = [kind == "sliding_attention" for kind in cfg["layer_types"]]
    layers, shared = cfg["num_hidden_layers"], cfg["num_kv_shared_layers"]
    rope = cfg["rope_parameters"]
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    writer.add_sliding_window(cfg["sliding_window"])
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(cfg["hidden_size_per_layer_input"])
    writer.add_sliding_window_pattern(swa)
    writer.add_key_length(cfg["global_head_dim"])
    writer.add_value_length(cfg["global_head_dim"])
    writer.add_key_length_swa(cfg["head_dim"])
    writer.add_value_length_swa(cfg["head_dim"])
    ffn = cfg["intermediate_size"]
    writer.add_feed_forward_length([ffn if i < layers - shared else 2 * ffn for i in range(layers)])
    writer.add_rope_dimension_count(cfg["global_head_dim"])
    writer.add_rope_dimension_count_swa(cfg["head_dim"])
    if (global_kv := cfg.get("num_global_key_value_heads")) is not None:
        writer.add_head_count_kv([cfg["num_key_value_heads"] if sliding else global_kv for sliding in swa])
    if expert_count:
        writer.add_expert_count(expert_count)
    writer.add_tokenizer_model("gemma4")
    writer.add_token_list(GEMMA4_PIECES)
    writer.add_token_scores(GEMMA4_SCORES)
    writer.add_token_types(GEMMA4_TYPES)
    writer.add_token_merges([f"{a} {b}" for a, b in spm_merges(GEMMA4_PIECES, GEMMA4_SCORES, GEMMA4_TYPES)])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_add_space_prefix(False)
    writer.add_add_bos_token(True)
    pairs = cfg["global_head_dim"] // 2
    rotating = int(pairs * rope["full_attention"]["partial_rotary_factor"])
    writer.add_tensor("rope_freqs.weight", np.array([1.0] * rotating + [1e30] * (pairs - rotating), np.float32))
    weights = load_file(str(folder / "model.safetensors"))
    renamed = {n + ".weight" if n.endswith("layer_scalar") else n: w for n, w in weights.items()}
    add_tensors(writer, gguf.MODEL_ARCH.GEMMA4, renamed, layers)  # Gemma 4's norms are stored as they are
    for name, array in extra_tensors:
        writer.add_tensor(name, array)
    finish(writer)
    return path


def assert_same_model_config(converted, original) -> None:
    """The converted folder's config means the same model as the original's (token ids come from the GGUF)."""
    ours, theirs = (dataclasses.asdict(ModelConfig.from_file(f / "config.json")) for f in (converted, original))
    for field in ("bos_token_id", "eos_token_ids"):
        del ours[field], theirs[field]
    theirs["rms_norm_eps"] = float(np.float32(theirs["rms_norm_eps"]))  # GGUF stores it as float32
    assert ours == theirs


def test_a_qwen35_gguf_converts_back_to_the_hf_tensors_and_config(tmp_path, tiny_folder):
    folder = tiny_folder(QWEN35)
    path = write_qwen35_gguf(tmp_path / "q.gguf", folder)
    out = convert_gguf(path, tmp_path / "out", "f32", progress=False)
    theirs, ours = load_file(str(folder / "model.safetensors")), read_folder(out)[0]
    assert sorted(ours) == sorted(theirs)
    for name, expected in theirs.items():
        # A_log goes through exp and log; a norm weight w through 1 + w, rounded to float32 as the model's
        # 1 + w is, then - 1 (exact).
        np.testing.assert_allclose(ours[name], expected, rtol=1e-6, atol=6e-8, err_msg=name)
    assert_same_model_config(out, folder)


def test_a_qwen35_gguf_runs_like_transformers_on_the_original_folder(tmp_path, tiny_folder, tiny_model, reference):
    folder = tiny_folder(QWEN35)
    out = convert_gguf(write_qwen35_gguf(tmp_path / "q.gguf", folder), tmp_path / "out", "f32", progress=False)
    ids = sequence(QWEN35.vocab_size, PREFILL + DECODE)
    ours = our_logits(tiny_model(out, "f32", max_rows=32), ids)
    np.testing.assert_allclose(ours, reference.hf_logits(folder, ids), atol=1e-4, rtol=0)


def test_a_q8_0_qwen35_gguf_keeps_its_blocks_in_transformers_row_order(tmp_path, tiny_folder):
    """Moved rows keep their blocks (in_proj_qkv's value rows, in_proj_z); out_proj, whose value-head COLUMNS
    llama.cpp moved, is dequantised to f16."""
    folder = tiny_folder(QWEN35)
    path = write_qwen35_gguf(tmp_path / "q8.gguf", folder, Q.Q8_0)
    ours, metadata = read_folder(convert_gguf(path, tmp_path / "out", "keep", progress=False))
    theirs = load_file(str(folder / "model.safetensors"))
    kept = set(json.loads(metadata[QUANT_METADATA_KEY]))
    qkv, z, out = (f"model.layers.0.linear_attn.{n}.weight" for n in ("in_proj_qkv", "in_proj_z", "out_proj"))
    assert {qkv, z} <= kept and out not in kept
    for name in (qkv, z):  # quantising each HF row equals quantising it where llama.cpp moved it
        np.testing.assert_array_equal(
            dequantize(ours[name], Q.Q8_0), dequantize(quantize(theirs[name], Q.Q8_0), Q.Q8_0)
        )
    np.testing.assert_allclose(ours[out], theirs[out], atol=0.02 * np.abs(theirs[out]).max())
    assert ours[out].dtype == np.float16


def test_a_gemma4_gguf_runs_like_transformers_on_the_original_folder(tmp_path, tiny_folder, tiny_model, reference):
    folder = tiny_folder(GEMMA4)
    path = write_gemma4_gguf(tmp_path / "g.gguf", folder)
    out = convert_gguf(path, tmp_path / "out", "f32", progress=False)
    theirs, ours = load_file(str(folder / "model.safetensors")), read_folder(out)[0]
    assert sorted(ours) == sorted(theirs)
    for name, expected in theirs.items():
        np.testing.assert_array_equal(ours[name], expected, err_msg=name)
    assert_same_model_config(out, folder)
    ids = sequence(GEMMA4.vocab_size, PREFILL + DECODE)
    ours_logits = our_logits(tiny_model(out, "f32", max_rows=32), ids)
    np.testing.assert_allclose(ours_logits, reference.hf_logits(folder, ids), atol=1e-4, rtol=0)


def test_a_gemma4_gguf_whose_full_layers_have_values_equal_to_keys(tmp_path, tiny_folder, tiny_model, reference):
    """attention_k_eq_v shows as full layers without attn_v, their KV head count in a per-layer head_count_kv."""
    spec = dataclasses.replace(GEMMA4, attention_k_eq_v=True, num_global_key_value_heads=2, seed=12)
    folder = tiny_folder(spec)
    out = convert_gguf(
        write_gemma4_gguf(tmp_path / "g.gguf", folder, spec=spec), tmp_path / "out", "f32", progress=False
    )
    assert_same_model_config(out, folder)
    ids = sequence(spec.vocab_size, PREFILL + DECODE, seed=1)
    ours = our_logits(tiny_model(out, "f32", max_rows=32), ids)
    np.testing.assert_allclose(ours, reference.hf_logits(folder, ids), atol=1e-4, rtol=0)


def test_the_gemma4_vocabulary_is_bpe_over_utf8_with_byte_fallback(tmp_path, tiny_folder):
    path = write_gemma4_gguf(tmp_path / "g.gguf", tiny_folder(GEMMA4))
    ours = Backend.from_str(tokenizer_files(read_gguf(path))[0])
    assert ours.encode("the thing").tokens == ["<bos>", "t", "he", SPACE + "th", "ing"]
    assert ours.encode("Ü\n\nin").tokens == ["<bos>", "<0xC3>", "<0x9C>", "<0x0A>", "<0x0A>", "in"]
    for text in ("the other one, then!", "  double  spaces\nand lines ", "Ünïcödé ☃"):
        assert ours.decode(ours.encode(text).ids, skip_special_tokens=True) == text, text


def test_the_qwen35_vocabulary_splits_combining_marks_into_words(tmp_path, tiny_folder):
    path = write_qwen35_gguf(tmp_path / "q.gguf", tiny_folder(QWEN35))
    ours = Backend.from_str(tokenizer_files(read_gguf(path))[0])
    # "e" + U+0301 (a combining acute accent) stays in the word, where qwen2's split cuts the accent off; digits
    # stand alone.
    pieces = [span for _, span in ours.pre_tokenizer.pre_tokenize_str("cafe\u0301 12")]
    assert pieces == [(0, 5), (5, 6), (6, 7), (7, 8)]


@pytest.mark.parametrize("arch, missing", [("qwen35moe", "mixture-of-experts"), ("clip", "multimodal projector")])
def test_a_moe_or_vision_architecture_is_refused_naming_what_is_missing(tmp_path, tiny_folder, arch, missing):
    path = write_qwen35_gguf(tmp_path / "m.gguf", tiny_folder(QWEN35), arch=arch)
    with pytest.raises(UnsupportedModelError, match=missing):
        convert_gguf(path, tmp_path / "out", "f32", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_gemma4_mixture_of_experts_is_refused_naming_its_experts(tmp_path, tiny_folder):
    router = ("blk.0.ffn_gate_inp.weight", np.zeros((4, GEMMA4.hidden_size), np.float32))
    path = write_gemma4_gguf(tmp_path / "moe.gguf", tiny_folder(GEMMA4), extra_tensors=[router], expert_count=4)
    with pytest.raises(
        UnsupportedModelError, match=r"mixture-of-experts model \(expert_count = 4; tensors blk\.0\.ffn_gate_inp"
    ):
        hf_config(read_gguf(path))
