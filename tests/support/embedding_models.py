"""Tiny embedding models laid out as sentence-transformers keeps them, written by the tests.

`qwen3_embedding_folder`: a tiny random Qwen3 whose files follow Qwen3-Embedding's (weights saved from the bare model,
"embed_tokens.weight" with no "model." prefix; a tokenizer whose post-processor appends <|endoftext|>; the
sentence-transformers 2–5 files: modules.json, 1_Pooling/config.json with pooling_mode_lasttoken, 2_Normalize, and
config_sentence_transformers.json with a "query" prompt). `saved_by_sentence_transformers`: a folder that
sentence-transformers itself writes (its own current layout) for a pooling mode and optional Dense layers.
`embedding_gemma_folder`: a tiny random Gemma 3 with use_bidirectional_attention, saved as EmbeddingGemma is (mean
pooling, two Dense layers, Normalize).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from doppler_py.testing.tiny import TINY_SPECS, TinySpec, write_tiny_model

QWEN3 = TinySpec(
    arch="qwen3", num_attention_heads=4, num_key_value_heads=2, explicit_head_dim=32, rope_theta=1e6, seed=21
)
QUERY_PROMPT = "Instruct: find the passage\nQuery:"
# EmbeddingGemma's shape in small: Gemma 3 layers sliding, full, sliding, grouped-query heads. With bidirectional
# attention transformers reads sliding_window 5 as 5 // 2 + 1 = 3 (saved again as 4, read as 3): keys less than 3
# positions away either way, far fewer than the tests' longer texts hold.
GEMMA3 = dataclasses.replace(TINY_SPECS["gemma3-sliding"], seed=23, sliding_window=5)


def _write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


POOLING_FLAGS = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")


def pooling_flags(mode: str, width: int) -> dict:
    """A pooling config as sentence-transformers before its `pooling_mode` key wrote it (one boolean per mode), the
    layout the Hub's EmbeddingGemma and Qwen3-Embedding ship; `mode` is one of POOLING_FLAGS."""
    if mode not in POOLING_FLAGS:
        raise ValueError(f"pooling mode {mode!r} is not one of {POOLING_FLAGS}")
    flags = {f"pooling_mode_{f}": f == mode for f in POOLING_FLAGS}
    return {"word_embedding_dimension": width} | flags | {"include_prompt": True}


def with_pooling_flags(folder: Path) -> Path:
    """A folder saved by sentence-transformers 6 with its Pooling config rewritten in the boolean-key layout."""
    config_file = folder / "1_Pooling" / "config.json"
    config = json.loads(config_file.read_text())
    mode = {"mean": "mean_tokens", "lasttoken": "lasttoken", "cls": "cls_token"}[config["pooling_mode"]]
    _write_json(config_file, pooling_flags(mode, config["embedding_dimension"]))
    return folder


def qwen3_embedding_folder(folder: Path, spec: TinySpec = QWEN3, *, f16_rounded: bool = False) -> Path:
    """The tiny Qwen3 as Qwen3-Embedding lays itself out (module docstring). `f16_rounded`: its weights rounded to
    float16 and stored as float32 (what f16 weights compute with, for a reference in float32)."""
    from tokenizers import Tokenizer, processors

    write_tiny_model(folder, spec)
    weights = load_file(str(folder / "model.safetensors"))
    bare = {}
    for name, value in weights.items():
        if f16_rounded and value.ndim == 2:
            value = value.astype(np.float16).astype(np.float32)
        bare[name.removeprefix("model.")] = value
    bare.pop("lm_head.weight", None)
    save_file(bare, str(folder / "model.safetensors"), metadata={"format": "pt"})
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos = "<|endoftext|>"
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A:0 {eos}:0", pair=f"$A:0 {eos}:0 $B:1 {eos}:1", special_tokens=[(eos, tokenizer.token_to_id(eos))]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    # transformers then reads tokenizer.json as it is (its post-processor included).
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    _write_json(folder / "tokenizer_config.json", config)
    _write_json(
        folder / "modules.json",
        [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
        ],
    )
    _write_json(folder / "1_Pooling" / "config.json", pooling_flags("lasttoken", spec.hidden_size))
    (folder / "2_Normalize").mkdir(exist_ok=True)
    _write_json(folder / "sentence_bert_config.json", {"max_seq_length": 200, "do_lower_case": False})
    _write_json(
        folder / "config_sentence_transformers.json",
        {
            "prompts": {"query": QUERY_PROMPT, "document": ""},
            "default_prompt_name": None,
            "similarity_fn_name": "cosine",
        },
    )
    return folder


def saved_by_sentence_transformers(source: Path, folder: Path, pooling: str, dense: tuple[int, ...] = ()) -> Path:
    """`source` (an HF folder) with a `pooling` module, Dense layers of these widths (identity activation, with
    biases, random) and Normalize, built and saved by sentence-transformers itself."""
    import torch
    from sentence_transformers import SentenceTransformer, models

    transformer = models.Transformer(str(source))
    width = transformer.get_embedding_dimension()
    modules = [transformer, models.Pooling(width, pooling_mode=pooling)]
    generator = torch.Generator().manual_seed(7)
    for out in dense:
        layer = models.Dense(width, out, activation_function=torch.nn.Identity())
        with torch.no_grad():
            layer.linear.weight.copy_(torch.randn(out, width, generator=generator) / width**0.5)
            layer.linear.bias.copy_(torch.randn(out, generator=generator) * 0.1)
        modules.append(layer)
        width = out
    SentenceTransformer(modules=[*modules, models.Normalize()], device="cpu").save(str(folder))
    # With a chat template beside the tokenizer and a "message" modality in its settings, sentence-transformers 6
    # wraps a text in the template as a user message; doppler-py embeds text as it is (as Qwen3-Embedding's own
    # files ask), so neither is kept.
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    settings = json.loads((folder / "sentence_bert_config.json").read_text())
    settings["modality_config"].pop("message", None)
    _write_json(folder / "sentence_bert_config.json", settings)
    return folder


def embedding_gemma_folder(folder: Path, dense: tuple[int, ...] = (96, 48), spec: TinySpec = GEMMA3) -> Path:
    """The tiny Gemma 3 (`spec`) with use_bidirectional_attention, saved by sentence-transformers with mean pooling,
    Dense layers of these widths (EmbeddingGemma: 768 -> 3072 -> 768) and Normalize."""
    source = write_tiny_model(folder.with_name(folder.name + "-source"), spec)
    config = json.loads((source / "config.json").read_text())
    _write_json(source / "config.json", config | {"use_bidirectional_attention": True})
    # transformers' Gemma tokenizer class rebuilds the tokenizer from Gemma's own vocabulary; the tiny one is read
    # from tokenizer.json as it is.
    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
    _write_json(source / "tokenizer_config.json", tokenizer_config | {"tokenizer_class": "PreTrainedTokenizerFast"})
    return saved_by_sentence_transformers(source, folder, "mean", dense=dense)
