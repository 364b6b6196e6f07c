"""An OpenAI-compatible HTTP server over one `Engine` (Starlette app, served by uvicorn).

    doppler-py serve --model smollm2-135m-instruct --port 8000
    curl http://127.0.0.1:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

Endpoints: GET /v1/models, GET /v1/models/{id}, POST /v1/completions, POST /v1/chat/completions (both with
`"stream": true` for server-sent events in OpenAI's chunk format, ending with `data: [DONE]`), GET /health and GET
/metrics (Prometheus text).
Every response carries `usage` and a `doppler` object with the speculation figures of the generation.

`stop` (a string or up to 4) ends the text before the first stop string, with finish_reason "stop"; streamed
text never shows it. Extra request fields: `top_k`, `seed`, `speculative` ("auto", "none" or a drafter's name from
`speculative.registry.DRAFTERS`), `k` (pinned draft length) and
`tree` (true, false or "auto": token trees of lookup, draft-model, EAGLE or Medusa drafts, `k` nodes each,
`Engine.stream`'s `tree`).
Options a request leaves out take the server's defaults (the `serve` command's flags); without `max_tokens` a
prompt that leaves less room in the context than the default gets the room there is (finish_reason "length"), as
OpenAI's API does, where a request's own `max_tokens` that does not fit is refused (400). Features that would
silently change results (`best_of`, penalties, `logit_bias`, legacy `functions`) are refused with 400 rather than
ignored.

`n` (1..16) asks for several choices, each a generation of its own (`index` i in `choices` and in every streamed
chunk): sampled with seed + i when the request has a seed (choice 0 is then the answer of the same request with
n = 1), with a seed of its own otherwise. A greedy request (temperature 0) runs once and repeats its answer, since
every choice would be the same. With `--parallel` the choices decode together, and choices after the first wait
until the first has prefilled the prompt, so they take it from the prefix cache instead of prefilling it again.
`usage` counts the prompt once, as OpenAI does (its cached tokens are those of choice 0), and the completion tokens
of every choice; the top-level `doppler` object is choice 0's, and with n > 1 each choice also carries its own.

Structured output: `response_format` (OpenAI's text / json_object / json_schema) on both endpoints, or the extra
fields `regex` and `grammar` (a Lark grammar, llguidance's dialect); at most one, checked before the request
queues (400 naming the field). A request that gives one replaces a constraint among the server's defaults.
Tool calls on /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls` as OpenAI has them, answered
with `message.tool_calls` and finish_reason "tool_calls", streamed as OpenAI streams them (a first delta with the
call's id, type and name, then pieces of its arguments); see `doppler_py.tool_calls` for the constraint and prompt.

Log-probabilities: chat `"logprobs": true` with `top_logprobs` 0..20, completions `"logprobs": N` (0..20),
answered in OpenAI's shapes, streamed chunks included (each carries its own tokens' entries). They are the
target model's log_softmax(logits / T) at the request's temperature (T = 1 when greedy), before top-k/top-p
filtering (see `Engine.stream`); a log-probability of -inf is sent as -9999.0, as OpenAI does.

With an API key (`serve --api-key KEY`, or the DOPPLER_API_KEY environment variable), every /v1/* request
needs `Authorization: Bearer KEY` (compared in constant time; otherwise 401 with an OpenAI-style error body);
/health stays open. Binding a non-loopback address without a key prints a warning.

Generations run on the engine's `parallel` worker threads (`serve --parallel N`, default 1): with more than
one, the running generations decode together, every step of each sharing one forward of the model
(`speculative.batch`), and each answer is the one it would be alone. Requests beyond those wait in a bounded
queue and a full queue answers 429. A client that disconnects (mid-stream or while queued)
cancels its generation, which closes the engine's stream iterator and so frees its KV cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import re
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from doppler_py.api import Engine, GenerationResult, check_stop
from doppler_py.constraints.grammar import constraint_from_options
from doppler_py.defaults import TEMPERATURE
from doppler_py.errors import (
    CapacityError,
    DopplerError,
    GenerationOptionError,
    UnsupportedModelError,
    VocabularyMismatchError,
)
from doppler_py.model.catalog import KNOWN_MODELS
from doppler_py.model.kv_arena import BLOCK
from doppler_py.ops.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from doppler_py.ops.speculative import MAX_DRAFT_TOKENS
from doppler_py.sampling import SamplingParams
from doppler_py.speculative.registry import speculative_modes
from doppler_py.tool_calls import Delta, ToolCallParser, tool_plan

# Engine errors caused by what the request asked for; any other DopplerError is the server's fault.
_CLIENT_ERRORS = (GenerationOptionError, CapacityError, UnsupportedModelError, VocabularyMismatchError)
_INT32_MAX = 2**31 - 1
# Request fields that would change the output if honoured, with the values that mean "not used".
_UNSUPPORTED_UNLESS = {
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "logit_bias": ({},),
    "functions": ([],),
}
_CONSTRAINTS = ("response_format", "regex", "grammar")
MAX_CHOICES = 16  # `n`: each choice is a generation of its own
_FIELD_PATH = re.compile(r"[A-Za-z_][\w.\[\]]*")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    queue_size: int = 8  # requests that may wait while one generates; one more gets 429
    max_body_bytes: int = 1 << 20  # larger request bodies get 413
    model_id: str | None = None  # the name clients use; default: derived from the engine's model
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <api_key>"
    # Engine.stream options for requests that leave them out, over `doppler_py.defaults` (which Engine.stream has).
    defaults: dict[str, Any] = field(default_factory=dict)


class RequestError(Exception):
    """A request the server refuses, answered with an OpenAI-style error body."""

    def __init__(
        self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None, code=None
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status == 429 else None
        return JSONResponse(_error_body(self.message, self.kind, self.param, self.code), self.status, headers)


def _error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _engine_error(exc: Exception) -> RequestError:
    if isinstance(exc, _CLIENT_ERRORS):
        return RequestError(400, str(exc), code=type(exc).__name__)
    if isinstance(exc, DopplerError):
        return RequestError(500, f"{type(exc).__name__}: {exc}", kind="server_error", code=type(exc).__name__)
    return RequestError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error")


def default_model_id(name: str) -> str:
    """A known model's name, else the folder's name or the .gguf file's stem."""
    if name in KNOWN_MODELS:
        return name
    path = Path(name)
    return (path.stem if path.suffix.lower() == ".gguf" else path.name) or name


