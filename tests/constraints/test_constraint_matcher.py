"""The matcher's masks allow exactly the tokens that keep the output inside the grammar (checked against an
enumeration of the grammar's language), draft-chain masks equal step-by-step masks, and every way of moving
the state (advance, rollback, drafts, refused tokens) leaves it where it says."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from doppler_py.constraints import GrammarMatcher, allowed_ids, constraint_from_options, mask_words, token_bytes
from doppler_py.errors import InternalError, VocabularyMismatchError
from doppler_py.testing.tiny import TinySpec

# The tiny models have 128 output ids for the character tokenizer's 99: ids 99..127 are padding.
TINY_MODEL_VOCAB = TinySpec().vocab_size

# A finite language: the mask after any prefix is decidable by listing the strings.
WORDS = ["cat", "cats", "car", "cars", "dog", "x1", "x2"]
WORDS_REGEX = r"(cat|car)s?|dog|x[12]"


def expected_ids(pieces: list[bytes], language: list[bytes], prefix: bytes, eos: set[int]) -> set[int]:
    """Ids whose bytes extend `prefix` to a prefix of a string of `language`, and eos where `prefix` is in it."""
    viable = {word[:n] for word in language for n in range(len(word) + 1)}
    ids = {t for t, piece in enumerate(pieces) if piece and prefix + piece in viable}
    return ids | (eos if prefix in language else set())


def test_masks_allow_exactly_the_characters_that_stay_in_the_grammar(char_tokenizer, char_ll):
    pieces, eos = token_bytes(char_tokenizer), set(char_tokenizer.eos_token_ids)
    language = [w.encode() for w in WORDS]
    matcher = GrammarMatcher(char_ll, constraint_from_options(regex=WORDS_REGEX), TINY_MODEL_VOCAB)
    for word in WORDS:
        for n in range(len(word) + 1):
            matcher.rollback(matcher.length)
            matcher.advance(char_tokenizer.encode(word[:n], add_special_tokens=False))
            got = set(allowed_ids(matcher.mask()).tolist())
            assert got == expected_ids(pieces, language, word[:n].encode(), eos), word[:n]


def test_after_a_complete_word_eos_is_allowed_and_after_a_final_one_only_eos(char_tokenizer, char_ll):
    eos = set(char_tokenizer.eos_token_ids)
    matcher = GrammarMatcher(char_ll, constraint_from_options(regex=WORDS_REGEX), TINY_MODEL_VOCAB)
    matcher.advance(char_tokenizer.encode("cat", add_special_tokens=False))
    assert matcher.accepting and not matcher.finished
    assert set(allowed_ids(matcher.mask()).tolist()) == {char_tokenizer.token_to_id("s")} | eos
    matcher.advance(char_tokenizer.encode("s", add_special_tokens=False))
    assert matcher.finished
    assert set(allowed_ids(matcher.mask()).tolist()) == eos


def test_padded_model_ids_are_never_allowed(char_tokenizer, char_ll):
    """The tiny models have 128 output ids for 99 tokens; a grammar taking any text allows every real one."""
    matcher = GrammarMatcher(char_ll, constraint_from_options(regex=r"(?s:.*)"), TINY_MODEL_VOCAB)
    row = matcher.mask()
    assert row.shape == (mask_words(TINY_MODEL_VOCAB),) == (4,) and row.dtype == np.uint32
    allowed = allowed_ids(row)
    assert allowed.max() < char_tokenizer.vocab_size
    assert set(allowed.tolist()) == set(range(3, char_tokenizer.vocab_size)) | set(char_tokenizer.eos_token_ids)
    with pytest.raises(InternalError, match="not allowed"):
        matcher.advance([TINY_MODEL_VOCAB - 1])
    with pytest.raises(VocabularyMismatchError):
        GrammarMatcher(char_ll, constraint_from_options(regex="a"), char_tokenizer.vocab_size - 1)


def test_a_refused_token_raises_and_commits_nothing(char_tokenizer, char_ll):
    matcher = GrammarMatcher(char_ll, constraint_from_options(regex=WORDS_REGEX), TINY_MODEL_VOCAB)
    matcher.advance(char_tokenizer.encode("c", add_special_tokens=False))
    before = matcher.mask().copy()
    with pytest.raises(InternalError, match="not allowed"):
        matcher.advance(char_tokenizer.encode("az", add_special_tokens=False))
    assert matcher.length == 1
    np.testing.assert_array_equal(matcher.mask(), before)


def test_a_walk_counts_the_allowed_tokens_and_the_forced_ones_after_them_and_moves_nothing(char_tokenizer, char_ll):
    matcher = GrammarMatcher(char_ll, constraint_from_options(regex=r"ab(cab|dab)ee!"), TINY_MODEL_VOCAB)
    encode = lambda text: char_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    matcher.advance(encode("a"))
    assert matcher.walk(encode("bd")) == (2, encode("abee!"))  # "bd" allowed, then "abee!" forced
    assert matcher.walk(encode("bcx")) == (2, encode("abee!"))  # "x" refused: what is forced after "bc"
    assert matcher.walk([]) == (0, encode("b"))
    assert matcher.length == 1 and matcher.forced_tokens() == encode("b")


def test_eos_after_a_finished_grammar_rolls_back_like_any_token(char_tokenizer, char_ll):
    """llguidance does not record an eos once stopped; the matcher counts it so rollback undoes the eos first."""
    (eos,) = char_tokenizer.eos_token_ids
    matcher = GrammarMatcher(char_ll, constraint_from_options(regex="dog"), TINY_MODEL_VOCAB)
    matcher.advance([*char_tokenizer.encode("dog", add_special_tokens=False), eos])
    assert matcher.length == 4 and matcher.finished
    matcher.rollback(1)
    assert matcher.finished and set(allowed_ids(matcher.mask()).tolist()) == {eos}
    matcher.rollback(1)
    assert allowed_ids(matcher.mask()).tolist() == [char_tokenizer.token_to_id("g")]


# --- SmolLM2's vocabulary: multi-character tokens, forced tokens, drafts -------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "kind": {"enum": ["cat", "dog"]},
        "scores": {"type": "array", "items": {"type": "number"}},
    },
    "required": ["name", "kind", "scores"],
    "additionalProperties": False,
}
OUTPUT = '{"name": "Rex", "kind": "dog", "scores": [1.5, -2, 30]}'


@pytest.fixture(scope="module")
def schema(smollm2_ll):
    response_format = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
    return constraint_from_options(response_format=response_format, tokenizer=smollm2_ll)


@pytest.mark.realmodel
def test_smollm2_masks_allow_exactly_the_tokens_that_stay_in_a_number_regex(smollm2_tokenizer, smollm2_ll):
    """Every string of the language listed (1-3 digits, an optional decimal): the mask after each prefix is the
    set of the 49,152 tokens whose bytes keep it a prefix of one, where no byte is forced."""
    pieces, eos = token_bytes(smollm2_tokenizer), set(smollm2_tokenizer.eos_token_ids)
    numbers = ["".join(d) for n in (1, 2, 3) for d in itertools.product("0123456789", repeat=n)]
    language = [s.encode() for s in numbers + [f"{s}.{d}" for s in numbers for d in "0123456789"]]
    matcher = GrammarMatcher(smollm2_ll, constraint_from_options(regex=r"[0-9]{1,3}(\.[0-9])?"), 49152)
    for prefix in ["", "4", "42", "421", "42.", "421.5"]:
        matcher.rollback(matcher.length)
        for char in prefix:  # one digit per token, the way SmolLM2 splits digits anyway
            matcher.advance(smollm2_tokenizer.encode(char, add_special_tokens=False))
        assert not matcher.forced_tokens(), prefix
        got = set(allowed_ids(matcher.mask()).tolist())
        assert got == expected_ids(pieces, language, prefix.encode(), eos), prefix


@pytest.mark.realmodel
def test_smollm2_where_bytes_are_forced_the_mask_is_the_forced_token(smollm2_tokenizer, smollm2_ll):
    """llguidance keeps forced text canonical: once bytes are forced, the only allowed token is the first of
    their tokenization (not every token that spells a prefix of them)."""
    matcher = GrammarMatcher(smollm2_ll, constraint_from_options(regex="(yes|no), because"), 49152)
    matcher.advance(smollm2_tokenizer.encode("yes", add_special_tokens=False))
    forced = matcher.forced_tokens()
    pieces = token_bytes(smollm2_tokenizer)
    assert forced and b"".join(pieces[t] for t in forced) == b", because"[: sum(len(pieces[t]) for t in forced)]
    assert allowed_ids(matcher.mask()).tolist() == [forced[0]]
    matcher.advance(forced)


@pytest.mark.realmodel
def test_smollm2_draft_masks_equal_step_by_step_masks(smollm2_tokenizer, smollm2_ll, schema):
    ids = smollm2_tokenizer.encode(OUTPUT, add_special_tokens=False)
    im_end = smollm2_tokenizer.token_to_id("<|im_end|>")
    vocab = 49152 + 64  # padded, as models round their output layer up
    matcher = GrammarMatcher(smollm2_ll, schema, vocab)
    stepwise = []
    for token in [*ids, im_end]:
        stepwise.append(matcher.mask().copy())
        matcher.advance([token])
    stepwise.append(matcher.mask().copy())
    matcher.rollback(matcher.length)

    start = 5
    matcher.advance(ids[:start])
    before = matcher.mask().copy()
    drafts = [*ids[start:], im_end]
    rows, valid = matcher.draft_masks(drafts)
    assert valid == len(drafts)
    np.testing.assert_array_equal(rows, np.stack(stepwise[start:]))
    assert matcher.length == start
    np.testing.assert_array_equal(matcher.mask(), before)

    # A draft the grammar refuses ends the walk: rows up to it as before, zero after.
    bad = smollm2_tokenizer.encode("}", add_special_tokens=False)[0]
    drafts = [*ids[start : start + 3], bad, *ids[start + 4 : start + 6]]
    out = np.full((len(drafts) + 1, mask_words(vocab)), 7, dtype=np.uint32)
    rows, valid = matcher.draft_masks(drafts, out=out)
    assert rows is out and valid == 3
    np.testing.assert_array_equal(rows[:4], np.stack(stepwise[start : start + 4]))
    assert not rows[4:].any()
    assert matcher.length == start
    np.testing.assert_array_equal(matcher.mask(), before)


@pytest.mark.realmodel
def test_smollm2_rollback_restores_every_earlier_state(smollm2_tokenizer, smollm2_ll, schema):
    ids = smollm2_tokenizer.encode(OUTPUT, add_special_tokens=False)
    matcher = GrammarMatcher(smollm2_ll, schema, 49152)
    masks = [matcher.mask().copy()]
    for token in ids:
        matcher.advance([token])
        masks.append(matcher.mask().copy())
    assert matcher.finished and json.loads(OUTPUT)
    for back in (1, 4, 9):
        matcher.rollback(back)
        np.testing.assert_array_equal(matcher.mask(), masks[matcher.length])
        matcher.advance(ids[matcher.length : matcher.length + back])
    matcher.rollback(len(ids))
    np.testing.assert_array_equal(matcher.mask(), masks[0])
    with pytest.raises(InternalError, match="cannot roll back"):
        matcher.rollback(1)


@pytest.mark.realmodel
def test_smollm2_forced_bytes_are_spelled_past_the_forced_tokens(smollm2_tokenizer, smollm2_ll, schema):
    """After a key's colon the bytes ` "` are forced, but not a token: the model may write ` "` merged with the value
    (` "Ali`, say). `forced_spelling` drafts them as their canonical token; `walk` ends with the same spelling."""
    encode = lambda text: smollm2_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    matcher = GrammarMatcher(smollm2_ll, schema, 49152)
    matcher.advance(matcher.forced_tokens())  # {"name":
    assert matcher.forced_tokens() == [] and matcher.forced_spelling() == encode(' "')
    assert matcher.walk(encode(' "Ann",')) == (len(encode(' "Ann",')), encode(' "kind": "'))
    matcher.advance(encode(' "'))
    assert matcher.forced_spelling() == matcher.forced_tokens() == []  # the value is free


@pytest.mark.realmodel
def test_smollm2_forced_tokens_are_the_canonical_tokens_of_forced_text(smollm2_tokenizer, smollm2_ll, schema):
    matcher = GrammarMatcher(smollm2_ll, schema, 49152)
    matcher.advance(smollm2_tokenizer.encode("{", add_special_tokens=False))
    forced = matcher.forced_tokens()
    # The layout is fixed (grammar.JSON_LAYOUT: no free whitespace), so after "{" the first key is forced.
    assert smollm2_tokenizer.decode(forced).startswith('"name') and forced == smollm2_tokenizer.encode(
        smollm2_tokenizer.decode(forced), add_special_tokens=False
    )
    matcher.advance(forced)
