"""LoRA adapters on the server (server/adapters_route.py): a request picks one by `model` ("<id>:<name>") or the field
`adapter`; two clients with different adapters at once each get what their adapter answers alone; adapters are added
and removed on the running server (with --lora-admin only); unknown names are 400s naming them. The adapters'
outputs themselves are held to PEFT in tests/model/test_lora.py."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from support.lora import make_adapter

from doppler_py.api import load
from doppler_py.server import OpenAIServer, ServerConfig, serving_in_background
from doppler_py.testing.tiny import write_tiny_model

pytest.importorskip("peft")  # the adapters are made by peft (on torch)

PROMPT = "hello world, hello"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = write_tiny_model(tmp_path_factory.mktemp("tiny-lora-server"))
    out = tmp_path_factory.mktemp("adapters")
    return base, make_adapter(base, out / "a", seed=1), make_adapter(base, out / "b", rank=2, seed=2)


@pytest.fixture(scope="module")
def engine(folders):
    base, a, _ = folders
    with load(base, weights="f32", progress=False, parallel=2, lora={"a": a}) as engine:
        yield engine


def completion(client: httpx.Client, **fields) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0} | fields
    return client.post("/v1/completions", json=body)


@pytest.fixture(scope="module")
def url(engine):
    config = ServerConfig(model_id="tiny", adapter_admin=True, defaults={"speculative": None})
    with serving_in_background(OpenAIServer(engine, config).app) as url:
        yield url


def test_two_adapters_and_the_base_answer_together_as_each_alone(url, engine, folders):
    _, _, b = folders
    with httpx.Client(base_url=url, timeout=120) as client:
        added = client.post("/v1/adapters", json={"name": "b", "path": str(b)})
        assert added.status_code == 201 and added.json()["rank"] == 2
        try:
            assert {m["id"] for m in client.get("/v1/models").json()["data"]} == {"tiny", "tiny:a", "tiny:b"}
            assert client.get("/v1/models/tiny:b").json()["parent"] == "tiny"
            alone = {
                name: engine.generate(PROMPT, max_tokens=8, speculative=None, chat=False, adapter=name).text
                for name in ("a", "b", None)
            }
            assert len(set(alone.values())) == 3, "the adapters do not change the answer: the test could not fail"
            requests = [{"model": "tiny:a"}, {"adapter": "b"}, {}]
            with ThreadPoolExecutor(3) as pool:
                answers = list(pool.map(lambda fields: completion(client, **fields), requests))
            assert [a.status_code for a in answers] == [200, 200, 200]
            assert [a.json()["choices"][0]["text"] for a in answers] == [alone["a"], alone["b"], alone[None]]
        finally:
            assert client.delete("/v1/adapters/b").json()["deleted"] is True
        assert client.delete("/v1/adapters/b").status_code == 404
        assert [card["id"] for card in client.get("/v1/adapters").json()["data"]] == ["a"]


def test_unknown_adapters_are_400s_naming_them(url):
    with httpx.Client(base_url=url, timeout=60) as client:
        for fields, param in (({"model": "tiny:zzz"}, "model"), ({"adapter": "zzz"}, "adapter")):
            answer = completion(client, **fields)
            assert answer.status_code == 400
            error = answer.json()["error"]
            assert "'zzz'" in error["message"] and error["param"] == param
        assert completion(client, model="tiny:a", adapter="b").status_code == 400  # two different adapters
        added = client.post("/v1/adapters", json={"name": "c", "path": "/no/such/folder"})
        assert added.status_code == 400 and "no such file" in added.json()["error"]["message"]


def test_without_lora_admin_adapters_cannot_be_added_or_removed(engine, folders):
    config = ServerConfig(model_id="tiny", defaults={"speculative": None})
    with serving_in_background(OpenAIServer(engine, config).app) as url, httpx.Client(base_url=url) as client:
        assert client.post("/v1/adapters", json={"name": "x", "path": str(folders[2])}).status_code == 403
        assert client.delete("/v1/adapters/a").status_code == 403
        assert [card["id"] for card in client.get("/v1/adapters").json()["data"]] == ["a"]


def test_anthropic_messages_pick_adapters_as_the_openai_routes_do(url, engine):
    """/v1/messages: "model": "<id>:<name>" (or the field `adapter`) answers as that adapter alone; an unknown adapter
    is a 400 in Anthropic's error shape, naming it."""
    messages = [{"role": "user", "content": PROMPT}]
    alone = {name: engine.generate(messages, max_tokens=8, speculative=None, adapter=name).text for name in ("a", None)}
    assert alone["a"] != alone[None], "the adapter does not change the answer: the test could not fail"
    with httpx.Client(base_url=url, timeout=120) as client:
        for fields, name in (({"model": "tiny:a"}, "a"), ({"model": "tiny", "adapter": "a"}, "a"), ({}, None)):
            body = {"model": "tiny", "max_tokens": 8, "temperature": 0, "messages": messages} | fields
            answer = client.post("/v1/messages", json=body)
            assert answer.status_code == 200, answer.text
            assert answer.json()["content"][0]["text"] == alone[name]
        refused = client.post("/v1/messages", json={"model": "tiny:zzz", "max_tokens": 8, "messages": messages})
        assert refused.status_code == 400
        error = refused.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert "'zzz'" in error["error"]["message"]
