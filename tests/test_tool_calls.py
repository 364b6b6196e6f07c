"""Tool calls (`doppler_py.tool_calls`): the plan's checks, the prompt, the answer parser, whole or streamed, and
the real model held to a JSON schema. The server's tool calls are tested in test_server.py."""

from __future__ import annotations

import json

import pytest
from support.schemas import person_schema

from doppler_py.errors import GenerationOptionError
from doppler_py.tool_calls import ToolCallParser, chat_messages, parse_answer, tool_plan

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}
TWO_CALLS = (
    '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris \\"}\\" x","days":2}}\n</tool_call>\n'
    '<tool_call>\n{"name":"now","arguments":{}}\n</tool_call>'
)


def streamed(text: str, size: int) -> tuple[ToolCallParser, list]:
    parser, deltas = ToolCallParser(), []
    for start in range(0, len(text), size):
        deltas += parser.feed(text[start : start + size])
    return parser, deltas + parser.finish()


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_streamed_deltas_join_to_the_calls_of_the_whole_answer(size):
    content, calls = parse_answer(TWO_CALLS)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "now"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": 'Paris "}" x', "days": 2}
    assert calls[1]["function"]["arguments"] == "{}"
    _, deltas = streamed(TWO_CALLS, size)
    starts = [d for d in deltas if d.kind == "call"]
    assert [(d.index, d.name) for d in starts] == [(0, "get_weather"), (1, "now")]
    for index, call in enumerate(calls):
        pieces = "".join(d.text for d in deltas if d.kind == "arguments" and d.index == index)
        assert pieces == call["function"]["arguments"]
    assert all(d.kind != "content" for d in deltas)


@pytest.mark.parametrize("text", ["Sunny, I think.", "<tool", "<tools are fun>", ""])
def test_text_that_opens_no_call_is_content(text):
    assert parse_answer(text) == (text, [])
    parser, deltas = streamed(text, 1)
    assert "".join(d.text for d in deltas) == text and parser.calls == []


def test_an_answer_cut_short_keeps_the_arguments_written_so_far():
    content, calls = parse_answer(TWO_CALLS[: TWO_CALLS.index("Paris") + 5])
    assert content is None and calls[0]["function"]["arguments"] == '{"city":"Paris'


def test_the_grammar_fits_the_choice():
    auto = tool_plan([WEATHER, NOW]).grammar
    assert auto.startswith("start: TEXT | calls") and 'calls: call ("\\n" call)*' in auto
    required = tool_plan([WEATHER, NOW], "required", parallel_tool_calls=False).grammar
    assert required.startswith("start: calls\ncalls: call\n") and "TEXT" not in required
    named = tool_plan([WEATHER, NOW], {"type": "function", "function": {"name": "now"}})
    assert [f.name for f in named.functions] == ["now"] and named.choice == "required"
    assert tool_plan([WEATHER], "none") is None and tool_plan(None) is None


@pytest.mark.parametrize(
    ("tools", "choice", "message"),
    [
        ([{"type": "function", "function": {"name": "a b"}}], None, "tools[0].function.name"),
        ([WEATHER, {"type": "retrieval"}], None, "tools[1] must be"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}], None,
         "tools[0].function.parameters"),
        ([WEATHER, WEATHER], None, "distinct"),
        ([WEATHER], "sometimes", "tool_choice must be"),
        ([WEATHER], {"type": "function", "function": {"name": "other"}}, "not among the tools"),
        (None, "required", "needs tools"),
    ],
)  # fmt: skip
def test_bad_tools_name_the_field(tools, choice, message):
    with pytest.raises(GenerationOptionError, match=message.replace("[", r"\[").replace("]", r"\]")):
        tool_plan(tools, choice)


class _Template:
    """The tokenizer attributes `chat_messages` reads."""

    def __init__(self, template: str):
        self.chat_template = template


def test_history_calls_and_results_are_rendered_in_the_answer_format():
    history = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": parse_answer(TWO_CALLS)[1]},
        {"role": "tool", "tool_call_id": "x", "content": "sunny"},
    ]
    plain = _Template("{% for m in messages %}{{ m.content }}{% endfor %}")
    messages, variables = chat_messages(history, plain, tool_plan([WEATHER, NOW]))
    assert variables == {} and messages[0]["role"] == "system" and "<tools>" in messages[0]["content"]
    assert parse_answer(messages[2]["content"])[1][0]["function"]["name"] == "get_weather"
    assert messages[3] == {"role": "tool", "content": "<tool_response>\nsunny\n</tool_response>"}
    # A template that takes `tools` gets them, and the calls as objects, as transformers passes them.
    native = _Template("{{ tools }}{% for m in messages %}{{ m.content }}{% endfor %}")
    messages, variables = chat_messages(history, native, tool_plan([WEATHER, NOW]))
    assert [t["function"]["name"] for t in variables["tools"]] == ["get_weather", "now"]
    assert messages[1]["tool_calls"][1]["function"]["arguments"] == {} and messages[0]["role"] == "user"


# --- the real model --------------------------------------------------------------------------------------------
PERSON = person_schema(name_length=12, max_age=150)


@pytest.mark.realmodel
def test_smollm2_answers_in_json_valid_under_the_schema(smollm2_engine):
    messages = [{"role": "user", "content": "Give the name and age of a famous scientist as JSON."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    result = smollm2_engine.generate(messages, max_tokens=40, response_format=response_format, speculative="none")
    assert result.finish_reason == "stop", result.text
    person = json.loads(result.text)
    assert set(person) == {"name", "age"} and isinstance(person["name"], str) and len(person["name"]) <= 12
    assert isinstance(person["age"], int) and 0 <= person["age"] <= 150
