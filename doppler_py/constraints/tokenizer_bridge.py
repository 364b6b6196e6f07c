"""Our tokenizer as llguidance sees it: the exact bytes of every token id, which tokens are special, the end of
sequence ids, and an encoder for text fragments.

llguidance decides which tokens keep the output inside a grammar from each token's bytes alone, so those bytes
must be exactly what the token adds to the decoded text. They are read from the tokenizer's own decoder
specification (tokenizer.json "decoder"), step by step, the way the `tokenizers` package decodes:
- ByteLevel (GPT-2 style, e.g. SmolLM2): every character of a piece stands for one byte ("Ġ" is a space, "Ċ" a
  newline); a piece with a character outside that alphabet (an added token such as "<|im start|>") is its
  own UTF-8 text, as `tokenizers` decodes it.
- ByteFallback (SentencePiece): a piece "<0x0A>" is the single byte 0x0A.
- Replace / Metaspace: the SentencePiece space "▁" becomes " ".
- Fuse and a Strip after it act on the whole decoded text (the leading space a SentencePiece decoder drops at
  the very start), not on one token's contribution, so they do not change a piece's bytes.
Anything else is refused rather than guessed: a wrong byte silently lets the grammar accept text it should not.

llguidance marks special tokens by a leading 0xFF byte, so a piece that starts with the byte 0xFF ("ÿ" in a
byte-level vocabulary, "<0xFF>" in SentencePiece) is a special token to it. No grammar over text can allow one
anyway: 0xFF never occurs in UTF-8.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from doppler_py.errors import UnsupportedModelError

if TYPE_CHECKING:
    import llguidance

    from doppler_py.tokenizer import Tokenizer

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# Decoder steps that join or trim the decoded text as a whole once they (or a Fuse before them) have run.
_WHOLE_TEXT_STEPS = {"Fuse", "Strip"}


def byte_level_alphabet() -> dict[str, int]:
    """The character each byte is written as in a GPT-2 byte-level vocabulary → that byte.

    Printable bytes ("!".."~", "¡".."¬", "®".."ÿ") are written as the Latin-1 character of the same number; the
    other 68 (controls, space, DEL, 0x80-0xA0, soft hyphen) take U+0100, U+0101, ... in byte order, so that
    every piece is printable text.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shown = set(printable)
    alphabet = {chr(byte): byte for byte in printable}
    alphabet.update({chr(0x100 + n): byte for n, byte in enumerate(b for b in range(256) if b not in shown)})
    return alphabet


def _decoder_steps(spec: dict[str, Any] | None, source: str) -> list[dict[str, Any]]:
    if spec is None:
        # Without a decoder `tokenizers` joins pieces with spaces: no piece has bytes of its own.
        raise UnsupportedModelError(f"{source}: the tokenizer has no decoder, so tokens have no exact bytes")
    if spec.get("type") == "Sequence":
        return [step for inner in spec.get("decoders", []) for step in _decoder_steps(inner, source)]
    return [spec]


def _piece_steps(steps: list[dict[str, Any]], source: str) -> list[dict[str, Any]]:
    """The decoder steps that act on each piece on its own (those before the first Fuse), checked supported."""
    per_piece: list[dict[str, Any]] = []
    fused = False
    for step in steps:
        kind = step.get("type")
        if kind == "Fuse":
            fused = True
        elif fused and kind not in _WHOLE_TEXT_STEPS:
            raise UnsupportedModelError(f"{source}: decoder step {kind} after Fuse is not supported for constraints")
        elif kind == "Replace" and "String" not in step.get("pattern", {}):
            raise UnsupportedModelError(f"{source}: a regex Replace decoder step is not supported for constraints")
        elif kind == "Strip" and not fused:
            raise UnsupportedModelError(f"{source}: a Strip decoder step before Fuse is not supported for constraints")
        elif kind in ("ByteLevel", "ByteFallback", "Replace", "Metaspace"):
            per_piece.append(step)
        elif not fused:
            raise UnsupportedModelError(f"{source}: decoder step {kind} is not supported for constraints")
    return per_piece


def _piece_bytes(piece: str, steps: list[dict[str, Any]], alphabet: dict[str, int]) -> bytes:
    text = piece
    for step in steps:
        kind = step["type"]
        if kind == "ByteFallback":
            match = _BYTE_PIECE.fullmatch(text)
            if match:
                return bytes([int(match[1], 16)])
        elif kind == "ByteLevel":
            if all(char in alphabet for char in text):
                return bytes(alphabet[char] for char in text)
            return text.encode("utf-8")  # `tokenizers` keeps such a piece (an added token) as it is written
        elif kind == "Replace":
            text = text.replace(step["pattern"]["String"], step["content"])
        elif kind == "Metaspace":
            # Only the first piece of a text loses its leading space, which no generated token is.
            text = text.replace(step.get("replacement", "\u2581"), " ")
    return text.encode("utf-8")


