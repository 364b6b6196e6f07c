"""The OpenAI-compatible server, served by uvicorn on a free loopback port and driven with real HTTP clients.

One tiny model is loaded for the module. It is wrapped in `GatedEngine`, which passes everything through to
the real engine but lets a test hold generations at a gate, so a busy GPU worker (and so a full queue) is
reproducible instead of a race.
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn
from support.schemas import PERSON, check_person

from doppler_py.api import load
from doppler_py.server import OpenAIServer, ServerConfig, is_loopback, serve, serving_in_background
from doppler_py.testing.tiny import write_tiny_model

MAX_BODY = 16_384
STORY = [{"role": "user", "content": "Tell me a story."}]  # greedy: no end-of-sequence for > 1,500 tokens


class GatedEngine:
    """The real engine; while `gate` is clear, a generation waits on the worker thread before it starts."""

    def __init__(self, engine):
        self._engine = engine
        self.gate = threading.Event()
        self.gate.set()

    def stream(self, *args, **kwargs):
        assert self.gate.wait(timeout=60), "a test left the gate closed"
        return self._engine.stream(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._engine, name)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp("tiny-chat"))
    with load(folder, weights="f32", progress=False, warmup="now") as engine:
        # The first prompt-lookup generation compiles every verification size and measures this device's costs
        # (load's warmup="now"): done here, so that no request waits for it within the clients' timeouts on a
        # slow or busy machine (it took over 60 s on a loaded 2-core one).
        engine.generate("warm up", max_tokens=2, speculative="prompt-lookup", chat=False)
        yield GatedEngine(engine)


@pytest.fixture(scope="module")
def server(engine):
    config = ServerConfig(queue_size=1, max_body_bytes=MAX_BODY, defaults={"max_tokens": 12, "speculative": "auto"})
    with serving_in_background(OpenAIServer(engine, config).app) as url:
        yield url


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server, timeout=60) as client:
        yield client


def wait_for(client: httpx.Client, condition, timeout: float = 30) -> dict:
    """Poll /health until `condition(status)` holds; return that status."""
    deadline = time.monotonic() + timeout
    while True:
        status = client.get("/health").json()
        if condition(status):
            return status
        assert time.monotonic() < deadline, f"timed out waiting; last status {status}"
        time.sleep(0.02)


def sse_events(response: httpx.Response) -> list:
    """The `data:` payloads of a server-sent event stream, JSON-decoded except the final [DONE]."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def check_figures(body: dict) -> None:
    usage, stats = body["usage"], body["doppler"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens"] > 0 and 0 < usage["completion_tokens"] <= 12
    assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]
    assert stats["speculative"] == "prompt-lookup" and 0 <= stats["accepted"] <= stats["drafted"]
    assert 0 <= stats["acceptance_rate"] <= 1 and stats["tokens_per_s"] > 0
    for key in ("mean_accepted_per_step", "time_saved_s", "elapsed_s"):
        assert key in stats


# --- the happy paths -------------------------------------------------------------------------------------------
def test_models_lists_the_served_model(client):
    listing = client.get("/v1/models").json()
    assert listing["object"] == "list" and [m["id"] for m in listing["data"]] == ["tiny-chat0"]
    assert client.get("/v1/models/tiny-chat0").json()["id"] == "tiny-chat0"
    assert client.get("/v1/models/gpt-4").status_code == 404


def test_completion_returns_text_usage_and_speculation_figures(client):
    response = client.post("/v1/completions", json={"model": "tiny-chat0", "prompt": "Once upon", "max_tokens": 10})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny-chat0"
    (choice,) = body["choices"]
    assert isinstance(choice["text"], str) and choice["finish_reason"] in ("stop", "length")
    check_figures(body)
    assert body["usage"]["prompt_tokens"] == len("Once upon")  # no chat template: one token per character


def test_a_tree_request_gives_the_chain_requests_greedy_text(client, engine):
    body = {"model": "tiny-chat0", "prompt": "abcabdabcabeabcab", "max_tokens": 16, "speculative": "prompt-lookup"}
    texts = []
    for extra in ({"tree": False}, {"tree": True}, {"tree": True, "k": 6}, {"tree": "auto"}):
        response = client.post("/v1/completions", json=body | extra)
        assert response.status_code == 200, response.text
        texts.append(response.json()["choices"][0]["text"])
        if "k" in extra:  # a pinned budget; True's is the policy's k, which may be 1 where wide verifies cost more
            assert engine.last_result.stats["tree_steps"] > 0
    assert len(set(texts)) == 1


