"""The Starlette application: `OpenAIServer`, the routes over one engine (a request read, its generations queued,
the answer whole or streamed), its `ServerConfig`, and the API-key middleware."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from doppler_py.api import Engine, GenerationResult
from doppler_py.model.catalog import KNOWN_MODELS
from doppler_py.options import GenerationOptions
from doppler_py.server import adapters_route, anthropic_shapes, embeddings_route, messages_route, rerank_route
from doppler_py.server.anthropic_shapes import is_messages_path
from doppler_py.server.disconnect import _DISCONNECTED, _unless_disconnected
from doppler_py.server.errors import RequestError, _engine_error, _error_body
from doppler_py.server.jobs import Event, GenerationQueue, Job, _cancel, _JobEvents
from doppler_py.server.metrics import kv_status, prometheus_text
from doppler_py.server.openai_shapes import _Format, _sse, doppler_stats, usage
from doppler_py.server.parsing import GenerationRequest, _describe, parse_request
from doppler_py.tool_calls import ToolCallParser


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    queue_size: int = 8  # requests that may wait while one generates; one more gets 429
    max_body_bytes: int = 1 << 20  # larger request bodies get 413
    model_id: str | None = None  # the name clients use; default: derived from the engine's model
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <api_key>" or "x-api-key: <api_key>"
    # The options of requests that leave them out: a GenerationOptions, or a dict of its fields (made into one).
    defaults: GenerationOptions | Mapping[str, Any] = field(default_factory=GenerationOptions)
    adapter_admin: bool = False  # POST/DELETE /v1/adapters may add and remove LoRA adapters (`adapters_route`)

    def __post_init__(self) -> None:
        if not isinstance(self.defaults, GenerationOptions):
            object.__setattr__(self, "defaults", GenerationOptions(**self.defaults))


def default_model_id(name: str) -> str:
    """A known model's name, else the folder's name or the .gguf file's stem."""
    if name in KNOWN_MODELS:
        return name
    path = Path(name)
    return (path.stem if path.suffix.lower() == ".gguf" else path.name) or name


class ApiKeyCheck:
    """ASGI middleware: /v1/* requests must carry the key, as `Authorization: Bearer <key>` (OpenAI's clients) or
    `x-api-key: <key>` (Anthropic's); anything else passes. A refusal is a 401 in the route's API's error shape."""

    def __init__(self, app, key: str):
        self.app = app
        self.expected = f"Bearer {key}".encode()
        self.key = key.encode()

    async def __call__(self, scope, receive, send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        if path == "/v1" or path.startswith("/v1/"):
            headers = scope["headers"]
            bearer = next((value for name, value in headers if name == b"authorization"), b"")
            api_key = next((value for name, value in headers if name == b"x-api-key"), b"")
            # Both compared, in constant time, whichever was sent.
            good = hmac.compare_digest(bearer.strip(), self.expected) | hmac.compare_digest(api_key.strip(), self.key)
            if not good:
                message = "missing or incorrect API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
                if is_messages_path(path):
                    body = anthropic_shapes.error_body(401, message)
                else:
                    body = _error_body(message, "invalid_request_error", code="invalid_api_key")
                await JSONResponse(body, 401, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


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
                Route("/v1/messages", partial(messages_route.messages, self), methods=["POST"]),  # Anthropic's
                Route("/v1/messages/count_tokens", partial(messages_route.count_tokens, self), methods=["POST"]),
                Route("/v1/embeddings", partial(embeddings_route.embeddings, self), methods=["POST"]),
                Route("/v1/rerank", partial(rerank_route.rerank, self), methods=["POST"]),
                Route("/rerank", partial(rerank_route.rerank, self), methods=["POST"]),  # llama.cpp's path too
                Route("/v1/adapters", partial(adapters_route.list_adapters, self), methods=["GET"]),
                Route("/v1/adapters", partial(adapters_route.add_adapter, self), methods=["POST"]),
                Route("/v1/adapters/{name:path}", partial(adapters_route.remove_adapter, self), methods=["DELETE"]),
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
    async def _http_error(request: Request, exc: HTTPException) -> Response:
        if is_messages_path(request.url.path):  # e.g. GET /v1/messages: Anthropic's clients read Anthropic's shape
            return anthropic_shapes.error_response(RequestError(exc.status_code, str(exc.detail)))
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(_error_body(str(exc.detail), kind), exc.status_code, getattr(exc, "headers", None))

    @staticmethod
    async def _internal_error(_request: Request, exc: Exception) -> Response:
        return _engine_error(exc).response()

    # -- routes ------------------------------------------------------------------------------------------------
    def _model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "doppler-py"}

    async def list_models(self, _request: Request) -> Response:
        cards = [self._model_card(), *adapters_route.model_cards(self)]
        return JSONResponse({"object": "list", "data": cards})

    async def get_model(self, request: Request) -> Response:
        model = request.path_params["model"]
        adapters = {card["id"]: card for card in adapters_route.model_cards(self)}
        if model in adapters:
            return JSONResponse(adapters[model])
        self._check_model(model)
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
        body = adapters_route.request_adapter(self, await self._read_json(request))  # checks `model` too
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
