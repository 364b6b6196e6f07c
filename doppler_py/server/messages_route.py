"""Anthropic's routes over the OpenAI server's engine and queue: `POST /v1/messages` (an answer, whole or streamed as
Anthropic's events) and `POST /v1/messages/count_tokens`. Every refusal is answered in Anthropic's error shape
(`anthropic_shapes.error_body`), whatever raised it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from doppler_py.server import adapters_route
from doppler_py.server.anthropic_parsing import parse_messages
from doppler_py.server.anthropic_shapes import MessageEvents, error_body, error_response, message_response, sse_event
from doppler_py.server.disconnect import _DISCONNECTED, _unless_disconnected
from doppler_py.server.errors import RequestError, _engine_error
from doppler_py.server.jobs import Event, Job, _cancel, _JobEvents
from doppler_py.server.parsing import GenerationRequest, _describe

if TYPE_CHECKING:
    from doppler_py.server.app import OpenAIServer


async def messages(server: OpenAIServer, request: Request) -> Response:
    try:
        return await _messages(server, request)
    except RequestError as exc:
        return error_response(exc)
    except Exception as exc:  # the server's fault: Anthropic's api_error, as the app answers it in OpenAI's shape
        return error_response(_engine_error(exc))


async def count_tokens(server: OpenAIServer, request: Request) -> Response:
    """The prompt's tokens as the model would read them (system, messages and tools rendered)."""
    try:
        parsed = await _read(server, request, counting=True)
        return JSONResponse({"input_tokens": await _prompt_tokens(server, parsed)})
    except RequestError as exc:
        return error_response(exc)
    except Exception as exc:
        return error_response(_engine_error(exc))


async def _read(server: OpenAIServer, request: Request, *, counting: bool = False) -> GenerationRequest:
    body = await server._read_json(request)
    model = body.get("model")
    if not isinstance(model, str):  # required in Anthropic's API
        raise RequestError(400, f"'model' must be a string naming the model, got {_describe(model)}", param="model")
    body = adapters_route.request_adapter(server, body)  # the 404 of another model, a LoRA adapter's 400
    return parse_messages(body, server.config.defaults, counting=counting)


async def _prompt_tokens(server: OpenAIServer, parsed: GenerationRequest) -> int:
    # Off the event loop: rendering a long conversation's template and tokenizing it take a while.
    ids = await asyncio.get_running_loop().run_in_executor(
        None, server.engine.encode_prompt, parsed.prompt, True, parsed.options.tool_plan
    )
    return len(ids)


async def _messages(server: OpenAIServer, request: Request) -> Response:
    parsed = await _read(server, request)
    (job,) = server.queue.submit(parsed)
    max_tokens = parsed.options.max_tokens
    if not parsed.stream:
        try:
            result = await _unless_disconnected(request, job.result())
        except Exception as exc:
            _cancel([job])
            raise _engine_error(exc) from None
        if result is _DISCONNECTED:
            _cancel([job])
            return Response(status_code=499)  # nobody is listening any more
        return JSONResponse(message_response(result, server.model_id, max_tokens))
    events = _JobEvents([job])
    # Wait for the first event so a request the engine refuses still gets a 4xx status, not a broken stream.
    first = await _unless_disconnected(request, events.get())
    if first is _DISCONNECTED or first[1][0] == "error":
        events.close()
        _cancel([job])
        if first is _DISCONNECTED:
            return Response(status_code=499)
        raise _engine_error(first[1][1])
    try:
        prompt_tokens = await _prompt_tokens(server, parsed)
    except BaseException:
        events.close()
        _cancel([job])
        raise
    stream = MessageEvents(server.model_id, prompt_tokens, max_tokens, tools=parsed.tool_calls)
    return StreamingResponse(
        _events(stream, job, events, first[1]),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _events(stream: MessageEvents, job: Job, events: _JobEvents, event: Event) -> AsyncIterator[str]:
    # Starlette cancels this generator when the client disconnects; `finally` then stops the generation.
    try:
        for opening in stream.opening():
            yield sse_event(opening)
        while True:
            kind, value = event
            out: list[tuple[str, dict[str, Any]]]
            if kind == "piece":
                out = stream.piece(value[0])
            elif kind == "done":
                out = stream.finish(value)
            else:  # the engine failed mid-answer: Anthropic's error event ends the stream
                error = _engine_error(value)
                out = [("error", error_body(error.status, error.message))]
            for item in out:
                yield sse_event(item)
            if kind != "piece":
                break
            event = (await events.get())[1]
    finally:
        events.close()
        _cancel([job])
