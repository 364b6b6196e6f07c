"""Request parsing and validation: an OpenAI request body (completions or chat) to a `GenerationRequest`, whose
options are `Engine.stream`'s keyword arguments, checked before the request queues; what is refused is a
`RequestError` (400) naming the field."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

from doppler_py.constraints.grammar import constraint_from_options
from doppler_py.defaults import TEMPERATURE
from doppler_py.errors import GenerationOptionError
from doppler_py.ops.logprobs import MAX_TOP_LOGPROBS
from doppler_py.ops.speculative import MAX_DRAFT_TOKENS
from doppler_py.options import check_stop
from doppler_py.sampling import SamplingParams
from doppler_py.server.errors import RequestError
from doppler_py.speculative.registry import speculative_modes
from doppler_py.tool_calls import tool_plan

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
