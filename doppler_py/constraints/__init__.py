"""Structured output on the host: user constraints (JSON schema, regex, Lark) compiled by llguidance into token
masks for the GPU sampler, over an exact byte view of the model's tokenizer."""

from doppler_py.constraints.grammar import (
    Constraint,
    constraint_from_options,
    json_schema_constraint,
    lark_constraint,
    regex_constraint,
    response_format_constraint,
)
from doppler_py.constraints.matcher import GrammarMatcher, allowed_ids, mask_words
from doppler_py.constraints.tokenizer_bridge import ll_tokenizer, token_bytes

__all__ = [
    "Constraint",
    "GrammarMatcher",
    "allowed_ids",
    "constraint_from_options",
    "json_schema_constraint",
    "lark_constraint",
    "ll_tokenizer",
    "mask_words",
    "regex_constraint",
    "response_format_constraint",
    "token_bytes",
]
