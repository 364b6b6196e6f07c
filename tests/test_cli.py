"""The `doppler-py` command line, driven in subprocesses as a user would, on tiny random models.

Loading a model compiles every pipeline (seconds on a software adapter), so the commands that load one run
concurrently in a module fixture and the tests read their results. The model cache is a temporary folder.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from support.schemas import PERSON
from tokenizers.pre_tokenizers import ByteLevel

from doppler_py import cli
from doppler_py.api import GenerationResult
from doppler_py.testing.tiny import write_tiny_model

STATS_LINE = re.compile(
    r"^\[(?P<tokens>\d+) tokens \(prompt (?P<prompt>\d+)\), [\d.]+ tok/s"
    r"( \| (?P<method>[a-z+-]+): (\d+/\d+ drafts accepted \(\d+%\), [\d.]+ accepted/step"
    r"(, \d+ plain steps while warming up)?|(speculation warming up \(pipelines compiling\)|nothing worth drafting|"
    r"speculation not started: compiling its pipelines \(~\d+ s here\) would cost more than this answer could "
    r"save \(~[\d.]+ s\)|speculation not started: its compile \(~\d+ s here\) waits until plain tokens are "
    r"timed), "
    r"every token a plain step)"
    r"( \| (saved|lost) [\d.]+ ± [\d.]+ s vs plain decoding)?|, no speculation)\]$"
)
PROMPT = "Tell me about the sea."
CHAT_INPUT = "Hello there\nAnd again\n/reset\nHello there\n/exit\nnever read\n"
# Five turns of ~27 tokens each with their answers (the tiny tokenizer is one token per character, and its template
# adds ~19 per prompt) in a context of 96 positions: the fourth no longer fits beside the first three.
LONG_CHAT_INPUT = "".join(f"message {i}\n" for i in range(5))
LONG_CHAT_CONTEXT = 96


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    return os.environ | {"DOPPLER_CACHE": str(tmp_path_factory.mktemp("cache")), "PYTHONUNBUFFERED": "1"}


def run_cli(args: list[str], env: dict[str, str], stdin: str | None = None, timeout: float = 120):
    return subprocess.run(
        [sys.executable, "-m", "doppler_py.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory, env) -> dict[str, subprocess.CompletedProcess]:
    """name -> finished CLI run; the runs that load a model or a device go side by side."""
    model = str(write_tiny_model(tmp_path_factory.mktemp("tiny")))
    common = ["--model", model, "--max-tokens", "24", "--no-progress"]
    schema = tmp_path_factory.mktemp("schema") / "person.json"
    schema.write_text(json.dumps(PERSON))
    # A seeded sampled request, plainly decoded: the constraint must hold whatever is sampled.
    sampled = ["--model", model, "--max-tokens", "200", "--no-progress", "--temperature", "1", "--seed", "3"]
    commands = {
        "generate": (["generate", PROMPT, *common], None),
        "generate_json": (["generate", PROMPT, *common, "--json"], None),
        "json_schema": (["generate", PROMPT, *sampled, "--speculative", "none", "--json-schema", str(schema)], None),
        "regex": (["generate", PROMPT, *common, "--regex", "[a-z]{3}-[0-9]{2}", "--json"], None),
        "chat": (["chat", *common, "--max-tokens", "8"], CHAT_INPUT),
        "long_chat": (
            ["chat", *common, "--max-tokens", "8", "--max-seq", str(LONG_CHAT_CONTEXT)],
            LONG_CHAT_INPUT,
        ),
        "info": (["info"], None),
        "info_json": (["info", "--json"], None),
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "doppler_py.cli", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for name, (args, _) in commands.items()
    }
    done = {}
    try:
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(commands[name][1], timeout=600)
            done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done | {"model": model}


def ok(run: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert run.returncode == 0, f"exit {run.returncode}\nstdout:\n{run.stdout}\nstderr:\n{run.stderr}"
    assert "Traceback" not in run.stderr, run.stderr
    return run


def stats_lines(stderr: str) -> list[re.Match]:
    return [m for line in stderr.splitlines() if (m := STATS_LINE.match(line))]


# --- generate ----------------------------------------------------------------------------------------------------
def spec_result(drafted: int, accepted: int, warmup: int | tuple[int, float, float]) -> GenerationResult:
    """`warmup`: plain steps while warming up, or those with the compile's weighed cost and gain."""
    steps, cost, gain = warmup if isinstance(warmup, tuple) else (warmup, None, None)
    return GenerationResult(
        text="",
        tokens=[1] * 12,
        prompt_tokens=5,
        finish_reason="length",
        speculative="auto",
        drafted=drafted,
        accepted=accepted,
        acceptance_rate=accepted / drafted if drafted else 0.0,
        mean_accepted_per_step=accepted / 3 if drafted else 0.0,
        tokens_per_s=20.0,
        elapsed_s=0.6,
        time_saved_s=None,
        stats={"warmup_steps": steps, "compile_cost_s": cost, "compile_gain_s": gain},
    )


