"""A model's shape and hyper-parameters, read from a Hugging Face `config.json` and checked.

Fields a config leaves out take the value transformers would use for that architecture, so a folder loads
the same way here as in transformers. Both the transformers 4 spelling (`rope_theta`, `rope_scaling`,
`torch_dtype`) and the transformers 5 spelling (`rope_parameters`, `dtype`) are read.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from types import EllipsisType
from typing import Any

import numpy as np

from doppler_py.errors import ModelFormatError, UnsupportedModelError
from doppler_py.gpu.weights import BLOCK
from doppler_py.ops.attention import MAX_HEAD_DIM
from doppler_py.ops.sampling import MAX_VOCAB


@dataclass(frozen=True)
class _Architecture:
    model_type: str
    max_position_embeddings: int  # transformers' default when config.json omits it
    qkv_bias: bool = False  # q/k/v projections always carry biases (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    head_dim: int | None = None  # transformers' default head_dim (None: hidden_size / num_attention_heads)
    gemma: bool = False  # the Gemma 2/3 block: see ModelConfig.norm_offset, sandwich_norms, embed_scale, ...
    hybrid: bool = False  # Qwen 3.5: Gated DeltaNet layers between gated full-attention layers


ARCHITECTURES: dict[str, _Architecture] = {
    "LlamaForCausalLM": _Architecture("llama", 2048),
    "MistralForCausalLM": _Architecture("mistral", 131072),
    "Qwen2ForCausalLM": _Architecture("qwen2", 32768, qkv_bias=True),
    "Qwen3ForCausalLM": _Architecture("qwen3", 32768, qk_norm=True, head_dim=128),
    "Gemma2ForCausalLM": _Architecture("gemma2", 8192, head_dim=256, gemma=True),
    "Gemma3ForCausalLM": _Architecture("gemma3_text", 131072, qk_norm=True, head_dim=256, gemma=True),
    "Gemma4ForCausalLM": _Architecture("gemma4_text", 131072, qk_norm=True, head_dim=256, gemma=True),
    "Qwen3_5ForCausalLM": _Architecture("qwen3_5_text", 32768, qk_norm=True, head_dim=256, hybrid=True),
}
# Multimodal folders whose text part we load: architecture -> (model_type, the text model's architecture, the
# prefix of its tensors' names).
TEXT_PARTS = {
    "Gemma4ForConditionalGeneration": ("gemma4", "Gemma4ForCausalLM", "model.language_model."),
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", "Qwen3_5ForCausalLM", "model.language_model."),
}
# Architectures of the supported families that need something this engine lacks, and what.
MISSING_FEATURES = {
    "Qwen3_5MoeForCausalLM": "mixture-of-experts MLP layers",
    "Qwen3_5MoeForConditionalGeneration": "mixture-of-experts MLP layers",
}
# Activations of the gated MLP, act(gate) * up, by their transformers names.
HIDDEN_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# Gemma configs without layer_types: every 2nd (Gemma 2) or 6th (Gemma 3) layer is global.
GEMMA_SLIDING_WINDOW_PATTERN = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6}

# Parameters each RoPE scaling type needs besides its name ("default" means no scaling).
ROPE_SCALING_PARAMETERS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}

_REQUIRED_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_DEFAULT_RMS_NORM_EPS = 1e-6
_DEFAULT_ROPE_THETA = 10000.0
_FLOAT_MAX = sys.float_info.max
# attention.wgsl splits a head into 16-lane pieces (doppler_py/ops/attention.py refuses other head dims).
HEAD_DIM_MULTIPLE = 16


# shaders/linear_attention.wgsl keeps a key-dim column of the state per invocation and a value head per workgroup.
MAX_LINEAR_KEY_DIM = 128
MAX_LINEAR_VALUE_DIM = 128
MAX_CONV_TAPS = 16


@dataclass(frozen=True)
class LinearAttention:
    """The shape of Qwen 3.5's Gated DeltaNet layers (transformers' `linear_*` config fields)."""

    conv_taps: int  # linear_conv_kernel_dim: the causal depthwise convolution's width
    key_heads: int
    value_heads: int  # a multiple of key_heads; value head h reads key head h // (value_heads // key_heads)
    key_dim: int
    value_dim: int

    @property
    def channels(self) -> int:
        """Width of the convolved [q | k | v] rows."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    @property
    def value_width(self) -> int:
        return self.value_heads * self.value_dim

    @property
    def mix_width(self) -> int:
        """Width of the input projection's rows, [q | k | v | z | b | a]."""
        return self.channels + self.value_width + 2 * self.value_heads