def test_chat_completion_renders_the_chat_template(client, engine):
    response = client.post("/v1/chat/completions", json={"messages": STORY, "max_tokens": 8})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    check_figures(body)
    assert body["usage"]["prompt_tokens"] == len(engine.encode_prompt(STORY))


def test_a_chats_next_turn_reports_the_prompt_tokens_it_took_from_the_prefix_cache(client):
    first = client.post("/v1/chat/completions", json={"messages": STORY}).json()
    answer = first["choices"][0]["message"]["content"]
    turn = [*STORY, {"role": "assistant", "content": answer}, {"role": "user", "content": "Go on, please."}]
    second = client.post("/v1/chat/completions", json={"messages": turn}).json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    # At least the first turn's prompt (its answer too, where the template renders it as it was generated).
    assert first["usage"]["prompt_tokens"] <= cached < second["usage"]["prompt_tokens"]


def test_metrics_count_requests_tokens_and_prefix_cache_hits_in_prometheus_text(client):
    def read() -> dict[str, float]:
        response = client.get("/metrics")
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
        samples = [line.rsplit(" ", 1) for line in response.text.splitlines() if not line.startswith("#")]
        return {name: float(value) for name, value in samples}

    completed = wait_for(client, lambda status: status["running"] == 0)["completed"]
    before = read()
    body = client.post("/v1/chat/completions", json={"messages": STORY}).json()
    assert "usage" in body, body
    wait_for(client, lambda status: status["completed"] > completed)  # counted once the worker lets go of the job
    after = read()
    assert (
        after['doppler_requests_total{outcome="completed"}']
        == before['doppler_requests_total{outcome="completed"}'] + 1
    )
    assert (
        after["doppler_completion_tokens_total"] - before["doppler_completion_tokens_total"]
        == body["usage"]["completion_tokens"]
    )
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert after["doppler_cached_prompt_tokens_total"] - before["doppler_cached_prompt_tokens_total"] == cached
    assert after["doppler_prefix_cache_lookups_total"] > before["doppler_prefix_cache_lookups_total"]
    assert after["doppler_prefix_cache_entries"] >= 1 and after["doppler_running"] == 0


def test_streamed_chat_sends_role_pieces_finish_usage_then_done(client):
    request = {"messages": STORY, "max_tokens": 10, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=request) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    *_, finish, usage_only = chunks
    assert finish["choices"][0]["finish_reason"] in ("stop", "length")
    assert usage_only["choices"] == [] and usage_only["usage"] == finish["usage"]
    check_figures(finish)
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    # Greedy: the same request without streaming gives the same text.
    whole = client.post("/v1/chat/completions", json={"messages": STORY, "max_tokens": 10}).json()
    assert streamed == whole["choices"][0]["message"]["content"]


SAMPLED_COMPLETION = {"prompt": "Once upon", "max_tokens": 10, "temperature": 1.0, "top_k": 20}


def test_n_sampled_choices_are_the_answers_of_seed_plus_i(client):
    one = [client.post(DONE, json=SAMPLED_COMPLETION | {"seed": 5 + i}).json() for i in range(2)]
    body = client.post(DONE, json=SAMPLED_COMPLETION | {"seed": 5, "n": 2}).json()
    assert [choice["index"] for choice in body["choices"]] == [0, 1]
    assert [choice["text"] for choice in body["choices"]] == [answer["choices"][0]["text"] for answer in one]
    assert body["choices"][0]["text"] != body["choices"][1]["text"]
    usage = body["usage"]
    assert usage["prompt_tokens"] == one[0]["usage"]["prompt_tokens"]  # the prompt counts once
    assert usage["completion_tokens"] == sum(answer["usage"]["completion_tokens"] for answer in one)
    assert [choice["doppler"]["speculative"] for choice in body["choices"]] == [body["doppler"]["speculative"]] * 2
    # Without a seed each choice draws its own numbers.
    unseeded = client.post(DONE, json=SAMPLED_COMPLETION | {"n": 2}).json()["choices"]
    assert unseeded[0]["text"] != unseeded[1]["text"]


