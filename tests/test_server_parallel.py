"""The server with `--parallel`: concurrent generations decode together (their steps share forwards) and every
answer is the one the same request gets alone, under a soak of many clients with mixed parameters and
cancellations, with a KV budget that holds the caches of about two of the four generations that may run (the
others wait for room); GPU buffers and the budget return to their baseline; /metrics reports the batches."""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from reliability.helpers import buffer_use
from test_server import wait_for

from doppler_py.api import load
from doppler_py.server import OpenAIServer, ServerConfig, serving_in_background
from doppler_py.speculative.kv_budget import KVBudget
from doppler_py.testing.tiny import write_tiny_model

PARALLEL = 4
CLIENTS = 8
SOAK_REQUESTS = 200
PROMPTS = ["the cat sat on the mat. the cat sat", "one two three one two", "a", "hello there, hello there, hel"]
# Mixed parameters: greedy and seeded sampling, plain and speculative (host and GPU drafts, chains and trees), stop
# strings, lengths, a constraint.
OPTIONS = [
    {"max_tokens": 12, "speculative": "none"},
    {"max_tokens": 16, "speculative": "prompt-lookup", "k": 3},
    {"max_tokens": 10, "temperature": 0.9, "top_k": 20, "seed": 3, "speculative": "none"},
    {"max_tokens": 14, "temperature": 0.7, "seed": 11, "speculative": "prompt-lookup"},
    {"max_tokens": 20, "stop": ["e"], "speculative": "auto"},
    # A constraint (each step's rows masked in the batch) and log-probs (read from the batch's moved rows).
    {"max_tokens": 12, "regex": "[a-e ]{3,10}!", "speculative": "prompt-lookup", "logprobs": 2},
    # Drafts on the GPU from the target's own layers, and token trees, inside the batch too.
    {"max_tokens": 12, "speculative": "layer-skip", "k": 2},
    {"max_tokens": 12, "speculative": "prompt-lookup", "tree": True, "k": 3},
]
DONE = "/v1/completions"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-parallel"))


@pytest.fixture(scope="module")
def solo(folder):
    """Each (prompt, options) pair's answer (its whole choice: text, log-probs, finish reason) from a server that
    runs one generation at a time."""
    with (
        load(folder, weights="f32", progress=False, warmup="now", kv_cache_mb=0) as engine,
        serving_in_background(OpenAIServer(engine, ServerConfig()).app) as url,
    ):
        return {(p, o): answer(url, p, o) for p in range(len(PROMPTS)) for o in range(len(OPTIONS))}


@pytest.fixture(scope="module")
def server(folder):
    # No prefix cache, so the soak's buffer count has a fixed baseline.
    with load(folder, weights="f32", progress=False, warmup="background", kv_cache_mb=0, parallel=PARALLEL) as engine:
        # In bytes: kv_budget_mb counts MiB, which would hold hundreds of this tiny model's caches.
        engine.kv_budget = KVBudget(engine.model.cache_bytes(128))
        config = ServerConfig(queue_size=CLIENTS)
        with serving_in_background(OpenAIServer(engine, config).app) as url:
            yield url, engine


