"""Tool (function) calls, OpenAI style: the tools rendered into the prompt, ONE grammar that makes the model's answer
either a well-formed call of an offered function or (tool_choice "auto") plain text, and a parser that turns the
answer, whole or streamed, into OpenAI's `tool_calls`.

The answer format (the Hermes / Qwen convention, the most common among small open models) is one or more blocks

    <tool_call>
    {"name":"get_weather","arguments":{"city":"Paris"}}
    </tool_call>

separated by one newline (at most one block with parallel_tool_calls=False). The JSON inside a block follows
`{"anyOf": [{"name": <const>, "arguments": <that function's parameters schema>}, ...]}`, compact (no free
whitespace: a model cannot run away in blanks). With tool_choice "auto" the grammar is `TEXT | calls`, where TEXT
is any text that does not start with "<tool_call>": the model answers in words, or the moment it writes the
opening tag it is held to a valid call. "required" and a named function allow calls only (a named one, that
function only). "none" (or no tools) constrains nothing and does not show the tools.

Prompt: when the model's chat template takes `tools` (it names the variable), the tools go to the template, so
the model sees them as it was trained to; otherwise (SmolLM2, the tiny test models) they are described in the
system message (`tools_system_prompt`). Earlier assistant calls are rendered in the answer format above, and tool
results (role "tool") as `<tool_response>` blocks, unless the template renders tool calls itself.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from doppler_py.constraints.grammar import short_json
from doppler_py.errors import GenerationOptionError

if TYPE_CHECKING:
    from doppler_py.tokenizer import Tokenizer

CALL_TAG = "<tool_call>"
CALL_OPEN = CALL_TAG + "\n"
CALL_CLOSE = "\n</tool_call>"
TOOL_CHOICES = ("none", "auto", "required")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
# What precedes the arguments inside a block; the grammar makes it compact, the parser also reads spaced JSON.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*')
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: Mapping[str, Any]
    strict: bool

    def as_tool(self) -> dict[str, Any]:
        """The OpenAI tool object, as shown to the model."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function | {"parameters": dict(self.parameters)}}


@dataclass(frozen=True)
class ToolPlan:
    """Checked tools and choice: what the prompt shows, and the grammar the answer follows."""

    functions: tuple[Function, ...]  # the functions the answer may call (a named choice: that one only)
    choice: str  # "auto" or "required" (a named function is "required" over one function)
    parallel: bool  # more than one call per answer
    named: str | None = None

    @property
    def tools(self) -> list[dict[str, Any]]:
        return [function.as_tool() for function in self.functions]

    @property
    def grammar(self) -> str:
        """The Lark grammar (llguidance's dialect, `%json` for the call objects) of an answer."""
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": f.name}, "arguments": dict(f.parameters)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in self.functions
        ]
        # Compact JSON: with free whitespace a small model can fill max_tokens with blanks. Lenient (keywords
        # llguidance does not implement are ignored) unless every function asked for strict schemas.
        options = {"whitespace_flexible": False, "lenient": not all(f.strict for f in self.functions)}
        body = json.dumps({"anyOf": calls, "x-guidance": options})
        lines = [
            "start: TEXT | calls" if self.choice == "auto" else "start: calls",
            'calls: call ("\\n" call)*' if self.parallel else "calls: call",
            'call: "<tool_call>\\n" body "\\n</tool_call>"',
            f"body: %json {body}",
        ]
        if self.choice == "auto":
            lines.append("TEXT: /(?s:.*)/ & ~/<tool_call>(?s:.*)/")
        return "\n".join(lines) + "\n"


def _check_function(index: int, tool: Any) -> Function:
    where = f"tools[{index}]"
    if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(tool.get("function"), Mapping):
        raise GenerationOptionError(f'{where} must be {{"type": "function", "function": {{"name": ...}}}}')
    spec = tool["function"]
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise GenerationOptionError(f"{where}.function.name must be 1-64 letters, digits, _ or -, got {name!r}")
    description = spec.get("description")
    if description is not None and not isinstance(description, str):
        raise GenerationOptionError(f"{where}.function.description must be a string")
    strict = spec.get("strict") or False
    if not isinstance(strict, bool):
        raise GenerationOptionError(f"{where}.function.strict must be true or false, got {strict!r}")
    parameters = spec.get("parameters")
    if parameters is None:  # OpenAI: a function without parameters takes none
        parameters = _NO_PARAMETERS
    from doppler_py.constraints.grammar import json_schema_constraint

    # Each schema on its own first, so an error names the function it is in.
    json_schema_constraint(parameters, strict=strict, option=f"{where}.function.parameters")
    return Function(name, description, parameters, strict)


def tool_plan(
    tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any = None, parallel_tool_calls: bool = True
) -> ToolPlan | None:
    """The checked plan, or None when nothing may be called (no tools, or tool_choice "none").

    tool_choice: "auto" (the default with tools), "required", "none", or {"type": "function", "function":
    {"name": NAME}}. Errors are GenerationOptionError naming the field ("tools[1].function.parameters", ...).
    """
    if tools is None:
        if tool_choice not in (None, "none", "auto"):
            raise GenerationOptionError(f"tool_choice={short_json(tool_choice)} needs tools")
        return None
    if not isinstance(tools, Sequence) or isinstance(tools, str | bytes):
        raise GenerationOptionError(f"tools must be a list of tools, got {type(tools).__name__}")
    functions = [_check_function(i, tool) for i, tool in enumerate(tools)]
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise GenerationOptionError(f"tools: function names must be distinct, got {names}")
    if not isinstance(parallel_tool_calls, bool):
        raise GenerationOptionError(f"parallel_tool_calls must be true or false, got {short_json(parallel_tool_calls)}")
    if tool_choice is None:
        tool_choice = "auto"
    if isinstance(tool_choice, Mapping):
        spec = tool_choice.get("function")
        name = spec.get("name") if isinstance(spec, Mapping) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise GenerationOptionError(
                f'tool_choice must be "none", "auto", "required" or {{"type": "function", "function": '
                f'{{"name": ...}}}}, got {short_json(tool_choice)}'
            )
        if name not in names:
            raise GenerationOptionError(f"tool_choice names {name!r}, which is not among the tools ({names})")
        chosen = tuple(f for f in functions if f.name == name)
        return ToolPlan(chosen, "required", parallel_tool_calls, named=name)
    if tool_choice not in TOOL_CHOICES:
        raise GenerationOptionError(
            f'tool_choice must be "none", "auto", "required" or a named function, got {short_json(tool_choice)}'
        )
    if tool_choice == "none" or not functions:
        return None
    return ToolPlan(tuple(functions), tool_choice, parallel_tool_calls)


# --- the prompt --------------------------------------------------------------------------------------------------
def template_takes_tools(tokenizer: Tokenizer) -> bool:
    """Whether the chat template reads a `tools` variable (then it renders tools and tool calls itself)."""
    if tokenizer.chat_template is None:
        return False
    import jinja2
    import jinja2.meta

    try:
        parsed = jinja2.Environment().parse(tokenizer.chat_template)
    except jinja2.TemplateError:
        return False
    return "tools" in jinja2.meta.find_undeclared_variables(parsed)


def tools_system_prompt(plan: ToolPlan) -> str:
    """The description of the tools and the answer format, for templates that do not render tools."""
    tools = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in plan.tools)
    if plan.named is not None:
        rule = f"You must call the function {plan.named}."
    elif plan.choice == "required":
        rule = "You must call one of these functions."
    else:
        rule = "Call a function when it helps; otherwise answer in plain text."
    many = " Write one block per call." if plan.parallel else " Call at most one function."
    return (
        "You can call these functions (one JSON description per line):\n"
        f"<tools>\n{tools}\n</tools>\n"
        f"{rule} To call a function, answer with exactly:\n"
        f'{CALL_OPEN}{{"name":"<function name>","arguments":<the arguments as a JSON object>}}{CALL_CLOSE}\n'
        f"{many.strip()} Each function's result comes back in a <tool_response></tool_response> block."
    )


def render_call(call: Mapping[str, Any]) -> str:
    """An earlier call (OpenAI shape) in the answer format."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise GenerationOptionError(f"a tool call needs function.name and function.arguments, got {short_json(call)}")
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, separators=(",", ":"))
    return f'{CALL_OPEN}{{"name":"{function["name"]}","arguments":{arguments}}}{CALL_CLOSE}'


def chat_messages(
    messages: Sequence[Mapping[str, Any]], tokenizer: Tokenizer, plan: ToolPlan | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages for the chat template, extra template variables): tool calls and results in the history made
    renderable, and the plan's tools shown (see the module's docstring)."""
    native = template_takes_tools(tokenizer)
    rendered: list[dict[str, Any]] = []
    for message in messages:
        message = dict(message)
        calls = message.get("tool_calls")
        if calls and not native:
            text = "\n".join(render_call(call) for call in calls)
            message = {"role": message.get("role"), "content": "\n".join(filter(None, [message.get("content"), text]))}
        elif calls:
            message["tool_calls"] = [_with_parsed_arguments(call) for call in calls]
            message["content"] = message.get("content") or ""
        elif message.get("role") == "tool" and not native:
            message = {"role": "tool", "content": f"<tool_response>\n{message.get('content')}\n</tool_response>"}
        rendered.append(message)
    if plan is None:
        return rendered, {}
    if native:
        return rendered, {"tools": plan.tools}
    prompt = tools_system_prompt(plan)
    if rendered and rendered[0].get("role") == "system":
        rendered[0] = rendered[0] | {"content": f"{rendered[0].get('content')}\n\n{prompt}"}
    else:
        rendered.insert(0, {"role": "system", "content": prompt})
    return rendered, {}