@pytest.mark.parametrize(
    ("drafted", "accepted", "warmup", "says"),
    [
        (0, 0, 12, "auto: speculation warming up (pipelines compiling), every token a plain step"),
        (0, 0, 0, "auto: nothing worth drafting, every token a plain step"),
        (6, 4, 2, "auto: 4/6 drafts accepted (67%), 1.33 accepted/step, 2 plain steps while warming up"),
        (6, 4, 0, "auto: 4/6 drafts accepted (67%), 1.33 accepted/step]"),
        (
            0,
            0,
            (12, 40.0, 2.5),
            "auto: speculation not started: compiling its pipelines (~40 s here) would cost more "
            "than this answer could save (~2.5 s), every token a plain step",
        ),
        (0, 0, (12, 40.0, None), "auto: speculation not started: its compile (~40 s here) waits until plain tokens"),
    ],
)
def test_stats_line_says_why_nothing_was_drafted(drafted, accepted, warmup, says):
    line = cli.format_stats(spec_result(drafted, accepted, warmup))
    assert says in line and STATS_LINE.match(line), line


@pytest.mark.slow
def test_generate_streams_the_text_then_ends_with_one_stats_line(runs):
    run = ok(runs["generate"])
    assert run.stdout.strip(), "no text on stdout"
    (stats,) = stats_lines(run.stderr)
    assert run.stderr.rstrip("\n").splitlines()[-1] == stats.group(0), "the stats line must come last"
    assert int(stats["tokens"]) <= 24 and stats["method"] == "prompt-lookup"  # what "auto" picks with no draft


@pytest.mark.slow
def test_generate_json_is_one_object_with_the_text_and_the_result_record(runs):
    record = json.loads(ok(runs["generate_json"]).stdout)
    for key in ("text", "prompt_tokens", "completion_tokens", "finish_reason", "speculative", "drafted", "accepted"):
        assert key in record, key
    assert record["speculative"] == "prompt-lookup" and record["finish_reason"] in ("stop", "length")
    assert 0 < record["completion_tokens"] <= 24 and record["accepted"] <= record["drafted"]
    assert 0.0 <= record["acceptance_rate"] <= 1.0 and record["tokens_per_s"] > 0


@pytest.mark.slow
def test_streamed_text_is_the_generated_text(runs):
    # Greedy, same prompt and options: the streamed pieces must join to exactly the record's text.
    text = json.loads(runs["generate_json"].stdout)["text"]
    assert runs["generate"].stdout == (text if text.endswith("\n") or not text else text + "\n")
    stats = stats_lines(runs["generate"].stderr)[0]
    assert int(stats["prompt"]) == json.loads(runs["generate_json"].stdout)["prompt_tokens"]


@pytest.mark.slow
def test_generate_stop_ends_the_text_before_the_stop_string(runs, tmp_path_factory, env):
    full = json.loads(ok(runs["generate_json"]).stdout)["text"]
    stop = full[4:7]
    assert len(stop) == 3, full
    args = ["generate", PROMPT, "--model", runs["model"], "--max-tokens", "24", "--no-progress", "--json"]
    record = json.loads(ok(run_cli([*args, "--stop", "never-there", "--stop", stop], env)).stdout)
    assert record["text"] == full[: full.find(stop)] and record["finish_reason"] == "stop"


@pytest.mark.slow
def test_generate_follows_a_json_schema_file_or_a_regex(runs):
    person = json.loads(ok(runs["json_schema"]).stdout)
    assert set(person) == {"name", "age"} and isinstance(person["name"], str) and len(person["name"]) <= 6
    assert isinstance(person["age"], int) and 0 <= person["age"] <= 120
    record = json.loads(ok(runs["regex"]).stdout)
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", record["text"]) and record["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("content", "flag", "message"),
    [
        (None, "--json-schema", "cannot be read"),
        ("{not json", "--json-schema", "not valid JSON"),
        ('{"type": "nope"}', "--json-schema", "not a valid JSON schema"),
        ("start: undefined_rule", "--grammar", "not a valid Lark grammar"),
    ],
    ids=["missing-file", "bad-json", "bad-schema", "bad-grammar"],
)
def test_bad_constraint_files_fail_before_loading_naming_the_file(tmp_path, capsys, content, flag, message):
    path = tmp_path / "constraint.txt"
    if content is not None:
        path.write_text(content)
    assert cli.main(["generate", "hi", "--model", "/no/such/model", flag, str(path)]) == cli.EXIT_USAGE
    error = capsys.readouterr().err.strip()
    assert error.startswith("doppler-py: GenerationOptionError:") and str(path) in error and message in error


