"""Anthropic's Messages API (`POST /v1/messages`) on the server, driven by the real `anthropic` client (and by httpx
where the wire itself is the point: event names, error bodies, headers). The request-to-options mapping is checked
without a server, the rest against one tiny model served on a free loopback port, plainly decoded (the engine's
speculation is the OpenAI routes' tests' business; this route only shapes its answers)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from doppler_py.api import load
from doppler_py.options import GenerationOptions
from doppler_py.server import OpenAIServer, ServerConfig, serving_in_background
from doppler_py.server.anthropic_parsing import chat_messages, parse_messages
from doppler_py.testing.tiny import write_tiny_model

anthropic = pytest.importorskip("anthropic")

MODEL = "tiny-chat"  # the id the servers are given (the folder's name depends on the tests run before)
STORY = [{"role": "user", "content": "Tell me a story."}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city over the next days",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 8},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}
NOW = {"name": "now", "description": "The time", "input_schema": {"type": "object", "properties": {}}}
API_KEY = "sk-ant-test-0123"


# --- the request's mapping, no server ------------------------------------------------------------------------------
def test_a_conversation_becomes_the_chat_messages_the_engine_renders():
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "user", "content": [{"type": "text", "text": "In Paris."}]},  # one turn with the one before
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "days": 1}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "Thanks."},
            ],
        },
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_2", "name": "now", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True}]},
    ]
    system = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind.", "cache_control": {}}]
    call = {
        "id": "toolu_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city":"Paris","days":1}'},
    }
    assert chat_messages(system, messages) == [
        {"role": "system", "content": "Be brief.\n\nBe kind."},
        {"role": "user", "content": "Weather?\n\nIn Paris."},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "Thanks."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "toolu_2", "type": "function", "function": {"name": "now", "arguments": "{}"}}
        ]},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: "},
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("tool_choice", "choice", "parallel"),
    [
        (None, "auto", True),
        ({"type": "any"}, "required", True),
        ({"type": "tool", "name": "now", "disable_parallel_tool_use": True}, "required", False),
        ({"type": "none"}, None, True),
    ],
)
def test_sampling_fields_and_tool_choice_map_to_the_engines_options(tool_choice, choice, parallel):
    body = {
        "max_tokens": 7,
        "messages": STORY,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 20,
        "stop_sequences": ["\n\n"],
        "tools": [WEATHER, NOW | {"strict": True}],
    } | ({"tool_choice": tool_choice} if tool_choice else {})
    options = parse_messages(body, GenerationOptions(max_tokens=99)).options
    assert (options.max_tokens, options.temperature, options.top_p, options.top_k) == (7, 0.5, 0.9, 20)
    assert options.stop == ("\n\n",) and options.chat
    plan = options.tool_plan
    assert (plan and plan.choice) == choice
    if plan is not None:
        assert plan.parallel == parallel and plan.named == (tool_choice or {}).get("name")
        assert plan.functions[0].parameters == WEATHER["input_schema"] or plan.named == "now"
        assert {f.name: f.strict for f in plan.functions}.items() <= {"get_weather": False, "now": True}.items()


# --- the server ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp("tiny-chat"))
    with load(folder, weights="f32", progress=False) as engine:
        yield engine


@pytest.fixture(scope="module")
def server(engine):
    config = ServerConfig(model_id=MODEL, defaults={"max_tokens": 12, "speculative": "none"})
    with serving_in_background(OpenAIServer(engine, config).app) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=60)


def events_of(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event, each name checked against its data's type."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            data = json.loads(line.removeprefix("data: "))
            assert data["type"] == name, (name, data)
            events.append((name, data))
    return events


def test_a_message_has_a_text_block_a_stop_reason_and_usage_counting_the_prompt(client, server, engine):
    request = {"model": MODEL, "max_tokens": 6, "system": "Be brief.", "messages": STORY}
    message = client.messages.create(**request)
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.id.startswith("msg_")
    (block,) = message.content
    assert block.type == "text" and isinstance(block.text, str)
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    usage = message.usage
    prompt = len(engine.encode_prompt([{"role": "system", "content": "Be brief."}, *STORY]))
    assert usage.input_tokens + usage.cache_read_input_tokens == prompt and usage.cache_creation_input_tokens == 0
    assert 0 < usage.output_tokens <= 6
    assert client.messages.count_tokens(model=MODEL, system="Be brief.", messages=STORY).input_tokens == prompt


def test_a_repeated_prompt_reads_its_tokens_from_the_prefix_cache(client):
    request = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "Say something new."}]}
    first, again = client.messages.create(**request).usage, client.messages.create(**request).usage
    prompt = first.input_tokens + first.cache_read_input_tokens
    assert again.input_tokens + again.cache_read_input_tokens == prompt
    assert again.cache_read_input_tokens > first.cache_read_input_tokens and again.input_tokens < prompt


def test_a_streamed_message_sends_anthropics_events_in_order_with_the_whole_answers_text(client, server):
    request = {"model": MODEL, "max_tokens": 10, "messages": STORY}
    whole = client.messages.create(**request)
    with httpx.stream("POST", f"{server}/v1/messages", json=request | {"stream": True}, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = events_of(response)
    names = [name for name, _ in events if name != "ping"]
    deltas = names.count("content_block_delta")
    assert deltas >= 1
    assert names == ["message_start", "content_block_start", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"]  # fmt: skip
    data = dict(events)  # the last of each name
    start = data["message_start"]["message"]
    assert start["role"] == "assistant" and start["content"] == [] and start["stop_reason"] is None
    assert data["content_block_start"] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    text = "".join(d["delta"]["text"] for name, d in events if name == "content_block_delta")
    assert all(
        d["delta"]["type"] == "text_delta" and d["index"] == 0 for name, d in events if name == "content_block_delta"
    )
    assert text == whole.content[0].text  # greedy: the same answer
    final = data["message_delta"]
    assert final["delta"] == {"stop_reason": whole.stop_reason, "stop_sequence": None}
    assert final["usage"]["output_tokens"] == whole.usage.output_tokens
    # The client's own stream helper reads the same events into the same message.
    with client.messages.stream(**request) as stream:
        streamed = "".join(stream.text_stream)
        message = stream.get_final_message()
    assert streamed == text and message.content[0].text == text and message.stop_reason == whole.stop_reason
    assert message.usage.output_tokens == whole.usage.output_tokens
    assert message.usage.cache_read_input_tokens + message.usage.input_tokens == start["usage"]["input_tokens"]


def test_stop_sequences_end_the_text_before_them_with_stop_reason_stop_sequence(client):
    request = {"model": MODEL, "max_tokens": 20, "messages": STORY}
    full = client.messages.create(**request).content[0].text
    stop = full[5:8]
    assert len(stop) == 3, full
    message = client.messages.create(**request, stop_sequences=["never-there", stop])
    assert message.content[0].text == full[: full.find(stop)]
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    with client.messages.stream(**request, stop_sequences=[stop]) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].text == message.content[0].text and streamed.stop_sequence == stop


def test_max_tokens_past_the_context_gives_the_room_left_and_says_so(client, engine):
    content = "ab " * 40
    room = (
        engine.model.max_positions
        - client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": content}]).input_tokens
    )
    # Fill the context but for 3 positions (one token per character in the tiny model's tokenizer).
    content += "c" * (room - 3)
    message = client.messages.create(model=MODEL, max_tokens=50, messages=[{"role": "user", "content": content}])
    assert message.usage.output_tokens == 3 and message.stop_reason == "model_context_window_exceeded"


TOOL_REQUEST = {
    "model": MODEL,
    "max_tokens": 150,
    "messages": STORY,
    "tools": [WEATHER, NOW],
    "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
}


def test_a_tool_use_round_trip_with_the_anthropic_client(client):
    message = client.messages.create(**TOOL_REQUEST)
    assert message.stop_reason == "tool_use", message
    (call,) = message.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    arguments = call.input  # valid under the schema: the answer was constrained to it
    assert set(arguments) == {"city", "days"} and isinstance(arguments["city"], str) and len(arguments["city"]) <= 8
    assert isinstance(arguments["days"], int) and 1 <= arguments["days"] <= 7
    # Streamed: one tool_use block whose input_json_delta pieces join to the same input (greedy).
    with client.messages.stream(**TOOL_REQUEST) as stream:
        kinds = [event.delta.type for event in stream if event.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert set(kinds) == {"input_json_delta"} and streamed.stop_reason == "tool_use"
    (streamed_call,) = streamed.content
    assert (streamed_call.name, streamed_call.input) == (call.name, call.input)
    # The tool's result goes back; the answer is text (tool_choice "none": nothing more may be called).
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"}
    turn = [*STORY, {"role": "assistant", "content": message.content}, {"role": "user", "content": [result]}]
    reply = client.messages.create(
        **TOOL_REQUEST | {"messages": turn, "max_tokens": 8, "tool_choice": {"type": "none"}}
    )
    assert [block.type for block in reply.content] == ["text"] and reply.stop_reason in ("end_turn", "max_tokens")

    # The result is in the prompt the model read: 5 more characters of it are 5 more tokens (one per character).
    def prompt_tokens(content: str) -> int:
        messages = [*turn[:-1], {"role": "user", "content": [result | {"content": content}]}]
        return client.messages.count_tokens(model=MODEL, messages=messages, tools=[WEATHER, NOW]).input_tokens

    assert prompt_tokens("sunny, 21 C, dry") - prompt_tokens("sunny, 21 C") == len(", dry")


def test_a_client_leaving_mid_stream_cancels_the_generation(server):
    before = httpx.get(f"{server}/health").json()
    request = {"model": MODEL, "max_tokens": 2000, "messages": STORY, "stream": True}
    with httpx.stream("POST", f"{server}/v1/messages", json=request, timeout=60) as response:
        lines = response.iter_lines()
        assert any(line == "event: content_block_delta" for line, _ in zip(lines, range(20), strict=False))
    deadline = time.monotonic() + 20  # the generation stops long before its 2,000 tokens
    while (status := httpx.get(f"{server}/health").json())["running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert status["running"] == 0 and status["cancelled"] == before["cancelled"] + 1
    assert status["completed"] == before["completed"]


# --- refusals, in Anthropic's error shape ----------------------------------------------------------------------
def user(content) -> list[dict]:
    return [{"role": "user", "content": content}]


CALLED = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "now", "input": {}}]}
BASE = {"model": MODEL, "max_tokens": 4, "messages": STORY}
BAD_REQUESTS = {
    "malformed-json": (b'{"model": "tiny-chat0",', 400, "not valid JSON"),
    "model-missing": ({"max_tokens": 4, "messages": STORY}, 400, "'model'"),
    "model-unknown": (BASE | {"model": "claude-opus-4"}, 404, "claude-opus-4"),
    "max-tokens-missing": ({"model": MODEL, "messages": STORY}, 400, "'max_tokens' is required"),
    "max-tokens-zero": (BASE | {"max_tokens": 0}, 400, "'max_tokens'"),
    "messages-empty": (BASE | {"messages": []}, 400, "'messages'"),
    "role-system": (BASE | {"messages": [{"role": "system", "content": "x"}, *STORY]}, 400, "messages[0].role"),
    "first-turn-assistant": (BASE | {"messages": [{"role": "assistant", "content": "Hi"}, *STORY]}, 400,
                             "messages[0].role must be 'user'"),
    "prefill": (BASE | {"messages": [*STORY, {"role": "assistant", "content": "Once"}]}, 400, "messages[1]"),
    "empty-content": (BASE | {"messages": user("")}, 400, "messages[0].content must not be empty"),
    "image-block": (BASE | {"messages": user([{"type": "image", "source": {}}])}, 400,
                    'messages[0].content[0].type "image" is not supported'),
    "unknown-block": (BASE | {"messages": user([{"type": "hologram"}])}, 400, "messages[0].content[0].type"),
    "text-not-a-string": (BASE | {"messages": user([{"type": "text", "text": 3}])}, 400, "messages[0].content[0].text"),
    "tool-use-from-the-user": (BASE | {"messages": user([CALLED["content"][0]])}, 400, "messages[0].content[0]"),
    "tool-result-without-its-call": (
        BASE | {"messages": [*STORY, {"role": "assistant", "content": "ok"},
                             *user([{"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}])]},
        400, "messages[2].content[0].tool_use_id 'toolu_9' matches no tool_use block of the turn before",
    ),
    "tool-use-unanswered": (BASE | {"messages": [*STORY, CALLED, *user("and?")]}, 400, "tool_use ids ['toolu_1']"),
    "stop-sequences-a-string": (BASE | {"stop_sequences": "\n"}, 400, "'stop_sequences' must be a list"),
    "stop-sequences-too-many": (BASE | {"stop_sequences": list("abcde")}, 400, "'stop_sequences'"),
    "temperature-negative": (BASE | {"temperature": -1}, 400, "temperature"),
    "tool-schema-bad": (BASE | {"tools": [WEATHER | {"input_schema": {"type": "nope"}}]}, 400, "tools[0].input_schema"),
    "tool-without-schema": (BASE | {"tools": [{"name": "f"}]}, 400, "tools[0].input_schema"),
    "server-tool": (BASE | {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "tools[0].type"),
    "tool-choice-bad": (BASE | {"tools": [NOW], "tool_choice": {"type": "always"}}, 400, "'tool_choice'"),
    "tool-choice-unknown-tool": (BASE | {"tools": [NOW], "tool_choice": {"type": "tool", "name": "f"}}, 400, "'f'"),
    "thinking": (BASE | {"thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "'thinking'"),
    "prompt-beyond-the-context": (BASE | {"messages": user("x" * 5000)}, 400, "context"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_requests_get_an_anthropic_error_naming_the_field(server, case):
    body, status, message = case
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{server}/v1/messages", content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
    assert error["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert message in error["error"]["message"]


def test_the_anthropic_client_raises_its_own_errors(client, server):
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.messages.create(model=MODEL, max_tokens=0, messages=STORY)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-opus-4", max_tokens=4, messages=STORY)
    response = httpx.get(f"{server}/v1/messages")  # the method: still Anthropic's shape
    assert response.status_code == 405 and response.json()["type"] == "error"


def test_a_full_server_answers_429_rate_limit_error(engine):
    config = ServerConfig(model_id=MODEL, queue_size=0, defaults={"speculative": "none"})  # one generation at a time
    with serving_in_background(OpenAIServer(engine, config).app) as url:
        running = {"model": MODEL, "max_tokens": 2000, "messages": STORY, "stream": True}
        with httpx.stream("POST", f"{url}/v1/messages", json=running, timeout=60) as response:
            assert response.status_code == 200  # its first event is in: it runs
            refused = httpx.post(f"{url}/v1/messages", json=BASE, timeout=60)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"


@pytest.fixture(scope="module")
def keyed_server(engine):
    config = ServerConfig(model_id=MODEL, api_key=API_KEY, defaults={"max_tokens": 2, "speculative": "none"})
    with serving_in_background(OpenAIServer(engine, config).app) as url:
        yield url


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({"x-api-key": API_KEY}, 200),
        ({"Authorization": f"Bearer {API_KEY}"}, 200),
        ({}, 401),
        ({"x-api-key": "sk-wrong"}, 401),
        ({"x-api-key": f"Bearer {API_KEY}"}, 401),
    ],
    ids=["x-api-key", "bearer", "none", "wrong-key", "bearer-in-x-api-key"],
)
def test_with_an_api_key_messages_take_x_api_key_or_bearer(keyed_server, headers, status):
    response = httpx.post(f"{keyed_server}/v1/messages", json=BASE, headers=headers, timeout=60)
    assert response.status_code == status, response.text
    if status == 401:
        assert response.json()["error"]["type"] == "authentication_error"
    # The OpenAI routes take the same headers (the key is the server's, whichever API a client speaks).
    assert httpx.get(f"{keyed_server}/v1/models", headers=headers).status_code == status


def test_the_anthropic_client_authenticates_with_the_api_key(keyed_server):
    good = anthropic.Anthropic(base_url=keyed_server, api_key=API_KEY, max_retries=0, timeout=60)
    assert good.messages.create(model=MODEL, max_tokens=2, messages=STORY).content
    by_header = anthropic.Anthropic(base_url=keyed_server, auth_token=None, api_key=None, max_retries=0,
                                    default_headers={"x-api-key": API_KEY})  # fmt: skip
    assert by_header.messages.create(model=MODEL, max_tokens=2, messages=STORY).content
    bad = anthropic.Anthropic(base_url=keyed_server, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        bad.messages.create(model=MODEL, max_tokens=2, messages=STORY)
    assert caught.value.status_code == 401
