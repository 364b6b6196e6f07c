"""User constraints → an llguidance grammar: OpenAI's `response_format`, a regular expression, or a Lark grammar.

Every constraint is checked when it is made (llguidance compiles it), so a bad schema, regex or grammar is a
GenerationOptionError naming the option at request time, never a matcher stuck in an error state mid-generation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from doppler_py.errors import GenerationOptionError

if TYPE_CHECKING:
    import llguidance

_RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class Constraint:
    """A checked constraint. `grammar` is llguidance's grammar text (what `LLMatcher` takes); `option` names the
    user option it came from, for messages; `warnings` are what llguidance ignored (lenient JSON schemas)."""

    grammar: str
    option: str
    warnings: tuple[str, ...] = ()


def _checked(grammar: str, option: str, what: str, tokenizer: llguidance.LLTokenizer | None) -> Constraint:
    from llguidance import LLMatcher

    # With the tokenizer, references to special tokens (Lark `<|im_end|>`) are checked against the vocabulary too.
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        raise GenerationOptionError(f"{option} is not {what}: {messages[0].strip()}")
    return Constraint(grammar, option, tuple(messages))


# JSON output is laid out as json.dumps lays it out: ", " and ": ", no other whitespace. With llguidance's default
# (any whitespace between tokens) a small model can emit newlines until max_tokens; a fixed layout also forces
# more of the separators, which the step drafts for free.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_schema_constraint(
    schema: Mapping[str, Any],
    *,
    strict: bool = True,
    option: str = "json_schema",
    tokenizer: llguidance.LLTokenizer | None = None,
) -> Constraint:
    """Output that is one JSON value valid under `schema`. `strict=False` lets llguidance skip keywords it does not
    implement (e.g. "not", unknown formats; listed in `warnings`) instead of refusing the schema."""
    from llguidance import LLMatcher

    if not isinstance(schema, Mapping):
        raise GenerationOptionError(f"{option} must be a JSON object (a JSON schema), got {type(schema).__name__}")
    try:
        grammar = LLMatcher.grammar_from_json_schema(dict(schema), overrides={"lenient": not strict, **JSON_LAYOUT})
    except (TypeError, ValueError) as exc:  # the schema does not serialise to JSON (e.g. a set inside it)
        raise GenerationOptionError(f"{option} is not a valid JSON schema: {exc}") from None
    return _checked(grammar, option, "a valid JSON schema", tokenizer)


def regex_constraint(
    pattern: str, *, option: str = "regex", tokenizer: llguidance.LLTokenizer | None = None
) -> Constraint:
    """Output that matches `pattern` as a whole (Rust `regex` crate syntax, anchored at both ends)."""
    from llguidance import LLMatcher

    if not isinstance(pattern, str):
        raise GenerationOptionError(f"{option} must be a string, got {type(pattern).__name__}")
    return _checked(
        LLMatcher.grammar_from_regex(pattern), option, f"a valid regular expression ({pattern!r})", tokenizer
    )


def lark_constraint(
    text: str, *, option: str = "grammar", tokenizer: llguidance.LLTokenizer | None = None
) -> Constraint:
    """Output derived from the `start` rule of a Lark grammar (llguidance's dialect: `%json`, `<|special|>`)."""
    from llguidance import LLMatcher

    if not isinstance(text, str):
        raise GenerationOptionError(f"{option} must be a string (Lark grammar text), got {type(text).__name__}")
    return _checked(LLMatcher.grammar_from_lark(text), option, "a valid Lark grammar", tokenizer)


def response_format_constraint(
    response_format: Mapping[str, Any], *, tokenizer: llguidance.LLTokenizer | None = None
) -> Constraint | None:
    """OpenAI's `response_format`: {"type": "text"} → None (no constraint); {"type": "json_object"} → any JSON
    object; {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}} → that schema."""
    where = "response_format"
    if not isinstance(response_format, Mapping):
        raise GenerationOptionError(f"{where} must be an object, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind not in _RESPONSE_FORMAT_TYPES:
        raise GenerationOptionError(f"{where}.type = {kind!r} is not one of {', '.join(_RESPONSE_FORMAT_TYPES)}")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_constraint(ANY_JSON_OBJECT, option=where, tokenizer=tokenizer)
    spec = response_format.get("json_schema")
    where += ".json_schema"
    if not isinstance(spec, Mapping):
        raise GenerationOptionError(f"{where} must be an object with 'name' and 'schema', got {short_json(spec)}")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise GenerationOptionError(f"{where}.name must be a non-empty string, got {short_json(name)}")
    strict = spec.get("strict", False)
    if strict is None:
        strict = False
    if not isinstance(strict, bool):
        raise GenerationOptionError(f"{where}.strict must be true or false, got {short_json(strict)}")
    if "schema" not in spec:
        raise GenerationOptionError(f"{where}.schema is missing (the JSON schema the output must follow)")
    return json_schema_constraint(spec["schema"], strict=strict, option=f"{where}.schema", tokenizer=tokenizer)


def constraint_from_options(
    *,
    response_format: Mapping[str, Any] | None = None,
    regex: str | None = None,
    grammar: str | None = None,
    tokenizer: llguidance.LLTokenizer | None = None,
) -> Constraint | None:
    """The constraint the generation options ask for, or None; at most one of them may be given."""
    given = [
        name
        for name, value in (("response_format", response_format), ("regex", regex), ("grammar", grammar))
        if value is not None
    ]
    if len(given) > 1:
        raise GenerationOptionError(f"give one of response_format, regex and grammar, not {' and '.join(given)}")
    if response_format is not None:
        return response_format_constraint(response_format, tokenizer=tokenizer)
    if regex is not None:
        return regex_constraint(regex, tokenizer=tokenizer)
    if grammar is not None:
        return lark_constraint(grammar, tokenizer=tokenizer)
    return None


def short_json(value: Any, limit: int = 60) -> str:
    """A user's value as JSON (else repr) for an error message, cut to `limit` characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
