"""The tokenizer bridge is exact: each token id's bytes are what it adds to our tokenizer's decoded text, and
llguidance, given those bytes, decodes and tokenizes as our tokenizer does."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models

from doppler_py.constraints.tokenizer_bridge import FragmentEncoder, ll_tokenizer, token_bytes
from doppler_py.errors import UnsupportedModelError
from doppler_py.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    '  {"name": "Ann", "tags": ["a", "b"], "n": -12.5e3}\n\n',
    "tab\there, newline\nand\r\n CRLF",
    "日本語 and émoji 👋🏽 mixed",
    "the <|im_end|> name as plain text",
    "",
]
TOKENIZERS = ["char_tokenizer", "byte_level_tokenizer", "sentencepiece_tokenizer"]


def check_every_token_decodes_to_its_bytes(tokenizer: Tokenizer) -> None:
    """decode(anchor + [t]) = decode(anchor) + bytes(t), for every id t (special ones included): the anchor keeps
    a SentencePiece decoder from stripping t's leading space, which it does only at the start of a text. A
    token that is part of a character decodes to U+FFFD on its own, as its bytes do in Python."""
    pieces = token_bytes(tokenizer)
    assert len(pieces) == tokenizer.vocab_size
    anchor = [tokenizer.encode("a", add_special_tokens=False)[-1]]
    prefix = tokenizer.decode(anchor)
    decoded = tokenizer.backend.decode_batch([[*anchor, t] for t in range(len(pieces))], skip_special_tokens=False)
    wrong = [t for t, text in enumerate(decoded) if text != prefix + pieces[t].decode("utf-8", "replace")]
    assert not wrong, [(t, tokenizer.backend.id_to_token(t), pieces[t], decoded[t]) for t in wrong[:5]]
    # llguidance marks special tokens with a leading 0xFF byte, so it reads a piece starting with 0xFF (never valid
    # UTF-8, so no grammar can allow it anyway) as a special token named by its other bytes.
    llg = ll_tokenizer(tokenizer)
    seen = [llg.decode_bytes([t]) for t in range(len(pieces))]
    assert seen == [piece.removeprefix(b"\xff") for piece in pieces]
    assert all(llg.is_special_token(t) for t, piece in enumerate(pieces) if piece.startswith(b"\xff"))


def check_encodings_are_the_texts_bytes(tokenizer: Tokenizer, texts: list[str], prefix: bytes = b"") -> None:
    """Multi-byte characters split over tokens come back byte for byte (what a per-token decode cannot show)."""
    pieces = token_bytes(tokenizer)
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        expected = prefix + text.encode() if text else b""
        assert b"".join(pieces[t] for t in ids) == expected, text


@pytest.mark.parametrize("name", TOKENIZERS)
def test_every_token_decodes_to_its_bridge_bytes(request, name):
    check_every_token_decodes_to_its_bytes(request.getfixturevalue(name))


def test_byte_level_and_sentencepiece_pieces_become_their_bytes(byte_level_tokenizer, sentencepiece_tokenizer):
    byte_level = token_bytes(byte_level_tokenizer)
    assert [byte_level[byte_level_tokenizer.token_to_id(p)] for p in ["Ġ", "Ċ", "Ã", "Ġthe", "<tool call>"]] == [
        b" ",
        b"\n",
        b"\xc3",
        b" the",
        b"<tool call>",
    ]
    spm = token_bytes(sentencepiece_tokenizer)
    assert [spm[sentencepiece_tokenizer.token_to_id(p)] for p in ["▁ab", "<0x0A>", "<0xF0>", "é"]] == [
        b" ab",
        b"\n",
        b"\xf0",
        "é".encode(),
    ]


def test_encoded_texts_are_their_bytes(char_tokenizer, byte_level_tokenizer, sentencepiece_tokenizer):
    check_encodings_are_the_texts_bytes(char_tokenizer, ["Hello, world!", ' {"a": [1, 2]}\n'])
    check_encodings_are_the_texts_bytes(byte_level_tokenizer, TEXTS)
    # The space prefix is a real byte of the first token; the decoder drops it only at the start of a text.
    check_encodings_are_the_texts_bytes(sentencepiece_tokenizer, [t for t in TEXTS if t], prefix=b" ")


@pytest.mark.parametrize("name", ["byte_level_tokenizer", "sentencepiece_tokenizer"])
def test_llguidance_tokenizes_fragments_without_prefix_or_special_tokens(request, name):
    """llguidance tokenizes forced text that continues the output: a SentencePiece prefix would add a space,
    and a special token's name in the text is only text."""
    tokenizer = request.getfixturevalue(name)
    pieces, llg = token_bytes(tokenizer), ll_tokenizer(tokenizer)
    special = set(tokenizer.eos_token_ids)
    for text in TEXTS:
        ids = llg.tokenize_str(text)
        assert b"".join(pieces[t] for t in ids) == text.encode(), text
        assert not special & set(ids)
    # A fragment cut inside a character still tokenizes (llguidance's Rust side cannot take an exception).
    encoder = FragmentEncoder(tokenizer, pieces)
    assert b"".join(pieces[t] for t in encoder("é👋".encode()[:-1])) == "é👋".encode()[:-1]