def test_constraint_flags_give_the_generation_options(tmp_path):
    parse = lambda *args: cli._generation_options(cli.build_parser().parse_args(["generate", "hi", *args]))  # noqa: E731
    (tmp_path / "person.json").write_text(json.dumps(PERSON))
    format_ = parse("--json-schema", str(tmp_path / "person.json")).response_format
    assert format_ == {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    assert parse("--json-object").response_format == {"type": "json_object"}
    assert parse("--regex", "a+").regex == "a+" and parse().regex is None
    with pytest.raises(SystemExit):  # one constraint at most
        parse("--json-object", "--regex", "a+")


def test_penalty_flags_give_the_generation_options():
    parse = lambda *args: cli._generation_options(cli.build_parser().parse_args(["generate", "hi", *args]))  # noqa: E731
    sampling = parse(
        "--frequency-penalty", "0.5", "--presence-penalty", "-0.25", "--repetition-penalty", "1.1",
        "--repeat-last-n", "-1", "--logit-bias", "7=-100", "--logit-bias", "3=2.5", "--min-p", "0.05",
    ).sampling  # fmt: skip
    assert (sampling.frequency_penalty, sampling.presence_penalty, sampling.min_p) == (0.5, -0.25, 0.05)
    assert (sampling.repetition_penalty, sampling.repeat_last_n) == (1.1, -1)
    assert sampling.logit_bias == ((3, 2.5), (7, -100.0))
    assert parse().sampling == parse("--repeat-last-n", "64").sampling and not parse().sampling.penalized
    with pytest.raises(SystemExit):  # not ID=BIAS
        parse("--logit-bias", "seven")


# --- chat ----------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_chat_keeps_history_resets_and_stops_at_exit(runs):
    run = ok(runs["chat"])
    turns = stats_lines(run.stderr)
    assert len(turns) == 3, run.stderr  # "/exit" ends the session: the line after it is never answered
    assert "(conversation reset)" in run.stderr
    first, second, after_reset = (int(t["prompt"]) for t in turns)
    # The second prompt holds the first exchange; after /reset the conversation starts from scratch.
    assert second > first + int(turns[0]["tokens"])
    assert after_reset == first


@pytest.mark.slow
def test_a_chat_longer_than_the_context_goes_on_without_its_oldest_exchanges(runs):
    run = ok(runs["long_chat"])
    turns = stats_lines(run.stderr)
    assert len(turns) == 5, run.stderr  # every message answered, none refused for the context
    assert f"no longer fit the context of {LONG_CHAT_CONTEXT} tokens" in run.stderr
    assert all(int(t["prompt"]) + 8 <= LONG_CHAT_CONTEXT for t in turns)
    assert int(turns[1]["prompt"]) > int(turns[0]["prompt"])  # the second turn still holds the first exchange


# --- info ------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_info_names_adapter_limits_kernels_and_precisions(runs):
    info = json.loads(ok(runs["info_json"]).stdout)
    assert info["adapter"] and info["backend"] and info["limits"]["max-storage-buffers-per-shader-stage"] >= 8
    shaders = {p.stem for p in cli.REPO_ROOT.joinpath("shaders").glob("*.wgsl")}
    assert set(info["kernels"]) == shaders and all(info["kernels"].values())
    assert {"f32", "f16", "q4_1"} <= set(info["weight_precisions"])
    assert info["dispatch_loop"] == "compiled" or info["dispatch_loop"].startswith("python (")
    text = ok(runs["info"]).stdout
    assert info["adapter"] in text and "matmul.wgsl" in text and "q4_1" in text
    assert f"dispatch loop: {info['dispatch_loop']}" in text
    # The streaming rate is measured only on request (`info --bandwidth`); the cache here is the test's own.
    assert info["stream_read"] is None and "streaming read: not measured" in text


# --- convert and models ------------------------------------------------------------------------------------------
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENS = SPECIALS + sorted(ByteLevel.alphabet()) + ["he"]


def write_tiny_gguf(path: Path, rng: np.random.Generator) -> Path:
    """A one-layer LLaMA GGUF with a byte-level BPE vocabulary, f32 tensors (rows need no un-permuting to load)."""
    hidden, ffn, vocab = 32, 64, len(TOKENS)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (vocab - len(SPECIALS)))
    writer.add_token_merges(["h e"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    shapes = {
        "token_embd.weight": (vocab, hidden),
        "output_norm.weight": (hidden,),
        "blk.0.attn_norm.weight": (hidden,),
        "blk.0.ffn_norm.weight": (hidden,),
        "blk.0.attn_q.weight": (hidden, hidden),
        "blk.0.attn_k.weight": (hidden // 2, hidden),
        "blk.0.attn_v.weight": (hidden // 2, hidden),
        "blk.0.attn_output.weight": (hidden, hidden),
        "blk.0.ffn_gate.weight": (ffn, hidden),
        "blk.0.ffn_up.weight": (ffn, hidden),
        "blk.0.ffn_down.weight": (hidden, ffn),
    }
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_convert_writes_a_model_folder_with_a_progress_bar(tmp_path, env, rng):
    source = write_tiny_gguf(tmp_path / "tiny.gguf", rng)
    run = ok(run_cli(["convert", str(source), "--out", str(tmp_path / "out"), "--weights", "f32"], env))
    folder = Path(run.stdout.strip())
    assert folder == tmp_path / "out"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).is_file(), name
    assert "tiny.gguf -> f32" in run.stderr  # the progress bar's label


def test_models_lists_the_known_model_and_converted_ones_with_sizes(tmp_path, env, rng):
    source = write_tiny_gguf(tmp_path / "mini.gguf", rng)
    cached = Path(ok(run_cli(["convert", str(source), "--weights", "f16", "--no-progress"], env)).stdout.strip())
    assert cached.parent == Path(env["DOPPLER_CACHE"]) / "models"
    listing = ok(run_cli(["models"], env)).stdout.splitlines()
    assert listing[0].split()[:3] == ["NAME", "WEIGHTS", "SIZE"]
    assert any(line.startswith("smollm2-135m-instruct") for line in listing)
    (row,) = [line for line in listing if line.startswith("mini-")]
    assert " f16 " in row and re.search(r"\d+\.\d MiB", row) and str(cached) in row


# --- errors -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", "hi", "--model", "/no/such/model"], "ModelFormatError: /no/such/model"),
        (["generate", "hi", "--temperature", "-1"], "GenerationOptionError: temperature"),
        (["generate", "hi", "--top-p", "0"], "GenerationOptionError: top_p"),
        (["generate", "hi", "--frequency-penalty", "3"], "GenerationOptionError: frequency_penalty"),
        (["convert", "/no/such/file.gguf", "--out", "/tmp/never"], "/no/such/file.gguf"),
    ],
    ids=["unknown-model", "negative-temperature", "zero-top-p", "frequency-penalty-3", "missing-gguf"],
)
def test_bad_input_exits_2_with_one_line_and_no_traceback(env, args, message):
    run = run_cli(args, env)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("doppler-py: ") and message in lines[0], run.stderr


def test_a_file_that_is_not_gguf_is_refused_with_exit_2(tmp_path, env):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf file at all")
    run = run_cli(["convert", str(fake), "--out", str(tmp_path / "out"), "--no-progress"], env)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.startswith("doppler-py: ModelFormatError:") and not (tmp_path / "out").exists()


def test_bench_says_clearly_when_a_benchmark_is_missing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "REPO_ROOT", tmp_path)  # a checkout without tools/
    assert cli.find_bench("speculative") is None
    assert cli.main(["bench", "speculative"]) == 1
    assert "tools/bench_speculative.py" in capsys.readouterr().err


