"""Qwen 3.5 (`qwen35`) and Gemma 4 (`gemma4`) GGUF files as llama.cpp writes them, read back into Hugging Face
config fields and tensors (gguf.py calls these; the reading, planning and writing are its own).

What llama.cpp's converter writes, and so what we undo, read in ggml-org/llama.cpp: conversion/qwen.py
(`Qwen3NextModel`, `_LinearAttentionVReorderBase`, `_Qwen35MRopeMixin`, `Qwen3_5TextModel`), conversion/gemma.py
(`Gemma3Model`, `Gemma4Model`), conversion/base.py (`TextModel.set_gguf_parameters`), gguf-py's constants.py and
tensor_mapping.py (the names), src/llama-vocab.cpp (the qwen35 and gemma4 tokenizers).

Qwen 3.5
- Metadata: ssm.conv_kernel = linear_conv_kernel_dim, ssm.state_size = linear_key_head_dim, ssm.group_count =
  linear_num_key_heads, ssm.time_step_rank = linear_num_value_heads, ssm.inner_size = value heads x
  linear_value_head_dim; full_attention_interval (layer i is a Gated DeltaNet layer unless (i + 1) % interval
  == 0, as llama.cpp's loader reads it); attention.key_length = head_dim; rope.dimension_count = head_dim x
  partial_rotary_factor. rope.dimension_sections (interleaved M-RoPE) is not read: for text every section sees
  the same position, which is plain partial RoPE. nextn_predict_layers: multi-token-prediction blocks written
  after the model's layers and counted in block_count (_Qwen35MtpMixin); left out (gguf.py).
- Tensors: A_log is stored as ssm_a = -exp(A_log), dt_bias as ssm_dt.bias, conv1d squeezed to [channels, taps];
  every norm weight but the gated one (linear_attn.norm) as 1 + w (gguf.py undoes that shift). With fewer key
  than value heads, value heads are reordered from grouped by key head to tiled (k0 k1 k0 k1 ...): the V rows of
  in_proj_qkv and conv1d, the rows of in_proj_z, in_proj_a, in_proj_b, A_log, dt_bias, the columns of out_proj.
  q_proj ([q | gate] per head) is kept whole.
Gemma 4
- Metadata: attention.key_length = global_head_dim, key_length_swa = head_dim; head_count_kv and
  feed_forward_length one per layer where they vary (num_global_key_value_heads; the double-wide MLPs of the
  KV-shared layers); sliding_window_pattern one flag per layer; attention.shared_kv_layers;
  embedding_length_per_layer_input; rope.freq_base (full layers) and rope.freq_base_swa; rope.dimension_count =
  global_head_dim, the proportional partial RoPE written as a rope_freqs tensor (1 for each rotating frequency
  pair, 1e30 for the others). Values equal to keys (attention_k_eq_v) shows as full layers without attn_v.
- Tensors: norms stored as they are (Gemma 4 scales by w, not 1 + w); layer_scalar as layer_output_scale.weight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from doppler_py.errors import ModelFormatError, UnsupportedModelError

if TYPE_CHECKING:
    from doppler_py.model.config import ModelConfig
    from doppler_py.model.gguf import GGUFTensor, _Metadata

# Per-layer names (after "blk.N.") -> Hugging Face names (after "model.layers.N."), weights and biases spelled out:
# llama.cpp names A_log and layer_scalar without a suffix / with ".weight", where transformers has none.
_FFN = {"ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight"}
_FFN |= {"ffn_down.weight": "mlp.down_proj.weight"}
_ATTENTION = {f"attn_{p}.weight": f"self_attn.{p}_proj.weight" for p in "qkv"}
_ATTENTION |= {"attn_output.weight": "self_attn.o_proj.weight"}
_ATTENTION |= {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
QWEN35_LINEAR = {
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}
QWEN35_SHARED = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    **_FFN,
}
GEMMA4_PER_LAYER_INPUT = {
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
}
GEMMA4_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "layer_output_scale.weight": "layer_scalar",
    **_ATTENTION,
    **_FFN,
    **GEMMA4_PER_LAYER_INPUT,
}
GEMMA4_GLOBAL = {
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}
LLAMA_CPP_ROPE_BASE = 10_000.0  # llama.cpp's loader: rope.freq_base when missing (freq_base_swa: freq_base)
GEMMA4_ROPE_FREQS = "rope_freqs.weight"  # read into the config, not a tensor of the folder
_UNROTATED_FACTOR = 1e29  # llama.cpp writes 1e30: a frequency divided by it is 0 in float32
# What a mixture-of-experts Gemma 4 (26B A4B) adds to a layer, besides metadata expert_count.
GEMMA4_EXPERT_PARTS = ("ffn_gate_inp", "ffn_gate_up_exps", "ffn_down_exps", "pre_ffw_norm_2", "post_ffw_norm_1")

# Architectures named in general.architecture that we recognise and refuse, with what they need.
REFUSED = {
    "qwen35moe": "Qwen 3.5 mixture-of-experts (routed and shared experts: ffn_gate_inp, ffn_*_exps, ffn_*_shexp) "
    "is not supported; the dense qwen35 is",
    "clip": "this is a multimodal projector (mmproj: a vision/audio encoder), not a language model; vision input "
    "is not supported, and the text model's own GGUF loads without it",
}


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _int(meta: _Metadata, name: str, default: Any = ...) -> int:
    return meta.checked(f"{meta.arch}.{name}", "a positive integer", _positive_int, default)


def _per_layer(meta: _Metadata, name: str, layers: int) -> list[int]:
    """A value llama.cpp writes once, or once per layer where layers differ."""
    value = meta.checked(
        f"{meta.arch}.{name}",
        f"a positive integer or one per layer ({layers})",
        lambda v: _positive_int(v) or (isinstance(v, list) and len(v) == layers and all(map(_positive_int, v))),
    )
    return value if isinstance(value, list) else [value] * layers


# --- Qwen 3.5 -------------------------------------------------------------------------------------------------


def qwen35_config(meta: _Metadata, base: dict[str, Any]) -> dict[str, Any]:
    layers, path = base["num_hidden_layers"], meta.gguf.path
    head_dim = _int(meta, "attention.key_length")
    value_heads, inner = _int(meta, "ssm.time_step_rank"), _int(meta, "ssm.inner_size")
    if inner % value_heads:
        raise ModelFormatError(
            f"{path}: {meta.arch}.ssm.inner_size = {inner} is not a multiple of ssm.time_step_rank = {value_heads}"
        )
    interval = _int(meta, "full_attention_interval", 4)
    rotary = _int(meta, "rope.dimension_count", head_dim)
    return base | {
        "model_type": "qwen3_5_text",
        "head_dim": head_dim,
        "hidden_act": "silu",
        "layer_types": ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)],
        "linear_conv_kernel_dim": _int(meta, "ssm.conv_kernel"),
        "linear_key_head_dim": _int(meta, "ssm.state_size"),
        "linear_num_key_heads": _int(meta, "ssm.group_count"),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": inner // value_heads,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": meta.model("rope.freq_base", LLAMA_CPP_ROPE_BASE),
            "partial_rotary_factor": rotary / head_dim,
        },
    }


def _tiled_to_grouped(key_heads: int, per_key: int, width: int) -> np.ndarray:
    """Indices that put value heads back in transformers' order: HF head k * per_key + r (grouped by key head k)
    is llama.cpp's head r * key_heads + k (tiled); `width` entries per head."""
    return np.arange(key_heads * per_key * width).reshape(per_key, key_heads, width).swapaxes(0, 1).reshape(-1)