def answer(url: str, p: int, o: int) -> dict:
    response = httpx.post(f"{url}{DONE}", json={"prompt": PROMPTS[p], **OPTIONS[o]}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def streamed(url: str, p: int, o: int, *, cancel: bool = False) -> str | None:
    """The streamed answer's text, or None for a client that gave up after its first piece (`cancel`)."""
    text = ""
    body = {"prompt": PROMPTS[p], **OPTIONS[o], "stream": True}
    with httpx.stream("POST", f"{url}{DONE}", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                if cancel:
                    return None  # closing the stream disconnects mid-generation
                text += json.loads(line.removeprefix("data: "))["choices"][0]["text"]
    return text


def complete(url: str, p: int, o: int, *, stream: bool = False, cancel: bool = False) -> str | None:
    """The answer's text (None: a client that cancelled)."""
    return streamed(url, p, o, cancel=cancel) if stream or cancel else answer(url, p, o)["text"]


def test_concurrent_answers_equal_the_solo_ones_and_share_forwards(server, solo):
    url, engine = server
    pairs = [(p, o) for p in range(len(PROMPTS)) for o in range(len(OPTIONS))]
    with ThreadPoolExecutor(CLIENTS) as pool:
        answers = list(pool.map(lambda pair: answer(url, *pair), pairs))
        texts = list(pool.map(lambda pair: streamed(url, *pair), pairs))
    assert dict(zip(pairs, answers, strict=True)) == solo  # texts, log-probs and finish reasons
    assert texts == [solo[pair]["text"] for pair in pairs]
    sizes = engine.batch.sizes
    assert max(sizes) > 1, sizes
    metrics = httpx.get(f"{url}/metrics").text
    assert re.search(r'^doppler_batch_steps_bucket\{le="\+Inf"\} [1-9]', metrics, re.M), metrics
    assert re.search(r"^doppler_parallel 4$", metrics, re.M)
    assert re.search(r"^doppler_kv_budget_bytes [1-9]", metrics, re.M) and "doppler_kv_waited_total" in metrics
    assert re.search(r"^doppler_batch_shared_attention_total [1-9]", metrics, re.M), metrics


def test_a_soak_of_mixed_requests_with_cancellations(server, solo):
    url, engine = server
    pairs = [(p, o) for p in range(len(PROMPTS)) for o in range(len(OPTIONS))]
    # Every option at full concurrency first: the engines each mode leases exist before the baseline.
    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(lambda i: complete(url, i % len(PROMPTS), i // CLIENTS), range(CLIENTS * len(OPTIONS))))
    baseline = buffer_use()
    draw = random.Random(20261206)
    plan = [(*draw.choice(pairs), draw.random() < 0.3, draw.random() < 0.15) for _ in range(SOAK_REQUESTS)]
    with ThreadPoolExecutor(CLIENTS) as pool:
        answers = list(pool.map(lambda req: complete(url, req[0], req[1], stream=req[2], cancel=req[3]), plan))
    completed = [(req, text) for req, text in zip(plan, answers, strict=True) if text is not None]
    assert len(completed) > SOAK_REQUESTS // 2
    assert all(text == solo[req[:2]]["text"] for req, text in completed)
    with httpx.Client(base_url=url, timeout=60) as client:
        status = wait_for(client, lambda s: s["running"] == 0 and s["waiting"] == 0)
    assert status["failed"] == 0 and status["rejected"] == 0, status
    assert status["running"] == 0 and engine.batch.members == 0
    assert buffer_use() == baseline
    assert engine.kv_budget.waited > 0, "no generation ever waited for KV memory"
    assert status["kv_reserved_mb"] == 0 and status["kv_waiting"] == 0
    assert engine.batch.arena.used_blocks == 0 and not engine.batch.arena.slabs  # every block given back
    metrics = httpx.get(f"{url}/metrics").text
    assert re.search(r"^doppler_kv_arena_blocks 0$", metrics, re.M) and engine.batch.paged_forwards > 0


def test_n_choices_decode_together_and_take_the_first_ones_prompt_from_the_prefix_cache(folder):
    request = {"prompt": "three choices of one prompt, please", "max_tokens": 12, "temperature": 0.9, "seed": 40}
    with (
        load(folder, weights="f32", progress=False, warmup="now", parallel=2) as engine,
        serving_in_background(OpenAIServer(engine, ServerConfig(queue_size=2)).app) as url,
    ):
        body = httpx.post(f"{url}{DONE}", json=request | {"n": 3}, timeout=120).json()
        hits = engine.prefix_cache.hits
        shared = max(engine.batch.sizes)
        alone = [httpx.post(f"{url}{DONE}", json=request | {"seed": 40 + i}, timeout=120).json() for i in range(3)]
    assert [choice["text"] for choice in body["choices"]] == [answer["choices"][0]["text"] for answer in alone]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # choice 0 prefilled the prompt
    # Choice 1 waited for that prefill, so it and choice 2 (queued behind the two workers) took the prompt's K/V from
    # the prefix cache.
    assert hits == 2
    assert shared > 1  # the choices' steps shared forwards
