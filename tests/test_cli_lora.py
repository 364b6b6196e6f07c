"""The CLI's LoRA flags: `--lora NAME=PATH` (repeatable) loads adapters, `--adapter NAME` answers with one; the text
is the API's with the same adapter. Bad flags fail before anything loads."""

from __future__ import annotations

import json

import pytest
from support.lora import make_adapter

from doppler_py import cli
from doppler_py.api import load
from doppler_py.testing.tiny import write_tiny_model

pytest.importorskip("peft")  # the adapter is made by peft (on torch)

PROMPT = "hello world, hello"


def test_generate_with_an_adapter_is_the_apis_text_with_it(tmp_path, capsys):
    base = write_tiny_model(tmp_path / "base")
    a, b = make_adapter(base, tmp_path / "a", seed=1), make_adapter(base, tmp_path / "b", rank=2, seed=2)
    flags = ["--model", str(base), "--weights", "f32", "--speculative", "none", "--max-tokens", "8", "--raw"]
    flags.append("--no-progress")
    lora = ["--lora", f"a={a}", "--lora", f"b={b}"]
    assert cli.main(["generate", PROMPT, *flags, *lora, "--adapter", "b", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    with load(base, "f32", progress=False, lora={"b": b}) as engine:
        expected = engine.generate(PROMPT, max_tokens=8, speculative=None, adapter="b")
        assert record["text"] == expected.text != engine.generate(PROMPT, max_tokens=8, speculative=None).text
    assert cli.main(["generate", PROMPT, *flags, *lora, "--adapter", "c"]) == cli.EXIT_USAGE
    assert "no LoRA adapter named 'c' is loaded (loaded: a, b)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        (["--lora", "nameonly"], "expected NAME=PATH"),
        (["--lora", "a=/x", "--lora", "a=/y"], "the name 'a' is given twice"),
        (["--lora", "a=/no/such/adapter"], "/no/such/adapter/adapter_config.json: no such file"),
    ],
)
def test_bad_lora_flags_are_refused_naming_them(tmp_path, capsys, lora, message):
    base = write_tiny_model(tmp_path / "base")
    try:
        code = cli.main(["generate", "hi", "--model", str(base), "--no-progress", *lora])
    except SystemExit as exit_:  # argparse's refusal of the flag's shape
        code = exit_.code
    assert code == cli.EXIT_USAGE and message in capsys.readouterr().err
