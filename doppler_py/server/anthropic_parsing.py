"""Anthropic's Messages API requests (`POST /v1/messages`): a body to the `GenerationRequest` the queue runs, its
conversation as the chat messages the engine renders and its options one `GenerationOptions`, every field checked
before it queues (a refusal is a 400 naming the field).

What maps to what:
- `system` (a string or text blocks) is the first, system, message. `messages` are user and assistant turns;
  consecutive turns of one role are combined (as Anthropic combines them); the first and the last are the user's.
- Text blocks are a turn's text; an assistant's `tool_use` blocks are its tool calls and a user's `tool_result`
  blocks the tool messages answering them, which `doppler_py.tool_calls` renders for the model.
- `tools` ({name, description, input_schema}) and `tool_choice` ({"type": "auto" | "any" | "tool" | "none"}) are the
  engine's function calling: "any" is "required", "tool" names one function, `disable_parallel_tool_use` allows one
  call. The answer is constrained to valid calls, so a `tool_use` block's input follows its schema.
- `max_tokens` is required; past the context's room it is a ceiling (`shorten_to_fit`, see `anthropic_shapes`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

from doppler_py.errors import GenerationOptionError
from doppler_py.options import CONSTRAINTS, GenerationOptions
from doppler_py.server.errors import RequestError
from doppler_py.server.parsing import GenerationRequest, _describe, _field, _option_error

# Sampling fields of Anthropic's with the same name and meaning as GenerationOptions', and this server's extensions
# (as on the OpenAI routes).
# "adapter": the LoRA adapter `adapters_route.request_adapter` resolved from `model` ("<id>:<name>") or the field.
_SAME = ("adapter", "temperature", "top_p", "top_k", "seed", "speculative", "k")
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # and "tool", which names one
_BLOCKS = ("text", "tool_use", "tool_result")


def _bad(param: str, message: str) -> RequestError:
    return RequestError(400, message, param=param)


@dataclass
class _Turn:
    role: str
    where: str  # "messages[i]" of its first message
    blocks: list[tuple[str, dict[str, Any]]]  # (where the block is, the block)


def _text_of(where: str, content: Any, what: str) -> str:
    """A string, or text blocks joined: the text of a system prompt or of a tool result."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        for j, block in enumerate(content):
            if not (isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)):
                kind = block.get("type") if isinstance(block, dict) else None
                raise _bad(f"{where}[{j}]", f"{where}[{j}]: {what} takes text blocks only, got {_describe(kind)}")
        return _joined(block["text"] for block in content)
    raise _bad(where, f"'{where}' must be a string or a list of text blocks, got {_describe(content)}")


def _joined(texts) -> str:
    # Blocks are separate passages of one turn (clients split a prompt into blocks to mark cache points).
    return "\n\n".join(texts)


def _check_block(where: str, role: str, block: Any) -> dict[str, Any]:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind not in _BLOCKS:
        raise _bad(
            f"{where}.type",
            f"{where}.type {_describe(kind)} is not supported: this server's text models read text, tool_use and "
            "tool_result blocks only",
        )
    if kind == "text" and not isinstance(block.get("text"), str):
        raise _bad(f"{where}.text", f"{where}.text must be a string")
    if kind == "tool_use":
        if role != "assistant":
            raise _bad(f"{where}.type", f"{where}: tool_use blocks belong in the assistant's turns")
        for name, kinds, what in (("id", str, "a string"), ("name", str, "a string"), ("input", dict, "an object")):
            if not isinstance(block.get(name), kinds):
                raise _bad(f"{where}.{name}", f"{where}.{name} must be {what}, got {_describe(block.get(name))}")
    if kind == "tool_result":
        if role != "user":
            raise _bad(f"{where}.type", f"{where}: tool_result blocks belong in the user's turns")
        if not isinstance(block.get("tool_use_id"), str):
            raise _bad(f"{where}.tool_use_id", f"{where}.tool_use_id must be a string")
        if block.get("is_error") not in (None, True, False):
            raise _bad(f"{where}.is_error", f"{where}.is_error must be true or false")
    return block


def _turns(messages: Any) -> list[_Turn]:
    """The conversation as alternating turns, each block checked and kept with where it was."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "'messages' must be a non-empty list of messages")
    turns: list[_Turn] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad(where, f"{where} must be an object with 'role' and 'content'")
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            hint = " (a system prompt is the top-level 'system' field)" if role == "system" else ""
            raise _bad(f"{where}.role", f"{where}.role must be 'user' or 'assistant', got {_describe(role)}{hint}")
        if isinstance(content, str):
            blocks = [(f"{where}.content", {"type": "text", "text": content})]
        elif isinstance(content, list):
            blocks = [
                (f"{where}.content[{j}]", _check_block(f"{where}.content[{j}]", role, b)) for j, b in enumerate(content)
            ]
        else:
            raise _bad(f"{where}.content", f"{where}.content must be a string or a list of content blocks")
        if not any(block["type"] != "text" or block["text"] for _, block in blocks):
            raise _bad(f"{where}.content", f"{where}.content must not be empty")
        if turns and turns[-1].role == role:
            turns[-1].blocks += blocks
        else:
            turns.append(_Turn(role, where, blocks))
    if turns[0].role != "user":
        raise _bad("messages[0].role", "messages[0].role must be 'user': the conversation starts with the user's turn")
    if turns[-1].role != "user":
        raise _bad(
            f"{turns[-1].where}.role",
            f"{turns[-1].where}: the last turn must be the user's (prefilling the assistant's answer is not supported)",
        )
    return turns


def _assistant_message(turn: _Turn) -> dict[str, Any]:
    text = _joined(block["text"] for _, block in turn.blocks if block["type"] == "text")
    calls = [
        {
            "id": block["id"],
            "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"], separators=(",", ":"))},
        }
        for _, block in turn.blocks
        if block["type"] == "tool_use"
    ]
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": text or None, "tool_calls": calls}


def _user_messages(turn: _Turn, calls: set[str]) -> list[dict[str, Any]]:
    """A user's turn: a tool message per tool_result (each answering one of `calls`, the tool_use ids of the
    assistant's turn before, all of which must be answered), then the turn's text, if any."""
    messages, texts, unanswered = [], [], set(calls)
    for where, block in turn.blocks:
        if block["type"] == "text":
            texts.append(block["text"])
            continue
        call = block["tool_use_id"]
        if call not in unanswered:
            problem = (
                "answers a call answered before" if call in calls else "matches no tool_use block of the turn before"
            )
            raise _bad(f"{where}.tool_use_id", f"{where}.tool_use_id {call!r} {problem}")
        unanswered.discard(call)
        text = _text_of(f"{where}.content", block.get("content") or "", "a tool_result")
        # The model is told when the tool failed: Anthropic's is_error has no place of its own in a chat template.
        messages.append(
            {"role": "tool", "tool_call_id": call, "content": f"Error: {text}" if block.get("is_error") else text}
        )
    if unanswered:
        raise _bad(
            f"{turn.where}.content",
            f"{turn.where}: tool_use ids {sorted(unanswered)} have no tool_result block in the user's next turn",
        )
    if texts:
        messages.append({"role": "user", "content": _joined(texts)})
    return messages


def chat_messages(system: Any, messages: Any) -> list[dict[str, Any]]:
    """The request's conversation as the chat messages (OpenAI's shape) that `Engine.stream` renders."""
    chat = []
    if system is not None:
        text = _text_of("system", system, "the system prompt")
        if text:
            chat.append({"role": "system", "content": text})
    calls: set[str] = set()  # the tool_use ids of the assistant's last turn
    for turn in _turns(messages):
        if turn.role == "assistant":
            message = _assistant_message(turn)
            calls = {call["id"] for call in message.get("tool_calls", ())}
            chat.append(message)
        else:
            chat += _user_messages(turn, calls)
            calls = set()
    return chat


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    """Anthropic's client tools as OpenAI's function tools (what `doppler_py.tool_calls` takes)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools", f"'tools' must be a list of tools, got {_describe(tools)}")
    functions = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad(where, f"{where} must be an object with 'name' and 'input_schema'")
        if tool.get("type") not in (None, "custom"):
            raise _bad(
                f"{where}.type",
                f"{where}.type {_describe(tool.get('type'))}: Anthropic's server tools are not supported here; give "
                "client tools (name, description, input_schema)",
            )
        if not isinstance(tool.get("name"), str):
            raise _bad(f"{where}.name", f"{where}.name must be a string")
        if not isinstance(tool.get("input_schema"), dict):
            raise _bad(f"{where}.input_schema", f"{where}.input_schema must be a JSON schema (an object)")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        # strict: the schema is compiled strictly (a keyword the grammar engine lacks is refused, not ignored).
        for name in ("description", "strict"):
            if tool.get(name) is not None:
                function[name] = tool[name]
        functions.append({"type": "function", "function": function})
    return functions


