"""SentencePiece vocabularies as llama.cpp stores them in GGUF (tokenizer model "llama": pieces, scores and
token types, no merges) turned into a `tokenizers` BPE with byte fallback.

llama.cpp's SentencePiece tokenizer starts from single characters and repeatedly merges the adjacent pair whose
concatenation is a normal piece with the highest score; characters missing from the vocabulary become their
UTF-8 bytes (<0xNN> pieces). A BPE whose merges are every (left, right) split of every normal piece, ranked by
the merged piece's score, applies the same merges in the same order, and `byte_fallback` gives the bytes.
Spaces are the metasymbol "▁" (U+2581); `add_space_prefix` (Llama 2 style, not Gemma) puts one before the text.
"""

from __future__ import annotations

from collections.abc import Sequence

SPACE = "\u2581"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # llama.cpp token types


def spm_merges(pieces: Sequence[str], scores: Sequence[float], types: Sequence[int]) -> list[tuple[str, str]]:
    """Every split of every normal piece into two normal pieces, the merged piece's score first (highest
    first), ties by the ids of the merged piece, then of its left and right parts."""
    ids = {piece: i for i, piece in enumerate(pieces) if types[i] == NORMAL}
    ranked = []
    for piece, merged_id in ids.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[merged_id], merged_id, ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def spm_tokenizer(
    pieces: Sequence[str], scores: Sequence[float], types: Sequence[int], *, add_space_prefix: bool, unknown: str | None
):
    """A `tokenizers.Tokenizer` (model, pre-tokenizer and decoder; the caller adds special tokens and the
    post-processor) that encodes and decodes like the SentencePiece vocabulary."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {piece: i for i, piece in enumerate(pieces)}
    model = models.BPE(
        vocab=vocab,
        merges=spm_merges(pieces, scores, types),
        unk_token=unknown,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(model)
    # No pre-tokenizer: the whole text is one word, as SentencePiece sees it (merges may cross a space's "▁").
    # The normalizer runs on each stretch of text between added tokens, so the prefix goes before the text and
    # after every special token, as llama.cpp adds it, even where the text already starts with a space.
    spaces = normalizers.Replace(" ", SPACE)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), spaces]) if add_space_prefix else spaces
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer
