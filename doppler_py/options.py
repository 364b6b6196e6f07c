"""One generation request's options (`GenerationOptions`), checked in one place.

The Python API (`Engine.stream` / `Engine.generate`), the CLI (its generation flags) and the server (a request's
JSON body) each build one; its defaults are `doppler_py.defaults`. Every value that is wrong on its own (a type, a
range, a combination refused whatever the model) raises `GenerationOptionError` when the object is made, naming
the option (`exc.option`) and the value. What needs the loaded model stays with the engine: the prompt against
the context (`CapacityError`), a drafter the model has no draft model or head for, `k` past the engine's
buffers, trees a drafter cannot propose.

To add an option: a field (with its default and a comment saying what it means) and one check line in `_check`
whose message starts with the field's name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from functools import cached_property
from typing import Any

from doppler_py import defaults, tool_calls
from doppler_py.errors import GenerationOptionError
from doppler_py.ops.logprobs import check_top_logprobs
from doppler_py.ops.speculative import MAX_DRAFT_TOKENS
from doppler_py.sampling import SamplingParams
from doppler_py.speculative.registry import speculative_modes

MAX_STOP_SEQUENCES = 4  # as OpenAI
CONSTRAINTS = ("response_format", "regex", "grammar")  # at most one
NO_SPECULATION = (None, "none", "off", False)  # what plain decoding may be called; kept as None


@dataclass(frozen=True)
class GenerationOptions:
    """How to answer one prompt. Made with keywords (`GenerationOptions(max_tokens=64, stop="\\n")`), checked at
    once; `dataclasses.replace` gives a changed copy, checked again.

    max_tokens: the most new tokens; a prompt that leaves less room in the model's context is refused
    (CapacityError), unless `shorten_to_fit`: then max_tokens is only a ceiling and the answer gets the room there
    is (finish_reason "length" where it runs out), as for a server's default when a request names none.

    temperature / top_k / top_p / seed: sampling (`sampling`, a `SamplingParams`); temperature 0 is greedy. A seed
    fixes a sampled answer exactly; without one each sampled generation draws its own.

    presence_penalty / frequency_penalty / repetition_penalty / repeat_last_n / logit_bias / min_p: what changes
    the logits before temperature, top-k and top-p, in this order, on the GPU (`testing.penalty_reference` is the
    exact contract): the repetition penalty (logit > 0 ? logit / r : logit * r for each token among the last
    repeat_last_n tokens, prompt included; r = 1 off, repeat_last_n 64 by default, -1 every token, 0 off), then
    logit -= frequency_penalty * count + presence_penalty * (count > 0), count = the token's occurrences among the
    generated tokens (OpenAI's definitions, in [-2, 2]), then logit += logit_bias[token] ({token id: bias in
    [-100, 100]}; -100 in effect bans a token, +100 in effect forces it), then the constraint's mask (response_format,
    regex, grammar, tools), then after temperature min_p ([0, 1], 0 off): tokens less likely than min_p times the
    likeliest are dropped. Under speculation each verified row counts the drafts before it on its own path (a chain's
    earlier drafts, a tree row's ancestors), so the output is exactly what plain decoding with these options gives.

    speculative: "auto" (per model: a loaded draft model, else a trained head with prompt lookup, else prompt
    lookup), a drafter's name (`registry.DRAFTERS`), or None / "none" for plain decoding (kept as None).

    k: the draft tokens (nodes) one step may verify, whatever their shape (a chain's length, a tree's node budget,
    lookahead's nodes; for a drafter that ends its chains by its confidence, the most it may draft); None: the
    policy chooses per step from measured costs and acceptance.

    chat: apply the chat template to a string prompt (None: no; a list of messages always goes through it).

    stop: up to 4 strings (or one string; kept as a tuple); generation ends at the first occurrence of any of them,
    which is not part of the text (finish_reason "stop"). Text that could be the start of a stop string is held
    back until it is known not to be one.

    logprobs: None (off) or N in 0..20: the result then holds, per returned token, its log-probability and the N
    most likely tokens of its position. They are log_softmax(logits / T) of the target model's raw logits over the
    whole vocabulary, T the request's temperature (1 when greedy, so greedy requests report the model's own
    probabilities, as OpenAI does), before top-k/top-p filtering; computed on the GPU from the rows each step
    already verified (no extra forward). Not given for token trees.

    tree: token trees of prompt-lookup drafts (several earlier continuations verified in one forward), of
    draft-model drafts (the greedy chain plus each row's second-best token as a leaf) or of Medusa heads (each
    head's best tokens), whose nodes are chosen by measured acceptance per depth and rank
    (`speculative.trees.ranked`), or of an EAGLE head (EAGLE-2's dynamic tree, `speculative.trees.dynamic`).
    None: used when this device's measured verification costs say extra rows are nearly free (`policy.trees_pay`:
    GPUs, not CPU adapters); True: used, with the policy's draft length as the node budget and, for model-drafted
    trees, only the nodes worth their verification cost (`policy.tree_budget`); with k given, k nodes; False:
    chains only. Sampled trees are verified exactly (recursive rejection over each node's children), so trees keep
    the target's distribution at any temperature.

    response_format / regex / grammar (at most one): the output follows a constraint. OpenAI's shapes
    ({"type": "text"}: none, kept as None; {"type": "json_object"}; {"type": "json_schema", "json_schema":
    {"name", "schema", "strict"}}), a regular expression, or a Lark grammar (llguidance's dialect). Every token is
    sampled from the model's distribution renormalised over the tokens the constraint allows (masked on the GPU),
    with any drafter; tokens the constraint forces are drafted for free. The answer ends when the constraint is
    complete (or at max_tokens, finish_reason "length", possibly unfinished).

    tools / tool_choice / parallel_tool_calls: OpenAI's function calling (`doppler_py.tool_calls`), for chat
    prompts. The tools are shown to the model (through its chat template when it takes `tools`, else in the system
    message) and the answer is constrained to `<tool_call>` blocks of valid calls: tool_choice "required" or
    {"type": "function", "function": {"name": ...}} forces a call, "auto" (the default) allows plain text instead,
    "none" neither shows nor calls them (`tool_plan`). Not combined with response_format, regex or grammar.

    adapter: the LoRA adapter (its name, as loaded: `load(lora=...)`, `Engine.add_adapter`) the model answers with;
    None: the base model. Generations with different adapters, or none, still share the engine's forwards.

    shorten_to_fit: see max_tokens.
    """

    max_tokens: int = defaults.MAX_TOKENS
    temperature: float = defaults.TEMPERATURE
    top_k: int = defaults.TOP_K
    top_p: float = defaults.TOP_P
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    repeat_last_n: int = defaults.REPEAT_LAST_N
    logit_bias: Mapping[Any, float] | None = None
    min_p: float = defaults.MIN_P
    speculative: str | None = defaults.SPECULATIVE
    k: int | None = defaults.K
    chat: bool | None = None
    stop: str | Sequence[str] | None = ()
    logprobs: int | None = None
    tree: bool | None = defaults.TREE
    response_format: Mapping[str, Any] | None = None
    regex: str | None = None
    grammar: str | None = None
    tools: Sequence[Mapping[str, Any]] | None = None
    tool_choice: str | Mapping[str, Any] | None = None
    parallel_tool_calls: bool = True
    adapter: str | None = None
    shorten_to_fit: bool = False

    def __post_init__(self) -> None:
        try:
            self._check()
        except GenerationOptionError as exc:
            exc.option = exc.option or _option_named(str(exc))
            raise

    def _check(self) -> None:
        """Every check, in order; each message starts with the option's name (which `__post_init__` then blames)."""
        _whole("max_tokens", self.max_tokens, 1, None, "")
        self.sampling  # noqa: B018  (temperature .. min_p: SamplingParams' own checks)
        self._keep("speculative", check_speculative(self.speculative))
        _whole("k (draft length)", self.k, 1, MAX_DRAFT_TOKENS, " or None (the policy's choice)")
        _flag("chat", self.chat, optional=True)
        self._keep("stop", check_stop(self.stop))
        check_top_logprobs(self.logprobs)
        check_tree(self.tree)
        if self.tree is True and self.logprobs is not None:
            raise GenerationOptionError(
                "logprobs are not given for token trees: use tree=False with logprobs", option="logprobs"
            )
        self._keep("response_format", _response_format(self.response_format))
        _text("regex", self.regex, "a string (a regular expression)")
        _text("grammar", self.grammar, "a string (a Lark grammar)")
        _flag("parallel_tool_calls", self.parallel_tool_calls)
        self.tool_plan  # noqa: B018  (tools, tool_choice: their shapes and names)
        self._check_constraint()
        _text("adapter", self.adapter, "a string (a loaded LoRA adapter's name)")
        _flag("shorten_to_fit", self.shorten_to_fit)

    @cached_property
    def sampling(self) -> SamplingParams:
        """How each token is picked."""
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            repeat_last_n=self.repeat_last_n,
            logit_bias=self.logit_bias,
            min_p=self.min_p,
        )

    @cached_property
    def tool_plan(self) -> tool_calls.ToolPlan | None:
        """The tools' checked plan (its grammar constrains the answer), or None when nothing may be called."""
        return tool_calls.tool_plan(self.tools, self.tool_choice, self.parallel_tool_calls)

    def _check_constraint(self) -> None:
        """At most one constraint, not beside tools, and one llguidance compiles (without a tokenizer)."""
        given = {name: getattr(self, name) for name in CONSTRAINTS if getattr(self, name) is not None}
        if not given:
            return
        if self.tool_plan is not None:
            raise GenerationOptionError("tools are not combined with response_format, regex or grammar")
        from doppler_py.constraints.grammar import constraint_from_options  # llguidance, only when asked for

        try:
            constraint_from_options(**given)
        except GenerationOptionError as exc:  # "give one of ...": blame the first given
            exc.option = _option_named(str(exc)) or next(iter(given))
            raise

    def _keep(self, name: str, value: Any) -> None:
        """Store a field's normal form (a tuple of stop strings, None for plain decoding or no constraint)."""
        object.__setattr__(self, name, value)


def request_options(options: GenerationOptions | None = None, **keywords: Any) -> GenerationOptions:
    """`options` (None: the defaults) with `keywords` replacing its fields: what `Engine.stream` generates with."""
    if options is None:
        return GenerationOptions(**keywords)
    if not isinstance(options, GenerationOptions):
        raise TypeError(f"options must be a GenerationOptions, got {type(options).__name__}")
    return replace(options, **keywords) if keywords else options


def check_speculative(speculative: Any) -> str | None:
    """A drafter's name (`speculative_modes`), or None for plain decoding."""
    if speculative in NO_SPECULATION:
        return None
    if speculative not in speculative_modes():
        raise GenerationOptionError(
            f"speculative must be one of None, {', '.join(speculative_modes())}; got {speculative!r}"
        )
    return speculative


def check_stop(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """The stop strings of a request: None, one string, or a list of at most 4 non-empty strings."""
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list | tuple) or not all(isinstance(s, str) for s in stops):
        raise GenerationOptionError(f"stop must be a string or a list of strings, got {stop!r}")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise GenerationOptionError(f"stop must hold at most {MAX_STOP_SEQUENCES} strings, got {len(stops)}")
    if any(not s for s in stops):
        raise GenerationOptionError("stop strings must not be empty")
    return tuple(stops)


def check_tree(tree: Any) -> None:
    if not (tree is None or isinstance(tree, bool)):
        raise GenerationOptionError(
            f"tree must be True, False or None (the shape of the drafts: trees, chains, or trees where they pay), "
            f"got {tree!r}; how many nodes one step verifies is k (the node budget is 'k')"
        )


def _whole(name: str, value: Any, low: int, high: int | None, otherwise: str) -> None:
    """An integer in low..high (None: no ceiling); `otherwise` says what else is allowed (None, for one)."""
    if value is None and otherwise:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
        allowed = f"in {low}..{high}" if high else f">= {low}"
        raise GenerationOptionError(f"{name} must be an integer {allowed}{otherwise}, got {value!r}")


def _flag(name: str, value: Any, *, optional: bool = False) -> None:
    if not (isinstance(value, bool) or (optional and value is None)):
        raise GenerationOptionError(f"{name} must be True or False{' or None' if optional else ''}, got {value!r}")


def _text(name: str, value: Any, what: str) -> None:
    if value is not None and not isinstance(value, str):
        raise GenerationOptionError(f"{name} must be {what}, got {_short(value)}")


def _response_format(response_format: Any) -> Mapping[str, Any] | None:
    """OpenAI's response_format, with {"type": "text"} (no constraint, as OpenAI's default) as None."""
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise GenerationOptionError(f"response_format must be an object, got {_short(response_format)}")
    return None if response_format.get("type") == "text" else response_format


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_NAMES = frozenset(f.name for f in fields(GenerationOptions))
_LEADING_NAME = re.compile(r"[A-Za-z_]\w*")


def _option_named(message: str) -> str | None:
    """The option a message starts with ("tools[0].function.name ..." -> "tools"), or None."""
    name = _LEADING_NAME.match(message)
    return name[0] if name and name[0] in _NAMES else None
