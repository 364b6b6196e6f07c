"""Helpers of the reliability tests: the tiny model spec, tiny GGUF files and GPU buffer accounting."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import wgpu
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from hypothesis import HealthCheck, settings
from tokenizers.pre_tokenizers import ByteLevel

from doppler_py.testing.tiny import TinySpec

# A model with room for the printable-ASCII tokenizer that `write_tiny_model` adds, and a short context so the
# capacity errors are cheap to provoke.
TINY = TinySpec(vocab_size=128, num_hidden_layers=2, max_position_embeddings=256, seed=21)
GOOD_PROMPT = "the cat sat on the mat. the cat sat"

# --- fuzzing ------------------------------------------------------------------------------------------------


def fuzz_settings(examples: int) -> settings:
    """Hypothesis settings for the fuzz tests; DOPPLER_FUZZ_EXAMPLES=N runs N examples each (a longer hunt)."""
    return settings(
        max_examples=int(os.environ.get("DOPPLER_FUZZ_EXAMPLES", examples)),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


class ExampleTally:
    """Examples run per fuzz test, for the session summary."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1

    def report(self, config: pytest.Config, title: str) -> None:
        if self.counts:
            total = sum(self.counts.values())
            report(config, f"{title}: {total} (" + ", ".join(f"{k}: {n}" for k, n in self.counts.items()) + ")")


# --- numbers for the session summary ------------------------------------------------------------------------

REPORT_KEY = pytest.StashKey[list[str]]()


def report(config: pytest.Config, line: str) -> None:
    """Add a line to the "reliability" section that conftest.py prints at the end of the session."""
    config.stash.setdefault(REPORT_KEY, []).append(line)


# --- GPU buffers ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BufferUse:
    count: int
    nbytes: int

    def __sub__(self, other: BufferUse) -> BufferUse:
        return BufferUse(self.count - other.count, self.nbytes - other.nbytes)


def buffer_use() -> BufferUse:
    """Live GPU buffers as wgpu-py counts them (`wgpu.diagnostics.object_counts`), after a full collection.

    wgpu-py releases a buffer's memory when its Python object goes away (or on `destroy()`); what is still
    counted after `gc.collect()` is held by something.
    """
    gc.collect()
    counts = wgpu.diagnostics.object_counts.get_dict()["Buffer"]
    return BufferUse(counts["count"], counts.get("resource_mem", 0))


# --- tiny GGUF files ----------------------------------------------------------------------------------------

GGUF_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
GGUF_MERGES = ["Ġ t", "h e"]
GGUF_TOKENS = GGUF_SPECIALS + sorted(ByteLevel.alphabet()) + [m.replace(" ", "") for m in GGUF_MERGES]


def tiny_gguf_metadata(architecture: str) -> dict[str, object]:
    """The metadata of the tiny GGUF below, as llama.cpp names it (general.architecture comes from the writer)."""
    arch = architecture
    return {
        f"{arch}.block_count": 2,
        f"{arch}.context_length": 256,
        f"{arch}.embedding_length": 64,
        f"{arch}.feed_forward_length": 96,
        f"{arch}.attention.head_count": 4,
        f"{arch}.attention.head_count_kv": 2,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{arch}.rope.freq_base": 10000.0,
        f"{arch}.vocab_size": len(GGUF_TOKENS),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": GGUF_TOKENS,
        "tokenizer.ggml.token_type": [3] * len(GGUF_SPECIALS) + [1] * (len(GGUF_TOKENS) - len(GGUF_SPECIALS)),
        "tokenizer.ggml.merges": GGUF_MERGES,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }


def gguf_value_type(value: object) -> GGUFValueType:
    """The GGUF type a Python value is written as (ints as u32 when they fit, as llama.cpp writes counts)."""
    if isinstance(value, bool):
        return GGUFValueType.BOOL
    if isinstance(value, int):
        if value < 0:
            return GGUFValueType.INT64
        return GGUFValueType.UINT32 if value < 2**32 else GGUFValueType.UINT64
    if isinstance(value, float):
        return GGUFValueType.FLOAT32
    if isinstance(value, str):
        return GGUFValueType.STRING
    return GGUFValueType.ARRAY


def write_tiny_gguf(
    path: Path,
    *,
    architecture: str = "llama",
    matrix_type: GGMLQuantizationType | None = None,
    metadata: dict[str, object] | None = None,
    seed: int = 0,
) -> Path:
    """A complete two-layer LLaMA GGUF (metadata, tokenizer, tensors) as llama.cpp lays one out.

    `matrix_type` stores the 2-D weights in that ggml type, as random bytes of the right size (for types the
    engine must refuse, whose values never matter). `metadata` replaces keys of `tiny_gguf_metadata` (a value
    of None drops the key); arrays take the type of their first element.
    """
    rng = np.random.default_rng(seed)
    hidden, ffn, heads, kv_heads, layers = 64, 96, 4, 2, 2
    kv = kv_heads * hidden // heads
    writer = gguf.GGUFWriter(str(path), architecture)
    for key, value in (tiny_gguf_metadata(architecture) | (metadata or {})).items():
        if value is None:
            continue
        kind = gguf_value_type(value)
        sub_type = gguf_value_type(value[0]) if kind == GGUFValueType.ARRAY and value else None
        writer.add_key_value(key, value, kind, sub_type)
    shapes = {"token_embd.weight": (len(GGUF_TOKENS), hidden), "output_norm.weight": (hidden,)}
    for i in range(layers):
        shapes |= {
            f"blk.{i}.attn_q.weight": (hidden, hidden),
            f"blk.{i}.attn_k.weight": (kv, hidden),
            f"blk.{i}.attn_v.weight": (kv, hidden),
            f"blk.{i}.attn_output.weight": (hidden, hidden),
            f"blk.{i}.ffn_gate.weight": (ffn, hidden),
            f"blk.{i}.ffn_up.weight": (ffn, hidden),
            f"blk.{i}.ffn_down.weight": (hidden, ffn),
            f"blk.{i}.attn_norm.weight": (hidden,),
            f"blk.{i}.ffn_norm.weight": (hidden,),
        }
    for name, shape in shapes.items():
        if matrix_type is not None and len(shape) == 2:
            block_size, block_bytes = GGML_QUANT_SIZES[matrix_type]
            raw = rng.integers(0, 256, (shape[0], shape[1] // block_size * block_bytes), dtype=np.uint8)
            writer.add_tensor(name, raw, raw_dtype=matrix_type)
        else:
            writer.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def patch_tensor_info(path: Path, name: str, *, dims: list[int] | None = None, type_id: int | None = None) -> None:
    """Overwrite the dimensions and/or ggml type id in the header entry of tensor `name`, with any values."""
    data = bytearray(path.read_bytes())
    encoded = name.encode()
    at = data.index(len(encoded).to_bytes(8, "little") + encoded) + 8 + len(encoded)
    n_dims = int.from_bytes(data[at : at + 4], "little")
    at += 4
    if dims is not None:
        assert len(dims) == n_dims
        data[at : at + 8 * n_dims] = b"".join(d.to_bytes(8, "little") for d in dims)
    at += 8 * n_dims
    if type_id is not None:
        data[at : at + 4] = type_id.to_bytes(4, "little")
    path.write_bytes(bytes(data))
