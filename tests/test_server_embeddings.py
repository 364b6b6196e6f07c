"""`POST /v1/embeddings`, driven with OpenAI's own client over HTTP, on a tiny Qwen3 laid out as Qwen3-Embedding (the
vectors themselves are held to sentence-transformers in test_embeddings.py)."""

from __future__ import annotations

import base64
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from support.embedding_models import QWEN3, qwen3_embedding_folder

from doppler_py.api import load
from doppler_py.server import OpenAIServer, ServerConfig, serving_in_background

openai = pytest.importorskip("openai")
TEXTS = ["a", "hello world", "the quick brown fox jumps over the lazy dog, " * 3]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = qwen3_embedding_folder(tmp_path_factory.mktemp("qwen3-embedding"))
    with load(folder, weights="f32", progress=False) as engine:
        yield engine


@pytest.fixture(scope="module")
def server(engine):
    with serving_in_background(
        OpenAIServer(engine, ServerConfig(model_id="tiny-embed", defaults={"speculative": None})).app
    ) as url:
        yield url


@pytest.fixture(scope="module")
def api(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def test_the_openai_client_gets_the_engines_vectors_and_usage(api, engine):
    expected = engine.embeddings(TEXTS)
    for encoding_format in ("float", "base64"):
        answer = api.embeddings.create(model="tiny-embed", input=TEXTS, encoding_format=encoding_format)
        assert answer.model == "tiny-embed" and answer.object == "list"
        assert [d.index for d in answer.data] == [0, 1, 2]
        vectors = [d.embedding for d in answer.data]
        if encoding_format == "base64":  # asked for by name, the client hands the strings over as they came
            vectors = [np.frombuffer(base64.b64decode(v), "<f4") for v in vectors]
        np.testing.assert_array_equal(np.asarray(vectors, np.float32), expected.vectors)
        assert answer.usage.prompt_tokens == answer.usage.total_tokens == expected.prompt_tokens


def test_the_clients_default_base64_and_a_single_string(api, engine):
    answer = api.embeddings.create(model="tiny-embed", input="hello world")  # the client asks for base64, decodes it
    assert len(answer.data) == 1
    np.testing.assert_array_equal(
        np.asarray(answer.data[0].embedding, np.float32), engine.embeddings("hello world").vectors[0]
    )


def test_token_arrays_dimensions_and_a_named_prompt(api, engine):
    tokens = [[5, 6, 7], [9]]
    answer = api.embeddings.create(model="tiny-embed", input=tokens, dimensions=16, encoding_format="float")
    vectors = np.asarray([d.embedding for d in answer.data], np.float32)
    np.testing.assert_array_equal(vectors, engine.embeddings(tokens, dimensions=16).vectors)
    assert vectors.shape == (2, 16) and answer.usage.prompt_tokens == 4
    single = api.embeddings.create(model="tiny-embed", input=[5, 6, 7], encoding_format="float")
    np.testing.assert_array_equal(
        np.asarray(single.data[0].embedding, np.float32), engine.embeddings([5, 6, 7]).vectors[0]
    )
    query = api.embeddings.create(
        model="tiny-embed", input="hello", encoding_format="float", extra_body={"prompt_name": "query"}
    )
    expected = engine.embeddings("hello", prompt_name="query").vectors[0]
    np.testing.assert_array_equal(np.asarray(query.data[0].embedding, np.float32), expected)


def test_base64_is_little_endian_float32_over_raw_http(server, engine):
    body = httpx.post(f"{server}/v1/embeddings", json={"input": ["hi"], "encoding_format": "base64"}, timeout=60).json()
    raw = base64.b64decode(body["data"][0]["embedding"])
    assert len(raw) == 4 * QWEN3.hidden_size
    np.testing.assert_array_equal(np.frombuffer(raw, "<f4"), engine.embeddings("hi").vectors[0])


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"input": []}, "input", "empty"),
        ({"input": ""}, "input", "empty string"),
        ({"input": ["fine", ""]}, "input", "input[1]"),
        ({}, "input", "required"),
        ({"input": [[1, QWEN3.vocab_size]]}, "input", "outside the vocabulary"),
        ({"input": "x" * 250}, "input", "past the context"),
        ({"input": {"text": "hi"}}, "input", "must be"),
        ({"input": "hi", "dimensions": 0}, "dimensions", "1..64"),
        ({"input": "hi", "dimensions": 65}, "dimensions", "1..64"),
        ({"input": "hi", "dimensions": "8"}, "dimensions", "whole number"),
        ({"input": "hi", "encoding_format": "hex"}, "encoding_format", "float, base64"),
        ({"input": "hi", "prompt_name": "passage"}, "prompt_name", "query"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(server, body, param, says):
    response = httpx.post(f"{server}/v1/embeddings", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"]


def test_another_models_name_is_a_404(api):
    with pytest.raises(openai.NotFoundError):
        api.embeddings.create(model="text-embedding-3-small", input="hi")


def test_embeddings_beside_a_generation_are_each_as_alone(api, engine):
    """The GPU is shared: an embedding request while a completion generates gets the vectors it gets alone, and the
    completion the text it gets alone."""
    alone_text = api.completions.create(model="tiny-embed", prompt="abc", max_tokens=24, temperature=0).choices[0].text
    alone = engine.embeddings(TEXTS).vectors
    with ThreadPoolExecutor(2) as pool:
        text = pool.submit(
            lambda: api.completions.create(model="tiny-embed", prompt="abc", max_tokens=24, temperature=0)
        )
        vectors = [
            pool.submit(lambda: api.embeddings.create(model="tiny-embed", input=TEXTS, encoding_format="float"))
            for _ in range(3)
        ]
        assert text.result().choices[0].text == alone_text
        for answer in vectors:
            got = np.asarray([d.embedding for d in answer.result().data], np.float32)
            np.testing.assert_array_equal(got, alone)


def test_embeddings_and_rerank_are_admitted_beside_generations_and_get_429_when_full(engine, monkeypatch):
    """queue_size=0, one generation at a time: an embeddings call that runs fills the server, so another embeddings
    request, a rerank and a completion each get 429 (rate_limit_error, Retry-After); once it is done, the server
    admits again."""
    running, release = threading.Event(), threading.Event()
    embeddings = engine.embeddings

    def held(*args, **kwargs):  # the first call holds the server until the test releases it
        running.set()
        release.wait(60)
        return embeddings(*args, **kwargs)

    monkeypatch.setattr(engine, "embeddings", held)
    config = ServerConfig(model_id="tiny-embed", queue_size=0, defaults={"speculative": None})
    with serving_in_background(OpenAIServer(engine, config).app) as url, ThreadPoolExecutor(1) as pool:
        try:
            first = pool.submit(httpx.post, f"{url}/v1/embeddings", json={"input": "held"}, timeout=60)
            assert running.wait(60)
            for route, body in (
                ("/v1/embeddings", {"input": "hi"}),
                ("/v1/rerank", {"query": "where?", "documents": ["here"]}),
                ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
            ):
                refused = httpx.post(f"{url}{route}", json=body, timeout=60)
                assert refused.status_code == 429 and refused.headers["retry-after"] == "1", route
                assert refused.json()["error"]["type"] == "rate_limit_error"
            health = httpx.get(f"{url}/health", timeout=60).json()
            assert health["running"] == 1 and health["rejected"] == 3
        finally:
            release.set()
        assert first.result().status_code == 200
        assert httpx.post(f"{url}/v1/embeddings", json={"input": "hi"}, timeout=60).status_code == 200
        assert httpx.get(f"{url}/health", timeout=60).json()["completed"] == 2