def test_n_choices_stream_each_under_its_index(client):
    request = SAMPLED_COMPLETION | {"seed": 5, "n": 2}
    whole = client.post(DONE, json=request).json()
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", DONE, json=request | stream) as response:
        assert response.status_code == 200
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    *chunks, usage_only = events[:-1]
    assert all(len(chunk["choices"]) == 1 for chunk in chunks)
    for index, choice in enumerate(whole["choices"]):
        mine = [chunk["choices"][0] for chunk in chunks if chunk["choices"][0]["index"] == index]
        assert "".join(piece["text"] for piece in mine) == choice["text"]
        assert [piece["finish_reason"] for piece in mine][-1] == choice["finish_reason"]
        assert all(piece["finish_reason"] is None for piece in mine[:-1])
    assert usage_only["choices"] == [] and usage_only["usage"] == whole["usage"]


def test_n_greedy_choices_are_one_generation_repeated(client):
    completed = wait_for(client, lambda status: status["running"] == 0)["completed"]
    request = {"messages": STORY, "max_tokens": 8, "n": 3}
    body = client.post(CHAT, json=request).json()
    one = client.post(CHAT, json=request | {"n": 1}).json()
    assert [choice["message"]["content"] for choice in body["choices"]] == [one["choices"][0]["message"]["content"]] * 3
    assert body["usage"]["completion_tokens"] == 3 * one["usage"]["completion_tokens"]
    # The n=3 request and the n=1 one ran one generation each.
    assert wait_for(client, lambda status: status["completed"] >= completed + 2)["completed"] == completed + 2


def test_without_max_tokens_a_long_prompt_gets_the_room_left_and_with_it_a_400(client, engine):
    context = engine.model.max_positions
    prompt = "ab" * ((context - 5) // 2)  # no chat template: one token per character, 5 or 6 positions left
    body = client.post(DONE, json={"prompt": prompt}).json()  # the server's default is 12 tokens
    usage = body["usage"]
    assert 1 <= usage["completion_tokens"] <= context - usage["prompt_tokens"] < 12
    assert body["choices"][0]["finish_reason"] in ("length", "stop")
    refused = client.post(DONE, json={"prompt": prompt, "max_tokens": 12})
    assert refused.status_code == 400 and "exceeds the context" in refused.json()["error"]["message"]


def test_streamed_completion_joins_to_the_whole_completion(client):
    request = {"prompt": "The sea", "max_tokens": 12, "temperature": 0}
    with client.stream("POST", "/v1/completions", json=request | {"stream": True}) as response:
        events = sse_events(response)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    streamed = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert streamed == client.post("/v1/completions", json=request).json()["choices"][0]["text"]


def test_the_openai_client_library_works_against_the_server(server):
    openai = pytest.importorskip("openai")
    api = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in api.models.list()] == ["tiny-chat0"]
    reply = api.chat.completions.create(model="tiny-chat0", messages=STORY, max_tokens=6)
    assert reply.usage.completion_tokens <= 6 and reply.choices[0].message.role == "assistant"
    pieces = [
        chunk.choices[0].delta.content or ""
        for chunk in api.chat.completions.create(model="tiny-chat0", messages=STORY, max_tokens=6, stream=True)
        if chunk.choices
    ]
    assert "".join(pieces) == reply.choices[0].message.content
    two = api.chat.completions.create(model="tiny-chat0", messages=STORY, max_tokens=6, n=2, temperature=1, seed=9)
    assert [choice.index for choice in two.choices] == [0, 1]
    with pytest.raises(openai.BadRequestError, match="temperature"):
        api.chat.completions.create(model="tiny-chat0", messages=STORY, temperature=-0.5)


def choice_text(choice: dict) -> str:
    """A choice's text: completion text, chat message content, or a chat chunk's delta content."""
    if "text" in choice:
        return choice["text"]
    return (choice["message"] if "message" in choice else choice["delta"]).get("content") or ""


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_stop_ends_the_text_before_the_stop_string_streamed_or_not(client, path):
    request = {"max_tokens": 20} | ({"messages": STORY} if "chat" in path else {"prompt": "The sea"})
    text = lambda body: choice_text(body["choices"][0])  # noqa: E731
    full = text(client.post(path, json=request).json())
    stop = full[5:8]
    assert len(stop) == 3, full
    for value in (stop, [stop, "never-there"]):
        body = client.post(path, json=request | {"stop": value}).json()
        assert text(body) == full[: full.find(stop)] and body["choices"][0]["finish_reason"] == "stop"
    with client.stream("POST", path, json=request | {"stop": [stop], "stream": True}) as response:
        events = sse_events(response)
    pieces = [choice_text(c["choices"][0]) for c in events[:-1] if c["choices"]]
    assert "".join(pieces) == full[: full.find(stop)] and all(stop not in p for p in pieces)
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


