"""Truncated and corrupted model files: every reader either loads the file or raises a typed error that names it.

Corruption aims at the headers (lengths, counts, dimensions, type ids, offsets, JSON fields), where a reader
can be led astray; flipped bytes inside tensor data are only different weights, which no format can detect.
Never another exception: a `ValueError` from numpy or an `OverflowError` from a huge count is a crash to a
caller that catches `DopplerError`.
"""

from __future__ import annotations

import itertools
import json
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from reliability.helpers import ExampleTally, fuzz_settings, tiny_gguf_metadata, write_tiny_gguf

from doppler_py.errors import DopplerError, ModelFormatError
from doppler_py.model.config import ModelConfig
from doppler_py.model.gguf import convert_gguf, hf_tensor_name, read_gguf, unpermute_rope_rows
from doppler_py.model.loader import load_weights
from doppler_py.model.safetensors_file import index_folder, load_array
from doppler_py.tokenizer import Tokenizer

FUZZ = fuzz_settings(300)
# Field values that break naive arithmetic: zero, sign bits, 32/64-bit extremes.
EDGE_INTEGERS = [0, 1, 2, 3, 7, 255, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]

_names = itertools.count()
EXAMPLES = ExampleTally()


@pytest.fixture(scope="module", autouse=True)
def example_counts(request):
    yield
    EXAMPLES.report(request.config, "reader fuzz examples")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz-readers")


def fresh(workdir: Path, suffix: str) -> Path:
    return workdir / f"case{next(_names)}{suffix}"


# --- GGUF -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GGUFBytes:
    data: bytes = field(repr=False)
    data_start: int  # where the tensor data begins: everything before it is header


@pytest.fixture(scope="module")
def gguf_file(workdir) -> GGUFBytes:
    """The bytes of a valid tiny GGUF."""
    path = write_tiny_gguf(workdir / "valid.gguf")
    parsed = read_gguf(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    base = mapped.__array_interface__["data"][0]
    data_start = min(t.raw.__array_interface__["data"][0] - base for t in parsed.tensors.values())
    return GGUFBytes(path.read_bytes(), data_start)


def convert_and_open(path: Path, out: Path) -> None:
    """What `doppler_py.load` does with a GGUF on the host: convert, then read config, tokenizer, tensors."""
    try:
        convert_gguf(path, out, "f32", progress=False)
        ModelConfig.from_file(out / "config.json")
        Tokenizer.from_dir(out)
        for info in index_folder(out).values():
            load_array(info)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def test_a_valid_tiny_gguf_converts(workdir, gguf_file):
    """The fuzz tests' baseline: the unedited file converts, and into the model its metadata and tensors describe.

    Each check reads back through the loader's own path (config, tokenizer, index_folder/load_array), so a
    conversion that silently wrote nothing or the wrong thing fails here, not just one that raises.
    """
    path = fresh(workdir, ".gguf")
    path.write_bytes(gguf_file.data)
    out = fresh(workdir, ".out")
    convert_gguf(path, out, "f32", progress=False)
    meta = tiny_gguf_metadata("llama")

    config = ModelConfig.from_file(out / "config.json")
    assert config.architecture == "LlamaForCausalLM"
    assert config.num_hidden_layers == meta["llama.block_count"]
    assert config.hidden_size == meta["llama.embedding_length"]
    assert config.intermediate_size == meta["llama.feed_forward_length"]
    assert config.num_attention_heads == meta["llama.attention.head_count"]
    assert config.num_key_value_heads == meta["llama.attention.head_count_kv"]
    assert config.head_dim == config.hidden_size // config.num_attention_heads  # no key_length in the file
    assert config.rms_norm_eps == pytest.approx(meta["llama.attention.layer_norm_rms_epsilon"])
    assert config.rope_theta == meta["llama.rope.freq_base"]
    assert config.max_position_embeddings == meta["llama.context_length"]
    assert config.vocab_size == meta["llama.vocab_size"]
    assert config.tie_word_embeddings  # the file has no output.weight

    source = read_gguf(path)
    tensors = {name: load_array(info) for name, info in index_folder(out).items()}
    assert set(tensors) == {hf_tensor_name(name) for name in source.tensors}
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for gguf_name, stored in source.tensors.items():
        name = hf_tensor_name(gguf_name)
        values = stored.raw.view(np.float32).reshape(stored.shape)
        # The file's Q/K rows are in llama.cpp's rotary order; the HF folder holds them un-permuted.
        rope_heads = heads.get(name.split(".")[-2], 0)
        want = unpermute_rope_rows(values, rope_heads) if rope_heads else values
        assert tensors[name].dtype == np.float32, name
        np.testing.assert_array_equal(tensors[name], want, err_msg=name)

    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    tokenizer = Tokenizer.from_dir(out)
    assert tokenizer.vocab_size == len(meta["tokenizer.ggml.tokens"])
    assert tokenizer.bos_token_id == meta["tokenizer.ggml.bos_token_id"]
    assert tokenizer.eos_token_ids == (meta["tokenizer.ggml.eos_token_id"],)
    ids = tokenizer.encode("<|im_start|>the tea<|im_end|>", add_special_tokens=False)
    assert [meta["tokenizer.ggml.tokens"][i] for i in ids] == ["<|im_start|>", "t", "he", "Ġt", "e", "a", "<|im_end|>"]
    assert tokenizer.decode(ids) == "<|im_start|>the tea<|im_end|>"


@FUZZ
@given(cut=st.data())
def test_a_truncated_gguf_is_a_format_error_naming_the_file(workdir, gguf_file, cut):
    EXAMPLES.add("truncated GGUF")
    size = cut.draw(st.integers(0, len(gguf_file.data) - 1), label="kept bytes")
    path = fresh(workdir, ".gguf")
    path.write_bytes(gguf_file.data[:size])
    with pytest.raises(ModelFormatError, match=r"truncated|too short") as info:
        read_gguf(path)
    assert str(path) in str(info.value)


@st.composite
def header_edits(draw, header_end: int) -> list[tuple[int, bytes]]:
    """1-4 edits inside the header: random bytes, or a little-endian integer field set to an edge value."""
    edits = []
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.booleans()):
            at = draw(st.integers(0, header_end - 1))
            edits.append((at, draw(st.binary(min_size=1, max_size=8))))
        else:
            width = draw(st.sampled_from([4, 8]))
            at = draw(st.integers(0, header_end - width))
            value = draw(st.sampled_from(EDGE_INTEGERS)) % (1 << (8 * width))
            edits.append((at, value.to_bytes(width, "little")))
    return edits


@FUZZ
@given(case=st.data())
def test_a_corrupted_gguf_header_converts_or_raises_a_typed_error(workdir, gguf_file, case):
    EXAMPLES.add("GGUF header")
    corrupted = bytearray(gguf_file.data)
    for at, patch in case.draw(header_edits(gguf_file.data_start), label="edits"):
        corrupted[at : at + len(patch)] = patch
    path = fresh(workdir, ".gguf")
    path.write_bytes(bytes(corrupted))
    try:
        convert_and_open(path, out := fresh(workdir, ".out"))
    except DopplerError as exc:
        assert str(path) in str(exc) or str(out) in str(exc)  # the GGUF, or the folder made from it


def gguf_arrays(items: st.SearchStrategy) -> st.SearchStrategy:
    return st.lists(items, min_size=1, max_size=4)  # GGUF arrays hold one type and are never empty


# Array items stay within the i32 range the writer gives nested integer arrays.
GGUF_ITEMS = [st.booleans(), st.sampled_from(EDGE_INTEGERS[:7]), st.floats(width=32), st.text(max_size=8)]
GGUF_VALUES = (
    st.none()  # the key is left out
    | st.sampled_from([*EDGE_INTEGERS, -1, -(2**63)])
    | st.one_of(GGUF_ITEMS)
    | st.one_of([gguf_arrays(items) for items in GGUF_ITEMS])
    | st.one_of([gguf_arrays(gguf_arrays(items)) for items in GGUF_ITEMS])
)


@FUZZ
@given(key=st.sampled_from([*tiny_gguf_metadata("llama"), "general.alignment"]), value=GGUF_VALUES)
def test_gguf_metadata_of_a_wrong_type_or_value_converts_or_raises_a_typed_error(workdir, key, value):
    EXAMPLES.add("GGUF metadata")
    path = write_tiny_gguf(fresh(workdir, ".gguf"), metadata={key: value})
    try:
        convert_and_open(path, out := fresh(workdir, ".out"))
    except DopplerError as exc:
        assert str(path) in str(exc) or str(out) in str(exc)  # the GGUF, or the folder made from it


# --- safetensors ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SafetensorsParts:
    header: dict = field(repr=False)
    data: bytes = field(repr=False)


@pytest.fixture(scope="module")
def safetensors_parts(tiny_dir) -> SafetensorsParts:
    """The parsed header of the tiny model's safetensors file and its data section."""
    raw = (tiny_dir / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return SafetensorsParts(json.loads(raw[8 : 8 + length]), raw[8 + length :])


def write_folder(workdir: Path, tiny_dir: Path, payload: bytes) -> Path:
    folder = fresh(workdir, "")
    folder.mkdir()
    shutil.copy(tiny_dir / "config.json", folder / "config.json")
    (folder / "model.safetensors").write_bytes(payload)
    return folder


def encode(header: object, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def load_folder(folder: Path, gpu) -> None:
    weights = load_weights(folder, gpu, "f32")
    weights.destroy()


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.sampled_from([*EDGE_INTEGERS, -1, -(2**63)]) | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)


@st.composite
def header_mutations(draw, header: dict) -> dict:
    """The header with 1-3 of its entries' fields replaced, deleted or given a random value."""
    header = json.loads(json.dumps(header))
    names = sorted(header)
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(names))
        target = header[name]
        action = draw(st.sampled_from(["field", "delete", "entry", "quant"]))
        if action == "entry" or not isinstance(target, dict):
            header[name] = draw(JSON_VALUES)
        elif action == "quant":
            quant = {draw(st.sampled_from(names)): draw(JSON_VALUES | st.just({"format": "q4_1", "shape": [64, 64]}))}
            header["__metadata__"] = {"doppler.quant": draw(st.sampled_from([json.dumps(quant), "{", "[]", "7"]))}
        else:
            field = draw(st.sampled_from(sorted(target) or ["dtype"]))
            if action == "delete":
                target.pop(field, None)
            else:
                target[field] = draw(JSON_VALUES)
    return header


@FUZZ
@given(case=st.data())
def test_a_corrupted_safetensors_header_loads_or_raises_a_typed_error(workdir, tiny_dir, safetensors_parts, gpu, case):
    EXAMPLES.add("safetensors header")
    header, data = safetensors_parts.header, safetensors_parts.data
    mutated = case.draw(header_mutations(header), label="header")
    folder = write_folder(workdir, tiny_dir, encode(mutated, data))
    try:
        load_folder(folder, gpu)
    except DopplerError as exc:
        assert str(folder) in str(exc)


@FUZZ
@given(case=st.data())
def test_a_truncated_or_garbled_safetensors_file_is_a_format_error(workdir, tiny_dir, safetensors_parts, gpu, case):
    EXAMPLES.add("garbled safetensors")
    header, data = safetensors_parts.header, safetensors_parts.data
    payload = bytearray(encode(header, data))
    header_end = 8 + struct.unpack("<Q", payload[:8])[0]
    if case.draw(st.booleans(), label="truncate"):
        payload = payload[: case.draw(st.integers(0, len(payload) - 1), label="kept bytes")]
    else:
        at = case.draw(st.integers(0, header_end - 1), label="at")
        patch = case.draw(st.binary(min_size=1, max_size=8), label="patch")
        payload[at : at + len(patch)] = patch
    folder = write_folder(workdir, tiny_dir, bytes(payload))
    try:
        load_folder(folder, gpu)
    except DopplerError as exc:
        assert str(folder) in str(exc)


# Optional config fields whose nested structure the parser walks.
EXTRA_CONFIG_FIELDS = ["rope_scaling", "rope_parameters", "layer_types", "sliding_window", "head_dim", "mlp_bias"]
ROPE_OBJECTS = st.fixed_dictionaries(
    {},
    optional={
        "rope_type": st.sampled_from(["default", "linear", "llama3", "yarn"]) | JSON_VALUES,
        "type": JSON_VALUES,
        "factor": JSON_VALUES,
        "rope_theta": JSON_VALUES,
        "low_freq_factor": JSON_VALUES,
        "high_freq_factor": JSON_VALUES,
        "original_max_position_embeddings": JSON_VALUES,
    },
)


@FUZZ
@given(case=st.data())
def test_a_config_json_with_a_wrong_field_loads_or_raises_a_typed_error(workdir, tiny_dir, gpu, case):
    EXAMPLES.add("config.json")
    config = json.loads((tiny_dir / "config.json").read_text())
    for _ in range(case.draw(st.integers(1, 3), label="fields")):
        field_name = case.draw(st.sampled_from(sorted(config) + EXTRA_CONFIG_FIELDS), label="field")
        value = case.draw(JSON_VALUES | ROPE_OBJECTS, label="value")
        if value is None:
            config.pop(field_name, None)
        else:
            config[field_name] = value
    folder = write_folder(workdir, tiny_dir, (tiny_dir / "model.safetensors").read_bytes())
    (folder / "config.json").write_text(json.dumps(config))
    try:
        load_folder(folder, gpu)
    except DopplerError as exc:
        assert str(folder) in str(exc)
