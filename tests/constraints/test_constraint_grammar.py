"""User constraints become llguidance grammars that accept exactly what they describe; bad input is a typed
error naming the option and llguidance's reason."""

from __future__ import annotations

import pytest

from doppler_py.constraints import GrammarMatcher, constraint_from_options, response_format_constraint
from doppler_py.errors import GenerationOptionError

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture
def accepts(char_tokenizer, char_ll):
    """Whether a constraint's grammar takes `text` as a complete output (on the character tokenizer, where any
    printable text is one token per character, so the answer is about the grammar alone)."""

    def check(constraint, text: str) -> bool:
        matcher = GrammarMatcher(char_ll, constraint, char_tokenizer.vocab_size)
        ids = char_tokenizer.encode(text, add_special_tokens=False)
        try:
            matcher.advance(ids)
        except Exception:
            return False
        return matcher.accepting

    return check


def test_text_format_and_no_options_mean_no_constraint():
    assert response_format_constraint({"type": "text"}) is None
    assert constraint_from_options() is None


def test_json_object_takes_any_object_and_only_objects(accepts):
    constraint = constraint_from_options(response_format={"type": "json_object"})
    assert accepts(constraint, '{"a": [1, {"b": null}], "c": "d"}')
    assert accepts(constraint, "{}")
    assert not accepts(constraint, "[1, 2]")
    assert not accepts(constraint, '"text"')
    assert not accepts(constraint, '{"a": 1')


def test_json_schema_takes_what_the_schema_allows(accepts):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    constraint = constraint_from_options(response_format=response_format)
    assert constraint.option == "response_format.json_schema.schema"
    assert accepts(constraint, '{"name": "Ann", "age": 41}')
    assert not accepts(constraint, '{"name": "Ann"}')
    assert not accepts(constraint, '{"name": "Ann", "age": -1}')
    assert not accepts(constraint, '{"name": "Ann", "age": 41, "x": 1}')


def test_regex_and_lark_take_their_language(accepts):
    regex = constraint_from_options(regex=r"[0-9]{3}-[a-z]+")
    assert accepts(regex, "123-abc")
    assert not accepts(regex, "12-abc")
    lark = constraint_from_options(grammar='start: "(" item ("," item)* ")"\nitem: /[a-z]+/')
    assert accepts(lark, "(ab,c)")
    assert not accepts(lark, "(ab,)")


def test_strict_refuses_unimplemented_keywords_and_non_strict_skips_them():
    schema = {"type": "string", "not": {"const": "x"}}

    def response_format(strict: bool) -> dict:
        return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": strict}}

    with pytest.raises(GenerationOptionError, match=r"json_schema\.schema is not a valid JSON schema: .*not"):
        response_format_constraint(response_format(True))
    assert any("not" in warning for warning in response_format_constraint(response_format(False)).warnings)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"response_format": {"type": "yaml"}}, r"response_format\.type = 'yaml' is not one of text"),
        ({"response_format": "json"}, r"response_format must be an object"),
        ({"response_format": {"type": "json_schema"}}, r"response_format\.json_schema must be an object"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}},
            r"json_schema\.name must be a non-empty string",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}},
            r"json_schema\.schema is missing",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": [1]}}},
            r"json_schema\.schema must be a JSON object",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "frob"}}}},
            r"response_format\.json_schema\.schema is not a valid JSON schema: Invalid type: frob",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": {"type": "string", "pattern": "(("}},
                }
            },
            r"schema is not a valid JSON schema: regex parse error",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {}, "strict": "yes"}}},
            r"json_schema\.strict must be true or false",
        ),
        ({"regex": "a(b"}, r"(?s)regex is not a valid regular expression \('a\(b'\): .*unclosed group"),
        ({"regex": 5}, r"regex must be a string"),
        ({"grammar": "start: foo"}, r'grammar is not a valid Lark grammar: .*unknown name: "foo"'),
        ({"regex": "a", "grammar": 'start: "a"'}, r"give one of response_format, regex and grammar, not regex and"),
    ],
)
def test_bad_constraints_are_typed_errors_naming_the_problem(options, message):
    with pytest.raises(GenerationOptionError, match=message):
        constraint_from_options(**options)


def test_special_token_references_are_checked_against_the_vocabulary(char_ll):
    assert constraint_from_options(grammar='start: "a" <|im_end|>', tokenizer=char_ll) is not None
    with pytest.raises(GenerationOptionError, match="grammar is not a valid Lark grammar"):
        constraint_from_options(grammar='start: "a" <|no_such_token|>', tokenizer=char_ll)
