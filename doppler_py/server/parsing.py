"""Request parsing and validation: an OpenAI request body (completions or chat) to a `GenerationRequest`, whose
options are a `GenerationOptions` (checked there) built over the server's defaults before the request queues; what
is refused is a `RequestError` (400) naming the field."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

from doppler_py.errors import GenerationOptionError
from doppler_py.options import CONSTRAINTS, GenerationOptions
from doppler_py.server.errors import RequestError

# Request fields that would change the output if honoured, with the values that mean "not used".
_UNSUPPORTED_UNLESS = {
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "functions": ([],),
}
_TOOLS = ("tools", "tool_choice", "parallel_tool_calls")  # chat only
# Request fields that are GenerationOptions fields of the same name and shape; max_tokens, logprobs, tree and stop
# have OpenAI shapes of their own (see `_options`).
_SAME = (
    "adapter",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "repeat_last_n",
    "logit_bias",
    "speculative",
    "k",
    *CONSTRAINTS,
    *_TOOLS,
)
# llama.cpp's names for options of ours: request field -> option.
_ALIASES = {"repeat_penalty": "repetition_penalty"}
MAX_CHOICES = 16  # `n`: each choice is a generation of its own
_FIELD_PATH = re.compile(r"[A-Za-z_][\w.\[\]]*")


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


@dataclass
class GenerationRequest:
    prompt: str | list[dict]
    options: GenerationOptions  # chat=True for /v1/chat/completions
    stream: bool
    include_usage: bool
    n: int = 1  # choices asked for

    @property
    def tool_calls(self) -> bool:
        """The answer may hold tool calls: stream it through a ToolCallParser."""
        return self.options.tool_plan is not None

    @property
    def greedy(self) -> bool:
        """Every choice would be the same answer."""
        return self.options.sampling.greedy

    def generations(self) -> list[GenerationRequest]:
        """The generations that answer it: one per choice, choice i with seed + i when seeded (else a seed of its
        own, drawn by the engine); one for all when greedy."""
        if self.n == 1 or self.greedy:
            return [replace(self, n=1)]
        seed = self.options.seed
        return [
            replace(self, n=1, options=self.options if seed is None else replace(self.options, seed=seed + i))
            for i in range(self.n)
        ]


def _option_error(exc: GenerationOptionError, fields: dict[str, str]) -> RequestError:
    """400 for a bad option, naming the request field that gave it (`fields`: option -> field where they differ):
    param is the field path the message starts with ("tools[0].function.parameters"), else the field."""
    message, option = str(exc), exc.option
    field = fields.get(option, option)
    if option and message.startswith(f"{option} "):
        return RequestError(400, f"'{field}'{message[len(option) :]}", param=field)
    path = _FIELD_PATH.match(message)
    return RequestError(400, message, param=path[0] if path and option and path[0].startswith(option) else field)


def _options(body: dict, defaults: GenerationOptions, *, chat: bool) -> GenerationOptions:
    """The request's options over the server's defaults. Only OpenAI's shapes are read here; the values are
    checked by GenerationOptions, so a bad one never queues."""
    for name, unused in _UNSUPPORTED_UNLESS.items():
        if body.get(name) is not None and not any(body[name] == value for value in unused):
            raise RequestError(400, f"'{name}' is not supported by this server", param=name)
    given = {name: body[name] for name in _SAME if body.get(name) is not None}
    fields: dict[str, str] = {}  # option -> the request field that gave it, where the names differ
    for alias, option in _ALIASES.items():
        if body.get(alias) is not None and option not in given:
            given[option], fields[option] = body[alias], alias
    if not chat and (tool := next((name for name in _TOOLS if name in given), None)):
        raise RequestError(400, f"'{tool}' is only for /v1/chat/completions", param=tool)
    if chat:  # logprobs: true with top_logprobs: N; max_completion_tokens before max_tokens
        wanted = _field(body, "logprobs", (bool,), "true or false")
        top = body.get("top_logprobs")
        if top is not None and not wanted:
            raise RequestError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        if wanted:
            given["logprobs"], fields["logprobs"] = (0 if top is None else top), "top_logprobs"
        if body.get("max_completion_tokens") is not None:
            given["max_tokens"], fields["max_tokens"] = body["max_completion_tokens"], "max_completion_tokens"
    elif body.get("logprobs") is not None:
        given["logprobs"] = body["logprobs"]
    if "max_tokens" not in given and body.get("max_tokens") is not None:
        given["max_tokens"] = body["max_tokens"]
    if body.get("tree") is not None:
        given["tree"] = None if body["tree"] == "auto" else body["tree"]  # "auto": the engine's policy decides
    if body.get("stop") not in (None, [], ""):  # what clients send to mean "no stop strings"
        given["stop"] = body["stop"]
    if any(name in given for name in (*CONSTRAINTS, *_TOOLS)):
        # The request's constraint (or tools) replaces any constraint among the server's defaults.
        defaults = replace(defaults, **dict.fromkeys(CONSTRAINTS))
    # Without max_tokens the server's default is a ceiling: a long prompt gets the room left, as OpenAI's does.
    try:
        return replace(defaults, chat=chat, shorten_to_fit="max_tokens" not in given, **given)
    except GenerationOptionError as exc:
        raise _option_error(exc, fields) from None


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


def parse_request(body: dict, defaults: GenerationOptions, *, chat: bool) -> GenerationRequest:
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
    n = _field(body, "n", (int,), "an integer")
    if n is not None and not 1 <= n <= MAX_CHOICES:
        raise RequestError(400, f"'n' must be in 1..{MAX_CHOICES}, got {n}", param="n")
    return GenerationRequest(prompt, options, stream, include_usage, n=n or 1)