def _with_parsed_arguments(call: Mapping[str, Any]) -> dict[str, Any]:
    # Templates that render tool calls (transformers' convention) expect the arguments as an object.
    call = dict(call)
    function = dict(call.get("function") or {})
    if isinstance(function.get("arguments"), str):
        with contextlib.suppress(ValueError):  # otherwise left as written: the template shows it as text
            function["arguments"] = json.loads(function["arguments"])
    call["function"] = function
    return call


# --- the answer --------------------------------------------------------------------------------------------------
@dataclass
class Delta:
    """One piece of a parsed answer: content text, a call's start (index, id, name) or a piece of its arguments."""

    kind: str  # "content", "call" or "arguments"
    text: str = ""
    index: int = 0
    id: str | None = None
    name: str | None = None


@dataclass
class ToolCallParser:
    """Reads an answer in the format above as it streams, one piece at a time: `feed(piece)` returns the deltas
    it completes, `finish()` the rest. Text that might still open a call ("<tool_c") is held back until it is
    known; a call's arguments are released as they come (the grammar guarantees the layout around them)."""

    state: str = "undecided"  # undecided | content | open | head | arguments | tail | between
    buffer: str = ""
    content: str | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _started: bool = False

    def feed(self, text: str) -> list[Delta]:
        self.buffer += text
        out: list[Delta] = []
        while self.buffer and self._step(out):
            pass
        return out

    def finish(self) -> list[Delta]:
        """The deltas left at the end of the answer (held-back text that turned out to be content)."""
        out: list[Delta] = []
        if self.state in ("undecided", "content") and self.buffer:
            self._content(self.buffer, out)
            self.buffer = ""
        return out

    def _content(self, text: str, out: list[Delta]) -> None:
        self.state = "content"
        self.content = (self.content or "") + text
        out.append(Delta("content", text))

    def _step(self, out: list[Delta]) -> bool:
        """Consume what the buffer allows in the current state; False when it must wait for more text."""
        state, buffer = self.state, self.buffer
        if state == "undecided":
            if buffer.startswith(CALL_TAG):
                self.state = "open"
            elif CALL_TAG.startswith(buffer):
                return False
            else:
                self.state = "content"
            return True
        if state == "content":
            self._content(buffer, out)
            self.buffer = ""
            return False
        if state in ("open", "between"):
            opening = CALL_OPEN if state == "open" else "\n" + CALL_OPEN
            if len(buffer) < len(opening):
                return False
            self.buffer, self.state = buffer.removeprefix(opening), "head"
            return True
        if state == "head":
            match = _HEAD.match(buffer)
            if match is None:
                return False
            call_id = f"call_{uuid.uuid4().hex[:24]}"
            self.calls.append({"id": call_id, "type": "function", "function": {"name": match[1], "arguments": ""}})
            out.append(Delta("call", index=len(self.calls) - 1, id=call_id, name=match[1]))
            self.buffer, self.state = buffer[match.end() :], "arguments"
            self._depth, self._in_string, self._escaped, self._started = 0, False, False, False
            return True
        if state == "arguments":
            end = self._scan(buffer)
            piece = buffer[:end]
            if piece:
                self.calls[-1]["function"]["arguments"] += piece
                out.append(Delta("arguments", piece, index=len(self.calls) - 1))
            self.buffer = buffer[end:]
            if end < len(buffer) or self._complete:
                self.state = "tail"
                return True
            return False
        if state == "tail":  # the closing brace of the call object, then the closing tag
            at = buffer.find(CALL_CLOSE.strip())
            if at < 0:
                return False
            self.buffer, self.state = buffer[at + len(CALL_CLOSE.strip()) :], "between"
            return True
        return False

    @property
    def _complete(self) -> bool:
        return self._started and self._depth == 0 and not self._in_string

    def _scan(self, text: str) -> int:
        """How much of `text` belongs to the arguments value (a JSON value: object, array or scalar)."""
        for i, char in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
                    if self._depth == 0:
                        return i + 1
                continue
            if self._depth == 0 and self._started and char in ",}":
                return i  # a scalar value ended
            if char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._started = True
                    return i + 1
            elif char == '"':
                self._in_string = True
            elif char.isspace() and not self._started:
                continue
            self._started = True
        return len(text)


def parse_answer(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a whole answer; an answer cut short (max_tokens) gives its calls so far, the
    last one with the arguments written before the cut."""
    parser = ToolCallParser()
    parser.feed(text)
    parser.finish()
    return (None if parser.calls else parser.content or ""), parser.calls
