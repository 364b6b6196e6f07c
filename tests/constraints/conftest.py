"""Tokenizers of each kind the bridge reads, built once per session: the tiny models' character tokenizer,
a byte-level BPE (with an added token outside the byte alphabet), a SentencePiece vocabulary with byte
fallback and a space prefix, and SmolLM2's real byte-level vocabulary from its GGUF."""

from __future__ import annotations

import json

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from doppler_py.constraints.tokenizer_bridge import ll_tokenizer
from doppler_py.model.spm_vocab import spm_tokenizer
from doppler_py.testing.tiny import PRINTABLE_CHARSET, SPECIAL_TOKENS, write_tokenizer
from doppler_py.tokenizer import Tokenizer


def _wrap(backend: Backend, eos: str, source: str) -> Tokenizer:
    special = {"bos_token": None, "eos_token": eos, "unk_token": None, "pad_token": None}
    return Tokenizer(
        backend, special_tokens=special, eos_token_ids=[backend.token_to_id(eos)], chat_template=None, source=source
    )


@pytest.fixture(scope="session")
def char_tokenizer(tmp_path_factory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("char-tokenizer")
    write_tokenizer(folder, PRINTABLE_CHARSET)
    return Tokenizer.from_dir(folder)


@pytest.fixture(scope="session")
def byte_level_tokenizer() -> Tokenizer:
    """GPT-2 style: every byte is a piece (so any text encodes), a few merges, special and added tokens."""
    from doppler_py.constraints.tokenizer_bridge import byte_level_alphabet

    alphabet = sorted(byte_level_alphabet(), key=lambda char: byte_level_alphabet()[char])
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("{", '"'), ("Ã", "©"), ("0", "0")]
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *alphabet, *(a + b for a, b in merges)])}
    backend = Backend(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    backend.add_tokens([AddedToken("<tool call>", special=False, normalized=False)])  # " " is outside the alphabet
    return _wrap(backend, "<|im_end|>", "byte-level test tokenizer")


@pytest.fixture(scope="session")
def sentencepiece_tokenizer() -> Tokenizer:
    """llama.cpp SentencePiece: "▁" spaces, a space prefix, byte fallback for characters it lacks."""
    normal = ["▁", "a", "b", "c", "{", "}", '"', ":", "1", "2", "▁a", "▁b", "ab", "▁ab", "bc", "é"]
    pieces = ["<unk>", "<s>", "</s>", *normal, *(f"<0x{b:02X}>" for b in range(256))]
    types = [2, 3, 3, *[1] * len(normal), *[6] * 256]
    scores = [0.0, 0.0, 0.0, *(-float(i) for i in range(len(normal))), *[0.0] * 256]
    backend = spm_tokenizer(pieces, scores, types, add_space_prefix=True, unknown="<unk>")
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<s>", "</s>")])
    return _wrap(backend, "</s>", "SentencePiece test tokenizer")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf, tmp_path_factory) -> Tokenizer:
    from doppler_py.model.gguf import read_gguf, tokenizer_files

    folder = tmp_path_factory.mktemp("smollm2-tokenizer")
    tokenizer_json, tokenizer_config = tokenizer_files(read_gguf(smollm2_gguf))
    (folder / "tokenizer.json").write_text(tokenizer_json)
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return Tokenizer.from_dir(folder)


@pytest.fixture(scope="session")
def smollm2_ll(smollm2_tokenizer):
    return ll_tokenizer(smollm2_tokenizer)


@pytest.fixture(scope="session")
def char_ll(char_tokenizer):
    return ll_tokenizer(char_tokenizer)