@dataclass(frozen=True)
class ModelConfig:
    """A validated LLaMA-family configuration (LLaMA, SmolLM, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 and Gemma 4
    text).

    The fields after `torch_dtype` describe how Qwen3 and Gemma depart from LLaMA; their defaults are
    LLaMA's, so a LLaMA config leaves them alone.
    """

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # {"rope_type": "linear" | "llama3", ...its parameters}, None = plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q_proj, k_proj and v_proj have biases
    attention_out_bias: bool  # o_proj has a bias too (LLaMA with attention_bias=true)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None
    qk_norm: bool = False  # q_norm / k_norm: RMSNorm weights [head_dim] applied to every q and k head
    norm_offset: float = 0.0  # RMSNorms scale by (norm_offset + w): Gemma's (1 + w), folded in at load time
    sandwich_norms: bool = False  # Gemma: attention and MLP outputs are normalised before the residual add
    embed_scale: float = 1.0  # embeddings are multiplied by this (Gemma: sqrt(hidden_size), rounded to f32)
    hidden_act: str = "silu"  # the gated MLP's activation (HIDDEN_ACTIVATIONS)
    attention_scale: float | None = None  # scores are q.k * this; None = 1 / sqrt(head_dim)
    sliding_window: int | None = None  # keys a sliding layer's query sees (itself included)
    layer_types: tuple[str, ...] = ()  # "full_attention" | "sliding_attention" per layer; () = all full
    rope_local_theta: float | None = None  # RoPE base of sliding layers (Gemma 3), plain RoPE; None = rope_theta
    # Gemma 2: scores, then the final logits, pass through c * tanh(x / c); None = not capped
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Gemma 4 (transformers' Gemma4TextConfig); the defaults leave every other family alone.
    layer_head_dims: tuple[int, ...] = ()  # head_dim of each layer (full layers: global_head_dim); () = head_dim
    layer_kv_heads: tuple[int, ...] = ()  # num_key_value_heads of each layer; () = num_key_value_heads
    num_kv_shared_layers: int = 0  # the last layers attend over the K/V of an earlier layer (`kv_source`)
    attention_k_eq_v: bool = False  # full layers have no v_proj: their values are the k projection
    v_norm: bool = False  # values pass a weightless per-head RMSNorm before the cache
    double_wide_mlp: bool = False  # the MLPs of KV-shared layers are 2 * intermediate_size wide
    hidden_size_per_layer_input: int = 0  # width of each layer's per-layer input (0: none)
    vocab_size_per_layer_input: int = 0  # rows of the per-layer input embedding
    weights_prefix: str = "model."  # where the text model's tensors live (a multimodal folder nests them)
    # Qwen 3.5: "linear_attention" layers (layer_types) are Gated DeltaNet layers of this shape; the full-attention
    # layers gate their output by sigmoid(x·Wgate) and rotate only the first rotary_dim dims of each head.
    linear_attention: LinearAttention | None = None
    attention_gate: bool = False
    rotary_dim: int | None = None  # None: the whole head
    # Gemma 3's use_bidirectional_attention (EmbeddingGemma): embedding forwards attend both ways (Embedder);
    # generation stays causal.
    bidirectional_attention: bool = False

    def is_linear(self, layer: int) -> bool:
        """Whether `layer` is a linear-attention (Gated DeltaNet) layer rather than an attention layer."""
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    def layer_head_dim(self, layer: int) -> int:
        return self.layer_head_dims[layer] if self.layer_head_dims else self.head_dim

    def layer_num_kv_heads(self, layer: int) -> int:
        return self.layer_kv_heads[layer] if self.layer_kv_heads else self.num_key_value_heads

    def layer_intermediate_size(self, layer: int) -> int:
        wide = self.double_wide_mlp and self.kv_source(layer) != layer
        return self.intermediate_size * (2 if wide else 1)

    def kv_source(self, layer: int) -> int:
        """The layer whose K/V `layer` attends over: itself, or for one of the last num_kv_shared_layers layers,
        the last earlier layer of its type (that layer's cache; the shared layer computes and writes no K/V)."""
        first_shared = self.num_hidden_layers - self.num_kv_shared_layers
        if layer < first_shared:
            return layer
        kind = self.layer_types[layer] if self.layer_types else "full_attention"
        kinds = self.layer_types or ("full_attention",) * self.num_hidden_layers
        return max(j for j in range(first_shared) if kinds[j] == kind)

    def layer_window(self, layer: int) -> int:
        """Keys the queries of `layer` see (0 = every earlier position)."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window or 0
        return 0

    def layer_rope(self, layer: int) -> tuple[float, dict[str, Any] | None]:
        """(theta, scaling) of the RoPE `layer` uses."""
        if self.layer_window(layer) and self.rope_local_theta is not None:
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ModelFormatError(f"{path}: config.json not found") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelFormatError(f"{path}: not a readable JSON file ({exc})") from None
        if not isinstance(data, dict):
            raise ModelFormatError(f"{path}: expected a JSON object, got {type(data).__name__}")
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> ModelConfig:
        """Check `data` (a parsed config.json); `source` names it in error messages."""
        data, weights_prefix = _text_part(data, source)
        fields = _Fields(data, source)
        architecture = _architecture(data, source)
        arch = ARCHITECTURES[architecture]

        ints = {name: fields.positive_int(name) for name in _REQUIRED_INTS}
        heads = ints["num_attention_heads"]
        kv_heads = fields.positive_int("num_key_value_heads", default=heads)
        if heads % kv_heads:
            raise ModelFormatError(
                f"{source}: field 'num_key_value_heads' = {kv_heads} does not divide num_attention_heads = {heads}"
            )
        head_dim = fields.positive_int("head_dim", default=arch.head_dim)
        if head_dim is None:
            if ints["hidden_size"] % heads:
                raise ModelFormatError(
                    f"{source}: field 'num_attention_heads' = {heads} does not divide "
                    f"hidden_size = {ints['hidden_size']} (and no head_dim is given)"
                )
            head_dim = ints["hidden_size"] // heads
        if head_dim % 2:
            raise ModelFormatError(f"{source}: field 'head_dim' = {head_dim} must be even for rotary embeddings")
        _check_engine_limits(ints, heads, head_dim, explicit_head_dim=data.get("head_dim") is not None, source=source)

        max_positions = fields.positive_int("max_position_embeddings", default=arch.max_position_embeddings)
        if architecture == "Gemma4ForCausalLM":
            family = _gemma4(fields, ints, kv_heads, head_dim, source)
            rope_theta, rope_scaling = family.pop("rope")
        elif arch.gemma:
            family = _gemma(fields, ints, architecture, source)
            rope_theta, rope_scaling = family.pop("rope")
        elif arch.hybrid:
            family = _qwen3_5(fields, ints, head_dim, source)
            rope_theta, rope_scaling = _rope(fields, source)
        else:
            family = _sliding_window(fields, architecture, ints["num_hidden_layers"], source)
            hidden_act = fields.get("hidden_act", "silu")
            if hidden_act != "silu":
                raise UnsupportedModelError(f"{source}: hidden_act {hidden_act!r} is not supported (only 'silu')")
            rope_theta, rope_scaling = _rope(fields, source)
        if fields.boolean("mlp_bias", default=False):
            raise UnsupportedModelError(f"{source}: mlp_bias = true is not supported")
        bias_flag = fields.boolean("attention_bias", default=False)

        return cls(
            architecture=architecture,
            model_type=arch.model_type,
            vocab_size=ints["vocab_size"],
            hidden_size=ints["hidden_size"],
            intermediate_size=ints["intermediate_size"],
            num_hidden_layers=ints["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=fields.positive_float("rms_norm_eps", default=_DEFAULT_RMS_NORM_EPS),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=fields.boolean("tie_word_embeddings", default=arch.gemma),
            attention_bias=arch.qkv_bias or bias_flag,
            attention_out_bias=bias_flag and not arch.qkv_bias,
            bos_token_id=fields.token_id("bos_token_id", ints["vocab_size"]),
            eos_token_ids=fields.token_ids("eos_token_id", ints["vocab_size"]),
            torch_dtype=fields.get("torch_dtype", None) or fields.get("dtype", None),
            qk_norm=arch.qk_norm,
            weights_prefix=weights_prefix,
            **family,
        )


def _text_part(data: dict[str, Any], source: str) -> tuple[dict[str, Any], str]:
    """A multimodal config (TEXT_PARTS) as the config of its text model, which is what we load, and where that
    model's tensors live; other configs as given, with the usual "model." prefix.

    The text model's fields come from `text_config`; token ids and tie_word_embeddings it leaves out come from
    the outer config, where transformers keeps them. Vision and audio towers are left unloaded.
    """
    architectures = data.get("architectures")
    name = architectures[0] if isinstance(architectures, list) and architectures else None
    if not isinstance(name, str):  # no name (or not a name: _architecture says so)
        name = next((a for a, part in TEXT_PARTS.items() if part[0] == data.get("model_type")), None)
    if name not in TEXT_PARTS:
        return data, "model."
    model_type, text_architecture, prefix = TEXT_PARTS[name]
    if data.get("model_type", model_type) != model_type:
        raise ModelFormatError(
            f"{source}: field 'model_type' = {data['model_type']!r} contradicts architecture {name!r} ({model_type!r})"
        )
    text = data.get("text_config")
    if not isinstance(text, dict):
        raise ModelFormatError(f"{source}: {name} needs a 'text_config' object, got {text!r:.80}")
    outer = {k: data[k] for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings", "dtype") if k in data}
    return {**outer, **text, "architectures": [text_architecture]}, prefix


BARE_MODELS = {name.removesuffix("ForCausalLM") + "Model": name for name in ARCHITECTURES}
BARE_MODELS["Gemma3TextModel"] = "Gemma3ForCausalLM"  # transformers' bare Gemma 3 text model (EmbeddingGemma's)


def _architecture(data: dict[str, Any], source: str) -> str:
    architectures = data.get("architectures")
    model_type = data.get("model_type")
    if architectures:
        if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
            raise ModelFormatError(f"{source}: field 'architectures' must be a list of names, got {architectures!r}")
        # The bare model (no LM head), as sentence-transformers saves an embedding model: its causal LM's layers.
        name = BARE_MODELS.get(architectures[0], architectures[0])
        if name in MISSING_FEATURES:
            raise UnsupportedModelError(
                f"{source}: architecture {name!r} is not supported: doppler-py lacks its {MISSING_FEATURES[name]}",
                advice="",
            )
        if name not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"{source}: architecture {name!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
            )
        expected = ARCHITECTURES[name].model_type
        if model_type is not None and model_type != expected:
            raise ModelFormatError(
                f"{source}: field 'model_type' = {model_type!r} contradicts architecture {name!r} ({expected!r})"
            )
        return name
    if model_type is None:
        raise ModelFormatError(f"{source}: neither 'architectures' nor 'model_type' is given")
    for name, arch in ARCHITECTURES.items():
        if arch.model_type == model_type:
            return name
    known = ", ".join(a.model_type for a in ARCHITECTURES.values())
    raise UnsupportedModelError(f"{source}: model_type {model_type!r} is not supported (supported: {known})")


def _check_engine_limits(
    ints: dict[str, int], heads: int, head_dim: int, *, explicit_head_dim: bool, source: str
) -> None:
    """Refuse, at load time, shapes the kernels cannot run.

    The ops refuse them too, but only when built (attention at the first forward) and with a bare ValueError,
    or as a ModelFormatError blaming the files; a valid config of an unsupported shape is UnsupportedModelError.
    """
    if head_dim % HEAD_DIM_MULTIPLE or not HEAD_DIM_MULTIPLE <= head_dim <= MAX_HEAD_DIM:
        what = (
            f"field 'head_dim' = {head_dim}"
            if explicit_head_dim
            else f"head_dim = hidden_size / num_attention_heads = {ints['hidden_size']} / {heads} = {head_dim} "
            "(no 'head_dim' field)"
        )
        raise UnsupportedModelError(
            f"{source}: {what} is not supported: the attention kernel runs head dims that are multiples of "
            f"{HEAD_DIM_MULTIPLE} from {HEAD_DIM_MULTIPLE} to {MAX_HEAD_DIM}",
            advice="",
        )
    # The matmul kernels and the block formats read K (a matrix's input width) in blocks of 32.
    inputs = {
        "hidden_size": ints["hidden_size"],  # embedding, q/k/v, gate/up and LM head
        "intermediate_size": ints["intermediate_size"],  # down_proj
        "num_attention_heads * head_dim": heads * head_dim,  # o_proj
    }
    for name, value in inputs.items():
        if value % BLOCK:
            shown = f"field '{name}' = {value}" if name in ints else f"{name} = {heads} * {head_dim} = {value}"
            raise UnsupportedModelError(
                f"{source}: {shown} is not supported: the matmul kernels need a multiple of {BLOCK}", advice=""
            )
    if ints["vocab_size"] > MAX_VOCAB:
        raise UnsupportedModelError(
            f"{source}: field 'vocab_size' = {ints['vocab_size']} is not supported: the GPU sampler handles at "
            f"most {MAX_VOCAB} tokens",
            advice="",
        )


def _sliding_window(fields: _Fields, architecture: str, layers: int, source: str) -> dict[str, Any]:
    """sliding_window and layer_types as transformers reads them for LLaMA, Mistral, Qwen2 and Qwen3.

    Mistral slides every layer whenever sliding_window is set. Qwen2 and Qwen3 slide only with
    use_sliding_window, then the layers from max_window_layers on (or as layer_types lists them). LLaMA has
    no sliding window: layer_types other than full attention are refused rather than ignored.
    """
    data = fields.data
    layer_types = data.get("layer_types") or []
    if not isinstance(layer_types, list):
        raise ModelFormatError(f"{source}: field 'layer_types' must be a list, got {layer_types!r:.80}")
    window = fields.positive_int("sliding_window", default=None)
    if architecture == "MistralForCausalLM":
        if window is None:
            return {}
        return {"sliding_window": window, "layer_types": ("sliding_attention",) * layers}
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not fields.boolean("use_sliding_window", default=False):
            return {}
        window = window or 4096
        if not layer_types:
            first = fields.positive_int("max_window_layers", default=28)
            layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        return {"sliding_window": window, "layer_types": _layer_kinds(layer_types, layers, "sliding_attention", source)}
    if any(kind != "full_attention" for kind in layer_types):
        raise UnsupportedModelError(
            f"{source}: layer_types other than 'full_attention' (sliding window) are not supported for "
            f"{architecture}: {layer_types}"
        )
    return {}


def _layer_kinds(layer_types: Any, layers: int, other: str, source: str) -> tuple[str, ...]:
    """config.json's layer_types (or the family's default for it), checked: 'full_attention' or `other` for each
    of the `layers` layers."""
    if (
        not isinstance(layer_types, list)
        or len(layer_types) != layers
        or any(kind not in ("full_attention", other) for kind in layer_types)
    ):
        raise ModelFormatError(
            f"{source}: field 'layer_types' must list 'full_attention' or {other!r} for each of the {layers} "
            f"layers, got {layer_types!r:.120}"
        )
    return tuple(layer_types)


def _gemma(fields: _Fields, ints: dict[str, int], architecture: str, source: str) -> dict[str, Any]:
    """The Gemma 2 and Gemma 3 text fields of ModelConfig (transformers' Gemma2Config / Gemma3TextConfig
    defaults), plus "rope": (theta, scaling) of the global layers."""
    gemma2 = architecture == "Gemma2ForCausalLM"
    # Gemma 2 caps scores at 50 and logits at 30 unless its config says otherwise (null: not capped); Gemma 3
    # configs set both to null, and transformers applies them where set.
    softcaps = {}
    for name, gemma2_default in (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0)):
        if name not in fields.data:
            softcaps[name] = gemma2_default if gemma2 else None
        else:
            softcaps[name] = None if fields.data[name] is None else fields.positive_float(name, None)
    # Gemma 3 (EmbeddingGemma): embeddings attend both ways; transformers' Gemma 2 has no such field.
    bidirectional = fields.boolean("use_bidirectional_attention", default=False)
    if bidirectional and gemma2:
        raise UnsupportedModelError(f"{source}: use_bidirectional_attention = true is not supported on Gemma 2")
    hidden_act = fields.get("hidden_activation", None) or fields.get("hidden_act", "gelu_pytorch_tanh")
    if hidden_act not in HIDDEN_ACTIVATIONS:
        raise UnsupportedModelError(
            f"{source}: hidden_activation {hidden_act!r} is not supported (supported: {', '.join(HIDDEN_ACTIVATIONS)})"
        )
    layers = ints["num_hidden_layers"]
    layer_types = fields.get("layer_types", None)
    if layer_types is None:
        pattern = fields.positive_int("sliding_window_pattern", default=GEMMA_SLIDING_WINDOW_PATTERN[architecture])
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    layer_types = _layer_kinds(layer_types, layers, "sliding_attention", source)
    window = fields.positive_int("sliding_window", default=4096)
    if bidirectional:  # transformers' Gemma3TextConfig: the field spans both ways, (window // 2 + 1) - 1 each way
        window = window // 2 + 1

    # transformers 5 nests the RoPE of each layer type in rope_parameters; transformers 4 spells the global
    # base rope_theta (+ rope_scaling) and the local one rope_local_base_freq.
    nested = fields.get("rope_parameters", None)
    if gemma2:  # one RoPE for every layer
        full, local = _rope(fields, source), (None, None)
    elif isinstance(nested, dict) and "full_attention" in nested:
        full = _rope(_Fields({"rope_parameters": nested["full_attention"], "rope_theta": 1_000_000.0}, source), source)
        local = _rope(
            _Fields({"rope_parameters": nested.get("sliding_attention"), "rope_theta": 10_000.0}, source), source
        )
    else:
        full = _rope(_Fields({"rope_theta": 1_000_000.0, **fields.data}, source), source)
        local = (fields.positive_float("rope_local_base_freq", default=10_000.0), None)
    if local[1] is not None:
        raise UnsupportedModelError(f"{source}: RoPE scaling on sliding-window layers is not supported")
    scalar = fields.positive_float("query_pre_attn_scalar", default=256.0)
    return {
        "norm_offset": 1.0,
        "sandwich_norms": True,
        "embed_scale": float(np.float32(math.sqrt(ints["hidden_size"]))),
        "hidden_act": hidden_act,
        "attention_scale": scalar**-0.5,
        "sliding_window": window,
        "layer_types": tuple(layer_types),
        "rope_local_theta": local[0],
        "rope": full,
        "bidirectional_attention": bidirectional,
        **softcaps,
    }


GEMMA4_ROPE_DEFAULTS = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
GEMMA4_LAYER_OVERRIDES = ("head_dim", "num_key_value_heads")  # the per_layer_config fields we read


def _gemma4(fields: _Fields, ints: dict[str, int], kv_heads: int, head_dim: int, source: str) -> dict[str, Any]:
    """The Gemma 4 text fields of ModelConfig (transformers' Gemma4TextConfig and its defaults), plus "rope":
    (theta, scaling) of the full-attention layers.

    Unlike Gemma 2/3, the RMSNorms scale by w (no 1 + w) and scores are q·k unscaled (q and k are normalised
    per head). What we do not run is refused: the mixture-of-experts block, bidirectional attention.
    """
    data, layers, heads = fields.data, ints["num_hidden_layers"], ints["num_attention_heads"]
    if fields.boolean("enable_moe_block", default=False):
        raise UnsupportedModelError(
            f"{source}: enable_moe_block = true (a mixture-of-experts MLP: num_experts, top_k_experts, "
            "moe_intermediate_size) is not supported; Gemma 4's dense models (e.g. E2B, E4B) are"
        )
    bidirectional = data.get("use_bidirectional_attention")
    if bidirectional == "all":
        raise UnsupportedModelError(f"{source}: use_bidirectional_attention = 'all' is not supported (causal only)")
    if bidirectional not in (None, "vision"):  # "vision" changes only image tokens' masks: text is causal
        raise ModelFormatError(
            f"{source}: field 'use_bidirectional_attention' must be null, 'vision' or 'all', got {bidirectional!r}"
        )
    if fields.boolean("attention_bias", default=False):
        raise UnsupportedModelError(f"{source}: attention_bias = true is not supported for Gemma 4")
    hidden_act = fields.get("hidden_activation", "gelu_pytorch_tanh")
    if hidden_act not in HIDDEN_ACTIVATIONS:
        raise UnsupportedModelError(
            f"{source}: hidden_activation {hidden_act!r} is not supported (supported: {', '.join(HIDDEN_ACTIVATIONS)})"
        )

    layer_types = fields.get("layer_types", None)
    if layer_types is None:
        layer_types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)]
    layer_types = _layer_kinds(layer_types, layers, "sliding_attention", source)
    layer_types = [*layer_types[:-1], "full_attention"]  # transformers forces the last layer to full attention

    k_eq_v = fields.boolean("attention_k_eq_v", default=False)
    head_dims, layer_kv = _gemma4_layer_shapes(fields, layer_types, kv_heads, head_dim, k_eq_v, source)
    for i, (hd, kv) in enumerate(zip(head_dims, layer_kv, strict=True)):
        if hd % HEAD_DIM_MULTIPLE or not HEAD_DIM_MULTIPLE <= hd <= MAX_HEAD_DIM or (heads * hd) % BLOCK:
            raise UnsupportedModelError(
                f"{source}: layer {i}'s head_dim = {hd} is not supported: the attention kernel runs head dims "
                f"that are multiples of {HEAD_DIM_MULTIPLE} from {HEAD_DIM_MULTIPLE} to {MAX_HEAD_DIM}",
                advice="",
            )
        if heads % kv:
            raise ModelFormatError(f"{source}: layer {i}'s {kv} KV heads do not divide num_attention_heads = {heads}")

    shared = data.get("num_kv_shared_layers") or 0
    if not isinstance(shared, int) or isinstance(shared, bool) or not 0 <= shared <= layers:
        raise ModelFormatError(f"{source}: field 'num_kv_shared_layers' must be in 0..{layers}, got {shared!r}")
    if shared == layers:
        raise UnsupportedModelError(
            f"{source}: num_kv_shared_layers = num_hidden_layers = {layers}: every layer reads another model's K/V "
            "(a gemma4_assistant drafter), which is not supported"
        )
    producers = set(layer_types[: layers - shared])
    if shared and producers != set(layer_types):
        raise ModelFormatError(
            f"{source}: the {shared} KV-shared layers need an earlier layer of each of their types "
            f"({sorted(set(layer_types))}); the first {layers - shared} layers hold only {sorted(producers)}"
        )
    for i in range(layers - shared, layers):  # a shared layer reads its source's cache: the same head shape
        j = max(j for j in range(layers - shared) if layer_types[j] == layer_types[i])
        if (head_dims[i], layer_kv[i]) != (head_dims[j], layer_kv[j]):
            raise ModelFormatError(
                f"{source}: KV-shared layer {i} has {layer_kv[i]} KV heads of {head_dims[i]} but reads the K/V of "
                f"layer {j}, which has {layer_kv[j]} of {head_dims[j]}"
            )

    per_layer = data.get("hidden_size_per_layer_input", 256)
    per_layer = 0 if per_layer is None else per_layer
    if not isinstance(per_layer, int) or isinstance(per_layer, bool) or per_layer < 0 or per_layer % BLOCK:
        raise UnsupportedModelError(
            f"{source}: field 'hidden_size_per_layer_input' = {per_layer!r} is not supported: the matmul kernels "
            f"need a multiple of {BLOCK} (or 0: no per-layer inputs)",
            advice="",
        )
    per_layer_vocab = fields.positive_int("vocab_size_per_layer_input", default=262_144) if per_layer else 0
    if per_layer and per_layer_vocab < ints["vocab_size"]:
        raise UnsupportedModelError(
            f"{source}: vocab_size_per_layer_input = {per_layer_vocab} is smaller than vocab_size = "
            f"{ints['vocab_size']}: tokens past it have no per-layer input"
        )

    nested = data.get("rope_parameters")
    if nested is None:
        nested = GEMMA4_ROPE_DEFAULTS
    if not isinstance(nested, dict):
        raise ModelFormatError(f"{source}: field 'rope_parameters' must be an object, got {nested!r:.80}")
    full = _gemma4_rope(nested, "full_attention", source)
    local = _gemma4_rope(nested, "sliding_attention", source) if "sliding_attention" in layer_types else (1.0, None)
    if local[1] is not None:
        raise UnsupportedModelError(f"{source}: RoPE scaling on sliding-window layers is not supported")
    cap = data.get("final_logit_softcapping")
    return {
        "sandwich_norms": True,
        "embed_scale": float(np.float32(math.sqrt(ints["hidden_size"]))),
        "hidden_act": hidden_act,
        "attention_scale": 1.0,
        "sliding_window": fields.positive_int("sliding_window", default=512),
        "layer_types": tuple(layer_types),
        "rope_local_theta": local[0],
        "rope": full,
        "final_logit_softcapping": None if cap is None else fields.positive_float("final_logit_softcapping", 1.0),
        "layer_head_dims": tuple(head_dims),
        "layer_kv_heads": tuple(layer_kv),
        "num_kv_shared_layers": shared,
        "attention_k_eq_v": k_eq_v,
        "v_norm": True,
        "double_wide_mlp": fields.boolean("use_double_wide_mlp", default=False),
        "hidden_size_per_layer_input": per_layer,
        "vocab_size_per_layer_input": per_layer_vocab,
    }


def _gemma4_layer_shapes(
    fields: _Fields, layer_types: list[str], kv_heads: int, head_dim: int, k_eq_v: bool, source: str
) -> tuple[list[int], list[int]]:
    """(head_dim, num_key_value_heads) of each layer: per_layer_config's overrides when config.json has them
    (transformers writes them when it saves), else global_head_dim (default 512) and, for attention_k_eq_v
    models, num_global_key_value_heads on the full-attention layers."""
    overrides = fields.data.get("per_layer_config")
    if overrides is None:
        full: dict[str, Any] = {"head_dim": fields.positive_int("global_head_dim", default=512)}
        global_kv = fields.positive_int("num_global_key_value_heads", default=None)
        if k_eq_v and global_kv is not None:
            full["num_key_value_heads"] = global_kv
        overrides = {i: full for i, kind in enumerate(layer_types) if kind == "full_attention"}
    if not isinstance(overrides, dict):
        raise ModelFormatError(f"{source}: field 'per_layer_config' must be an object, got {overrides!r:.80}")
    head_dims, layer_kv = [head_dim] * len(layer_types), [kv_heads] * len(layer_types)
    for key, values in overrides.items():
        index = int(key) if isinstance(key, int) or (isinstance(key, str) and key.isdigit()) else -1
        if not 0 <= index < len(layer_types) or not isinstance(values, dict):
            raise ModelFormatError(f"{source}: per_layer_config entry {key!r}: {values!r:.80} is not a layer's fields")
        unknown = sorted(set(values) - set(GEMMA4_LAYER_OVERRIDES))
        if unknown:
            raise UnsupportedModelError(f"{source}: per_layer_config overrides {unknown} of layer {index}")
        entry = _Fields(values, f"{source}: per_layer_config[{key!r}]")
        head_dims[index] = entry.positive_int("head_dim", default=head_dim)
        layer_kv[index] = entry.positive_int("num_key_value_heads", default=kv_heads)
    return head_dims, layer_kv


def _gemma4_rope(nested: dict[str, Any], kind: str, source: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) of one layer type's rope_parameters: "default", or "proportional" (the first
    partial_rotary_factor of each head's frequency pairs rotate, the others keep frequency 0)."""
    entry = nested.get(kind)
    if not isinstance(entry, dict):
        raise ModelFormatError(f"{source}: field 'rope_parameters.{kind}' must be an object, got {entry!r:.80}")
    where = f"{source}: rope_parameters.{kind}"
    fields = _Fields(entry, where)
    theta = fields.positive_float("rope_theta", GEMMA4_ROPE_DEFAULTS[kind]["rope_theta"])
    rope_type = entry.get("rope_type", "default")
    if rope_type == "default":
        return theta, None
    if rope_type != "proportional":
        raise UnsupportedModelError(f"{where}: rope type {rope_type!r} is not supported (default, proportional)")
    fraction = fields.positive_float("partial_rotary_factor", 1.0)
    if fraction > 1:
        raise ModelFormatError(f"{where}: field 'partial_rotary_factor' must be in (0, 1], got {fraction}")
    factor = fields.positive_float("factor", 1.0)
    return theta, {"rope_type": "proportional", "partial_rotary_factor": fraction, "factor": factor}


def _qwen3_5(fields: _Fields, ints: dict[str, int], head_dim: int, source: str) -> dict[str, Any]:
    """Qwen 3.5's text fields (transformers' Qwen3_5TextConfig defaults): the Gated DeltaNet shape, which layers
    are linear (every 4th is full attention unless layer_types says), partial RoPE, the attention output gate and
    the zero-centred (1 + w) norms."""
    layers = ints["num_hidden_layers"]
    layer_types = fields.get("layer_types", None)
    if layer_types is None:
        interval = fields.positive_int("full_attention_interval", default=4)
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    layer_types = _layer_kinds(layer_types, layers, "linear_attention", source)
    shape = LinearAttention(
        conv_taps=fields.positive_int("linear_conv_kernel_dim", default=4),
        key_heads=fields.positive_int("linear_num_key_heads", default=16),
        value_heads=fields.positive_int("linear_num_value_heads", default=32),
        key_dim=fields.positive_int("linear_key_head_dim", default=128),
        value_dim=fields.positive_int("linear_value_head_dim", default=128),
    )
    if shape.value_heads % shape.key_heads:
        raise ModelFormatError(
            f"{source}: field 'linear_num_key_heads' = {shape.key_heads} does not divide "
            f"linear_num_value_heads = {shape.value_heads}"
        )
    for name, value, limit in (
        ("linear_key_head_dim", shape.key_dim, MAX_LINEAR_KEY_DIM),
        ("linear_value_head_dim", shape.value_dim, MAX_LINEAR_VALUE_DIM),
        ("linear_conv_kernel_dim", shape.conv_taps, MAX_CONV_TAPS),
    ):
        if value > limit:
            raise UnsupportedModelError(
                f"{source}: field {name!r} = {value} is not supported: the linear-attention kernel takes at most "
                f"{limit}",
                advice="",
            )
    if shape.value_width % BLOCK:
        raise UnsupportedModelError(
            f"{source}: linear_num_value_heads * linear_value_head_dim = {shape.value_width} is not supported: the "
            f"matmul kernels need a multiple of {BLOCK}",
            advice="",
        )
    hidden_act = fields.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise UnsupportedModelError(f"{source}: hidden_act {hidden_act!r} is not supported (only 'silu')")
    parameters = fields.get("rope_parameters", None)
    factor = fields.get("partial_rotary_factor", None)
    if factor is None and isinstance(parameters, dict):
        factor = parameters.get("partial_rotary_factor")
    factor = 0.25 if factor is None else factor
    if not _is_number(factor) or not 0 < factor <= 1:
        raise ModelFormatError(f"{source}: field 'partial_rotary_factor' must be in (0, 1], got {factor!r}")
    rotary_dim = int(head_dim * factor)
    if rotary_dim < 2 or rotary_dim % 2:
        raise UnsupportedModelError(
            f"{source}: partial_rotary_factor {factor} of head_dim {head_dim} rotates {rotary_dim} dims; RoPE "
            "needs a positive even number",
            advice="",
        )
    return {
        "norm_offset": 1.0,
        "layer_types": tuple(layer_types),
        "linear_attention": shape,
        "attention_gate": True,
        "rotary_dim": None if rotary_dim == head_dim else rotary_dim,
    }


def _rope(fields: _Fields, source: str) -> tuple[float, dict[str, Any] | None]:
    parameters = fields.get("rope_parameters", None)
    if parameters is not None and not isinstance(parameters, dict):
        raise ModelFormatError(f"{source}: field 'rope_parameters' must be an object, got {parameters!r}")
    parameters = dict(parameters or {})
    theta = parameters.pop("rope_theta", None)
    if theta is None:
        theta = fields.positive_float("rope_theta", default=_DEFAULT_ROPE_THETA)
    elif not _is_number(theta) or theta <= 0:
        raise ModelFormatError(f"{source}: field 'rope_parameters.rope_theta' must be a positive number, got {theta!r}")

    scaling = fields.get("rope_scaling", None)
    if scaling is None:
        scaling = parameters
    elif not isinstance(scaling, dict):
        raise ModelFormatError(f"{source}: field 'rope_scaling' must be an object or null, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if not isinstance(kind, str):
        raise ModelFormatError(f"{source}: field 'rope_scaling.rope_type' must be a name, got {kind!r:.80}")
    if kind == "default":
        return float(theta), None
    if kind not in ROPE_SCALING_PARAMETERS:
        raise UnsupportedModelError(
            f"{source}: rope scaling type {kind!r} is not supported (supported: default, "
            f"{', '.join(ROPE_SCALING_PARAMETERS)})"
        )
    normalized: dict[str, Any] = {"rope_type": kind}
    for name in ROPE_SCALING_PARAMETERS[kind]:
        value = scaling.get(name)
        if not _is_number(value) or value <= 0:
            raise ModelFormatError(f"{source}: field 'rope_scaling.{name}' must be a positive number, got {value!r}")
        normalized[name] = value
    return float(theta), normalized


def _is_number(value: Any) -> bool:
    # Python's json reads NaN and Infinity, which would turn into NaN logits far from their cause.
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return abs(value) <= _FLOAT_MAX  # beyond it float(value) overflows
    return isinstance(value, float) and math.isfinite(value)


class _Fields:
    """Typed reads of config.json fields, with errors naming the file and the field."""

    def __init__(self, data: dict[str, Any], source: str):
        self.data = data
        self.source = source

    def get(self, name: str, default: Any) -> Any:
        value = self.data.get(name)
        return default if value is None else value

    def positive_int(self, name: str, default: int | EllipsisType | None = ...) -> Any:
        """The field's value; a missing field is an error unless a default (None included) is given."""
        value = self.data.get(name)
        if value is None:
            if default is ...:
                raise ModelFormatError(f"{self.source}: required field {name!r} is missing")
            return default
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelFormatError(f"{self.source}: field {name!r} must be a positive integer, got {value!r}")
        return value

    def positive_float(self, name: str, default: float) -> float:
        value = self.get(name, default)
        if not _is_number(value) or value <= 0:
            raise ModelFormatError(f"{self.source}: field {name!r} must be a positive number, got {value!r}")
        return float(value)

    def boolean(self, name: str, default: bool) -> bool:
        value = self.get(name, default)
        if not isinstance(value, bool):
            raise ModelFormatError(f"{self.source}: field {name!r} must be true or false, got {value!r}")
        return value

    def token_id(self, name: str, vocab_size: int) -> int | None:
        ids = self.token_ids(name, vocab_size)
        if len(ids) > 1:
            raise ModelFormatError(f"{self.source}: field {name!r} must be one token id, got {self.data[name]!r}")
        return ids[0] if ids else None

    def token_ids(self, name: str, vocab_size: int) -> tuple[int, ...]:
        value = self.data.get(name)
        values = value if isinstance(value, list) else [] if value is None else [value]
        if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < vocab_size for v in values):
            raise ModelFormatError(
                f"{self.source}: field {name!r} must be a token id below vocab_size = {vocab_size} "
                f"(or a list of them), got {value!r}"
            )
        return tuple(values)
