"""GGUF files: a checked, memory-mapped reader, and conversion into a Hugging Face style model folder.

A converted folder holds config.json, generation_config.json, model.safetensors, tokenizer.json and
tokenizer_config.json (with the chat template), plus `doppler_conversion.json`, which says what it was made
from. Weights are written as f32, f16, or "keep": GGUF blocks of Q4_0 / Q4_1 / Q8_0 are stored byte for byte
as U8 tensors of shape [N, K/32 * block_bytes], and the safetensors header metadata key "doppler.quant" maps
each such tensor to {"format": "q4_1", "shape": [N, K]}. Other block types are dequantised to f16 in "keep"
mode (f16 rounding is far below their quantisation error).

The header is parsed here rather than by `gguf.GGUFReader` so that a truncated or malformed file, or an
unknown tensor type, is reported with the file, the tensor and the byte offset; the `gguf` package still
supplies the type table and the dequantisers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from tqdm import tqdm

from doppler_py.errors import ModelFormatError, UnsupportedModelError
from doppler_py.model import gguf_families as families
from doppler_py.model.config import ModelConfig
from doppler_py.model.spm_vocab import SPACE as SPACE_PIECE
from doppler_py.model.spm_vocab import spm_tokenizer
from doppler_py.paths import cache_dir

WEIGHT_MODES = ("f32", "f16", "keep")
QUANT_METADATA_KEY = "doppler.quant"
KEPT_BLOCK_FORMATS = {
    GGMLQuantizationType.Q4_0: "q4_0",
    GGMLQuantizationType.Q4_1: "q4_1",
    GGMLQuantizationType.Q8_0: "q8_0",
}
CONVERSION_MARKER = "doppler_conversion.json"
CONVERSION_FORMAT = 1  # bump when converted folders change, so caches made by older versions are redone

_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4

# --- reading ----------------------------------------------------------------------------------------------

_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order, rows first (the file lists dimensions innermost first)
    raw: np.ndarray  # the stored bytes, a uint8 view into the memory map

    @property
    def rows(self) -> np.ndarray:
        """The bytes as one row per index of the first dimension (rows of blocks for quantised types)."""
        return self.raw.reshape(self.shape[0], -1)


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]


class _Cursor:
    """Sequential little-endian reads from the mapped file; running off its end is a truncation error."""

    def __init__(self, data: np.ndarray, path: Path):
        self.data = data
        self.path = path
        self.pos = 0

    def take(self, size: int, what: str) -> memoryview:
        end = self.pos + size
        if size < 0 or end > len(self.data):
            raise ModelFormatError(
                f"{self.path}: truncated GGUF header: {what} needs bytes [{self.pos}, {end}) "
                f"but the file has {len(self.data)} bytes"
            )
        view = memoryview(self.data[self.pos : end])
        self.pos = end
        return view

    def scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        size = self.scalar("<Q", what)
        try:
            return bytes(self.take(size, what)).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ModelFormatError(f"{self.path}: {what} is not valid UTF-8 ({exc})") from None

    def value(self, kind: int, what: str) -> Any:
        if kind == _STRING:
            return self.string(what)
        if kind in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[kind], what)
        if kind == _ARRAY:
            item_kind = self.scalar("<I", what)
            count = self.scalar("<Q", what)
            if item_kind in _SCALAR_FORMATS:
                dtype = np.dtype(_SCALAR_FORMATS[item_kind])
                return np.frombuffer(self.take(count * dtype.itemsize, what), dtype=dtype).tolist()
            return [self.value(item_kind, f"{what}[{i}]") for i in range(count)]
        raise ModelFormatError(f"{self.path}: {what} has unknown value type {kind}")


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF file's header and map its tensors (no tensor data is read until used)."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ModelFormatError(f"{path}: GGUF file not found") from None
    if size < len(_MAGIC):
        raise ModelFormatError(f"{path}: {size} bytes is too short to be a GGUF file")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(data, path)
    if bytes(cursor.take(4, "magic")) != _MAGIC:
        raise ModelFormatError(f"{path}: not a GGUF file (magic {bytes(data[:4])!r})")
    version = cursor.scalar("<I", "version")
    if version not in _SUPPORTED_VERSIONS:
        raise UnsupportedModelError(
            f"{path}: GGUF version {version} is not supported (supported: {_SUPPORTED_VERSIONS}; "
            "a huge number means a big-endian file)"
        )
    tensor_count = cursor.scalar("<Q", "tensor count")
    kv_count = cursor.scalar("<Q", "metadata count")
    metadata: dict[str, Any] = {}
    for index in range(kv_count):
        key = cursor.string(f"metadata key #{index}")
        metadata[key] = cursor.value(cursor.scalar("<I", f"type of {key}"), f"metadata {key!r}")

    infos = []
    for index in range(tensor_count):
        name = cursor.string(f"name of tensor #{index}")
        n_dims = cursor.scalar("<I", f"tensor {name!r}")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ModelFormatError(f"{path}: tensor {name!r} has {n_dims} dimensions")
        dims = [cursor.scalar("<Q", f"tensor {name!r}") for _ in range(n_dims)]
        type_id = cursor.scalar("<I", f"tensor {name!r}")
        offset = cursor.scalar("<Q", f"tensor {name!r}")
        infos.append((name, dims, type_id, offset))

    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ModelFormatError(f"{path}: general.alignment = {alignment!r} is not a power of two")
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = {}
    for name, dims, type_id, offset in infos:
        if name in tensors:
            raise ModelFormatError(f"{path}: tensor {name!r} appears twice")
        tensors[name] = _tensor(path, data, name, dims, type_id, data_start, offset, alignment)
    return GGUFFile(path, version, metadata, tensors)


def _tensor(
    path: Path, data: np.ndarray, name: str, dims: list[int], type_id: int, data_start: int, offset: int, align: int
) -> GGUFTensor:
    try:
        ggml_type = GGMLQuantizationType(type_id)
    except ValueError:
        raise UnsupportedModelError(f"{path}: tensor {name!r} has unknown ggml type id {type_id}") from None
    block_size, block_bytes = GGML_QUANT_SIZES[ggml_type]
    if 0 in dims:
        raise ModelFormatError(f"{path}: tensor {name!r} has a zero dimension ({dims})")
    if dims[0] % block_size:
        raise ModelFormatError(
            f"{path}: tensor {name!r} ({ggml_type.name}) has a row of {dims[0]} values, "
            f"not a multiple of its block size {block_size}"
        )
    if offset % align:
        raise ModelFormatError(f"{path}: tensor {name!r} starts at offset {offset}, not aligned to {align}")
    nbytes = math.prod(dims) // block_size * block_bytes  # Python ints: corrupt dimensions must not wrap
    begin = data_start + offset
    if begin + nbytes > len(data):
        raise ModelFormatError(
            f"{path}: tensor {name!r} needs bytes [{begin}, {begin + nbytes}) but the file has "
            f"{len(data)} bytes (truncated?)"
        )
    return GGUFTensor(name, ggml_type, tuple(reversed(dims)), data[begin : begin + nbytes])


# --- model configuration from metadata ---------------------------------------------------------------------


@dataclass(frozen=True)
class _GGUFArchitecture:
    hf_architecture: str
    rope_rows_permuted: bool  # llama.cpp's converter interleaves Q/K rows for its rotary kernel
    has_qkv_bias: bool
    has_qk_norm: bool = False  # attn_q_norm / attn_k_norm per layer
    # Gemma 3: norms before and after attention and the MLP, and every norm weight stored as 1 + w (llama.cpp
    # folds Gemma's (1 + w) into the weight; the HF folder keeps w)
    gemma: bool = False


# llama.cpp's converter permutes Q/K rows for LLaMA only (its LlamaModel); the others keep HF order.
_ARCHITECTURES = {
    "llama": _GGUFArchitecture("LlamaForCausalLM", rope_rows_permuted=True, has_qkv_bias=False),
    "qwen2": _GGUFArchitecture("Qwen2ForCausalLM", rope_rows_permuted=False, has_qkv_bias=True),
    "qwen3": _GGUFArchitecture("Qwen3ForCausalLM", rope_rows_permuted=False, has_qkv_bias=False, has_qk_norm=True),
    "gemma2": _GGUFArchitecture("Gemma2ForCausalLM", rope_rows_permuted=False, has_qkv_bias=False, gemma=True),
    "gemma3": _GGUFArchitecture(
        "Gemma3ForCausalLM", rope_rows_permuted=False, has_qkv_bias=False, has_qk_norm=True, gemma=True
    ),
    # Layers of two kinds, names and values as gguf_families describes.
    "qwen35": _GGUFArchitecture("Qwen3_5ForCausalLM", rope_rows_permuted=False, has_qkv_bias=False),
    "gemma4": _GGUFArchitecture("Gemma4ForCausalLM", rope_rows_permuted=False, has_qkv_bias=False),
}
# What llama.cpp fixes in its code for Gemma rather than storing: every 2nd (Gemma 2) or 6th (Gemma 3) layer is
# global, the others sliding-window; Gemma 3's sliding layers use RoPE base 10000; the 27B models (46 and 62
# layers) scale queries by (hidden / heads)^-1/2, every other size by head_dim^-1/2.
GEMMA_SLIDING_WINDOW_PATTERN = {"gemma2": 2, "gemma3": 6}
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
GEMMA_LOCAL_ROPE_BASE = 10_000.0
GEMMA_END_OF_TURN = "<end_of_turn>"


class _Metadata:
    def __init__(self, gguf: GGUFFile):
        self.gguf = gguf
        self.arch = gguf.metadata.get("general.architecture")

    def get(self, key: str, default: Any = None) -> Any:
        return self.gguf.metadata.get(key, default)

    def required(self, key: str) -> Any:
        if key not in self.gguf.metadata:
            raise ModelFormatError(f"{self.gguf.path}: metadata key {key!r} is missing")
        return self.gguf.metadata[key]

    def model(self, name: str, default: Any = ...) -> Any:
        key = f"{self.arch}.{name}"
        return self.required(key) if default is ... else self.get(key, default)

    def checked(self, key: str, expected: str, valid: Callable[[Any], bool], default: Any = ...) -> Any:
        """The value of `key` (required unless a default is given), refused unless `valid(value)`: a GGUF value
        carries its own type tag, so a corrupt or hand-made file can give any key any type."""
        if key not in self.gguf.metadata and default is not ...:
            return default
        value = self.required(key)
        if not valid(value):
            raise ModelFormatError(f"{self.gguf.path}: metadata {key!r} must be {expected}, got {value!r:.80}")
        return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _list_of(item: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, list) and all(item(v) for v in value)


def _architecture(gguf: GGUFFile) -> _GGUFArchitecture:
    arch = gguf.metadata.get("general.architecture")
    if arch in families.REFUSED:
        raise UnsupportedModelError(f"{gguf.path}: GGUF architecture {arch!r}: {families.REFUSED[arch]}", advice="")
    if not isinstance(arch, str) or arch not in _ARCHITECTURES:
        raise UnsupportedModelError(
            f"{gguf.path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(_ARCHITECTURES)})"
        )
    return _ARCHITECTURES[arch]


def hf_config(gguf: GGUFFile) -> dict[str, Any]:
    """The Hugging Face config.json contents this GGUF's metadata describes."""
    arch = _architecture(gguf)
    meta = _Metadata(gguf)
    if meta.arch in families.FAMILIES:
        return _family_config(meta, arch)
    if "rope_freqs.weight" in gguf.tensors:
        raise UnsupportedModelError(
            f"{gguf.path}: tensor 'rope_freqs.weight' (llama3-style RoPE scaling baked into frequency factors) "
            "is not supported in GGUF import",
            advice="convert the original Hugging Face folder instead",
        )
    hidden = meta.model("embedding_length")
    heads = meta.model("attention.head_count")
    # llama.cpp's default, hidden / heads, written out: Qwen3's HF config would otherwise default to 128.
    head_dim = meta.model("attention.key_length", None)
    if head_dim is None and _is_int(hidden) and _is_int(heads) and heads > 0:
        head_dim = hidden // heads
    if meta.model("attention.value_length", head_dim) != head_dim:
        raise UnsupportedModelError(f"{gguf.path}: attention key and value lengths differ")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab_size = meta.model("vocab_size", None) or (len(tokens) if isinstance(tokens, list) else None)
    config: dict[str, Any] = {
        "architectures": [arch.hf_architecture],
        "model_type": meta.arch,
        "vocab_size": vocab_size or None,
        "hidden_size": hidden,
        "intermediate_size": meta.model("feed_forward_length"),
        "num_hidden_layers": meta.model("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.model("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": meta.model("attention.layer_norm_rms_epsilon"),
        "rope_theta": meta.model("rope.freq_base", 10000.0),
        "max_position_embeddings": meta.model("context_length"),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _stop_ids(meta, arch.gemma),
    }
    scaling = meta.model("rope.scaling.type", "none")
    if scaling != "none":
        # ModelConfig refuses the types we do not implement, with their name.
        config["rope_scaling"] = {"rope_type": scaling, "factor": meta.model("rope.scaling.factor", None)}
    if arch.gemma:
        config |= _gemma_config(meta, hidden, heads, head_dim)
    return config


def _family_config(meta: _Metadata, arch: _GGUFArchitecture) -> dict[str, Any]:
    """config.json of a qwen35 or gemma4 file: the fields every family shares, then its own (gguf_families)."""
    gguf = meta.gguf
    tokens = meta.get("tokenizer.ggml.tokens")
    blocks = meta.checked(f"{meta.arch}.block_count", "a positive integer", lambda v: _is_int(v) and v > 0)
    mtp = _mtp_layers(meta)
    if mtp >= blocks:
        raise ModelFormatError(
            f"{gguf.path}: {meta.arch}.nextn_predict_layers = {mtp} leaves none of block_count = {blocks} layers"
        )
    layers = blocks - mtp
    base: dict[str, Any] = {
        "architectures": [arch.hf_architecture],
        "vocab_size": meta.model("vocab_size", None) or (len(tokens) if isinstance(tokens, list) else None),
        "hidden_size": meta.model("embedding_length"),
        "intermediate_size": meta.model("feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": meta.model("attention.head_count"),
        "num_key_value_heads": meta.model("attention.head_count_kv"),
        "rms_norm_eps": meta.model("attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": meta.model("context_length"),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _stop_ids(meta, meta.arch == "gemma4"),
    }
    if meta.model("rope.scaling.type", "none") != "none":
        raise UnsupportedModelError(
            f"{gguf.path}: {meta.arch}.rope.scaling.type = {meta.model('rope.scaling.type')!r} is not supported"
        )
    return families.FAMILIES[meta.arch].config(meta, base)


def _mtp_layers(meta: _Metadata) -> int:
    """How many of block_count's layers are multi-token-prediction layers after the model's own (llama.cpp writes
    Qwen 3.5's MTP block as the last blocks); they are left out, as transformers' CausalLM leaves out mtp.*."""
    return meta.checked(
        f"{meta.arch}.nextn_predict_layers", "a non-negative integer", lambda v: _is_int(v) and v >= 0, 0
    )


def _stop_ids(meta: _Metadata, gemma: bool) -> int | list[int] | None:
    """The end-of-sequence id, plus the end-of-turn id where it differs: chat models end a turn with it and
    stop there, as their HF generation_config says. Without tokenizer.ggml.eot_token_id, Gemma's is found by
    its text, as llama.cpp finds it."""
    eos, eot = meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")
    tokens = meta.get("tokenizer.ggml.tokens")
    if eot is None and gemma and isinstance(tokens, list) and GEMMA_END_OF_TURN in tokens:
        eot = tokens.index(GEMMA_END_OF_TURN)
    return [eos, eot] if eos is not None and eot is not None and eot != eos else eos


def _gemma_config(meta: _Metadata, hidden: Any, heads: Any, head_dim: Any) -> dict[str, Any]:
    """Gemma 2 and 3's config.json fields, with what llama.cpp fixes in its code spelled out."""
    layers = meta.model("block_count")
    pattern = meta.model("attention.sliding_window_pattern", GEMMA_SLIDING_WINDOW_PATTERN[meta.arch])
    if _list_of(_is_bool)(pattern):  # newer llama.cpp: one flag per layer, True = sliding window
        layer_types = ["sliding_attention" if sliding else "full_attention" for sliding in pattern]
    elif _is_int(pattern) and pattern > 0 and _is_int(layers):
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    else:
        raise ModelFormatError(
            f"{meta.gguf.path}: metadata {meta.arch}.attention.sliding_window_pattern must be a positive integer "
            f"or a list of booleans, got {pattern!r:.80}"
        )
    is_27b = layers == GEMMA_27B_LAYERS[meta.arch] and _is_int(hidden) and _is_int(heads) and heads > 0
    config = {
        "hidden_act": None,
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": meta.model("attention.sliding_window"),
        "layer_types": layer_types,
        "query_pre_attn_scalar": hidden // heads if is_27b else head_dim,
    }
    if meta.arch == "gemma2":
        return config | {
            "model_type": "gemma2",
            "attn_logit_softcapping": meta.model("attn_logit_softcapping", 50.0),
            "final_logit_softcapping": meta.model("final_logit_softcapping", 30.0),
        }
    return config | {
        "model_type": "gemma3_text",
        "rope_theta": meta.model("rope.freq_base", 1_000_000.0),
        "rope_local_base_freq": GEMMA_LOCAL_ROPE_BASE,
    }


# --- tensor names and layout -------------------------------------------------------------------------------

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GEMMA_LAYER_TENSORS = {
    **{name: hf for name, hf in _LAYER_TENSORS.items() if name != "ffn_norm"},
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_QK_NORM_TENSORS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


def _layer_tensors(arch: _GGUFArchitecture) -> dict[str, str]:
    """llama.cpp's per-layer tensor names (without blk.N. and .weight) -> the HF names, for `arch`."""
    names = dict(_GEMMA_LAYER_TENSORS if arch.gemma else _LAYER_TENSORS)
    if arch.has_qk_norm:
        names |= _QK_NORM_TENSORS
    return names


_LAYER_TENSOR_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_BLOCK_INDEX = re.compile(r"blk\.(\d+)\.")
_FAMILY_LAYER_TENSOR_NAME = re.compile(r"blk\.(\d+)\.(\w+(?:\.weight|\.bias)?)")  # qwen35's ssm_a has no suffix


def hf_tensor_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """The Hugging Face name of a llama.cpp tensor name in a GGUF of `architecture`, or None if it has no
    counterpart."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    family = families.FAMILIES.get(architecture)
    if family:
        match = _FAMILY_LAYER_TENSOR_NAME.fullmatch(gguf_name)
        part = match and family.layer_names.get(match[2])
        return f"model.layers.{match[1]}.{part}" if part else family.global_names.get(gguf_name)
    match = _LAYER_TENSOR_NAME.fullmatch(gguf_name)
    part = match and _layer_tensors(_ARCHITECTURES[architecture]).get(match[2])
    return f"model.layers.{match[1]}.{part}.{match[3]}" if part else None


def _expected_tensors(config: ModelConfig, arch: _GGUFArchitecture, architecture: str) -> Iterator[str]:
    """The tensor names the config calls for, lazily: a corrupt block_count (up to 2^64) must end at the first
    missing layer, not build billions of names."""
    yield from ("token_embd.weight", "output_norm.weight")
    if not config.tie_word_embeddings:
        yield "output.weight"
    family = families.FAMILIES.get(architecture)
    if family:
        yield from family.expected_global(config)
    for layer in range(config.num_hidden_layers):
        if family:
            yield from (f"blk.{layer}.{part}" for part in family.expected_layer(config, layer))
            continue
        yield from (f"blk.{layer}.{part}.weight" for part in _layer_tensors(arch))
        if arch.has_qkv_bias:
            yield from (f"blk.{layer}.attn_{part}.bias" for part in "qkv")


def unpermute_rope_rows(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: within each head it interleaves the two rotary halves
    (row 2j+i holds HF row i*head_dim/2 + j). Rows may be bytes or blocks; they are only moved."""
    per_head = rows.shape[0] // n_heads
    return rows.reshape(n_heads, per_head // 2, 2, -1).swapaxes(1, 2).reshape(rows.shape)


_ITEM_BYTES = {"F32": 4, "F16": 2, "U8": 1}
_NO_RESTORE = families.Restore()


@dataclass(frozen=True)
class _Planned:
    """One output tensor: where it comes from and how it is stored."""

    name: str
    source: GGUFTensor
    dtype: str  # safetensors dtype: "F32", "F16" or "U8"
    shape: tuple[int, ...]
    kept_format: str | None  # the ggml block format of a "keep" tensor stored as raw bytes
    rope_heads: int  # undo the Q/K row permutation over this many heads (0: rows stay)
    shift: float = 0.0  # added to the values (-1: a Gemma norm weight stored as 1 + w)
    restore: families.Restore = _NO_RESTORE  # rows to reorder, values to transform (qwen35)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * _ITEM_BYTES[self.dtype]


def _plan(gguf: GGUFFile, config: ModelConfig, arch: _GGUFArchitecture, weights: str) -> list[_Planned]:
    architecture = gguf.metadata["general.architecture"]
    for name in _expected_tensors(config, arch, architecture):
        if name not in gguf.tensors:
            raise ModelFormatError(f"{gguf.path}: tensor {name!r} is missing")
    rope_heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    family = families.FAMILIES.get(architecture)
    mtp_layers = _mtp_layers(_Metadata(gguf)) if family else 0
    plan = []
    for tensor in gguf.tensors.values():
        if family and tensor.name in family.config_tensors:
            continue  # read into the config (Gemma 4's proportional RoPE)
        block = _BLOCK_INDEX.match(tensor.name)
        if block and 0 <= int(block[1]) - config.num_hidden_layers < mtp_layers:
            continue  # a multi-token-prediction layer (_mtp_layers), its nextn.* tensors included
        name = hf_tensor_name(tensor.name, architecture)
        if name is None:
            raise UnsupportedModelError(f"{gguf.path}: tensor {tensor.name!r} has no Hugging Face counterpart")
        match = (_FAMILY_LAYER_TENSOR_NAME if family else _LAYER_TENSOR_NAME).fullmatch(tensor.name)
        if match and int(match[1]) >= config.num_hidden_layers:
            raise ModelFormatError(
                f"{gguf.path}: tensor {tensor.name!r} is beyond block_count = {config.num_hidden_layers}"
            )
        heads = rope_heads.get(match[2], 0) if match and arch.rope_rows_permuted else 0
        if heads and tensor.shape[0] != heads * config.head_dim:
            raise ModelFormatError(
                f"{gguf.path}: tensor {tensor.name!r} has {tensor.shape[0]} rows, expected "
                f"{heads} heads x head_dim {config.head_dim}"
            )
        restore = family.restore(match[2], tensor, config, gguf.path) if family and match else _NO_RESTORE
        planned = _plan_tensor(name, tensor, weights, heads, restore)
        # Gemma 2/3 (and a family that says so) scale by 1 + w, which llama.cpp stores.
        one_plus = family.one_plus(tensor.name) if family else arch.gemma and tensor.name.endswith("norm.weight")
        if one_plus:
            planned = dataclasses.replace(planned, shift=-1.0)
        plan.append(planned)
    return plan


def _plan_tensor(name: str, tensor: GGUFTensor, weights: str, rope_heads: int, restore: families.Restore) -> _Planned:
    kind = tensor.ggml_type
    # Blocks are kept when at most their rows move; values transformed within a row are dequantised.
    keep_blocks = len(tensor.shape) == 2 and restore.values is None and restore.shape is None
    if weights == "keep" and kind in KEPT_BLOCK_FORMATS and keep_blocks:
        return _Planned(name, tensor, "U8", tensor.rows.shape, KEPT_BLOCK_FORMATS[kind], rope_heads, restore=restore)
    if weights == "keep" and kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        dtype = "F32" if kind == GGMLQuantizationType.F32 else "F16"
    else:
        dtype = "F32" if weights == "f32" else "F16"
    return _Planned(name, tensor, dtype, restore.shape or tensor.shape, None, rope_heads, restore=restore)


def _materialise(item: _Planned, gguf_path: Path) -> np.ndarray:
    """The stored array for one planned tensor, Q/K rows restored to Hugging Face order."""
    source = item.source
    rows = source.rows
    if item.rope_heads:
        rows = unpermute_rope_rows(rows, item.rope_heads)
    if item.restore.rows is not None:
        rows = rows[item.restore.rows]
    if item.kept_format:
        return rows
    try:
        values = dequantize(np.ascontiguousarray(rows), source.ggml_type)
    except NotImplementedError:
        raise UnsupportedModelError(
            f"{gguf_path}: tensor {source.name!r} uses {source.ggml_type.name}, which cannot be dequantised "
            f"(kept as blocks: {', '.join(KEPT_BLOCK_FORMATS.values())})"
        ) from None
    values = values.reshape(source.shape)
    if item.shift:
        values = values.astype(np.float32) + np.float32(item.shift)
    if item.restore.values is not None:
        values = item.restore.values(values)
    values = values.reshape(item.shape)
    if item.dtype == "F32":
        return values.astype(np.float32, copy=False)
    half = values.astype(np.float16)
    if not np.isfinite(half).all() and np.isfinite(values).all():
        raise UnsupportedModelError(
            f"{gguf_path}: tensor {source.name!r} has values beyond the float16 range",
            advice="convert with weights='f32'",
        )
    return half


# --- safetensors writing ------------------------------------------------------------------------------------


def _write_safetensors(
    path: Path, plan: list[_Planned], produce: Callable[[_Planned], np.ndarray], on_tensor: Callable[[int], None]
) -> None:
    """Stream tensors into a safetensors file one at a time, so at most one dequantised tensor is in memory."""
    header: dict[str, Any] = {}
    offset = 0
    for item in plan:
        header[item.name] = {
            "dtype": item.dtype,
            "shape": list(item.shape),
            "data_offsets": [offset, offset + item.nbytes],
        }
        offset += item.nbytes
    metadata = {"format": "pt"}
    kept = {
        item.name: {"format": item.kept_format, "shape": list(item.source.shape)} for item in plan if item.kept_format
    }
    if kept:
        metadata[QUANT_METADATA_KEY] = json.dumps(kept, sort_keys=True)
    header["__metadata__"] = metadata
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for item in plan:
            array = np.ascontiguousarray(produce(item))
            if array.nbytes != item.nbytes:
                raise AssertionError(f"{item.name}: produced {array.nbytes} bytes, planned {item.nbytes}")
            out.write(memoryview(array).cast("B"))
            on_tensor(item.nbytes)


# --- tokenizer from metadata --------------------------------------------------------------------------------

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# Qwen 3.5: combining marks (\p{M}) continue a word (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN35)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# How the text splitting that llama.cpp names in `tokenizer.ggml.pre` is spelled for the tokenizers package.
# A missing or unknown name is refused rather than guessed: a wrong split tokenises silently differently.
_PRE_TOKENIZER_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "qwen35": _QWEN35_SPLIT,
}
_GPT2_PRE_TOKENIZERS = ("gpt-2",)
_DIGIT_SPLITTING_PRE_TOKENIZERS = ("smollm",)  # GPT-2's regex after splitting every digit on its own


def _pre_tokenizer(kind: str, path: Path):
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind in _GPT2_PRE_TOKENIZERS:
        return byte_level
    if kind in _DIGIT_SPLITTING_PRE_TOKENIZERS:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if kind in _PRE_TOKENIZER_SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_PRE_TOKENIZER_SPLITS[kind]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    known = ", ".join(sorted((*_GPT2_PRE_TOKENIZERS, *_DIGIT_SPLITTING_PRE_TOKENIZERS, *_PRE_TOKENIZER_SPLITS)))
    stated = "is missing" if kind is None else f"= {kind!r} is not supported"
    raise UnsupportedModelError(f"{path}: tokenizer.ggml.pre {stated} (supported: {known})")


def _byte_level_bpe(meta: _Metadata, vocab: dict[str, int]):
    """The model, pre-tokenizer and decoder of a GPT-2 style vocabulary with its merges."""
    from tokenizers import Tokenizer, decoders, models

    path = meta.gguf.path
    merges = []
    for index, merge in enumerate(meta.checked("tokenizer.ggml.merges", "a list of strings", _list_of(_is_str))):
        pair = merge.split(" ")
        if len(pair) != 2:
            raise ModelFormatError(f"{path}: tokenizer.ggml.merges[{index}] = {merge!r} is not a pair")
        merges.append((pair[0], pair[1]))
    try:
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    except Exception as exc:  # the tokenizers package raises plain Exception, e.g. for a merge of unknown tokens
        raise ModelFormatError(f"{path}: the BPE vocabulary and merges do not fit together ({exc})") from None
    tokenizer.pre_tokenizer = _pre_tokenizer(meta.checked("tokenizer.ggml.pre", "a string", _is_str, None), path)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _gemma4_bpe(meta: _Metadata, vocab: dict[str, int]):
    """Gemma 4's vocabulary (tokenizer model "gemma4"), as llama.cpp reads it: BPE over raw UTF-8 with each space
    written "▁", the text split only between newline runs and the rest, unknown bytes spelled <0xXX>."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    path = meta.gguf.path
    merges = []
    for index, merge in enumerate(meta.checked("tokenizer.ggml.merges", "a list of strings", _list_of(_is_str))):
        cut = merge.find(" ", 1)  # from 1: a piece may itself be a space
        if cut < 0:
            raise ModelFormatError(f"{path}: tokenizer.ggml.merges[{index}] = {merge!r} is not a pair")
        merges.append((merge[:cut], merge[cut + 1 :]))
    try:
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=False))
    except Exception as exc:  # the tokenizers package raises plain Exception, e.g. for a merge of unknown tokens
        raise ModelFormatError(f"{path}: the BPE vocabulary and merges do not fit together ({exc})") from None
    tokenizer.normalizer = normalizers.Replace(" ", SPACE_PIECE)
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|\n+"), behavior="isolated")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(SPACE_PIECE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return tokenizer


def tokenizer_files(gguf: GGUFFile) -> tuple[str, dict[str, Any]]:
    """`(tokenizer.json text, tokenizer_config.json contents)` for the vocabulary in the metadata: byte-level BPE
    (tokenizer model "gpt2"), SentencePiece (model "llama", see `spm_vocab`) or Gemma 4's BPE (model "gemma4")."""
    from tokenizers import AddedToken, processors

    meta = _Metadata(gguf)
    model = meta.required("tokenizer.ggml.model")
    if model not in ("gpt2", "llama", "gemma4"):
        raise UnsupportedModelError(
            f"{gguf.path}: tokenizer.ggml.model = {model!r} is not supported "
            "(supported: 'gpt2', byte-level BPE; 'llama', SentencePiece; 'gemma4', BPE over UTF-8)"
        )
    tokens = meta.checked("tokenizer.ggml.tokens", "a list of strings", _list_of(_is_str))
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        duplicate = next(t for i, t in enumerate(tokens) if vocab[t] != i)
        raise ModelFormatError(f"{gguf.path}: tokenizer.ggml.tokens lists {duplicate!r} more than once")
    token_types = meta.checked("tokenizer.ggml.token_type", "a list of integers", _list_of(_is_int), [0] * len(tokens))
    if len(token_types) != len(tokens):
        raise ModelFormatError(
            f"{gguf.path}: tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens"
        )

    def token(key: str) -> str | None:
        index = meta.checked(f"tokenizer.ggml.{key}", "a token id", _is_int, None)
        if index is None:
            return None
        if not 0 <= index < len(tokens):
            raise ModelFormatError(f"{gguf.path}: tokenizer.ggml.{key} = {index} is outside the vocabulary")
        return tokens[index]

    if model == "gpt2":
        tokenizer = _byte_level_bpe(meta, vocab)
    elif model == "gemma4":
        tokenizer = _gemma4_bpe(meta, vocab)
    else:
        scores = meta.checked("tokenizer.ggml.scores", "a list of numbers", _list_of(_is_number))
        if len(scores) != len(tokens):
            raise ModelFormatError(
                f"{gguf.path}: tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens"
            )
        add_space_prefix = meta.checked("tokenizer.ggml.add_space_prefix", "a boolean", _is_bool, True)
        tokenizer = spm_tokenizer(
            tokens, scores, token_types, add_space_prefix=add_space_prefix, unknown=token("unknown_token_id")
        )
    typed = list(zip(tokens, token_types, strict=True))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in typed if k == _CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in typed if k == _USER_DEFINED])

    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        single = " ".join([*([f"{bos}:0"] if add_bos else []), "$A:0", *([f"{eos}:0"] if add_eos else [])])
        special = [(t, vocab[t]) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
        tokenizer.post_processor = processors.TemplateProcessing(single=single, special_tokens=special)
    elif model == "gpt2":
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta.model("context_length", None),
    }
    template = meta.checked("tokenizer.chat_template", "a string", _is_str, None)
    if template is not None:
        config["chat_template"] = template
    return tokenizer.to_str(), config


# --- conversion ---------------------------------------------------------------------------------------------


def _json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps({k: v for k, v in data.items() if v is not None}, indent=2, ensure_ascii=False) + "\n")


def source_identity(gguf_path: Path) -> dict[str, Any]:
    """What identifies a GGUF file for caching: its name, size and the SHA-256 of its content, not its path or
    modification time, so one file installed in two environments (two venvs' copies of a model package) is one
    cache entry and an edited file a new one. The digest is read once per file version: it is kept beside the
    cache (`cache_dir("sources")`), keyed by the file's path, size, mtime and inode."""
    stat = gguf_path.stat()
    version = f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ino}"
    record = cache_dir("sources") / f"{hashlib.sha256(version.encode()).hexdigest()[:24]}.json"
    try:
        digest = json.loads(record.read_text())["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        hasher = hashlib.sha256()
        with open(gguf_path, "rb") as f:
            while block := f.read(1 << 22):
                hasher.update(block)
        digest = hasher.hexdigest()
        partial = record.with_name(f".{record.name}.{os.getpid()}")
        with contextlib.suppress(OSError):  # an unwritable cache only costs the next process a re-read
            partial.write_text(json.dumps({"version": version, "sha256": digest}))
            os.replace(partial, record)
    return {"source": gguf_path.name, "source_size": stat.st_size, "source_sha256": digest}


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, weights: str = "f16", *, progress: bool = True) -> Path:
    """Convert a GGUF file into a Hugging Face style folder at `out_dir`, which must not exist yet.

    The folder appears complete or not at all: it is written under a temporary name beside `out_dir` and
    renamed at the end. A progress bar on stderr counts output bytes unless `progress` is False.
    """
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {weights!r}")
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists")
    started = time.perf_counter()
    gguf = read_gguf(gguf_path)
    arch = _architecture(gguf)
    config_data = hf_config(gguf)
    config_data["torch_dtype"] = {"f32": "float32", "f16": "float16"}.get(weights)
    config = ModelConfig.from_dict(config_data, source=f"{gguf_path} (metadata)")
    rotary_dims = gguf.metadata.get(f"{gguf.metadata['general.architecture']}.rope.dimension_count", config.head_dim)
    if rotary_dims != config.head_dim and gguf.metadata["general.architecture"] not in families.FAMILIES:
        raise UnsupportedModelError(
            f"{gguf_path}: rotary embedding on {rotary_dims} of {config.head_dim} head dimensions is not supported"
        )
    plan = _plan(gguf, config, arch, weights)
    tokenizer_json, tokenizer_config = tokenizer_files(gguf)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".partial", dir=out_dir.parent))
    try:
        _json(staging / "config.json", config_data)
        _json(
            staging / "generation_config.json",
            {"bos_token_id": config.bos_token_id, "eos_token_id": config_data["eos_token_id"]},
        )
        (staging / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
        _json(staging / "tokenizer_config.json", tokenizer_config)
        total = sum(item.nbytes for item in plan)
        with tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=f"{gguf_path.name} -> {weights}",
            file=sys.stderr,
            disable=not progress,
        ) as bar:
            _write_safetensors(
                staging / "model.safetensors", plan, lambda item: _materialise(item, gguf_path), bar.update
            )
        marker = {"format": CONVERSION_FORMAT, "weights": weights, **source_identity(gguf_path)}
        marker["seconds"] = round(time.perf_counter() - started, 3)
        _json(staging / CONVERSION_MARKER, marker)
        try:
            os.rename(staging, out_dir)
        except OSError:
            if out_dir.exists():  # another process finished the same conversion first
                raise FileExistsError(f"{out_dir} appeared while converting") from None
            raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir
