"""Every kind of bad input gets its own error class and a message that names the culprit and says what to do;
and after each one the engine goes on working as if nothing had happened.

The table below is the specification: one row per bad input, with the class it must raise and the words its
message must contain (the file, tensor, shape or value at fault, and the advice). After each row the test runs
a plain and a speculative greedy generation on the already-loaded engine and checks they give the tokens of
the first generation, and that the last good result is still there. The counts per kind are printed in the
session summary ("reliability numbers").

The guards of the speculative path follow: NaN/inf logits are caught on the GPU (the verifier's status word)
and raised as `NumericalError`, never sampled into tokens.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from reliability.helpers import GOOD_PROMPT, TINY, patch_tensor_info, report, write_tiny_gguf
from safetensors.numpy import load_file, save_file
from support.decode import reference_decode

import doppler_py
from doppler_py.api import Engine
from doppler_py.errors import (
    CapacityError,
    DeviceLimitError,
    DopplerError,
    GenerationOptionError,
    ModelFormatError,
    NumericalError,
    UnsupportedModelError,
    VocabularyMismatchError,
)
from doppler_py.gpu.tensor import Tensor
from doppler_py.gpu.weights import Weight
from doppler_py.model.kv_cache import KVCache
from doppler_py.sampling import SamplingParams
from doppler_py.speculative import DraftModelDrafter, LayerSkipDrafter, PromptLookupDrafter
from doppler_py.speculative.engine import SpeculativeEngine
from doppler_py.speculative.stats import SpecStats
from doppler_py.testing.tiny import TinySpec, draft_spec, write_tiny_model

MODEL_ADVICE = "download or convert the model again"
SUPPORTED_ADVICE = "convert this one to a supported format"


@dataclass
class Context:
    engine: Engine
    gpu: object
    tiny_dir: Path
    scratch: Path
    made: int = 0

    def folder(self) -> Path:
        """A fresh copy of the tiny model to break."""
        self.made += 1
        return Path(shutil.copytree(self.tiny_dir, self.scratch / f"model{self.made}"))

    def path(self, name: str) -> Path:
        self.made += 1
        return self.scratch / f"{self.made}-{name}"

    def load(self, source: Path, **options) -> None:
        doppler_py.load(source, weights="f32", gpu=self.gpu, progress=False, **options).close()

    def prompt_ids(self, text: str = GOOD_PROMPT) -> list[int]:
        return self.engine.encode_prompt(text)


@dataclass(frozen=True)
class BadInput:
    kind: str
    name: str
    error: type[DopplerError]
    says: tuple[str, ...]  # substrings of the message: the culprit and what to do
    run: Callable[[Context], object]


# --- model files ---------------------------------------------------------------------------------------------


def edit_tensors(folder: Path, edit: Callable[[dict[str, np.ndarray]], None], metadata: dict | None = None) -> Path:
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt", **(metadata or {})})
    return folder


def edit_header(folder: Path, edit: Callable[[dict], None]) -> Path:
    path = folder / "model.safetensors"
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    edit(header)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])
    return folder


def edit_config(folder: Path, **fields) -> Path:
    config = json.loads((folder / "config.json").read_text())
    config.update(fields)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def edit_bytes(path: Path, edit: Callable[[bytes], bytes]) -> Path:
    path.write_bytes(edit(path.read_bytes()))
    return path


def remove(path: Path) -> Path:
    path.unlink()
    return path.parent


def load_broken(make: Callable[[Context], Path], **options) -> Callable[[Context], None]:
    return lambda ctx: ctx.load(make(ctx), **options)


DOWN = "model.layers.1.mlp.down_proj.weight"
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
EMBED = "model.embed_tokens.weight"
SAFETENSORS = "model.safetensors"


def drop(name: str) -> Callable[[dict], None]:
    return lambda tensors: tensors.pop(name)


def replace(name: str, array: np.ndarray) -> Callable[[dict], None]:
    return lambda tensors: tensors.__setitem__(name, array)


def set_dtype(name: str, dtype: str) -> Callable[[dict], None]:
    return lambda header: header[name].__setitem__("dtype", dtype)


def as_q5_0_blocks(tensors: dict[str, np.ndarray]) -> None:
    rows, cols = tensors[DOWN].shape
    tensors[DOWN] = np.zeros((rows, cols // 32 * 22), np.uint8)  # 22-byte q5_0 blocks


MODEL_FORMAT = [
    BadInput("model format", "missing tensor", ModelFormatError, (DOWN, "missing", "[64, 160]", MODEL_ADVICE),
             load_broken(lambda c: edit_tensors(c.folder(), drop(DOWN)))),
    BadInput("model format", "wrong shape", ModelFormatError, (Q_PROJ, "[64, 32]", "expected [64, 64]", MODEL_ADVICE),
             load_broken(lambda c: edit_tensors(c.folder(), replace(Q_PROJ, np.ones((64, 32), np.float32))))),
    BadInput("model format", "integer weights", ModelFormatError, (EMBED, "dtype I32", MODEL_ADVICE),
             load_broken(lambda c: edit_tensors(c.folder(), replace(EMBED, np.ones((128, 64), np.int32))))),
    BadInput("model format", "unknown dtype", UnsupportedModelError,
             ("model.norm.weight", "'F8_E4M3'", SUPPORTED_ADVICE),
             load_broken(lambda c: edit_header(c.folder(), set_dtype("model.norm.weight", "F8_E4M3")))),
    BadInput("model format", "truncated safetensors", ModelFormatError, (SAFETENSORS, "truncated", MODEL_ADVICE),
             load_broken(lambda c: edit_bytes(c.folder() / SAFETENSORS, lambda b: b[: len(b) * 3 // 5]).parent)),
    BadInput("model format", "empty safetensors", ModelFormatError, (SAFETENSORS, "truncated", MODEL_ADVICE),
             load_broken(lambda c: edit_bytes(c.folder() / SAFETENSORS, lambda b: b"").parent)),
    BadInput("model format", "header not JSON", ModelFormatError, (SAFETENSORS, "not valid JSON", MODEL_ADVICE),
             load_broken(lambda c: edit_bytes(c.folder() / SAFETENSORS, lambda b: b[:8] + b"#" * 9 + b[17:]).parent)),
    BadInput("model format", "header beyond the file", ModelFormatError, (SAFETENSORS, "header length", MODEL_ADVICE),
             load_broken(lambda c: edit_bytes(c.folder() / SAFETENSORS, lambda b: b"\xff" * 8 + b[8:]).parent)),
    BadInput("model format", "missing config.json", ModelFormatError, ("config.json", "no config.json", MODEL_ADVICE),
             load_broken(lambda c: remove(c.folder() / "config.json"))),
    BadInput("model format", "empty config.json", ModelFormatError,
             ("config.json", "not a readable JSON", MODEL_ADVICE),
             load_broken(lambda c: edit_bytes(c.folder() / "config.json", lambda b: b"").parent)),
    BadInput("model format", "config field out of range", ModelFormatError,
             ("num_attention_heads", "positive integer", MODEL_ADVICE),
             load_broken(lambda c: edit_config(c.folder(), num_attention_heads=0))),
    BadInput("model format", "NaN in config", ModelFormatError, ("rope_theta", "got nan", MODEL_ADVICE),
             load_broken(lambda c: edit_config(c.folder(), rope_theta=float("nan")))),
    BadInput("model format", "unknown architecture", UnsupportedModelError,
             ("'GPT2LMHeadModel'", "LlamaForCausalLM", SUPPORTED_ADVICE),
             load_broken(lambda c: edit_config(c.folder(), architectures=["GPT2LMHeadModel"], model_type=None))),
    BadInput("model format", "unsupported rope scaling", UnsupportedModelError, ("'yarn'", "llama3", SUPPORTED_ADVICE),
             load_broken(lambda c: edit_config(c.folder(), rope_scaling={"rope_type": "yarn", "factor": 4.0}))),
    BadInput("model format", "unsupported quant type", UnsupportedModelError,
             (DOWN, "'q5_0'", "q4_1", SUPPORTED_ADVICE),
             load_broken(lambda c: edit_tensors(
                 c.folder(), as_q5_0_blocks,
                 {"doppler.quant": json.dumps({DOWN: {"format": "q5_0", "shape": [64, 160]}})}))),
    BadInput("model format", "missing tokenizer.json", ModelFormatError, ("tokenizer.json", "not found", MODEL_ADVICE),
             load_broken(lambda c: remove(c.folder() / "tokenizer.json"))),
    BadInput("model format", "truncated GGUF", ModelFormatError, (".gguf", "truncated", MODEL_ADVICE),
             load_broken(lambda c: edit_bytes(write_tiny_gguf(c.path("t.gguf")), lambda b: b[:2000]))),
    BadInput("model format", "GGUF tensor data cut short", ModelFormatError, ("'blk.1.ffn_norm.weight'", "truncated"),
             load_broken(lambda c: edit_bytes(write_tiny_gguf(c.path("t.gguf")), lambda b: b[:-100]))),
    BadInput("model format", "not a GGUF file", ModelFormatError, ("not a GGUF file", MODEL_ADVICE),
             load_broken(lambda c: edit_bytes(write_tiny_gguf(c.path("t.gguf")), lambda b: b"GGML" + b[4:]))),
    BadInput("model format", "unknown GGUF tensor type", UnsupportedModelError,
             ("'blk.0.ffn_up.weight'", "type id 99", SUPPORTED_ADVICE),
             load_broken(lambda c: patch_gguf(c.path("t.gguf"), "blk.0.ffn_up.weight", type_id=99))),
    BadInput("model format", "unsupported GGUF quant type", UnsupportedModelError,
             ("Q8_1", "cannot be dequantised", SUPPORTED_ADVICE),
             load_broken(lambda c: write_tiny_gguf(c.path("t.gguf"), matrix_type=GGMLQuantizationType.Q8_1))),
    BadInput("model format", "unsupported GGUF architecture", UnsupportedModelError, ("'falcon'", SUPPORTED_ADVICE),
             load_broken(lambda c: write_tiny_gguf(c.path("t.gguf"), architecture="falcon"))),
    BadInput("model format", "GGUF metadata of the wrong type", ModelFormatError,
             ("'tokenizer.ggml.tokens'", "list of strings", MODEL_ADVICE),
             load_broken(lambda c: write_tiny_gguf(c.path("t.gguf"), metadata={"tokenizer.ggml.tokens": 5}))),
    BadInput("model format", "absurd GGUF block count", ModelFormatError, ("'blk.2.attn_q.weight'", "missing"),
             load_broken(lambda c: write_tiny_gguf(c.path("t.gguf"), metadata={"llama.block_count": 2**63}))),
    BadInput("model format", "overflowing GGUF dimensions", ModelFormatError, ("'blk.1.ffn_down.weight'", "truncated"),
             load_broken(lambda c: patch_gguf(c.path("t.gguf"), "blk.1.ffn_down.weight", dims=[96, 2**62 + 1]))),
]  # fmt: skip


def patch_gguf(path: Path, tensor: str, **fields) -> Path:
    write_tiny_gguf(path)
    patch_tensor_info(path, tensor, **fields)
    return path


# --- capacity ------------------------------------------------------------------------------------------------


def spec_beyond_context(ctx: Context) -> None:
    spec = ctx.engine.speculative_engine("prompt-lookup")
    list(spec.iter_generate(ctx.prompt_ids(), TINY.max_position_embeddings, SamplingParams(), stats=SpecStats()))


def forward_beyond_cache(ctx: Context) -> None:
    model = ctx.engine.model
    cache = model.new_cache(8)
    try:
        model.forward(list(range(10)), cache)
    finally:
        model.release_cache(cache)


def fits_after(ctx: Context, text: str) -> str:
    return f"at most {max(0, TINY.max_position_embeddings - len(ctx.prompt_ids(text)))} new tokens fit"


CAPACITY = [
    BadInput("capacity", "prompt + max_tokens beyond the context", CapacityError,
             ("context of 256 tokens", "{fits}", "max_seq"),
             lambda c: c.engine.generate(GOOD_PROMPT, max_tokens=250)),
    BadInput("capacity", "prompt alone beyond the context", CapacityError, ("at most 0 new tokens fit", "max_seq"),
             lambda c: c.engine.generate("x" * 300, max_tokens=1)),
    BadInput("capacity", "speculative engine beyond the context", CapacityError, ("context of 256 tokens", "max_seq"),
             spec_beyond_context),
    BadInput("capacity", "forward beyond the KV cache", CapacityError, ("KV cache of 8 positions", "max_seq"),
             forward_beyond_cache),
]  # fmt: skip


# --- generation options ------------------------------------------------------------------------------------------


def generate(**options) -> Callable[[Context], object]:
    return lambda ctx: ctx.engine.generate(options.pop("prompt", GOOD_PROMPT), max_tokens=4, **options)


def generate_ids(ids) -> Callable[[Context], object]:
    spec = lambda ctx: ctx.engine.speculative_engine("prompt-lookup")  # noqa: E731
    return lambda ctx: spec(ctx).generate(ids, 4, SamplingParams())


def option(name: str, says: tuple[str, ...], run: Callable[[Context], object]) -> BadInput:
    return BadInput("generation option", name, GenerationOptionError, says, run)


def max_tokens(value) -> Callable[[Context], object]:
    return lambda ctx: ctx.engine.generate(GOOD_PROMPT, max_tokens=value)


OPTIONS = [
    option("negative temperature", ("temperature", "-1.0", ">= 0"), generate(temperature=-1.0)),
    option("NaN temperature", ("temperature", "nan"), generate(temperature=float("nan"))),
    option("infinite temperature", ("temperature", "inf"), generate(temperature=float("inf"))),
    option("top_p zero", ("top_p", "(0, 1]", "got 0"), generate(top_p=0.0, temperature=1.0)),
    option("top_p above one", ("top_p", "1.5"), generate(top_p=1.5)),
    option("top_p NaN", ("top_p", "nan"), generate(top_p=float("nan"))),
    option("negative top_k", ("top_k", ">= 0", "-1"), generate(top_k=-1)),
    option("fractional top_k", ("top_k", "integer", "2.5"), generate(top_k=2.5)),
    option("draft length 0", ("k (draft length)", "1..16", "got 0"), generate(speculative="prompt-lookup", k=0)),
    option("draft length 17", ("k (draft length)", "1..16", "got 17"), generate(speculative="prompt-lookup", k=17)),
    option("token id = vocabulary size", ("token id 128", "[0, 128)"), generate_ids([5, 128])),
    option("negative token id", ("token id -1", "[0, 128)"), generate_ids([-1, 5])),
    option("fractional token id", ("token ids must be integers", "1.5"), generate_ids([1.5])),
    option("nested token ids", ("token ids must be integers",), generate_ids([[1, 2], [3]])),
    option("huge token id", ("token ids must be integers",), generate_ids([2**70])),
    option("empty prompt", ("prompt is empty",), generate(prompt="")),
    option("empty chat", ("no chat messages",), generate(prompt=[])),
    option("chat message without content", ("'role' and 'content'",), generate(prompt=[{"role": "user"}])),
    option("empty token ids", ("prompt is empty",), generate_ids([])),
    option("max_tokens 0", ("max_tokens", "integer >= 1", "got 0"), max_tokens(0)),
    option("negative max_tokens", ("max_tokens", "got -3"), max_tokens(-3)),
    option("fractional max_tokens", ("max_tokens", "got 2.5"), max_tokens(2.5)),
    option("boolean max_tokens", ("max_tokens", "got True"), max_tokens(True)),
    option("unknown speculative mode", ("speculative must be one of", "'bogus'"), generate(speculative="bogus")),
    option("draft-model without a draft", ("needs a draft model", "draft="), generate(speculative="draft-model")),
    option("seed of the wrong type", ("seed", "'abc'"), generate(seed="abc", temperature=1.0)),
    option("infinite seed", ("seed", "inf"), generate(seed=float("inf"), temperature=1.0)),
    option("unknown weight format", ("weights must be one of", "'q3_k'"),
           lambda c: doppler_py.load(c.tiny_dir, weights="q3_k", gpu=c.gpu, progress=False)),
]  # fmt: skip


# --- device limits ---------------------------------------------------------------------------------------------

BROWSER_BUFFER_LIMIT = "268,435,456"


DEVICE = [
    BadInput("device", "a buffer beyond the device", DeviceLimitError,
             ("huge needs a 300,000,000-byte buffer", BROWSER_BUFFER_LIMIT, "split the tensor"),
             lambda c: Tensor.empty(c.gpu, 75_000_000, "f32", "huge")),
    BadInput("device", "a KV cache beyond the device", DeviceLimitError,
             ("KV cache of 3000000 positions", BROWSER_BUFFER_LIMIT, "smaller max_seq"),
             lambda c: KVCache(c.gpu, 2, 3_000_000, 2, 16)),
    BadInput("device", "a context whose RoPE table is beyond the device", DeviceLimitError,
             ("RoPE table for 100000000 positions", BROWSER_BUFFER_LIMIT, "smaller max_seq"),
             load_broken(lambda c: edit_config(c.folder(), max_position_embeddings=100_000_000), max_seq=None)),
    BadInput("device", "a weight row group beyond a storage binding", DeviceLimitError,
             ("w: a group of 8 rows", "100-byte storage binding limit", "smaller weight format"),
             lambda c: Weight.from_numpy(c.gpu, np.zeros((16, 64), np.float32), "f32", name="w", max_part_bytes=100)),
]  # fmt: skip


# --- draft models ------------------------------------------------------------------------------------------------


def draft_folder(ctx: Context, spec: TinySpec) -> Path:
    return write_tiny_model(ctx.path("draft"), spec)


DRAFTS = [
    BadInput("draft vocabulary", "draft vocabulary of another size", VocabularyMismatchError,
             ("2000 tokens", "(128)", "share the tokenizer"),
             lambda c: c.load(c.tiny_dir, draft=draft_folder(c, TinySpec(vocab_size=2000, num_hidden_layers=1)))),
    BadInput("draft vocabulary", "draft with another tokenizer", VocabularyMismatchError,
             ("tokenizer differs", "same tokenizer"),
             lambda c: c.load(c.tiny_dir, draft=draft_folder(c, TinySpec(vocab_size=48, num_hidden_layers=1)))),
]  # fmt: skip

TABLE = MODEL_FORMAT + CAPACITY + OPTIONS + DEVICE + DRAFTS


# --- the test ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tally(request):
    """Bad inputs that passed, by kind; the session summary prints them (the lead's numbers)."""
    counts: Counter[str] = Counter()
    yield counts
    if counts:
        summary = ", ".join(f"{kind}: {n}" for kind, n in counts.most_common())
        report(request.config, f"bad inputs refused with a typed error: {sum(counts.values())} ({summary})")


@pytest.fixture(scope="module")
def context(tiny_dir, gpu, tmp_path_factory):
    engine = doppler_py.load(tiny_dir, weights="f32", gpu=gpu, max_seq=None, progress=False)
    yield Context(engine, gpu, tiny_dir, tmp_path_factory.mktemp("broken"))
    engine.close()


@pytest.fixture(scope="module")
def reference_tokens(context) -> list[int]:
    return context.engine.generate(GOOD_PROMPT, max_tokens=12).tokens


@pytest.mark.parametrize("bad", TABLE, ids=[f"{b.kind}: {b.name}" for b in TABLE])
def test_bad_input_raises_its_error_naming_the_culprit_and_the_engine_keeps_working(
    bad, context, reference_tokens, tally, monkeypatch
):
    monkeypatch.setenv("DOPPLER_CACHE", str(context.scratch / "cache"))  # GGUF conversions stay in the scratch dir
    engine = context.engine
    last_good = engine.generate(GOOD_PROMPT, max_tokens=12)
    with pytest.raises(DopplerError) as info:
        bad.run(context)
    assert type(info.value) is bad.error, f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    for needle in bad.says:
        if needle == "{fits}":
            needle = fits_after(context, GOOD_PROMPT)
        assert needle in message, message
    assert engine.last_result is last_good  # the failed call replaced nothing
    assert engine.generate(GOOD_PROMPT, max_tokens=12).tokens == reference_tokens
    assert engine.generate(GOOD_PROMPT, max_tokens=12, speculative="prompt-lookup", k=3).tokens == reference_tokens
    tally[bad.kind] += 1


def test_every_kind_of_bad_input_is_covered():
    kinds = Counter(bad.kind for bad in TABLE)
    assert set(kinds) == {"model format", "capacity", "generation option", "device", "draft vocabulary"}
    assert len({(b.kind, b.name) for b in TABLE}) == len(TABLE)


# --- guards in the speculative path --------------------------------------------------------------------------------

# The token whose embedding row is +inf in the poisoned models. The drafts' vocabulary stops before it (a
# padded-vocabulary pair), so a healthy draft never proposes it: the verifier reports NaN in ANY of the k+1
# rows it scores, including rows behind a rejected draft, so a proposed POISON would stop a clean run too.
POISON = 62
DRAFT_POISON = 7  # the poisoned draft's +inf row
CLEAN_PROMPT = [3, 17, 5, 9, 3, 17, 5, 22, 40, 3, 17]
POISONED_PROMPT = [3, 17, 5, POISON, 3, 17, 5, 22, 40, 3, 17]
DRAFT_POISONED_PROMPT = [3, 17, 5, DRAFT_POISON, 3, 17, 5, 22, 40, 3, 17]
GUARD_TARGET = TinySpec(vocab_size=64, tie_word_embeddings=False, num_hidden_layers=2, weight_std=0.25, seed=31)
GUARD_DRAFT = draft_spec(vocab_size=60, seed=32, tie_word_embeddings=False)


def poison(folder: Path, token: int) -> Path:
    """An input embedding row of +inf: RMSNorm turns it into NaN, which attention spreads to every later position
    (a huge finite row would not do: RMSNorm scales it back to normal)."""

    def edit(tensors: dict[str, np.ndarray]) -> None:
        tensors[EMBED][token] = np.inf

    return edit_tensors(folder, edit)


@pytest.fixture(scope="module")
def guard_models(tmp_path_factory, tiny_model):
    """name -> Transformer: "target" and "draft" (healthy), "poisoned_target" and "poisoned_draft"."""
    folders = {}
    for name, spec, token in (("target", GUARD_TARGET, POISON), ("draft", GUARD_DRAFT, DRAFT_POISON)):
        folders[name] = spec
        folders[f"poisoned_{name}"] = poison(write_tiny_model(tmp_path_factory.mktemp(f"poisoned_{name}"), spec), token)
    return {name: tiny_model(source, max_rows=16, max_positions=128) for name, source in folders.items()}


def guard_engine(models, target: str, drafter: str) -> SpeculativeEngine:
    model = models[target]
    make = {
        "none": lambda: None,
        "prompt-lookup": PromptLookupDrafter,
        "layer-skip": lambda: LayerSkipDrafter(model, 1),
        "draft-model": lambda: DraftModelDrafter(models["draft"], 64),
        "poisoned-draft": lambda: DraftModelDrafter(models["poisoned_draft"], 64),
    }[drafter]
    return SpeculativeEngine(model, make())


GREEDY = SamplingParams()


@pytest.mark.parametrize("drafter", ["none", "prompt-lookup", "layer-skip", "draft-model"])
def test_nan_logits_of_the_target_are_reported_not_sampled(guard_models, drafter, tally):
    engine = guard_engine(guard_models, "poisoned_target", drafter)
    target = guard_models["poisoned_target"]
    caches_before = len(target._cache_ops)
    try:
        with pytest.raises(NumericalError, match=r"target model produced NaN/inf logits.*weights='f32'"):
            engine.generate(POISONED_PROMPT, 12, GREEDY, k=3)
        assert len(target._cache_ops) == caches_before  # the failed generation's caches are gone
        # Prompts that never meet the poisoned row are untouched: the engine gives plain greedy's tokens.
        expected = reference_decode(target, CLEAN_PROMPT, 12, GREEDY)
        assert POISON not in expected
        assert engine.generate(CLEAN_PROMPT, 12, GREEDY, k=3).tokens == expected
    finally:
        engine.close()
    tally["numerical guard"] += 1


def test_nan_logits_of_a_sampling_draft_are_reported(guard_models, tally):
    engine = guard_engine(guard_models, "target", "poisoned-draft")
    try:
        with pytest.raises(NumericalError, match="draft model produced NaN/inf logits"):
            engine.generate(DRAFT_POISONED_PROMPT, 12, SamplingParams(temperature=1.0, seed=3), k=3)
    finally:
        engine.close()
    tally["numerical guard"] += 1


def test_a_greedy_broken_draft_only_costs_rejections(guard_models):
    """Greedy verification never reads the draft's logits: NaN drafts are rejected and the target decides."""
    engine = guard_engine(guard_models, "target", "poisoned-draft")
    try:
        result = engine.generate(DRAFT_POISONED_PROMPT, 12, GREEDY, k=3)
    finally:
        engine.close()
    assert result.tokens == reference_decode(guard_models["target"], DRAFT_POISONED_PROMPT, 12, GREEDY)
    assert result.stats.drafted > 0


def test_a_draft_with_an_incompatible_vocabulary_is_refused_before_drafting(guard_models, tally):
    with pytest.raises(VocabularyMismatchError, match=r"draft vocabulary \(60 tokens\).*\(5000\).*share the tokenizer"):
        DraftModelDrafter(guard_models["draft"], 5000)
    tally["draft vocabulary"] += 1