# --- request parsing ---------------------------------------------------------------------------------------------
def _describe(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _field(body: dict, name: str, kinds: tuple[type, ...], what: str) -> Any:
    """body[name] when present and of one of `kinds` (JSON true/false never counts as a number); None if absent."""
    value = body.get(name)
    if value is None:
        return None
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise RequestError(400, f"'{name}' must be {what}, got {_describe(value)}", param=name)
    return value


def _int_field(body: dict, name: str, low: int, high: int) -> int | None:
    value = _field(body, name, (int,), "an integer")
    if value is not None and not low <= value <= high:
        raise RequestError(400, f"'{name}' must be in {low}..{high}, got {value}", param=name)
    return value


def _tree_field(body: dict) -> bool | str | None:
    """`tree`: true, false or "auto" (the server's default, as if left out); `k` gives the node budget."""
    tree = body.get("tree")
    if tree is None or tree == "auto" or isinstance(tree, bool):
        return tree
    raise RequestError(
        400, f"'tree' must be true, false or \"auto\" (the node budget is 'k'), got {_describe(tree)}", param="tree"
    )


def _stop_field(body: dict) -> list[str] | None:
    stop = body.get("stop")
    if stop is None or stop == [] or stop == "":  # what clients send to mean "no stop strings"
        return None
    try:
        return list(check_stop(stop))
    except GenerationOptionError as exc:
        raise RequestError(400, f"'stop': {exc}", param="stop") from None


@dataclass
class GenerationRequest:
    prompt: str | list[dict]
    chat: bool
    options: dict[str, Any]  # keyword arguments of Engine.stream
    stream: bool
    include_usage: bool
    tool_calls: bool = False  # the answer may hold tool calls: stream it through a ToolCallParser
    n: int = 1  # choices asked for

    @property
    def greedy(self) -> bool:
        """Every choice would be the same answer."""
        return SamplingParams(temperature=self.options.get("temperature", TEMPERATURE)).greedy

    def generations(self) -> list[GenerationRequest]:
        """The generations that answer it: one per choice, choice i with seed + i when seeded (else a seed of its
        own, drawn by the engine); one for all when greedy."""
        if self.n == 1 or self.greedy:
            return [replace(self, n=1)]
        seed = self.options.get("seed")
        return [
            replace(self, n=1, options=self.options | ({} if seed is None else {"seed": seed + i}))
            for i in range(self.n)
        ]


def _option_error(exc: GenerationOptionError, name: str) -> RequestError:
    """400 for a bad option; param is the field path the message starts with ("tools[0].function.parameters")."""
    message = str(exc)
    path = _FIELD_PATH.match(message)
    param = path[0] if path and path[0].startswith(name) else name
    return RequestError(400, message, param=param)


def _constraint_options(body: dict, defaults: dict[str, Any]) -> dict[str, Any]:
    """response_format / regex / grammar, checked now (llguidance compiles them) so a bad one never queues."""
    response_format = _field(body, "response_format", (dict,), "an object")
    given = {
        "response_format": response_format,
        "regex": _field(body, "regex", (str,), "a string (a regular expression)"),
        "grammar": _field(body, "grammar", (str,), "a string (a Lark grammar)"),
    }
    given = {name: value for name, value in given.items() if value is not None}
    if not given:
        return {name: defaults[name] for name in _CONSTRAINTS if defaults.get(name) is not None}
    try:
        constraint_from_options(**given)
    except GenerationOptionError as exc:
        raise _option_error(exc, next(iter(given))) from None
    if response_format is not None and response_format.get("type") == "text":
        return {}  # no constraint, as OpenAI's default
    return given


def _tool_options(body: dict, *, chat: bool) -> dict[str, Any]:
    """tools / tool_choice / parallel_tool_calls (chat only), checked now."""
    names = ("tools", "tool_choice", "parallel_tool_calls")
    given = {name: body[name] for name in names if body.get(name) is not None}
    if not given:
        return {}
    if not chat:
        name = next(iter(given))
        raise RequestError(400, f"'{name}' is only for /v1/chat/completions", param=name)
    try:
        tool_plan(given.get("tools"), given.get("tool_choice"), given.get("parallel_tool_calls", True))
    except GenerationOptionError as exc:
        raise _option_error(exc, "tool_choice" if str(exc).startswith("tool_choice") else "tools") from None
    return given


def _options(body: dict, defaults: dict[str, Any], *, chat: bool) -> dict[str, Any]:
    for name, unused in _UNSUPPORTED_UNLESS.items():
        if body.get(name) is not None and not any(body[name] == value for value in unused):
            raise RequestError(400, f"'{name}' is not supported by this server", param=name)
    if chat:
        wanted = _field(body, "logprobs", (bool,), "true or false")
        top = _int_field(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if top is not None and not wanted:
            raise RequestError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        logprobs = (top or 0) if wanted else None
    else:
        logprobs = _int_field(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    max_tokens = _int_field(body, "max_completion_tokens", 1, _INT32_MAX) if chat else None
    if max_tokens is None:
        max_tokens = _int_field(body, "max_tokens", 1, _INT32_MAX)
    speculative = _field(body, "speculative", (str,), "a string")
    if speculative is not None and speculative not in (*speculative_modes(), "none"):
        raise RequestError(
            400, f"'speculative' must be one of {', '.join((*speculative_modes(), 'none'))}", param="speculative"
        )
    given = {
        "max_tokens": max_tokens,
        "temperature": _field(body, "temperature", (int, float), "a number"),
        "top_p": _field(body, "top_p", (int, float), "a number"),
        "top_k": _int_field(body, "top_k", 0, _INT32_MAX),
        "seed": _field(body, "seed", (int,), "an integer"),
        "speculative": speculative,
        "k": _int_field(body, "k", 1, MAX_DRAFT_TOKENS),
        "tree": _tree_field(body),
        "stop": _stop_field(body),
        "logprobs": logprobs,
    }
    tools = _tool_options(body, chat=chat)
    constraint = _constraint_options(body, {} if tools else defaults)
    if tools and constraint:
        raise RequestError(400, f"'tools' cannot be combined with '{next(iter(constraint))}'", param="tools")
    # The request's constraint (or tools) replaces any constraint among the server's defaults.
    options = {name: value for name, value in defaults.items() if name not in _CONSTRAINTS}
    options |= {name: value for name, value in given.items() if value is not None} | constraint | tools
    if options.get("tree") == "auto":
        options["tree"] = None  # the engine's policy decides
    if max_tokens is None:  # the server's default is a ceiling: a long prompt gets the room left, as OpenAI's does
        options["shorten_to_fit"] = True
    sampling = {name: options[name] for name in ("temperature", "top_k", "top_p", "seed") if name in options}
    try:
        SamplingParams(**sampling)  # the engine's own checks, before the request waits for the GPU
    except GenerationOptionError as exc:
        raise RequestError(400, str(exc)) from None
    return options


def _tool_call(where: str, call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not (
        isinstance(function, dict)
        and isinstance(function.get("name"), str)
        and isinstance(function.get("arguments"), str)
    ):
        raise RequestError(
            400, f"{where} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}", param=where
        )
    return {
        "id": call.get("id"),
        "type": "function",
        "function": {"name": function["name"], "arguments": function["arguments"]},
    }


def _content(where: str, content: Any) -> str:
    if isinstance(content, list):  # content parts: only text can be rendered by a text model
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise RequestError(400, f"{where}.content: only text parts are supported", param=f"{where}.content")
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise RequestError(400, f"{where}.content must be a string or a list of text parts", param=f"{where}.content")
    return content


def _message(index: int, message: Any) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise RequestError(400, f"{where} must be an object with 'role' and 'content'", param=where)
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not role:
        raise RequestError(400, f"{where}.role must be a non-empty string", param=f"{where}.role")
    calls = message.get("tool_calls")
    if role == "assistant" and calls:  # an earlier answer that called tools: content may be null
        if not isinstance(calls, list):
            raise RequestError(400, f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
        checked = [_tool_call(f"{where}.tool_calls[{i}]", call) for i, call in enumerate(calls)]
        return {"role": role, "content": _content(where, content or "") or None, "tool_calls": checked}
    if role == "tool":  # a tool's result, answering the call with this id
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise RequestError(400, f"{where}.tool_call_id must be a string", param=f"{where}.tool_call_id")
        return {"role": role, "content": _content(where, content), "tool_call_id": call_id}
    return {"role": role, "content": _content(where, content)}


def parse_request(body: dict, defaults: dict[str, Any], *, chat: bool) -> GenerationRequest:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "'messages' must be a non-empty list of messages", param="messages")
        prompt: str | list[dict] = [_message(i, m) for i, m in enumerate(messages)]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise RequestError(
                400, "'prompt' must be a non-empty string (token-id prompts are not supported)", param="prompt"
            )
    stream = _field(body, "stream", (bool,), "true or false") or False
    stream_options = _field(body, "stream_options", (dict,), "an object") or {}
    include_usage = _field(stream_options, "include_usage", (bool,), "true or false") or False
    options = _options(body, defaults, chat=chat)
    calls = bool(options.get("tools")) and options.get("tool_choice") != "none"  # when tool_plan gives a plan
    n = _int_field(body, "n", 1, MAX_CHOICES) or 1
    return GenerationRequest(prompt, chat, options, stream, include_usage, tool_calls=calls, n=n)


# --- the GPU worker ----------------------------------------------------------------------------------------------
# ("piece", (text, its tokens' logprobs or None)) | ("done", GenerationResult) | ("error", Exception)
Event = tuple[str, Any]


class Job:
    """One generation: run on the GPU worker thread, its events delivered to the event loop's queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop, request: GenerationRequest, after: threading.Event | None):
        self.loop = loop
        self.request = request
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.cancel_requested = threading.Event()
        self.started = False  # set by the worker thread
        self.outcome = "queued"
        self.record: GenerationResult | None = None  # a completed generation's
        self.after = after  # set when this job may start (its request's first choice prefilled the prompt)
        self.prefilled = threading.Event()  # set once its prompt is prefilled (its first piece), or it ended
        # Set before its last event goes out, so a client that sends its next request at once finds the room free.
        self.ended = False

    @property
    def wanted(self) -> bool:
        """Running, or waiting for a client that is still there (an abandoned job is skipped at once)."""
        return not self.ended and (self.started or not self.cancel_requested.is_set())

    def cancel(self) -> None:
        self.cancel_requested.set()

    def _emit(self, event: Event) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is gone: the server is shutting down
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def _emit_last(self, event: Event) -> None:
        self.ended = True
        self._emit(event)

    def run(self, engine: Engine) -> None:
        """Worker thread: generate, stopping early (closing the engine's stream) once cancelled."""
        try:
            if self.after is not None:
                self.after.wait()
            self.started = True
            if self.cancel_requested.is_set():
                self.outcome = "cancelled"
                return
            try:
                self.outcome = self._generate(engine)
            except Exception as exc:  # reported to the client; the worker goes on with the next job
                self.outcome = "refused" if isinstance(exc, _CLIENT_ERRORS) else "failed"
                self._emit_last(("error", exc))
        finally:
            self.prefilled.set()

    def _generate(self, engine: Engine) -> str:
        request = self.request
        with contextlib.closing(engine.stream(request.prompt, chat=request.chat, **request.options)) as pieces:
            for piece in pieces:
                if self.cancel_requested.is_set():
                    return "cancelled"
                self._emit(("piece", (piece, engine.piece_logprobs)))
                self.prefilled.set()
        self.record = engine.thread_result
        self._emit_last(("done", self.record))
        return "completed"

    async def result(self) -> GenerationResult:
        while True:
            kind, value = await self.events.get()
            if kind == "done":
                return value
            if kind == "error":
                raise value


class GenerationQueue:
    """Runs jobs on the engine's `parallel` worker threads (their steps batched by the engine); admits a job while
    fewer than parallel + queue_size others are running or waiting (jobs whose clients left are not counted: the
    workers skip them)."""

    def __init__(self, engine: Engine, queue_size: int):
        if queue_size < 0:
            raise ValueError(f"queue_size must be >= 0, got {queue_size}")
        self.engine = engine
        self.queue_size = queue_size
        self.jobs: set[Job] = set()  # admitted and not finished; touched on the event loop thread only
        self.counts: Counter[str] = Counter()
        self.totals: Counter[str] = Counter()  # over completed generations (`metrics`)
        self.workers = engine.parallel
        self._executor = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="doppler-gpu")

    def submit(self, request: GenerationRequest) -> list[Job]:
        """The jobs of the request's generations (`GenerationRequest.generations`), admitted all or none. Beside other
        generations with a prefix cache, choices after the first start once it has prefilled the prompt."""
        generations = request.generations()
        capacity = self.workers + self.queue_size
        if len(generations) > capacity:
            raise RequestError(
                400,
                f"'n' asks for {len(generations)} generations; this server runs {self.workers} at once and queues "
                f"{self.queue_size}",
                param="n",
            )
        if sum(job.wanted for job in self.jobs) + len(generations) > capacity:
            self.counts["rejected"] += 1
            raise RequestError(
                429,
                f"the server is busy ({self.workers} running, {self.queue_size} waiting); retry later",
                kind="rate_limit_error",
                code="queue_full",
            )
        loop = asyncio.get_running_loop()
        jobs: list[Job] = []
        stagger = self.engine.batch is not None and self.engine.prefix_cache.budget_bytes > 0
        for generation in generations:
            job = Job(loop, generation, jobs[0].prefilled if jobs and stagger else None)
            jobs.append(job)
            self.jobs.add(job)
            future = loop.run_in_executor(self._executor, job.run, self.engine)
            future.add_done_callback(lambda _, job=job: self._finished(job))
        return jobs

    def _finished(self, job: Job) -> None:
        self.jobs.discard(job)
        self.counts[job.outcome] += 1
        if job.record is not None:
            result = job.record
            self.totals.update(
                prompt_tokens=result.prompt_tokens,
                cached_prompt_tokens=result.cached_tokens,
                completion_tokens=len(result.tokens),
                drafted_tokens=result.drafted,
                accepted_tokens=result.accepted,
                forced_tokens=result.stats.get("forced_tokens", 0),
            )

    def status(self) -> dict[str, int]:
        return {
            "running": sum(job.started for job in self.jobs),
            "waiting": sum(not job.started and job.wanted for job in self.jobs),
            "parallel": self.workers,
            "queue_size": self.queue_size,
            **{name: self.counts[name] for name in ("completed", "cancelled", "refused", "failed", "rejected")},
        }

    def shutdown(self) -> None:
        for job in list(self.jobs):
            job.cancel()
        self._executor.shutdown(wait=True, cancel_futures=False)


def kv_status(engine: Engine) -> dict[str, float]:
    """The KV budget's use (`--kv-budget-mb`), in MiB; nothing without a budget."""
    budget = engine.kv_budget
    if budget is None:
        return {}
    return {
        "kv_budget_mb": budget.limit / 2**20,
        "kv_reserved_mb": round(budget.reserved / 2**20, 3),
        "kv_waiting": budget.waiting,
    }


def prometheus_text(queue: GenerationQueue, engine: Engine) -> str:
    """The server's counters and gauges in Prometheus' text format."""
    status, totals, cache = queue.status(), queue.totals, engine.prefix_cache
    lines = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP doppler_{name} {help_text}", f"# TYPE doppler_{name} {kind}"])
        lines.extend(f"doppler_{name}{labels} {value:g}" for labels, value in samples)

    outcomes = ("completed", "cancelled", "refused", "failed", "rejected")
    metric("requests_total", "counter", "Requests by outcome.", [(f'{{outcome="{o}"}}', status[o]) for o in outcomes])
    for name, help_text in (
        ("prompt_tokens", "Prompt tokens of completed generations."),
        ("cached_prompt_tokens", "Prompt tokens whose K/V came from the prefix cache."),
        ("completion_tokens", "Generated tokens."),
        ("drafted_tokens", "Draft tokens verified."),
        ("accepted_tokens", "Draft tokens accepted."),
        ("forced_tokens", "Draft tokens a grammar forced."),
    ):
        metric(f"{name}_total", "counter", help_text, [("", totals[name])])
    metric("running", "gauge", "Generations running (their steps batched).", [("", status["running"])])
    metric("parallel", "gauge", "Generations that may run at once.", [("", status["parallel"])])
    if engine.batch is not None:
        sizes = engine.batch.sizes
        samples = [(f'{{le="{le}"}}', sum(n for size, n in sizes.items() if size <= le)) for le in (1, 2, 4, 8, 16)]
        samples += [('{le="+Inf"}', sum(sizes.values()))]
        metric("batch_steps", "histogram", "Batched forwards by the generations' steps they held.", [])
        lines.extend(f"doppler_batch_steps_bucket{labels} {value:g}" for labels, value in samples)
        lines.append(f"doppler_batch_steps_sum {sum(size * n for size, n in sizes.items()):g}")
        lines.append(f"doppler_batch_steps_count {sum(sizes.values()):g}")
        metric(
            "batch_shared_attention_total",
            "counter",
            "Batched forwards whose attention ran once per layer for all their generations.",
            [("", engine.batch.paged_forwards)],
        )
        metric(
            "batch_prefill_rows_total",
            "counter",
            "Prompt rows prefilled in the forwards of running generations' steps.",
            [("", engine.batch.prefill_rows_beside_steps)],
        )
        arena = engine.batch.arena
        metric(
            "kv_arena_bytes",
            "gauge",
            "GPU memory of the slabs the batched generations' KV caches sit in.",
            [("", arena.nbytes)],
        )
        metric(
            "kv_arena_blocks",
            "gauge",
            f"KV blocks of {BLOCK} positions the running generations hold.",
            [("", arena.used_blocks)],
        )
    metric("waiting", "gauge", "Generations waiting in the queue.", [("", status["waiting"])])
    budget = engine.kv_budget
    if budget is not None:
        metric("kv_budget_bytes", "gauge", "KV memory the running generations may take.", [("", budget.limit)])
        metric("kv_reserved_bytes", "gauge", "KV memory the running generations hold.", [("", budget.reserved)])
        metric("kv_waiting", "gauge", "Generations waiting for KV memory.", [("", budget.waiting)])
        metric("kv_waited_total", "counter", "Generations that waited for KV memory.", [("", budget.waited)])
    metric("queue_size", "gauge", "Waiting generations allowed before 429.", [("", status["queue_size"])])
    metric("prefix_cache_bytes", "gauge", "GPU memory held by the prefix cache.", [("", cache.nbytes)])
    metric("prefix_cache_entries", "gauge", "Sequences held by the prefix cache.", [("", len(cache))])
    metric("prefix_cache_lookups_total", "counter", "Prompts looked up in the prefix cache.", [("", cache.lookups)])
    metric("prefix_cache_hits_total", "counter", "Prompts that took a prefix from the cache.", [("", cache.hits)])
    return "\n".join(lines) + "\n"


# --- response formats --------------------------------------------------------------------------------------------
def usage(results: list[GenerationResult]) -> dict[str, Any]:
    """OpenAI's usage of a request's choices: the prompt once (with the tokens whose K/V choice 0 took from the
    prefix cache as its cached ones), every choice's completion tokens."""
    prompt = results[0]
    completion = sum(len(result.tokens) for result in results)
    return {
        "prompt_tokens": prompt.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": prompt.cached_tokens},
    }


def doppler_stats(result: GenerationResult) -> dict[str, Any]:
    """The extension object: what speculation did and what it saved."""
    return {
        "speculative": result.speculative,
        "drafted": result.drafted,
        "accepted": result.accepted,
        "acceptance_rate": round(result.acceptance_rate, 4),
        "mean_accepted_per_step": round(result.mean_accepted_per_step, 3),
        "tokens_per_s": round(result.tokens_per_s, 2),
        "elapsed_s": round(result.elapsed_s, 4),
        "time_saved_s": None if result.time_saved_s is None else round(result.time_saved_s, 4),
        "time_saved_s_err": None if result.time_saved_s_err is None else round(result.time_saved_s_err, 4),
    }


def _json_logprob(value: float) -> float:
    return value if value != float("-inf") else -9999.0  # JSON has no -inf; OpenAI sends -9999.0


class _Format:
    """OpenAI's response and chunk objects for one request."""

    def __init__(self, chat: bool, model: str, token_text):
        self.chat = chat
        self.model = model
        self.token_text = token_text  # token id -> its text
        # Completions' logprobs, per choice: where the next token's text starts (chunks continue it).
        self.text_offsets: Counter[int] = Counter()
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _object(self, kind: str, choices: list[dict], **extra: Any) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices} | extra

    def logprobs(self, entries: list[TokenLogprob] | None, index: int = 0) -> dict | None:
        """OpenAI's logprobs object of a choice: chat's {"content": [...]}, completions' parallel lists."""
        if entries is None:
            return None
        if self.chat:

            def item(token: int, logprob: float) -> dict:
                text = self.token_text(token)
                return {"token": text, "logprob": _json_logprob(logprob), "bytes": list(text.encode())}

            content = [item(e.token, e.logprob) | {"top_logprobs": [item(*t) for t in e.top]} for e in entries]
            return {"content": content, "refusal": None}
        texts = [self.token_text(e.token) for e in entries]
        offsets = []
        for text in texts:
            offsets.append(self.text_offsets[index])
            self.text_offsets[index] += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [_json_logprob(e.logprob) for e in entries],
            "top_logprobs": [{self.token_text(t): _json_logprob(lp) for t, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    def _choice(
        self, text: str | None, finish_reason: str | None, *, streaming: bool, logprobs=None, index: int = 0
    ) -> dict:
        logprobs = self.logprobs(logprobs, index)
        if not self.chat:
            return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        if streaming:
            delta = {"content": text} if text is not None else {}
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        message = {"role": "assistant", "content": text}
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def response(self, results: list[GenerationResult]) -> dict:
        """The whole answer: results[i] is choice i's."""
        kind = "chat.completion" if self.chat else "text_completion"
        choices = []
        for index, result in enumerate(results):
            # An answer that called tools has no content: its text is the calls as written (`tool_calls` module).
            text = None if result.tool_calls else result.text
            choice = self._choice(text, result.finish_reason, streaming=False, logprobs=result.logprobs, index=index)
            if result.tool_calls:
                choice["message"]["tool_calls"] = result.tool_calls
            if len(results) > 1:
                choice["doppler"] = doppler_stats(result)
            choices.append(choice)
        return self._object(kind, choices, usage=usage(results), doppler=doppler_stats(results[0]))

    def delta_chunks(self, deltas: list[Delta], logprobs: list[TokenLogprob] | None, index: int = 0) -> list[dict]:
        """Chunks for a parsed piece of a tool-calling answer: content, a call's start, pieces of arguments
        (OpenAI's streaming shape); the piece's log-probs ride on the first (or an empty delta when none)."""
        chunks = []
        for i, delta in enumerate(deltas or [None]):
            choice = self._choice(None, None, streaming=True, logprobs=logprobs if i == 0 else None, index=index)
            if delta is None and choice["logprobs"] is None:
                return []
            if delta is not None and delta.kind == "content":
                choice["delta"] = {"content": delta.text}
            elif delta is not None:
                function = {"name": delta.name, "arguments": ""} if delta.kind == "call" else {"arguments": delta.text}
                head = {"id": delta.id, "type": "function"} if delta.kind == "call" else {}
                choice["delta"] = {"tool_calls": [{"index": delta.index} | head | {"function": function}]}
            chunks.append(self._object(self._chunk_kind, [choice]))
        return chunks

    @property
    def _chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def opening_chunks(self, choices: int = 1) -> list[dict]:
        if not self.chat:
            return []
        return [
            self._object(
                self._chunk_kind,
                [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
            )
            for i in range(choices)
        ]

    def piece_chunk(self, text: str, logprobs: list[TokenLogprob] | None = None, index: int = 0) -> dict:
        return self._object(
            self._chunk_kind, [self._choice(text, None, streaming=True, logprobs=logprobs, index=index)]
        )

    def finish_chunk(self, result: GenerationResult, index: int = 0, logprobs_sent: int = 0, **figures: Any) -> dict:
        """A choice's finish chunk (with the log-probs of tokens no piece carried, e.g. end of sequence)."""
        rest = None if result.logprobs is None else result.logprobs[logprobs_sent:]
        finish = self._choice(None, result.finish_reason, streaming=True, logprobs=rest, index=index)
        return self._object(self._chunk_kind, [finish], **figures)

    def usage_chunk(self, results: list[GenerationResult]) -> dict:
        """What OpenAI clients asking for usage expect last: a chunk with no choices."""
        return self._object(self._chunk_kind, [], usage=usage(results), doppler=doppler_stats(results[0]))


def _sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


# --- HTTP ---------------------------------------------------------------------------------------------------------
class ApiKeyCheck:
    """ASGI middleware: /v1/* requests must carry `Authorization: Bearer <key>`; anything else passes."""

    def __init__(self, app, key: str):
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and (scope["path"] == "/v1" or scope["path"].startswith("/v1/")):
            given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            if not hmac.compare_digest(given.strip(), self.expected):
                message = "missing or incorrect API key: send 'Authorization: Bearer <key>'"
                body = _error_body(message, "invalid_request_error", code="invalid_api_key")
                await JSONResponse(body, 401, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


_DISCONNECTED = object()


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """The result of `work`, or _DISCONNECTED when the client goes away first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    return task.result() if task.done() and not task.cancelled() else _DISCONNECTED


class OpenAIServer:
    """The routes over one engine; `app` is the Starlette application."""

    def __init__(self, engine: Engine, config: ServerConfig = ServerConfig()):
        self.engine = engine
        self.config = config
        self.model_id = config.model_id or default_model_id(engine.name)
        self.created = int(time.time())
        self.queue = GenerationQueue(engine, config.queue_size)
        self.app = Starlette(
            routes=[
                Route("/v1/models", self.list_models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.get_model, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
            ],
            exception_handlers={
                RequestError: self._request_error,
                HTTPException: self._http_error,
                Exception: self._internal_error,
            },
            lifespan=self._lifespan,
            middleware=[Middleware(ApiKeyCheck, key=config.api_key)] if config.api_key else None,
        )

    @contextlib.asynccontextmanager
    async def _lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        yield
        await asyncio.get_running_loop().run_in_executor(None, self.queue.shutdown)

    @staticmethod
    async def _request_error(_request: Request, exc: RequestError) -> Response:
        return exc.response()

    @staticmethod
    async def _http_error(_request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(_error_body(str(exc.detail), kind), exc.status_code, getattr(exc, "headers", None))

    @staticmethod
    async def _internal_error(_request: Request, exc: Exception) -> Response:
        return _engine_error(exc).response()

    # -- routes ------------------------------------------------------------------------------------------------
    def _model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "doppler-py"}

    async def list_models(self, _request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def get_model(self, request: Request) -> Response:
        self._check_model(request.path_params["model"])
        return JSONResponse(self._model_card())

    async def health(self, _request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.model_id, **self.queue.status(), **kv_status(self.engine)})

    async def metrics(self, _request: Request) -> Response:
        return PlainTextResponse(prometheus_text(self.queue, self.engine), media_type="text/plain; version=0.0.4")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    # -- generation --------------------------------------------------------------------------------------------
    def _token_text(self, token: int) -> str:
        return self.engine.tokenizer.decode([token], skip_special_tokens=False)

    def _check_model(self, model: Any) -> None:
        if model is not None and model not in (self.model_id, self.engine.name):
            raise RequestError(
                404,
                f"model {_describe(model)} is not served here; this server serves {self.model_id!r}",
                param="model",
                code="model_not_found",
            )

    async def _read_json(self, request: Request) -> dict:
        limit = self.config.max_body_bytes
        too_large = RequestError(413, f"request body larger than {limit:,} bytes", code="request_too_large")
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise RequestError(400, f"invalid Content-Length header {declared!r}")
            if int(declared) > limit:
                raise too_large
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
        try:
            data = json.loads(bytes(body))
        except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise RequestError(400, f"the request body is not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise RequestError(400, "the request body must be a JSON object")
        return data

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        body = await self._read_json(request)
        self._check_model(_field(body, "model", (str,), "a string"))
        parsed = parse_request(body, self.config.defaults, chat=chat)
        jobs = self.queue.submit(parsed)
        owners = [i if len(jobs) > 1 else 0 for i in range(parsed.n)]  # choice i's job (one for all when greedy)
        form = _Format(chat, self.model_id, self._token_text)
        if not parsed.stream:
            try:
                results = await _unless_disconnected(request, asyncio.gather(*(job.result() for job in jobs)))
            except Exception as exc:
                _cancel(jobs)
                raise _engine_error(exc) from None
            if results is _DISCONNECTED:
                _cancel(jobs)
                return Response(status_code=499)  # nobody is listening any more
            return JSONResponse(form.response([results[job] for job in owners]))
        events = _JobEvents(jobs)
        # Wait for the first event so a request the engine refuses still gets a 4xx status, not a broken stream.
        first = await _unless_disconnected(request, events.get())
        if first is _DISCONNECTED or first[1][0] == "error":
            events.close()
            _cancel(jobs)
            if first is _DISCONNECTED:
                return Response(status_code=499)
            raise _engine_error(first[1][1])
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(
            self._events(jobs, owners, events, first, form, parsed),
            media_type="text/event-stream",
            headers=headers,
        )

    async def _events(
        self,
        jobs: list[Job],
        owners: list[int],
        events: _JobEvents,
        event: tuple[int, Event],
        form: _Format,
        request: GenerationRequest,
    ) -> AsyncIterator[str]:
        # Starlette cancels this generator when the client disconnects; `finally` then stops the generations.
        choices = len(owners)
        parsers = [ToolCallParser() if request.tool_calls else None for _ in owners]
        sent = [0] * choices  # per choice: logprobs entries sent with pieces
        results: list[GenerationResult | None] = [None] * choices
        try:
            for chunk in form.opening_chunks(choices):
                yield _sse(chunk)
            while True:
                job, (kind, value) = event
                if kind == "error":
                    error = _engine_error(value)
                    yield _sse(_error_body(error.message, error.kind, code=error.code))
                    break
                for i in (i for i, owner in enumerate(owners) if owner == job):
                    for chunk in self._choice_chunks(form, i, kind, value, parsers[i], sent, results):
                        yield _sse(chunk)
                if events.open == 0:
                    if request.include_usage:
                        yield _sse(form.usage_chunk(results))
                    break
                event = await events.get()
            yield _sse("[DONE]")
        finally:
            events.close()
            _cancel(jobs)

    @staticmethod
    def _choice_chunks(
        form: _Format,
        index: int,
        kind: str,
        value: Any,
        parser: ToolCallParser | None,
        sent: list[int],
        results: list[GenerationResult | None],
    ) -> Iterator[dict]:
        """Choice `index`'s chunks for its generation's event: a piece, or its end (the finish chunk, which carries
        the usage of every choice when it is the last to finish)."""
        if kind == "piece":
            text, logprobs = value
            sent[index] += len(logprobs or ())
            if parser is None:
                yield form.piece_chunk(text, logprobs, index)
            else:  # tool calls: the answer's text becomes content or call deltas
                yield from form.delta_chunks(parser.feed(text), logprobs, index)
            return
        if parser is not None:  # text held back as a possible call's start is content after all
            yield from form.delta_chunks(parser.finish(), None, index)
        results[index] = value
        figures = {"doppler": doppler_stats(value)}
        if all(result is not None for result in results):
            figures = {"usage": usage(results)} | figures
        yield form.finish_chunk(value, index, sent[index], **figures)


class _JobEvents:
    """The events of a request's jobs as they come, each as (its job's index, event); `open`: jobs not ended."""

    def __init__(self, jobs: list[Job]):
        self.open = len(jobs)
        self._queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        self._tasks = [asyncio.ensure_future(self._forward(i, job)) for i, job in enumerate(jobs)]

    async def _forward(self, i: int, job: Job) -> None:
        while True:
            event = await job.events.get()
            self._queue.put_nowait((i, event))
            if event[0] != "piece":
                return

    async def get(self) -> tuple[int, Event]:
        i, event = await self._queue.get()
        if event[0] != "piece":
            self.open -= 1
        return i, event

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()


def _cancel(jobs: list[Job]) -> None:
    for job in jobs:
        job.cancel()


def serve(engine: Engine, config: ServerConfig = ServerConfig(), *, log_level: str = "info") -> None:
    """Serve `engine` until interrupted (Ctrl-C)."""
    import uvicorn

    server = OpenAIServer(engine, config)
    if not config.api_key and not is_loopback(config.host):
        print(
            f"doppler-py: warning: serving on {config.host} without an API key: anyone who can reach this address "
            "can use the model (set --api-key or DOPPLER_API_KEY)",
            file=sys.stderr,
            flush=True,
        )
    print(f"doppler-py: serving {server.model_id!r} at http://{config.host}:{config.port}/v1", flush=True)
    uvicorn.run(server.app, host=config.host, port=config.port, log_level=log_level, timeout_graceful_shutdown=5)


@contextlib.contextmanager
def serving_in_background(app: Starlette, host: str = "127.0.0.1") -> Iterator[str]:
    """`app` (an `OpenAIServer`'s) served by uvicorn on a free port of `host` in a background thread, for a Python
    program or notebook that serves and calls the server itself; yields the base URL and stops the server on exit."""
    import socket

    import uvicorn

    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="doppler-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise DopplerError(f"the server on {host}:{port} did not start")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