@dataclass(frozen=True)
class Restore:
    """How one stored tensor becomes its transformers tensor (beyond dequantisation and a norm shift)."""

    rows: np.ndarray | None = None  # HF row i is stored row rows[i]: whole rows move, so quantised blocks stay
    values: Callable[[np.ndarray], np.ndarray] | None = None  # on the dequantised values, after `rows`
    shape: tuple[int, ...] | None = None  # the HF shape, where it differs from the stored one


def qwen35_restore(part: str, tensor: GGUFTensor, config: ModelConfig, path: Any) -> Restore:
    """Undo llama.cpp's value-head reordering, -exp(A_log) and the conv1d squeeze for one layer tensor."""
    shape = config.linear_attention
    if part not in QWEN35_LINEAR or shape is None:
        return Restore()
    per_key = shape.value_heads // shape.key_heads
    qk_rows = 2 * shape.key_heads * shape.key_dim
    expected = {
        "attn_qkv.weight": qk_rows + shape.value_width,
        "ssm_conv1d.weight": qk_rows + shape.value_width,
        "attn_gate.weight": shape.value_width,
        "ssm_alpha.weight": shape.value_heads,
        "ssm_beta.weight": shape.value_heads,
        "ssm_a": shape.value_heads,
        "ssm_dt.bias": shape.value_heads,
    }
    if part in expected and tensor.shape[0] != expected[part]:
        raise ModelFormatError(
            f"{path}: tensor {tensor.name!r} has {tensor.shape[0]} rows, expected {expected[part]} for "
            f"{shape.key_heads} key heads of {shape.key_dim} and {shape.value_heads} value heads of {shape.value_dim}"
        )
    rows = columns = None
    if per_key > 1:
        heads = _tiled_to_grouped(shape.key_heads, per_key, 1)
        values = _tiled_to_grouped(shape.key_heads, per_key, shape.value_dim)
        rows = {
            "attn_qkv.weight": np.concatenate([np.arange(qk_rows), qk_rows + values]),
            "ssm_conv1d.weight": np.concatenate([np.arange(qk_rows), qk_rows + values]),
            "attn_gate.weight": values,
            "ssm_alpha.weight": heads,
            "ssm_beta.weight": heads,
            "ssm_a": heads,
            "ssm_dt.bias": heads,
        }.get(part)
        columns = values if part == "ssm_out.weight" else None
    if part == "ssm_a":  # stored as -exp(A_log)
        return Restore(rows, lambda a: np.log(-a.astype(np.float64)).astype(np.float32))
    if part == "ssm_conv1d.weight":  # stored squeezed: [channels, taps]
        return Restore(rows, None, (tensor.shape[0], 1, tensor.shape[-1]))
    if columns is not None:
        if tensor.shape[-1] != shape.value_width:
            raise ModelFormatError(
                f"{path}: tensor {tensor.name!r} has {tensor.shape[-1]} columns, expected {shape.value_width}"
            )
        return Restore(None, lambda w: w[:, columns])
    return Restore(rows)