# --- train-draft ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_train_draft_writes_heads_that_generate_drafts_with(runs, env, tmp_path, monkeypatch, capsys):
    """In this process (the subprocess runs above show the CLI as a user starts it): the pipelines compiled by
    earlier tests serve these runs too."""
    pytest.importorskip("torch")
    monkeypatch.setenv("DOPPLER_CACHE", env["DOPPLER_CACHE"])

    def run(args: list[str]) -> tuple[int, str, str]:
        code = cli.main(args)
        out, err = capsys.readouterr()
        assert "Traceback" not in err, err
        return code, out, err

    heads = {"eagle": tmp_path / "eagle", "medusa": tmp_path / "medusa"}
    small = [
        "--seed-prompts",
        "40",
        "--magpie-prompts",
        "2",
        "--max-new-tokens",
        "6",
        "--draft-vocab",
        "24",
        "--steps",
        "4",
    ]
    fused = {"eagle": ["--feature-taps", "0"], "medusa": []}  # the EAGLE head fuses layer 0 (EAGLE-3)
    for kind, out in heads.items():  # the second run reuses the first one's data (same --work)
        args = ["train-draft", runs["model"], "--kind", kind, "--out", str(out), "--work", str(tmp_path / "work")]
        code, stdout, stderr = run([*args, *small, *fused[kind]])
        assert code == 0, stderr
        card = json.loads(stdout)
        assert card["kind"] == kind and card["steps"] == 4 and card["sequences"] == 42
        assert card["options"]["feature_taps"] == [0] * (kind == "eagle")
        assert "answers_s" in card["wall_time_s"] and "train: step 4/4" in stderr
    common = ["--model", runs["model"], "--max-tokens", "12", "--no-progress", "--warmup", "now"]
    common += ["--draft-head", str(heads["eagle"]), "--draft-head", str(heads["medusa"])]
    code, stdout, stderr = run(["generate", PROMPT, *common, "--speculative", "none", "--json"])
    assert code == 0, stderr
    plain = json.loads(stdout)
    for kind in heads:
        code, stdout, stderr = run(["generate", PROMPT, *common, "--speculative", kind, "--json"])
        assert code == 0, stderr
        record = json.loads(stdout)
        assert record["speculative"] == kind and record["drafted"] > 0 and record["text"] == plain["text"]
    code, _, stderr = run(["train-draft", runs["model"], "--out", str(heads["eagle"]), *small])
    assert code == 2 and "not empty" in stderr