def _tool_choice(choice: Any) -> tuple[str | dict[str, Any] | None, bool]:
    """(OpenAI's tool_choice, parallel_tool_calls) of Anthropic's tool_choice."""
    if choice is None:
        return None, True
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in (*_TOOL_CHOICES, "tool"):
        raise _bad(
            "tool_choice",
            f'\'tool_choice\' must be {{"type": "auto" | "any" | "tool" | "none"}}, got {_describe(choice)}',
        )
    one = choice.get("disable_parallel_tool_use", False)
    if not isinstance(one, bool):
        raise _bad(
            "tool_choice.disable_parallel_tool_use", "tool_choice.disable_parallel_tool_use must be true or false"
        )
    if kind != "tool":
        return _TOOL_CHOICES[kind], not one
    if not isinstance(choice.get("name"), str):
        raise _bad("tool_choice.name", "tool_choice of type 'tool' needs the tool's 'name'")
    return {"type": "function", "function": {"name": choice["name"]}}, not one


def _anthropic_names(error: RequestError) -> RequestError:
    """An option error about tools named with Anthropic's fields (tools[i].input_schema, not ...function.parameters)."""

    def rename(text: str) -> str:
        text = re.sub(r"(tools\[\d+\])\.function\.parameters", r"\1.input_schema", text)
        return re.sub(r"(tools\[\d+\])\.function\.", r"\1.", text)

    error.message = rename(error.message)
    error.param = error.param and rename(error.param)
    return error


def _refuse_unsupported(body: dict) -> None:
    """Fields that would change the answer and that this server cannot honour get a 400, not silence."""
    thinking = body.get("thinking")
    if thinking is not None and not (isinstance(thinking, dict) and thinking.get("type") == "disabled"):
        raise _bad("thinking", "'thinking' (extended thinking) is not supported by this server")
    for name in ("mcp_servers", "container"):
        if body.get(name) not in (None, [], {}):
            raise _bad(name, f"'{name}' is not supported by this server")


def parse_messages(body: dict, defaults: GenerationOptions, *, counting: bool = False) -> GenerationRequest:
    """A Messages body to the request the queue runs (one generation), every field checked before it queues.
    `counting`: for /v1/messages/count_tokens, which needs no max_tokens."""
    _refuse_unsupported(body)
    prompt = chat_messages(body.get("system"), body.get("messages"))
    stream = _field(body, "stream", (bool,), "true or false") or False
    given = {name: body[name] for name in _SAME if body.get(name) is not None}
    if body.get("max_tokens") is not None:
        given["max_tokens"] = body["max_tokens"]
    elif not counting:
        raise _bad("max_tokens", "'max_tokens' is required: the most tokens the answer may have")
    stops = _field(body, "stop_sequences", (list,), "a list of strings")
    if stops:
        given["stop"] = stops
    tools = _tools(body.get("tools"))
    if tools is not None or body.get("tool_choice") is not None:
        given["tools"] = tools
        given["tool_choice"], given["parallel_tool_calls"] = _tool_choice(body.get("tool_choice"))
        # The tools' constraint replaces any constraint among the server's defaults.
        defaults = replace(defaults, **dict.fromkeys(CONSTRAINTS))
    try:
        # shorten_to_fit: a max_tokens beyond the context's room ends the answer where the context does.
        options = replace(defaults, chat=True, shorten_to_fit=True, **given)
    except GenerationOptionError as exc:
        raise _anthropic_names(_option_error(exc, {"stop": "stop_sequences"})) from None
    return GenerationRequest(prompt, options, stream, include_usage=False)