def qwen35_expected(config: ModelConfig, layer: int) -> list[str]:
    linear = config.is_linear(layer)
    return [*QWEN35_SHARED, *(QWEN35_LINEAR if linear else _ATTENTION)]


def qwen35_one_plus(name: str) -> bool:
    """Every norm weight but the gated one is stored as 1 + w."""
    return name.endswith("norm.weight") and not name.endswith("ssm_norm.weight")


# --- Gemma 4 --------------------------------------------------------------------------------------------------


def gemma4_config(meta: _Metadata, base: dict[str, Any]) -> dict[str, Any]:
    gguf, path, layers = meta.gguf, meta.gguf.path, base["num_hidden_layers"]
    experts = meta.model("expert_count", 0)
    stored_experts = sorted({n for n in gguf.tensors if any(f".{p}." in n for p in GEMMA4_EXPERT_PARTS)})
    if experts or stored_experts:
        raise UnsupportedModelError(
            f"{path}: a Gemma 4 mixture-of-experts model (expert_count = {experts}; tensors "
            f"{', '.join(stored_experts[:3]) or 'none'}...) is not supported; the dense Gemma 4 models (E2B, E4B) are",
            advice="",
        )
    pattern = meta.checked(
        f"{meta.arch}.attention.sliding_window_pattern",
        f"one boolean per layer ({layers})",
        lambda v: isinstance(v, list) and len(v) == layers and all(isinstance(x, bool) for x in v),
    )
    layer_types = ["sliding_attention" if sliding else "full_attention" for sliding in pattern]
    shared = meta.checked(
        f"{meta.arch}.attention.shared_kv_layers",
        f"an integer in 0..{layers}",
        lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= layers,
        0,
    )
    first_shared = layers - shared

    ffn = _per_layer(meta, "feed_forward_length", layers)
    wide = {ffn[0], 2 * ffn[0]}
    if set(ffn[:first_shared]) != {ffn[0]} or len(set(ffn[first_shared:])) > 1 or not set(ffn[first_shared:]) <= wide:
        raise UnsupportedModelError(
            f"{path}: {meta.arch}.feed_forward_length = {ffn} is not supported (one width, or twice it on the "
            f"{shared} KV-shared layers)"
        )
    head_dim, global_head_dim = _int(meta, "attention.key_length_swa"), _int(meta, "attention.key_length")
    for key, expected in (("value_length_swa", head_dim), ("value_length", global_head_dim)):
        if _int(meta, f"attention.{key}", expected) != expected:
            raise UnsupportedModelError(f"{path}: {meta.arch}.attention.{key} differs from the key length")
    if _int(meta, "rope.dimension_count_swa", head_dim) != head_dim:
        raise UnsupportedModelError(
            f"{path}: {meta.arch}.rope.dimension_count_swa = {meta.model('rope.dimension_count_swa')}: partial RoPE "
            f"on sliding layers (head_dim {head_dim}) is not supported"
        )
    if _int(meta, "rope.dimension_count", global_head_dim) != global_head_dim:
        raise UnsupportedModelError(
            f"{path}: {meta.arch}.rope.dimension_count = {meta.model('rope.dimension_count')} is not "
            f"global_head_dim = {global_head_dim} (llama.cpp marks the pairs that do not rotate in rope_freqs)"
        )

    kv = _per_layer(meta, "attention.head_count_kv", layers)
    kv_of = {kind: {n for n, t in zip(kv, layer_types, strict=True) if t == kind} for kind in set(layer_types)}
    if any(len(values) > 1 for values in kv_of.values()):
        raise UnsupportedModelError(f"{path}: {meta.arch}.attention.head_count_kv = {kv} varies within a layer type")
    swa_kv = next(iter(kv_of.get("sliding_attention", {kv[0]})))
    full_kv = next(iter(kv_of.get("full_attention", {swa_kv})))
    own_full = [i for i in range(first_shared) if layer_types[i] == "full_attention"]
    k_eq_v = bool(own_full) and all(f"blk.{i}.attn_v.weight" not in gguf.tensors for i in own_full)
    if full_kv != swa_kv and not k_eq_v:
        raise UnsupportedModelError(
            f"{path}: full layers with {full_kv} KV heads beside sliding ones with {swa_kv} are supported only when "
            "values equal keys (no attn_v on full layers)"
        )
    per_layer = meta.checked(
        f"{meta.arch}.embedding_length_per_layer_input",
        "a non-negative integer",
        lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
        0,
    )
    per_layer_embed = gguf.tensors.get("per_layer_token_embd.weight")
    if per_layer and per_layer_embed is None:
        raise ModelFormatError(f"{path}: tensor 'per_layer_token_embd.weight' is missing")
    cap = meta.model("final_logit_softcapping", None)
    full_theta = meta.model("rope.freq_base", LLAMA_CPP_ROPE_BASE)
    config = base | {
        "model_type": "gemma4_text",
        "hidden_act": None,
        "hidden_activation": "gelu_pytorch_tanh",
        "intermediate_size": ffn[0],
        "num_key_value_heads": swa_kv,
        "head_dim": head_dim,
        "global_head_dim": global_head_dim,
        "attention_k_eq_v": k_eq_v,
        "num_kv_shared_layers": shared,
        "use_double_wide_mlp": shared > 0 and ffn[-1] == 2 * ffn[0],
        "hidden_size_per_layer_input": per_layer,
        "vocab_size_per_layer_input": per_layer_embed.shape[0] if per_layer else None,
        "sliding_window": meta.model("attention.sliding_window"),
        "layer_types": layer_types,
        "final_logit_softcapping": cap,
        "enable_moe_block": False,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": meta.model("rope.freq_base_swa", full_theta)},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": _proportional_fraction(meta, global_head_dim),
                "rope_theta": full_theta,
            },
        },
    }
    if k_eq_v and full_kv != swa_kv:
        config["num_global_key_value_heads"] = full_kv
    return config