@pytest.mark.parametrize(
    ("text", "kind", "error"),
    [("2,x", "eagle", "layer indices like"), ("3,3", "eagle", "distinct"), ("-1", "eagle", "distinct"),
     ("2", "medusa", "for EAGLE heads")],
)  # fmt: skip
def test_feature_taps_are_checked_before_any_work(text, kind, error):
    from doppler_py.errors import GenerationOptionError

    with pytest.raises(GenerationOptionError, match=error):
        cli.feature_taps(text, kind)
    assert cli.feature_taps("2,15", "eagle") == (2, 15) and cli.feature_taps(None, "medusa") == ()


@pytest.mark.parametrize(
    ("extra", "error"),
    [(["--kind", "medusa", "--init-from", "head"], "continues EAGLE heads"), (["--lr", "0"], "--lr must be positive")],
)
def test_train_draft_checks_continuing_and_the_learning_rate_before_any_work(extra, error, tmp_path, capsys):
    pytest.importorskip("torch")
    assert cli.main(["train-draft", "no-such-model", "--out", str(tmp_path / "out"), *extra]) == cli.EXIT_USAGE
    assert error in capsys.readouterr().err


# --- serve -----------------------------------------------------------------------------------------------------------
def test_serve_takes_the_api_key_from_the_flag_or_the_environment(monkeypatch):
    import contextlib

    keys = []
    monkeypatch.setattr("doppler_py.server.serve", lambda engine, config: keys.append(config.api_key))
    monkeypatch.setattr(cli, "_load", lambda args, **options: contextlib.nullcontext(None))
    monkeypatch.setenv("DOPPLER_API_KEY", "from-env")
    assert cli.main(["serve"]) == 0 and cli.main(["serve", "--api-key", "from-flag"]) == 0
    monkeypatch.delenv("DOPPLER_API_KEY")
    assert cli.main(["serve"]) == 0
    assert keys == ["from-env", "from-flag", None]


def test_serve_parallel_and_kv_budget_reach_the_engine(monkeypatch):
    import contextlib

    loads = []
    monkeypatch.setattr("doppler_py.server.serve", lambda engine, config: None)
    monkeypatch.setattr(cli, "_load", lambda args, **options: loads.append(options) or contextlib.nullcontext(None))
    assert cli.main(["serve"]) == 0 and cli.main(["serve", "--parallel", "3", "--kv-budget-mb", "512"]) == 0
    assert loads == [{"parallel": 1, "kv_budget_mb": None}, {"parallel": 3, "kv_budget_mb": 512}]


@pytest.mark.parametrize(("text", "value"), [("auto", None), ("on", True), ("off", False)])
def test_tree_flag_values(text, value):
    args = cli.build_parser().parse_args(["generate", "hi", "--tree", text])
    assert repr(cli._generation_options(args).tree) == repr(value)


@pytest.mark.parametrize("text", ["6", "1", "yes", "-3"])
def test_tree_flag_refuses_other_values(text, capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "hi", "--tree", text])
    assert "the node budget is --k" in capsys.readouterr().err
