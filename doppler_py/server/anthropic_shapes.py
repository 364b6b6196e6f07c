"""Anthropic's Messages API (`POST /v1/messages`) over the same engine: the answer as a message, its stream as
Anthropic's events (`MessageEvents`), and refusals in Anthropic's error shape (a request is read by
`anthropic_parsing`).

- stop_reason: "end_turn" (the model ended), "stop_sequence" (with the one met), "max_tokens", "tool_use", or
  "model_context_window_exceeded": a prompt that leaves less room in the context than max_tokens gets the room
  there is (`shorten_to_fit`) and ends there, as Anthropic's API does.
- `usage`: Anthropic counts the prompt as input_tokens + cache_read_input_tokens + cache_creation_input_tokens, so
  input_tokens are the prompt tokens prefilled and cache_read_input_tokens those whose K/V came from the prefix
  cache; cache_creation_input_tokens is 0 (the prefix cache keeps prompts by itself, at no extra cost).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from starlette.responses import JSONResponse

from doppler_py.api import GenerationResult
from doppler_py.server.errors import RequestError
from doppler_py.server.openai_shapes import doppler_stats
from doppler_py.tool_calls import Delta, ToolCallParser

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def is_messages_path(path: str) -> bool:
    """A route answered in Anthropic's shapes (its errors too)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


# --- errors --------------------------------------------------------------------------------------------------------
def error_body(status: int, message: str) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(error: RequestError) -> JSONResponse:
    headers = {"Retry-After": "1"} if error.status == 429 else None
    return JSONResponse(error_body(error.status, error.message), error.status, headers)


# --- the answer ----------------------------------------------------------------------------------------------------
def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def tool_use_id(call_id: str) -> str:
    """Anthropic's id of a call the engine named "call_..."."""
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(result: GenerationResult, max_tokens: int) -> str:
    if result.finish_reason == "tool_calls":
        return "tool_use"
    if result.finish_reason == "length":
        # Fewer tokens than asked for and cut: the prompt left less room in the context (`shorten_to_fit`).
        return "max_tokens" if len(result.tokens) >= max_tokens else "model_context_window_exceeded"
    return "end_turn" if result.stop_sequence is None else "stop_sequence"


def usage(result: GenerationResult) -> dict[str, int]:
    cached = result.cached_tokens
    return {
        "input_tokens": result.prompt_tokens - cached,
        "output_tokens": len(result.tokens),
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def _tool_input(arguments: str) -> dict[str, Any] | None:
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def content_blocks(result: GenerationResult) -> list[dict[str, Any]]:
    """The answer's blocks: its tool calls as tool_use blocks, or its text as one text block (empty text too)."""
    if not result.tool_calls:
        return [{"type": "text", "text": result.text}]
    blocks = []
    for call in result.tool_calls:
        arguments = _tool_input(call["function"]["arguments"])
        if arguments is None:  # a call cut short by max_tokens: its input is not JSON yet, so there is no block
            continue
        blocks.append(
            {"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"], "input": arguments}
        )
    return blocks


def message_response(result: GenerationResult, model: str, max_tokens: int) -> dict[str, Any]:
    reason = stop_reason(result, max_tokens)
    return {
        "id": message_id(),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content_blocks(result),
        "stop_reason": reason,
        "stop_sequence": result.stop_sequence if reason == "stop_sequence" else None,
        "usage": usage(result),
        "doppler": doppler_stats(result),
    }


Event = tuple[str, dict[str, Any]]  # (event name, data)


class MessageEvents:
    """One answer streamed as Anthropic's events: message_start, then per content block content_block_start,
    its deltas (text_delta; input_json_delta for a tool_use block's input) and content_block_stop, then
    message_delta (stop_reason, the final usage) and message_stop. With tools, the answer's text is read by a
    `ToolCallParser`, whose calls become tool_use blocks."""

    def __init__(self, model: str, prompt_tokens: int, max_tokens: int, *, tools: bool):
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.parser = ToolCallParser() if tools else None
        self.block: str | None = None  # the type of the open block
        self.index = -1  # the open (or last) block's index

    def opening(self) -> list[Event]:
        # The prefix cache's share of the prompt is known only at the end: message_start counts the whole prompt
        # as input, message_delta gives the final split (the client's snapshot takes message_delta's figures).
        message = {
            "id": message_id(),
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0},
        }
        return [("message_start", {"type": "message_start", "message": message}), ("ping", {"type": "ping"})]

    def piece(self, text: str) -> list[Event]:
        if self.parser is None:
            return self._text(text)
        return [event for delta in self.parser.feed(text) for event in self._delta(delta)]

    def finish(self, result: GenerationResult) -> list[Event]:
        events = [] if self.parser is None else [e for delta in self.parser.finish() for e in self._delta(delta)]
        if self.index < 0:  # an empty answer still has its (empty) text block, as the whole answer has
            events += self._open({"type": "text", "text": ""})
        events += self._close()
        reason = stop_reason(result, self.max_tokens)
        delta = {"stop_reason": reason, "stop_sequence": result.stop_sequence if reason == "stop_sequence" else None}
        body = {"type": "message_delta", "delta": delta, "usage": usage(result), "doppler": doppler_stats(result)}
        return [*events, ("message_delta", body), ("message_stop", {"type": "message_stop"})]

    def _delta(self, delta: Delta) -> list[Event]:
        if delta.kind == "content":
            return self._text(delta.text)
        if delta.kind == "call":
            block = {"type": "tool_use", "id": tool_use_id(delta.id or ""), "name": delta.name, "input": {}}
            return [*self._close(), *self._open(block)]
        return [self._block_delta({"type": "input_json_delta", "partial_json": delta.text})]

    def _text(self, text: str) -> list[Event]:
        if not text:
            return []
        opening = [] if self.block == "text" else [*self._close(), *self._open({"type": "text", "text": ""})]
        return [*opening, self._block_delta({"type": "text_delta", "text": text})]

    def _open(self, block: dict[str, Any]) -> list[Event]:
        self.index += 1
        self.block = block["type"]
        return [("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})]

    def _close(self) -> list[Event]:
        if self.block is None:
            return []
        self.block = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _block_delta(self, delta: dict[str, Any]) -> Event:
        return ("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})


def sse_event(event: Event) -> str:
    """A server-sent event as Anthropic sends them: its name, then its data."""
    name, data = event
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