def test_byte_level_fragments_tokenize_like_our_encoder(byte_level_tokenizer):
    llg = ll_tokenizer(byte_level_tokenizer)
    for text in TEXTS[:4]:
        assert llg.tokenize_str(text) == byte_level_tokenizer.encode(text, add_special_tokens=False), text


def test_special_and_eos_tokens_are_marked(byte_level_tokenizer):
    llg = ll_tokenizer(byte_level_tokenizer)
    assert [llg.is_special_token(i) for i in range(3)] == [True, True, True]
    assert not llg.is_special_token(byte_level_tokenizer.token_to_id("<tool call>"))
    assert llg.eos_tokens == list(byte_level_tokenizer.eos_token_ids)


def test_the_llguidance_tokenizer_is_built_once_per_tokenizer(char_tokenizer):
    assert ll_tokenizer(char_tokenizer) is ll_tokenizer(char_tokenizer)


@pytest.mark.parametrize("decoder", [None, decoders.WordPiece(), decoders.Sequence([decoders.Fuse(), decoders.CTC()])])
def test_a_decoder_without_exact_token_bytes_is_refused(decoder):
    backend = Backend(models.BPE(vocab={"a": 0, "</s>": 1}, merges=[]))
    if decoder is not None:
        backend.decoder = decoder
    tokenizer = Tokenizer(backend, special_tokens={}, eos_token_ids=[1], chat_template=None, source="decoder test")
    with pytest.raises(UnsupportedModelError, match="decoder"):
        token_bytes(tokenizer)


def test_a_tokenizer_without_eos_is_refused(char_tokenizer):
    tokenizer = Tokenizer(
        char_tokenizer.backend, special_tokens={}, eos_token_ids=[], chat_template=None, source="no eos"
    )
    with pytest.raises(UnsupportedModelError, match="end-of-sequence"):
        ll_tokenizer(tokenizer)


# --- SmolLM2's real vocabulary (49,152 byte-level tokens) ---------------------------------------------------


@pytest.mark.realmodel
def test_smollm2_every_token_decodes_to_its_bridge_bytes(smollm2_tokenizer):
    check_every_token_decodes_to_its_bytes(smollm2_tokenizer)
    check_encodings_are_the_texts_bytes(smollm2_tokenizer, TEXTS)


@pytest.mark.realmodel
def test_smollm2_llguidance_tokenizes_like_our_encoder(smollm2_tokenizer, smollm2_ll):
    for text in TEXTS[:4]:
        assert smollm2_ll.tokenize_str(text) == smollm2_tokenizer.encode(text, add_special_tokens=False), text
    im_end = smollm2_tokenizer.token_to_id("<|im_end|>")
    assert im_end not in smollm2_ll.tokenize_str(TEXTS[4])
    assert smollm2_ll.eos_tokens == [im_end]