def token_bytes(tokenizer: Tokenizer) -> list[bytes]:
    """The bytes each token id adds to the decoded text, index = token id (b"" for an id the vocabulary skips)."""
    spec = json.loads(tokenizer.backend.to_str())
    steps = _piece_steps(_decoder_steps(spec.get("decoder"), tokenizer.source), tokenizer.source)
    alphabet = byte_level_alphabet()
    pieces = [tokenizer.backend.id_to_token(i) for i in range(tokenizer.vocab_size)]
    return [b"" if piece is None else _piece_bytes(piece, steps, alphabet) for piece in pieces]


def special_token_ids(tokenizer: Tokenizer) -> list[int]:
    """Ids of the added tokens marked special (<|im_end|>, ...): llguidance never lets text match them; a grammar
    names them explicitly (Lark `<|im_end|>`), and the end-of-sequence ones end generation."""
    return sorted(i for i, token in tokenizer.backend.get_added_tokens_decoder().items() if token.special)


class FragmentEncoder:
    """Token ids of a piece of text that continues other text, as llguidance asks for them (forced bytes).

    The model's own encoder would treat the fragment as the start of a text: a SentencePiece vocabulary puts its
    "▁" space prefix before it, and special token names inside it would become special tokens. This one is the
    same tokenizer with the prefix taken off and special names read as plain text.
    """

    def __init__(self, tokenizer: Tokenizer, pieces: Sequence[bytes]):
        from tokenizers import Tokenizer as Backend

        spec = json.loads(tokenizer.backend.to_str())
        spec["normalizer"] = _without_prepend(spec.get("normalizer"))
        spec["pre_tokenizer"] = _never_prepend(spec.get("pre_tokenizer"))
        self.backend = Backend.from_str(json.dumps(spec))
        self.backend.encode_special_tokens = True
        self._byte_ids = {piece[0]: i for i, piece in enumerate(pieces) if len(piece) == 1}

    def __call__(self, data: bytes | str) -> list[int]:
        # llguidance calls this from Rust and cannot take an exception (it aborts): never raise.
        if isinstance(data, str):
            return self.backend.encode(data, add_special_tokens=False).ids
        try:
            return self.backend.encode(data.decode("utf-8"), add_special_tokens=False).ids
        except UnicodeDecodeError as exc:
            # A fragment ending inside a character: its whole characters, then its last bytes one token each
            # (byte-level and byte-fallback vocabularies have a token for every byte).
            head = self.backend.encode(data[: exc.start].decode("utf-8"), add_special_tokens=False).ids
            return head + [self._byte_ids[b] for b in data[exc.start :] if b in self._byte_ids]


def _without_prepend(spec: dict[str, Any] | None) -> dict[str, Any] | None:
    if spec is None or spec.get("type") == "Prepend":
        return None
    if spec.get("type") == "Sequence":
        return {**spec, "normalizers": [n for n in spec["normalizers"] if n.get("type") != "Prepend"]}
    return spec


def _never_prepend(spec: dict[str, Any] | None) -> dict[str, Any] | None:
    if spec is None:
        return None
    if spec.get("type") == "Metaspace":
        return {**spec, "prepend_scheme": "never"}
    if spec.get("type") == "Sequence":
        return {**spec, "pretokenizers": [_never_prepend(p) for p in spec["pretokenizers"]]}
    return spec


class _Vocabulary:
    """What llguidance's `TokenizerWrapper` reads from a tokenizer object: these attribute names are its API."""

    def __init__(self, tokenizer: Tokenizer):
        if not tokenizer.eos_token_ids:
            raise UnsupportedModelError(
                f"{tokenizer.source}: the tokenizer names no end-of-sequence token, so a constrained generation "
                "could never end",
                advice="add eos_token to tokenizer_config.json (or eos_token_id to generation_config.json)",
            )
        self.tokens = token_bytes(tokenizer)
        self.special_token_ids = special_token_ids(tokenizer)
        self.eos_token_id = tokenizer.eos_token_ids[0]
        self.bos_token_id = tokenizer.bos_token_id
        self.encode = FragmentEncoder(tokenizer, self.tokens)

    def __call__(self, data: bytes | str) -> list[int]:
        return self.encode(data)


def build_ll_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """A new llguidance tokenizer for `tokenizer` (~0.2 s for 49k tokens); every eos id ends a grammar."""
    import llguidance

    vocabulary = _Vocabulary(tokenizer)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocabulary), eos_token=list(tokenizer.eos_token_ids))


_cache: weakref.WeakKeyDictionary[Tokenizer, llguidance.LLTokenizer] = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()


def ll_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """The llguidance tokenizer for `tokenizer`, built once per tokenizer object (it is immutable, and matchers
    of any number of generations and threads share it)."""
    with _cache_lock:
        cached = _cache.get(tokenizer)
        if cached is None:
            cached = _cache[tokenizer] = build_ll_tokenizer(tokenizer)
        return cached
