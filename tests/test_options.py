"""`GenerationOptions`: one request's options, checked in one place, built alike by the API, the CLI and the server.

No model and no GPU: the checks that need one (the prompt against the context, a drafter the model lacks, k past
the engine's buffers) stay with the engine and are tested there."""

from __future__ import annotations

import dataclasses
import math

import pytest

from doppler_py import cli, defaults
from doppler_py.errors import GenerationOptionError
from doppler_py.options import GenerationOptions, request_options
from doppler_py.server import RequestError, ServerConfig
from doppler_py.server.parsing import _options, parse_request

TOOL = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}

# One bad value of every option, and what the message says beside the option's name.
BAD = [
    ("max_tokens", {"max_tokens": 0}, "got 0"),
    ("max_tokens", {"max_tokens": 2.5}, "integer"),
    ("max_tokens", {"max_tokens": True}, "got True"),
    ("temperature", {"temperature": -1.0}, ">= 0"),
    ("temperature", {"temperature": math.nan}, "nan"),
    ("temperature", {"temperature": "hot"}, "number"),
    ("top_k", {"top_k": -1}, ">= 0"),
    ("top_p", {"top_p": 0.0}, "(0, 1]"),
    ("seed", {"seed": "abc"}, "'abc'"),
    ("speculative", {"speculative": "magic"}, "prompt-lookup"),
    ("k", {"k": 0}, "1..16"),
    ("presence_penalty", {"presence_penalty": 2.5}, "[-2, 2]"),
    ("frequency_penalty", {"frequency_penalty": float("nan")}, "[-2, 2]"),
    ("frequency_penalty", {"frequency_penalty": True}, "True"),
    ("repetition_penalty", {"repetition_penalty": 0}, "> 0"),
    ("repeat_last_n", {"repeat_last_n": -2}, ">= -1"),
    ("repeat_last_n", {"repeat_last_n": 1.5}, "1.5"),
    ("logit_bias", {"logit_bias": {"-1": 5}}, "token ids"),
    ("logit_bias", {"logit_bias": {"1.5": 5}}, "token ids"),
    ("logit_bias", {"logit_bias": {3: 100.5}}, "[-100, 100]"),
    ("logit_bias", {"logit_bias": [1, 2]}, "token id -> bias"),
    ("min_p", {"min_p": 1.01}, "[0, 1]"),
    ("min_p", {"min_p": -0.1}, "[0, 1]"),
    ("k", {"k": 17}, "got 17"),
    ("chat", {"chat": "yes"}, "'yes'"),
    ("stop", {"stop": ["a"] * 5}, "at most 4"),
    ("stop", {"stop": [1]}, "[1]"),
    ("stop", {"stop": ""}, "empty"),
    ("logprobs", {"logprobs": 21}, "0..20"),
    ("logprobs", {"logprobs": 1, "tree": True}, "token trees"),
    ("tree", {"tree": 6}, "the node budget is 'k'"),
    ("response_format", {"response_format": "json"}, "object"),
    ("response_format", {"response_format": {"type": "xml"}}, "xml"),
    ("regex", {"regex": "[a-"}, "regular expression"),
    ("regex", {"regex": "a", "grammar": 'start: "a"'}, "give one of"),
    ("grammar", {"grammar": 3}, "Lark grammar"),
    ("adapter", {"adapter": 7}, "loaded LoRA adapter's name"),
    ("tools", {"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ("tools", {"tools": [TOOL], "regex": "a"}, "not combined"),
    ("tool_choice", {"tool_choice": "required"}, "needs tools"),
    ("tool_choice", {"tools": [TOOL], "tool_choice": "sometimes"}, "sometimes"),
    ("parallel_tool_calls", {"parallel_tool_calls": "no"}, "'no'"),
    ("shorten_to_fit", {"shorten_to_fit": None}, "None"),
]


@pytest.mark.parametrize(("option", "given", "says"), BAD, ids=[f"{o}-{i}" for i, (o, _, _) in enumerate(BAD)])
def test_a_bad_value_raises_one_typed_error_naming_the_option(option, given, says):
    with pytest.raises(GenerationOptionError) as info:
        GenerationOptions(**given)
    assert info.value.option == option and says in str(info.value)
    assert isinstance(info.value, ValueError)


def test_every_option_has_a_check():
    assert {option for option, _, _ in BAD} == {field.name for field in dataclasses.fields(GenerationOptions)}


def test_the_defaults_are_doppler_py_defaults():
    options = GenerationOptions()
    assert (options.max_tokens, options.temperature, options.top_k, options.top_p) == (
        defaults.MAX_TOKENS,
        defaults.TEMPERATURE,
        defaults.TOP_K,
        defaults.TOP_P,
    )
    assert (options.speculative, options.k, options.tree) == (defaults.SPECULATIVE, defaults.K, defaults.TREE)
    assert options.sampling.greedy and options.stop == () and options.tool_plan is None


def test_values_are_kept_in_one_normal_form():
    # OpenAI's JSON keys are strings; the bias is kept as sorted (id, bias) pairs, so options stay comparable.
    assert GenerationOptions(logit_bias={"7": 1, 3: -100}).sampling.logit_bias == ((3, -100.0), (7, 1.0))
    assert GenerationOptions(logit_bias=None).sampling == GenerationOptions(logit_bias={}).sampling
    assert GenerationOptions(stop="x").stop == ("x",) == GenerationOptions(stop=["x"]).stop
    assert GenerationOptions(stop=None).stop == ()
    for plain in (None, "none", "off", False):
        assert GenerationOptions(speculative=plain).speculative is None
    assert GenerationOptions(response_format={"type": "text"}) == GenerationOptions()  # no constraint, as OpenAI's
    # {"type": "text"} is no constraint, so it goes beside tools.
    assert GenerationOptions(tools=[TOOL], response_format={"type": "text"}).tool_plan is not None


def test_a_changed_copy_is_checked_again():
    options = GenerationOptions(max_tokens=8)
    with pytest.raises(GenerationOptionError, match="max_tokens"):
        dataclasses.replace(options, max_tokens=-1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.max_tokens = 9  # type: ignore[misc]


def test_stream_keywords_and_a_ready_object_give_the_same_options():
    ready = GenerationOptions(max_tokens=8, temperature=0.5, seed=3)
    assert request_options(max_tokens=8, temperature=0.5, seed=3) == ready
    assert request_options(ready) is ready
    assert request_options(ready, stop="\n") == dataclasses.replace(ready, stop=("\n",))
    assert request_options() == GenerationOptions()
    with pytest.raises(TypeError):
        request_options(max_token=8)  # a misspelt keyword, as before
    with pytest.raises(TypeError):
        request_options({"max_tokens": 8})


def test_the_api_the_cli_and_the_server_build_equal_options_for_one_request():
    flags = ["--max-tokens", "20", "--temperature", "0.7", "--top-k", "5", "--top-p", "0.9", "--seed", "3"]
    flags += ["--speculative", "prompt-lookup", "--k", "4", "--tree", "off", "--stop", "END", "--regex", "[a-z]+"]
    from_cli = cli._generation_options(cli.build_parser().parse_args(["generate", "hi", *flags]))
    body = {"prompt": "hi", "max_tokens": 20, "temperature": 0.7, "top_k": 5, "top_p": 0.9, "seed": 3}
    body |= {"speculative": "prompt-lookup", "k": 4, "tree": False, "stop": ["END"], "regex": "[a-z]+"}
    from_server = parse_request(body, ServerConfig().defaults, chat=False).options
    from_api = request_options(
        max_tokens=20,
        temperature=0.7,
        top_k=5,
        top_p=0.9,
        seed=3,
        speculative="prompt-lookup",
        k=4,
        tree=False,
        stop="END",
        regex="[a-z]+",
        chat=False,
    )
    assert dataclasses.replace(from_cli, chat=False) == from_server == from_api


def test_the_serve_flags_are_the_defaults_a_request_leaves_out():
    served = cli._generation_options(cli.build_parser().parse_args(["serve", "--max-tokens", "9", "--regex", "a+"]))
    options = _options({"temperature": 1.0}, served, chat=True)
    assert (options.max_tokens, options.regex, options.temperature, options.chat) == (9, "a+", 1.0, True)
    assert options.shorten_to_fit  # without max_tokens the default is a ceiling
    assert _options({"tools": [TOOL]}, served, chat=True).regex is None  # tools replace the default constraint


def test_the_server_config_defaults_are_options():
    assert ServerConfig(defaults={"max_tokens": 12}).defaults == GenerationOptions(max_tokens=12)
    assert ServerConfig().defaults == GenerationOptions()


@pytest.mark.parametrize(
    ("body", "chat", "param", "says"),
    [
        ({"temperature": "hot"}, False, "temperature", "'temperature' must be a number"),
        ({"max_tokens": 2.5}, False, "max_tokens", "'max_tokens' must be an integer"),
        ({"max_completion_tokens": 0}, True, "max_completion_tokens", "'max_completion_tokens' must be an integer"),
        ({"logprobs": 21}, False, "logprobs", "'logprobs' must be"),
        ({"logprobs": True, "top_logprobs": 21}, True, "top_logprobs", "'top_logprobs' must be"),
        ({"k": 0}, False, "k", "'k' (draft length)"),
        ({"tree": "yes"}, False, "tree", "the node budget is 'k'"),
        ({"stop": ["a"] * 5}, True, "stop", "'stop' must hold at most 4"),
        ({"response_format": {"type": "xml"}}, True, "response_format.type", "xml"),
        ({"tools": [{"type": "retrieval"}]}, True, "tools[0]", "tools[0]"),
    ],
)  # fmt: skip
def test_the_server_names_the_request_field_of_a_bad_option(body, chat, param, says):
    with pytest.raises(RequestError) as info:
        _options(body, GenerationOptions(), chat=chat)
    assert info.value.status == 400 and info.value.param == param and says in info.value.message