# --- bad requests ----------------------------------------------------------------------------------------------
CHAT = "/v1/chat/completions"
DONE = "/v1/completions"
BAD_REQUESTS = {
    "malformed-json": (DONE, b'{"prompt": "hi",', 400, "not valid JSON"),
    "not-utf8": (DONE, b"\xff\xfe\x00", 400, "not valid JSON"),
    "deeply-nested": (DONE, b"[" * 5000 + b"]" * 5000, 400, "not valid JSON"),
    "array-body": (DONE, b'["hi"]', 400, "JSON object"),
    "prompt-missing": (DONE, {"max_tokens": 3}, 400, "'prompt'"),
    "prompt-empty": (DONE, {"prompt": ""}, 400, "'prompt'"),
    "prompt-token-ids": (DONE, {"prompt": [1, 2, 3]}, 400, "token-id"),
    "messages-empty": (CHAT, {"messages": []}, 400, "'messages'"),
    "messages-not-a-list": (CHAT, {"messages": "hi"}, 400, "'messages'"),
    "message-without-content": (CHAT, {"messages": [{"role": "user"}]}, 400, "content"),
    "message-image-part": (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "text parts",
    ),
    "temperature-negative": (DONE, {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    "temperature-string": (DONE, {"prompt": "hi", "temperature": "hot"}, 400, "'temperature' must be a number"),
    "temperature-nan": (DONE, b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    "top-p-zero": (DONE, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    "top-p-above-one": (DONE, {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    "top-k-negative": (DONE, {"prompt": "hi", "top_k": -1}, 400, "top_k"),
    "max-tokens-zero": (DONE, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    "max-tokens-float": (DONE, {"prompt": "hi", "max_tokens": 2.5}, 400, "'max_tokens' must be an integer"),
    "max-tokens-bool": (DONE, {"prompt": "hi", "max_tokens": True}, 400, "'max_tokens' must be an integer"),
    "max-tokens-beyond-context": (DONE, {"prompt": "hi", "max_tokens": 100_000}, 400, "context"),
    "k-zero": (DONE, {"prompt": "hi", "k": 0}, 400, "'k'"),
    "k-huge": (DONE, {"prompt": "hi", "k": 1000}, 400, "'k'"),
    "speculative-unknown": (DONE, {"prompt": "hi", "speculative": "magic"}, 400, "speculative"),
    "draft-model-without-draft": (DONE, {"prompt": "hi", "speculative": "draft-model"}, 400, "draft"),
    "tree-a-node-budget": (DONE, {"prompt": "hi", "tree": 6}, 400, "the node budget is 'k'"),
    "tree-string": (DONE, {"prompt": "hi", "tree": "yes"}, 400, "'tree'"),
    "tree-with-layer-skip": (DONE, {"prompt": "hi", "tree": True, "speculative": "layer-skip"}, 400, "tree"),
    "stream-not-bool": (DONE, {"prompt": "hi", "stream": "yes"}, 400, "'stream'"),
    "n-zero": (DONE, {"prompt": "hi", "n": 0}, 400, "'n' must be in 1..16"),
    "n-above-the-most": (DONE, {"prompt": "hi", "n": 17}, 400, "'n' must be in 1..16"),
    # queue_size=1 and one worker: two generations at most, and a sampled request runs one per choice.
    "n-beyond-the-server": (DONE, {"prompt": "hi", "n": 3, "temperature": 1.0}, 400, "'n' asks for 3 generations"),
    "best-of": (DONE, {"prompt": "hi", "best_of": 2}, 400, "'best_of' is not supported"),
    "presence-penalty-out-of-range": (DONE, {"prompt": "hi", "presence_penalty": 2.5}, 400, "'presence_penalty'"),
    "frequency-penalty-string": (DONE, {"prompt": "hi", "frequency_penalty": "1"}, 400, "'frequency_penalty'"),
    "repeat-penalty-zero": (DONE, {"prompt": "hi", "repeat_penalty": 0}, 400, "'repeat_penalty'"),
    "logit-bias-key": (DONE, {"prompt": "hi", "logit_bias": {"a": 1}}, 400, "'logit_bias' keys"),
    "logit-bias-out-of-vocab": (DONE, {"prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "below the vocabulary"),
    "logit-bias-value": (DONE, {"prompt": "hi", "logit_bias": {"1": -101}}, 400, "'logit_bias' values"),
    "min-p-above-one": (CHAT, {"messages": STORY, "min_p": 1.5}, 400, "'min_p'"),
    "stop-too-many": (CHAT, {"messages": STORY, "stop": ["a", "b", "c", "d", "e"]}, 400, "'stop'"),
    "stop-not-strings": (DONE, {"prompt": "hi", "stop": [1]}, 400, "'stop'"),
    "unknown-model": (CHAT, {"model": "gpt-4", "messages": STORY}, 404, "gpt-4"),
    "model-not-a-string": (CHAT, {"model": 7, "messages": STORY}, 400, "'model'"),
    "oversize-body": (DONE, {"prompt": "x" * (MAX_BODY + 1)}, 413, "larger than"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_requests_get_a_4xx_with_an_openai_error_body(client, case):
    path, body, status, message = case
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = client.post(path, content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"]


def test_oversize_body_without_content_length_gets_413(client):
    chunks = iter([b'{"prompt": "', b"x" * MAX_BODY, b'"}'])  # a generator body is sent chunked
    response = client.post(DONE, content=chunks)
    assert response.status_code == 413 and "larger than" in response.json()["error"]["message"]


def test_unknown_routes_and_methods_get_json_errors(client):
    assert client.get("/v1/nothing").status_code == 404
    response = client.get(DONE)
    assert response.status_code == 405 and "error" in response.json()


def test_the_server_keeps_serving_after_bad_requests(client):
    for body in (b"{", b"[]", b'{"prompt": 5}'):
        assert client.post(DONE, content=body).status_code == 400
    assert client.post(DONE, json={"prompt": "hi", "max_tokens": 3}).status_code == 200
    assert client.get("/health").json()["failed"] == 0  # no engine failure in any test so far


# --- queueing and cancellation -------------------------------------------------------------------------------------
def test_a_full_queue_answers_429_and_the_waiting_requests_still_complete(client, engine, server):
    # queue_size=1: one generation on the worker plus one waiting fill the server.
    engine.gate.clear()
    try:
        with ThreadPoolExecutor(2) as pool:
            request = {"prompt": "queued", "max_tokens": 4}
            first = pool.submit(httpx.post, f"{server}{DONE}", json=request, timeout=60)
            wait_for(client, lambda s: s["running"] == 1)
            second = pool.submit(httpx.post, f"{server}{DONE}", json=request, timeout=60)
            wait_for(client, lambda s: s["waiting"] == 1)
            rejected = httpx.post(f"{server}{DONE}", json=request, timeout=10)
            assert rejected.status_code == 429 and rejected.headers["retry-after"] == "1"
            assert rejected.json()["error"]["type"] == "rate_limit_error"
            engine.gate.set()
            assert first.result().status_code == 200 and second.result().status_code == 200
    finally:
        engine.gate.set()
    assert client.get("/health").json()["rejected"] >= 1


def test_a_request_abandoned_while_waiting_never_runs(client, engine, server):
    engine.gate.clear()
    try:
        before = client.get("/health").json()["cancelled"]
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(httpx.post, f"{server}{DONE}", json={"prompt": "a", "max_tokens": 2}, timeout=60)
            wait_for(client, lambda s: s["running"] == 1)
            with pytest.raises(httpx.ReadTimeout):  # the client gives up while its request waits
                httpx.post(f"{server}{DONE}", json={"prompt": "b", "max_tokens": 2}, timeout=1.0)
            wait_for(client, lambda s: s["waiting"] == 0)  # the server noticed
            engine.gate.set()
            assert running.result().status_code == 200
        status = wait_for(client, lambda s: s["running"] == 0)
        assert status["cancelled"] == before + 1
    finally:
        engine.gate.set()


def test_disconnecting_mid_stream_cancels_the_generation_and_the_next_request_works(client, server):
    before = client.get("/health").json()
    request = {"messages": STORY, "max_tokens": 2000, "stream": True}
    with httpx.Client(base_url=server, timeout=60) as leaving, leaving.stream("POST", CHAT, json=request) as response:
        lines = response.iter_lines()
        received = [line for line, _ in zip(lines, range(6), strict=False) if line.startswith("data: ")]
        assert len(received) >= 2
    # The client has closed the connection: the generation stops long before its 2,000 tokens.
    status = wait_for(client, lambda s: s["running"] == 0, timeout=20)
    assert status["cancelled"] == before["cancelled"] + 1
    assert status["completed"] == before["completed"]
    response = client.post(CHAT, json={"messages": STORY, "max_tokens": 5})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 5


# --- API key -------------------------------------------------------------------------------------------------------
API_KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def keyed_server(engine):
    config = ServerConfig(api_key=API_KEY, defaults={"max_tokens": 4, "speculative": "none"})
    with serving_in_background(OpenAIServer(engine, config).app) as url:
        yield url


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}, {"Authorization": f"Basic {API_KEY}"}],
    ids=["none", "wrong-key", "no-scheme", "basic"],
)
def test_with_an_api_key_v1_needs_the_bearer_key_and_health_stays_open(keyed_server, headers):
    with httpx.Client(base_url=keyed_server, timeout=60) as client:
        for method, path in (("GET", "/v1/models"), ("POST", CHAT), ("POST", DONE), ("GET", "/v1/models/x")):
            response = client.request(method, path, headers=headers, json={"prompt": "hi"})
            assert response.status_code == 401, (path, response.text)
            error = response.json()["error"]
            assert set(error) >= {"message", "type", "code"} and error["code"] == "invalid_api_key"
        assert client.get("/health").status_code == 200
        good = {"Authorization": f"Bearer {API_KEY}"}
        assert client.get("/v1/models", headers=good).status_code == 200
        assert client.post(DONE, headers=good, json={"prompt": "hi"}).status_code == 200


def test_serving_a_public_address_without_a_key_warns(engine, monkeypatch, capsys):
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: None)
    serve(engine, ServerConfig(host="0.0.0.0"))
    assert "without an API key" in capsys.readouterr().err
    for quiet in (ServerConfig(host="127.0.0.1"), ServerConfig(host="0.0.0.0", api_key="k")):
        serve(engine, quiet)
        assert "warning" not in capsys.readouterr().err
    assert is_loopback("::1") and is_loopback("localhost") and not is_loopback("example.com")


# --- logprobs and stop through the OpenAI client library ------------------------------------------------------------
def test_chat_logprobs_in_openai_shape_streamed_or_not(client, engine):
    request = {"messages": STORY, "max_tokens": 8, "logprobs": True, "top_logprobs": 3}
    body = client.post(CHAT, json=request).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    for item in content:
        assert isinstance(item["token"], str) and item["logprob"] <= 0 and item["bytes"] == list(item["token"].encode())
        assert len(item["top_logprobs"]) == 3 and item["top_logprobs"][0]["logprob"] >= item["logprob"] - 1e-6
    with client.stream("POST", CHAT, json=request | {"stream": True}) as response:
        events = sse_events(response)
    streamed = [
        i
        for e in events[:-1]
        if e["choices"] and e["choices"][0]["logprobs"]
        for i in e["choices"][0]["logprobs"]["content"]
    ]
    assert streamed == content  # greedy: the same entries, spread over the chunks
    assert client.post(CHAT, json={"messages": STORY, "top_logprobs": 2}).status_code == 400


def test_completion_logprobs_in_openai_shape(client):
    body = client.post(DONE, json={"prompt": "The sea", "max_tokens": 6, "logprobs": 2}).json()
    logprobs = body["choices"][0]["logprobs"]
    n = body["usage"]["completion_tokens"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == n
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"]) and logprobs["text_offset"][0] == 0
    assert logprobs["text_offset"] == [sum(map(len, logprobs["tokens"][:i])) for i in range(n)]
    with client.stream("POST", DONE, json={"prompt": "The sea", "max_tokens": 6, "logprobs": 2, "stream": True}) as r:
        chunks = [e["choices"][0]["logprobs"] for e in sse_events(r)[:-1] if e["choices"][0]["logprobs"]]
    assert [t for c in chunks for t in c["tokens"]] == logprobs["tokens"]
    assert [o for c in chunks for o in c["text_offset"]] == logprobs["text_offset"]  # offsets run on
    assert client.post(DONE, json={"prompt": "hi", "logprobs": 21}).status_code == 400


def test_the_openai_client_sends_stop_and_logprobs(server):
    openai = pytest.importorskip("openai")
    api = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    full = api.chat.completions.create(model="tiny-chat0", messages=STORY, max_tokens=16).choices[0].message.content
    stop = full[4:7]
    reply = api.chat.completions.create(
        model="tiny-chat0", messages=STORY, max_tokens=16, stop=[stop], logprobs=True, top_logprobs=2
    )
    (choice,) = reply.choices
    assert choice.message.content == full[: full.find(stop)] and choice.finish_reason == "stop"
    assert len(choice.logprobs.content) == reply.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in choice.logprobs.content)
    chunks = list(
        api.chat.completions.create(
            model="tiny-chat0", messages=STORY, max_tokens=16, stop=stop, logprobs=True, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    tokens = [t.token for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert tokens == [t.token for t in choice.logprobs.content]
    completion = api.completions.create(model="tiny-chat0", prompt="The sea", max_tokens=5, logprobs=2)
    assert len(completion.choices[0].logprobs.tokens) == completion.usage.completion_tokens


def test_the_openai_client_authenticates_with_the_api_key(keyed_server):
    openai = pytest.importorskip("openai")
    good = openai.OpenAI(base_url=f"{keyed_server}/v1", api_key=API_KEY, max_retries=0)
    assert [m.id for m in good.models.list()] == ["tiny-chat0"]
    assert good.chat.completions.create(model="tiny-chat0", messages=STORY, max_tokens=2).choices
    bad = openai.OpenAI(base_url=f"{keyed_server}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        bad.models.list()
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"


# --- structured output and tool calls -------------------------------------------------------------------------------
# A seeded sampled request, plainly decoded: the constraint must hold whatever is sampled.
SAMPLED = {"temperature": 1.0, "seed": 3, "speculative": "none", "max_tokens": 200}


@pytest.mark.parametrize("path", [CHAT, DONE])
def test_response_format_json_schema_gives_json_valid_under_the_schema(client, path):
    prompt = {"messages": STORY} if path == CHAT else {"prompt": "A person:"}
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    body = client.post(path, json=prompt | SAMPLED | {"response_format": response_format}).json()
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "stop", body
    check_person(json.loads(choice_text(choice)))


def test_response_format_json_object_and_regex(client):
    body = client.post(CHAT, json={"messages": STORY, "response_format": {"type": "json_object"}} | SAMPLED).json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(choice_text(body["choices"][0])), dict)
    request = {"prompt": "Code:", "regex": "[a-z]{3}-[0-9]{2}", "max_tokens": 20}
    text = client.post(DONE, json=request).json()["choices"][0]["text"]
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", text), text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format.json_schema.schema"),
        ({"regex": "[a-"}, "regex"),
        ({"grammar": "start: undefined_rule"}, "grammar"),
        ({"regex": "a", "grammar": "start: \"a\""}, "regex"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
         "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "always"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "regex": "a"}, "tools"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repeat_penalty": -1}, "repeat_penalty"),
        ({"logit_bias": {"5": "x"}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"min_p": -0.5}, "min_p"),
    ],
)  # fmt: skip
def test_bad_constraints_and_tools_get_400_naming_the_field(client, extra, param):
    response = client.post(CHAT, json={"messages": STORY} | extra)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_penalties_bias_and_min_p_are_honoured(client):
    """A bias of +100 forces its token at every step (greedy), beside a penalty against repeating it and min_p;
    the log-probs report the biased distribution (the forced token near-certain)."""
    request = {"prompt": "hi", "max_tokens": 3, "logit_bias": {"28": 100}, "frequency_penalty": 0.5, "min_p": 0.1}
    for extra in ({}, {"repeat_penalty": 1.3, "presence_penalty": 1.0}):
        body = client.post(DONE, json=request | extra | {"logprobs": 0}).json()
        logprobs = body["choices"][0]["logprobs"]
        assert len(set(logprobs["tokens"])) == 1 and len(logprobs["tokens"]) == 3, body
        assert all(lp > -1e-3 for lp in logprobs["token_logprobs"]), body


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city over the next days",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}  # fmt: skip
NOW = {"type": "function", "function": {"name": "now", "description": "The time"}}
TOOLS = {"messages": STORY, "tools": [WEATHER, NOW], "parallel_tool_calls": False, "max_tokens": 150}


def check_weather_arguments(arguments: str) -> None:
    value = json.loads(arguments)
    assert set(value) == {"city", "days"} and isinstance(value["city"], str) and len(value["city"]) <= 8
    assert isinstance(value["days"], int) and 1 <= value["days"] <= 7


@pytest.mark.parametrize(
    ("choice", "name"), [("required", None), ({"type": "function", "function": {"name": "get_weather"}}, "get_weather")]
)
def test_forced_tool_calls_follow_the_parameter_schema_streamed_or_not(client, choice, name):
    body = client.post(CHAT, json=TOOLS | {"tool_choice": choice}).json()
    (choice_,) = body["choices"]
    message = choice_["message"]
    assert choice_["finish_reason"] == "tool_calls" and message["content"] is None, body
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] in ({name} if name else {"get_weather", "now"})
    if call["function"]["name"] == "get_weather":
        check_weather_arguments(call["function"]["arguments"])
    else:
        assert json.loads(call["function"]["arguments"]) == {}
    with client.stream("POST", CHAT, json=TOOLS | {"tool_choice": choice, "stream": True}) as response:
        events = sse_events(response)
    deltas = [c["choices"][0]["delta"] for c in events[:-1] if c["choices"]]
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    first, *rest = calls
    assert first["id"].startswith("call_") and first["type"] == "function" and first["index"] == 0
    assert first["function"]["name"] == call["function"]["name"] and rest
    assert all(set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"} for tc in rest)
    assert "".join(tc["function"]["arguments"] for tc in calls) == call["function"]["arguments"]  # greedy
    assert not any(d.get("content") for d in deltas)
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_the_openai_client_reads_tool_calls(server):
    openai = pytest.importorskip("openai")
    api = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    request = dict(
        model="tiny-chat0", messages=STORY, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False
    )
    reply = api.chat.completions.create(**request, max_tokens=150)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and reply.choices[0].finish_reason == "tool_calls"
    check_weather_arguments(call.function.arguments)
    # Streamed: the client's deltas carry the call's id and name once, then pieces of the same arguments.
    names, arguments, finish = [], "", None
    for chunk in api.chat.completions.create(**request, max_tokens=150, stream=True):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        for delta_call in choice.delta.tool_calls or []:
            names += [delta_call.function.name] if delta_call.function.name else []
            arguments += delta_call.function.arguments or ""
        finish = choice.finish_reason or finish
    assert names == ["get_weather"] and finish == "tool_calls" and arguments == call.function.arguments
    # response_format with a JSON schema, through the client's own parameter.
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    person = api.chat.completions.create(
        model="tiny-chat0",
        messages=STORY,
        response_format=response_format,
        extra_body={"speculative": "none"},
        temperature=1.0,
        seed=3,
        max_tokens=200,
    )
    assert person.choices[0].finish_reason == "stop"
    check_person(json.loads(person.choices[0].message.content))


def test_tool_choice_none_answers_in_text_and_history_with_tool_results_is_accepted(client):
    plain = client.post(CHAT, json={"messages": STORY, "max_tokens": 8}).json()["choices"][0]["message"]
    body = client.post(CHAT, json=TOOLS | {"tool_choice": "none", "max_tokens": 8}).json()
    message = body["choices"][0]["message"]
    assert message == plain and "tool_calls" not in message  # the tools are neither shown nor callable
    call = {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}
    history = [*STORY, {"role": "assistant", "content": None, "tool_calls": [call]}]
    history.append({"role": "tool", "tool_call_id": "call_1", "content": "12:00"})
    response = client.post(CHAT, json={"messages": history, "tools": [NOW], "max_tokens": 6})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    missing_id = [*STORY, {"role": "tool", "content": "12:00"}]
    assert client.post(CHAT, json={"messages": missing_id}).json()["error"]["param"] == "messages[1].tool_call_id"