def _proportional_fraction(meta: _Metadata, global_head_dim: int) -> float:
    """The fraction of frequency pairs that rotate on full layers: llama.cpp's rope_freqs holds 1 for each of them,
    then 1e30 (frequency 0) for the rest; no tensor means every pair rotates."""
    from gguf import GGMLQuantizationType

    tensor = meta.gguf.tensors.get(GEMMA4_ROPE_FREQS)
    if tensor is None:
        return 1.0
    if tensor.ggml_type != GGMLQuantizationType.F32 or tensor.shape != (global_head_dim // 2,):
        raise ModelFormatError(
            f"{meta.gguf.path}: tensor {GEMMA4_ROPE_FREQS!r} must be F32 of shape ({global_head_dim // 2},), got "
            f"{tensor.ggml_type.name} {tensor.shape}"
        )
    factors = tensor.raw.view(np.float32)
    rotating = int(np.argmax(factors != 1.0)) if (factors != 1.0).any() else len(factors)
    if rotating == 0 or not (factors[rotating:] >= _UNROTATED_FACTOR).all():
        raise UnsupportedModelError(
            f"{meta.gguf.path}: tensor {GEMMA4_ROPE_FREQS!r} = {factors.tolist()!r:.120} is not proportional RoPE "
            "(1 for the rotating pairs, then 1e30): other frequency factors are not supported"
        )
    return rotating / len(factors)


def gemma4_expected(config: ModelConfig, layer: int) -> list[str]:
    names = [n for n in GEMMA4_LAYER if n not in GEMMA4_PER_LAYER_INPUT and n != "layer_output_scale.weight"]
    if config.hidden_size_per_layer_input:
        names += GEMMA4_PER_LAYER_INPUT
    if config.kv_source(layer) != layer:  # reads an earlier layer's K/V: no k/v projections or norms of its own
        names = [n for n in names if n not in ("attn_k.weight", "attn_v.weight", "attn_k_norm.weight")]
    elif config.attention_k_eq_v and config.layer_types[layer] == "full_attention":
        names.remove("attn_v.weight")
    return names


# --- the families, as gguf.py reads them ----------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """What gguf.py needs of a family whose layers are not all alike, beyond the reading every architecture shares."""

    layer_names: dict[str, str]  # "blk.N." names -> names after "model.layers.N."
    global_names: dict[str, str]  # its own names outside the layers -> HF names
    config: Callable[[_Metadata, dict[str, Any]], dict[str, Any]]  # config.json from the metadata and shared fields
    expected_layer: Callable[[ModelConfig, int], list[str]]  # the names layer N must have (after "blk.N.")
    expected_global: Callable[[ModelConfig], list[str]]  # its own global tensors the config calls for
    restore: Callable[[str, GGUFTensor, ModelConfig, Any], Restore]  # per layer tensor (name after "blk.N.")
    one_plus: Callable[[str], bool]  # a tensor stored as 1 + w (gguf.py subtracts the 1)
    config_tensors: tuple[str, ...] = ()  # tensors read into the config, not written to the folder


FAMILIES = {
    "qwen35": Family(
        QWEN35_SHARED | _ATTENTION | QWEN35_LINEAR,
        {},
        qwen35_config,
        qwen35_expected,
        lambda config: [],
        qwen35_restore,
        qwen35_one_plus,
    ),
    "gemma4": Family(
        GEMMA4_LAYER,
        GEMMA4_GLOBAL,
        gemma4_config,
        gemma4_expected,
        lambda config: list(GEMMA4_GLOBAL) if config.hidden_size_per_layer_input else [],
        lambda part, tensor, config, path: Restore(),
        lambda name: False,  # Gemma 4 scales by w
        (GEMMA4_ROPE_FREQS,),
    ),
}
