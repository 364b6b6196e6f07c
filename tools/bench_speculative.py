"""Plain vs speculative decoding on SmolLM2-135M, side by side in one run (interleaved, medians).

    python tools/bench_speculative.py --weights q4_1 --repeats 3 --json bench.json --png bench.png

For every weight format and prompt kind, each repeat runs every method once, one after another, so machine
noise hits all methods alike; the order is rotated and reversed from prompt to prompt and repeat to repeat
(`method_order`), so no method always runs right after the same one. A method name ending in -kN (eagle-k4,
lookup-tree-k8) pins that method's draft length (a tree's node budget) to N. The table reports medians and the
speedup of each method over plain decoding of the same model measured in the same run, then each group's
geometric mean and worst prompt. Greedy decoding
(so all methods produce the same text); a second pass reports acceptance at --sampled-temperature (every
drafter on the open-ended prompts, the lookup methods, chains and trees, on the copy-heavy ones too).
Peers (HF transformers on torch CPU, plain and with its prompt lookup) run on the same prompts when installed.
The structured group's prompts each carry a JSON schema (`response_format`), and run only its own methods
(`GROUP_METHODS`): constrained plain decoding, "prompt-lookup" (the grammar's forced tokens plus lookup drafts)
and "auto"; select it with `--groups structured`.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

from doppler_py.speculative.registry import HEAD_KINDS, speculative_modes

# Labelled groups, each reported with its own geometric mean. Copy-heavy: the answer copies much of the prompt,
# where prompt lookup is meant to help. Open-ended: what users bring most, where nothing is copied (none of these
# is in the draft head's training seeds). Structured: extraction, form filling and tool-call-like answers under a
# JSON schema (SCHEMAS), where the grammar forces keys and separators that every speculative step drafts for free.
COPY_HEAVY, OPEN_ENDED, STRUCTURED = "copy-heavy", "open-ended", "structured"
PROMPTS = {
    # SmolLM2 echoes this question in its answer ("Here are three good ways to stay healthy in winter"), so
    # lookup gains here say little about chat in general: it is labelled copy-heavy for that reason.
    "chat-echo": (
        COPY_HEAVY,
        [{"role": "user", "content": "What are three good ways to stay healthy in winter? Explain each briefly."}],
    ),
    "repeat": (
        COPY_HEAVY,
        [
            {
                "role": "user",
                "content": "Repeat this passage exactly, word for word:\n\nThe river bends twice before the old mill, "
                "where herons wait in the reeds and the water slows to a mirror under the willows. In spring the "
                "meadow floods and the path to the village disappears for a week; in autumn the miller's children "
                "gather walnuts along the bank and race paper boats from the bridge to the weir.",
            }
        ],
    ),
    # A realistic code edit: the answer mostly copies a longer block (where prompt lookup is meant to help).
    "code": (
        COPY_HEAVY,
        [
            {
                "role": "user",
                "content": "Add a one-line docstring to the add method of this class. Reply with the complete class "
                "only.\n\nclass Inventory:\n    def __init__(self):\n        self.items = {}\n\n"
                "    def add(self, name, count):\n        if name in self.items:\n"
                "            self.items[name] += count\n"
                "        else:\n            self.items[name] = count\n\n    def remove(self, name, count):\n"
                "        if name not in self.items:\n            raise KeyError(name)\n"
                "        self.items[name] -= count\n        if self.items[name] <= 0:\n"
                "            del self.items[name]\n\n"
                "    def total(self):\n        return sum(self.items.values())\n",
            }
        ],
    ),
    # A short function: SmolLM2 rewrites more than it copies, so lookup finds less to propose.
    "code-small": (
        COPY_HEAVY,
        [
            {
                "role": "user",
                "content": "Here is a Python function:\n\ndef summarize(values):\n    x = 0\n    for v in values:\n"
                "        if v > 0:\n            x += v\n    count = len(values)\n    mean = x / count if count else 0\n"
                "    return {'total': x, 'mean': mean}\n\nRewrite the function with the variable x renamed to total. "
                "Reply with the code only.",
            }
        ],
    ),
    "summarise": (
        COPY_HEAVY,
        [
            {
                "role": "user",
                "content": "Summarise in two sentences: The town council met on Tuesday to discuss the new library. "
                "Residents asked for longer opening hours and more study rooms. The council agreed to extend hours on "
                "weekends starting next month and to convert the old archive into two study rooms by the end of the "
                "year, funded by the regional culture grant.",
            }
        ],
    ),
    "story": (OPEN_ENDED, [{"role": "user", "content": "Write a short story about a fox who learns to share."}]),
    "explain": (OPEN_ENDED, [{"role": "user", "content": "Explain how a compass works and why it points north."}]),
    "tips": (
        OPEN_ENDED,
        [{"role": "user", "content": "Give me six tips for keeping a small garden healthy in summer."}],
    ),
    "email": (
        OPEN_ENDED,
        [{"role": "user", "content": "Write an email to my team saying the office closes early on Friday."}],
    ),
    "code-new": (
        OPEN_ENDED,
        [{"role": "user", "content": "Write a Python function that counts how often each word appears in a text."}],
    ),
    "dialogue": (
        OPEN_ENDED,
        [{"role": "user", "content": "Write a short dialogue between a librarian and a student who lost a book."}],
    ),
    "invoice": (
        STRUCTURED,
        [
            {
                "role": "user",
                "content": "Extract the invoice as JSON: Invoice INV-2031 from Brightline Supplies, dated 2026-03-14. "
                "3 boxes of printer paper at 24.50 each, 2 ink cartridges at 39.90 each, 1 desk lamp at 45.00. "
                "Total 238.80 EUR, due in 30 days.",
            }
        ],
    ),
    "signup": (
        STRUCTURED,
        [
            {
                "role": "user",
                "content": "Fill in the signup form as JSON for this person: I'm Daniel Okafor, born 12 June 1990, "
                "email daniel.okafor@example.com, I live in Leeds, UK, and I'd like the monthly newsletter in English.",
            }
        ],
    ),
    "weather-tool": (
        STRUCTURED,
        [
            {
                "role": "user",
                "content": "Answer with the function call as JSON. Functions: get_weather(city, unit, days). "
                "Request: what will the weather be like in Lisbon over the next three days, in celsius?",
            }
        ],
    ),
    "people": (
        STRUCTURED,
        [
            {
                "role": "user",
                "content": "List the people in this text as JSON with name, role and age: The team is led by Sara "
                "Kim, 41, the project manager. Omar Haddad, 29, is the lead developer, and Lena Vogel, 35, designs "
                "the interface.",
            }
        ],
    ),
    "ticket": (
        STRUCTURED,
        [
            {
                "role": "user",
                "content": "Triage this support ticket as JSON: 'Hi, since this morning I cannot log in to my account. "
                "The app says my password is wrong although I reset it twice. I need access for a client meeting "
                "at 3pm today.' Give category, priority, a one-sentence summary and suggested next steps.",
            }
        ],
    ),
    "calendar-tool": (
        STRUCTURED,
        [
            {
                "role": "user",
                "content": "Answer with the function call as JSON. Functions: create_event(title, date, start, "
                "duration_minutes, attendees). Request: book a project review with Anna and Marco on 2026-05-20 "
                "at 14:00 for one hour.",
            }
        ],
    ),
}
NAME = {"type": "string", "maxLength": 40}
DATE = {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}


def closed(properties: dict) -> dict:
    """An object schema with every property required and no others."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


# The structured prompts' JSON schemas (strict), passed as `response_format`.
SCHEMAS = {
    "invoice": closed(
        {
            "invoice_id": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
            "vendor": NAME,
            "date": DATE,
            "items": {
                "type": "array",
                "items": closed(
                    {
                        "description": NAME,
                        "quantity": {"type": "integer", "minimum": 1},
                        "unit_price": {"type": "number"},
                    }
                ),
                "minItems": 1,
                "maxItems": 5,
            },
            "total": {"type": "number", "minimum": 0},
            "currency": {"enum": ["EUR", "USD", "GBP"]},
        }
    ),
    "signup": closed(
        {
            "full_name": NAME,
            "birth_date": DATE,
            "email": {"type": "string", "maxLength": 60},
            "address": closed({"city": NAME, "country": NAME}),
            "newsletter": {"type": "boolean"},
            "frequency": {"enum": ["daily", "weekly", "monthly"]},
            "language": {"enum": ["English", "French", "German", "Spanish"]},
        }
    ),
    "weather-tool": closed(
        {
            "name": {"enum": ["get_weather"]},
            "arguments": closed(
                {"city": NAME, "unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"type": "integer", "minimum": 1}}
            ),
        }
    ),
    "people": closed(
        {
            "people": {
                "type": "array",
                "items": closed({"name": NAME, "role": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
                "minItems": 1,
                "maxItems": 5,
            }
        }
    ),
    "ticket": closed(
        {
            "category": {"enum": ["login", "billing", "bug", "feature_request", "other"]},
            "priority": {"enum": ["low", "medium", "high", "urgent"]},
            "summary": {"type": "string", "maxLength": 120},
            "next_steps": {"type": "array", "items": {"type": "string", "maxLength": 80}, "maxItems": 3},
        }
    ),
    "calendar-tool": closed(
        {
            "name": {"enum": ["create_event"]},
            "arguments": closed(
                {
                    "title": NAME,
                    "date": DATE,
                    "start": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
                    "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 480},
                    "attendees": {"type": "array", "items": NAME, "maxItems": 6},
                }
            ),
        }
    ),
}
# The methods a group runs (a group not named here: every --methods): constrained plain decoding, forced drafts
# plus prompt lookup, and auto.
GROUP_METHODS = {STRUCTURED: ("plain", "prompt-lookup", "auto")}
METHODS = (
    "plain",
    "prompt-lookup",
    "lookup-tree",
    "lookahead",
    "lookahead-pinned",
    "eagle",
    "eagle-tree",
    "medusa",
    "medusa-tree",
    "spark",
    "auto",
)
# Token trees: each against its drafter's chains at the same draft budget; with --k both verify the same rows
# per step (the tree's node budget is k).
TREE_METHODS = {"lookup-tree": "prompt-lookup", "eagle-tree": "eagle", "medusa-tree": "medusa"}
LOOKUP_METHODS = ("prompt-lookup", "lookup-tree")
# Lookahead as the policy runs it (paused where its measured tokens per step do not pay for its rows), and with
# its full shape pinned, so every step verifies the window (what it yields per step, whatever it costs).
PINNED_METHODS = {"lookahead-pinned": "lookahead"}


def base_mode(method: str) -> str:
    """The `speculative=` mode (or "plain") a bench method runs: "eagle-tree-k4" → "eagle"."""
    base = split_method(method)[0]
    return TREE_METHODS.get(base, PINNED_METHODS.get(base, base))


def split_method(method: str) -> tuple[str, int | None]:
    """ "eagle-k4" → ("eagle", 4): a method and the draft length its -kN suffix pins (None: none)."""
    base, dash, pin = method.rpartition("-k")
    if dash and base and pin.isdigit() and int(pin) > 0:
        return base, int(pin)
    return method, None


def method_order(methods: list[str], repeat: int, prompt_index: int) -> list[str]:
    """The order of the methods for one prompt of one repeat: rotated by repeat + prompt, reversed on odd
    repeats, so the method run right after another one (plain decoding, say) changes from prompt to prompt and
    repeat to repeat. A method run right after plain decoding measured ~0.05-0.1x slower on lavapipe."""
    start = (repeat + prompt_index) % len(methods)
    order = methods[start:] + methods[:start]
    return order[::-1] if repeat % 2 else order


def response_format(prompt: str) -> dict | None:
    """The JSON schema constraint a prompt's answers follow (None: unconstrained)."""
    schema = SCHEMAS.get(prompt)
    return (
        None
        if schema is None
        else {"type": "json_schema", "json_schema": {"name": prompt, "schema": schema, "strict": True}}
    )


def prompt_methods(methods: list[str], prompt: str) -> list[str]:
    """The methods `prompt` runs: those of its group (GROUP_METHODS) among `methods`."""
    allowed = GROUP_METHODS.get(PROMPTS[prompt][0])
    return [m for m in methods if allowed is None or m in allowed]


def run_ours(
    engine,
    prompt,
    method: str,
    tokens: int,
    temperature: float = 0.0,
    k: int | None = None,
    response_format: dict | None = None,
) -> dict:
    from doppler_py.speculative.drafters.lookahead import LookaheadShape

    method, pinned_k = split_method(method)
    k = pinned_k or k
    speculative = None if method == "plain" else TREE_METHODS.get(method, PINNED_METHODS.get(method, method))
    # Chains are chains even where the tree policy would switch trees on; "auto" lets the policy decide, and
    # every lookahead step is a tree of its own.
    tree = True if method in TREE_METHODS else (None if method == "auto" or "lookahead" in method else False)
    pinned = k if speculative == "prompt-lookup" or pinned_k else None
    pinned = LookaheadShape().nodes if method in PINNED_METHODS else pinned
    result = engine.generate(
        prompt,
        max_tokens=tokens,
        speculative=speculative,
        temperature=temperature,
        seed=0,
        k=pinned,
        tree=tree,
        response_format=response_format,
    )
    stats = result.stats
    drafted = stats["made"]  # drafts made, verified or cut by the engine: all were paid for
    draft_s = stats["gpu_draft_s"] if stats["gpu_draft_s"] is not None else stats["draft_s"]
    return {
        "tokens": len(result.tokens),
        "tokens_per_s": result.tokens_per_s,
        "acceptance_rate": result.acceptance_rate,
        # accepted drafts + 1 per verifying target forward (plain decoding: 1 token per forward)
        "tokens_per_step": stats["tokens_per_step"] if method != "plain" else 1.0,
        # the same over every target forward, plain steps included (speculation paused or a draft cut)
        "tokens_per_forward": stats["tokens_per_forward"] if method != "plain" else 1.0,
        "acceptance_by_position": stats["acceptance_by_position"],
        "draft_s_per_token": draft_s / drafted if drafted else None,
        "drafter": result.speculative,
        "plain_steps": stats["plain_steps"],
        "steps": stats["steps"],
        "tree_steps": stats["tree_steps"],
        "forced_tokens": stats["forced_tokens"],  # drafts a constraint forced
        "text_tokens": result.tokens,
    }


def run_peer(model, tokenizer, prompt, tokens: int, lookup: bool) -> dict:
    import torch

    ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt")
    if not isinstance(ids, torch.Tensor):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    kwargs = {"prompt_lookup_num_tokens": 10} if lookup else {}
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=0, **kwargs)
    elapsed = time.perf_counter() - start
    n = out.shape[1] - ids.shape[1]
    return {"tokens": n, "tokens_per_s": n / elapsed}


def load_peer(threads: int):
    try:
        import torch
        import transformers
    except ImportError:
        return None
    import os

    from doppler_py.model.catalog import DEFAULT_MODEL, known_model_file

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(threads)
    path = known_model_file(DEFAULT_MODEL)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.eval(), tokenizer


def mask_cost(engine, prompt: str, tokens: list[int], plain_tokens_per_s: float) -> dict:
    """The host's share of constrained decoding: a fresh matcher replays the answer `tokens`, timing each token's
    mask (the row uploaded for the sampler) and commit; against one constrained plain step (1 / its tok/s)."""
    from doppler_py.constraints.grammar import constraint_from_options
    from doppler_py.constraints.matcher import GrammarMatcher
    from doppler_py.constraints.tokenizer_bridge import ll_tokenizer

    ll = ll_tokenizer(engine.tokenizer)
    constraint = constraint_from_options(response_format=response_format(prompt), tokenizer=ll)
    matcher = GrammarMatcher(ll, constraint, engine.model.config.vocab_size)
    seconds = []
    for token in tokens:
        start = time.perf_counter()
        matcher.mask()
        matcher.advance([token])
        seconds.append(time.perf_counter() - start)
    per_token = statistics.median(seconds)
    return {
        "prompt": prompt,
        "tokens": len(tokens),
        "median_us": round(per_token * 1e6, 1),
        "mean_us": round(statistics.fmean(seconds) * 1e6, 1),
        "share_of_plain_step": round(per_token * plain_tokens_per_s, 4),
    }


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def geomean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def mean_by_position(rows: list[list[float]]) -> list[float]:
    """Per draft position, the mean over runs that drafted that far."""
    depth = max((len(r) for r in rows), default=0)
    return [round(statistics.fmean(r[i] for r in rows if len(r) > i), 3) for i in range(depth)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", default="q4_1")
    parser.add_argument("--prompts", default=",".join(PROMPTS))
    parser.add_argument(
        "--groups",
        default=",".join(dict.fromkeys(group for group, _ in PROMPTS.values())),
        help="prompt groups to run, comma-separated (of --prompts)",
    )
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument(
        "--draft-head", action="append", help="a head folder, repeatable (default: those shipped for the model)"
    )
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument(
        "--k", type=int, help="pin the lookup methods' draft length (lookup-tree: its node budget; default adaptive)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--sampled-temperature",
        type=float,
        default=0.7,
        help="also report acceptance of each drafter at this temperature on the open-ended prompts (0: skip)",
    )
    parser.add_argument(
        "--peers",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="also run HF transformers (torch CPU) when installed",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads for the peer")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args(argv)

    import doppler_py

    weights = args.weights.split(",")
    prompts = args.prompts.split(",")
    unknown = [p for p in prompts if p not in PROMPTS]
    if unknown:
        parser.error(f"unknown prompts {unknown}; known: {', '.join(PROMPTS)}")
    prompts = [p for p in prompts if PROMPTS[p][0] in args.groups.split(",")]
    results: dict[str, dict[str, dict[str, list[dict]]]] = {}
    sampled: list[dict] = []
    masks: list[dict] = []  # the grammar's host cost per token (structured prompts)
    for weight in weights:
        # warmup="now": every mode compiled and calibrated at its first use (the warm-up runs below), so the timed
        # runs measure steady speculation, not the default's wait for the compile to pay for itself.
        load = dict(weights=weight, progress=False, max_seq=1024, draft_head=args.draft_head, warmup="now")
        with doppler_py.load(**load) as engine:
            methods = [m for m in args.methods.split(",") if any(m in prompt_methods([m], p) for p in prompts)]
            unknown = [m for m in methods if base_mode(m) not in ("plain", *speculative_modes())]
            if unknown:
                parser.error(f"unknown methods {unknown}; drafters: {', '.join(speculative_modes())} (see METHODS)")
            missing = [
                m
                for m in methods
                if (kind := TREE_METHODS.get(base := split_method(m)[0], base)) in HEAD_KINDS
                and kind not in engine.heads
            ]
            if missing:  # heads come from the catalog (shipped with the package) or --draft-head
                print(f"[{weight}] no {' or '.join(missing)} head for this model: skipping it", file=sys.stderr)
                methods = [m for m in methods if m not in missing]
            print(f"[{weight}] adapter: {engine.model.gpu.name} via {engine.model.gpu.backend}", file=sys.stderr)
            for method in methods:  # warm-up: pipelines compile, cost models calibrate
                run_ours(engine, PROMPTS["chat-echo"][1], method, 8)
                for prompt in [p for p in prompts if p in SCHEMAS and method in prompt_methods(methods, p)][:1]:
                    run_ours(engine, PROMPTS[prompt][1], method, 8, response_format=response_format(prompt))
            per_prompt = results.setdefault(weight, {})
            for repeat in range(args.repeats):
                for i, prompt in enumerate(prompts):
                    for method in method_order(prompt_methods(methods, prompt), repeat, i):
                        row = run_ours(
                            engine,
                            PROMPTS[prompt][1],
                            method,
                            args.tokens,
                            k=args.k,
                            response_format=response_format(prompt),
                        )
                        per_prompt.setdefault(prompt, {}).setdefault(method, []).append(row)
                        print(
                            f"[{weight}] rep {repeat} {prompt:10s} {method:14s} {row['tokens_per_s']:7.2f} tok/s "
                            f"accept {row['acceptance_rate']:.2f} tok/step {row['tokens_per_step']:.2f}",
                            file=sys.stderr,
                        )
            masks += [
                mask_cost(engine, p, runs["plain"][0]["text_tokens"], median(runs["plain"], "tokens_per_s"))
                for p, runs in per_prompt.items()
                if p in SCHEMAS and "plain" in runs
            ]
            if args.sampled_temperature > 0:  # every drafter on open-ended prompts, lookup's on copy-heavy ones too
                for prompt, method in (
                    (p, m)
                    for p in prompts
                    for m in prompt_methods(methods, p)
                    if m != "plain" and (PROMPTS[p][0] == OPEN_ENDED or m in LOOKUP_METHODS)
                ):
                    row = run_ours(
                        engine,
                        PROMPTS[prompt][1],
                        method,
                        args.tokens,
                        args.sampled_temperature,
                        k=args.k,
                        response_format=response_format(prompt),
                    )
                    sampled.append({"weights": weight, "prompt": prompt, "method": method} | row)
    peers: dict[str, dict[str, list[dict]]] = {}
    peer = load_peer(args.threads) if args.peers else None
    if peer is not None:
        model, tokenizer = peer
        for _ in range(args.repeats):
            for prompt in prompts:
                for name, lookup in (("transformers", False), ("transformers+lookup", True)):
                    row = run_peer(model, tokenizer, PROMPTS[prompt][1], args.tokens, lookup)
                    peers.setdefault(prompt, {}).setdefault(name, []).append(row)
                    print(f"[peer] {prompt:10s} {name:20s} {row['tokens_per_s']:7.2f} tok/s", file=sys.stderr)

    table = []
    for weight, per_prompt in results.items():
        for prompt, per_method in per_prompt.items():
            plain = median(per_method["plain"], "tokens_per_s") if "plain" in per_method else None
            for method, rows in per_method.items():
                tps = median(rows, "tokens_per_s")
                same_text = (
                    all(r["text_tokens"] == per_method["plain"][0]["text_tokens"] for r in rows)
                    if "plain" in per_method
                    else None
                )
                draft_costs = [r["draft_s_per_token"] for r in rows if r["draft_s_per_token"] is not None]
                table.append(
                    {
                        "weights": weight,
                        "group": PROMPTS[prompt][0],
                        "prompt": prompt,
                        "method": method,
                        "drafter": rows[0]["drafter"],
                        "tokens_per_s": round(tps, 2),
                        "speedup_vs_plain": round(tps / plain, 3) if plain else None,
                        "acceptance_rate": round(median(rows, "acceptance_rate"), 3),
                        "tokens_per_step": round(median(rows, "tokens_per_step"), 2),
                        "tokens_per_forward": round(median(rows, "tokens_per_forward"), 2),
                        "tree_steps_per_run": round(median(rows, "tree_steps"), 1),
                        "forced_tokens": round(median(rows, "forced_tokens"), 1),
                        "acceptance_by_position": mean_by_position([r["acceptance_by_position"] for r in rows]),
                        # one draft token's time over one plain decoding step's (1 / plain tok/s), same run
                        "draft_cost_vs_plain_step": round(statistics.median(draft_costs) * plain, 3)
                        if draft_costs and plain
                        else None,
                        "same_tokens_as_plain": same_text,
                        "repeats": len(rows),
                    }
                )
    for prompt, per_method in peers.items():
        plain = median(per_method["transformers"], "tokens_per_s")
        for name, rows in per_method.items():
            tps = median(rows, "tokens_per_s")
            table.append(
                {
                    "weights": "f32 (torch)",
                    "group": PROMPTS[prompt][0],
                    "prompt": prompt,
                    "method": name,
                    "tokens_per_s": round(tps, 2),
                    "speedup_vs_plain": round(tps / plain, 3),
                    "acceptance_rate": None,
                    "tokens_per_step": None,
                    "same_tokens_as_plain": None,
                    "repeats": len(rows),
                }
            )

    header = (
        f"{'weights':12s} {'group':10s} {'prompt':10s} {'method':20s} {'tok/s':>8s} {'vs plain':>9s} {'accept':>7s} "
        f"{'tok/step':>8s}  same"
    )
    print(header)
    print("-" * len(header))
    for row in table:
        accept = "" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.2f}"
        per_step = "" if row["tokens_per_step"] is None else f"{row['tokens_per_step']:.2f}"
        speedup = "" if row["speedup_vs_plain"] is None else f"{row['speedup_vs_plain']:.2f}x"
        same = "" if row["same_tokens_as_plain"] is None else ("yes" if row["same_tokens_as_plain"] else "NO")
        print(
            f"{row['weights']:12s} {row['group']:10s} {row['prompt']:10s} {row['method']:20s} "
            f"{row['tokens_per_s']:8.2f} {speedup:>9s} {accept:>7s} {per_step:>8s}  {same}"
        )
    summary = summarise(table)
    print()
    print(
        f"{'weights':12s} {'group':10s} {'method':20s} {'geomean vs plain':>16s} {'worst':>6s} {'tok/step':>8s} "
        f"{'tok/fwd all':>11s}"
    )
    for row in summary:
        print(
            f"{row['weights']:12s} {row['group']:10s} {row['method']:20s} {row['geomean_speedup']:15.2f}x "
            f"{row['worst_speedup']:5.2f}x {row['mean_tokens_per_step']:8.2f} {row['mean_tokens_per_forward']:11.2f}"
        )
    for row in (r for r in table if r.get("acceptance_by_position")):
        if row["group"] == OPEN_ENDED and row["method"] == "eagle":
            cost = row["draft_cost_vs_plain_step"]
            print(f"eagle {row['prompt']:10s} acceptance by position {row['acceptance_by_position']} draft cost {cost}")
    if masks:
        print("\nthe grammar's host cost per token (mask + commit), against a constrained plain step:")
        for row in masks:
            print(
                f"{row['prompt']:14s} median {row['median_us']:7.1f} us, mean {row['mean_us']:7.1f} us "
                f"({100 * row['share_of_plain_step']:.2f}% of a plain step, {row['tokens']} tokens)"
            )
    if sampled:
        print(
            f"\nT = {args.sampled_temperature}: acceptance (open-ended prompts; lookup methods on the other groups too)"
        )
        for row in sampled:
            print(
                f"{row['weights']:12s} {row['prompt']:10s} {row['method']:14s} accept {row['acceptance_rate']:.2f} "
                f"tok/step {row['tokens_per_step']:.2f}"
            )
    report = {
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "tokens": args.tokens,
        "repeats": args.repeats,
        "rows": table,
        "summary": summary,
        "sampled": [{k: v for k, v in r.items() if k != "text_tokens"} for r in sampled],
        "sampled_temperature": args.sampled_temperature,
        "mask_cost": masks,
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.png:
        plot(table, args.png)
    return 0


def summarise(table: list[dict]) -> list[dict]:
    """Per weights, prompt group and method: geometric mean and worst speedup, mean tokens per target forward."""
    keys = sorted({(r["weights"], r["group"], r["method"]) for r in table if r["speedup_vs_plain"]})
    summary = []
    for weight, group, method in keys:
        rows = [r for r in table if (r["weights"], r["group"], r["method"]) == (weight, group, method)]
        steps = [r["tokens_per_step"] for r in rows if r["tokens_per_step"] is not None]
        forwards = [r["tokens_per_forward"] for r in rows if r.get("tokens_per_forward") is not None]
        summary.append(
            {
                "weights": weight,
                "group": group,
                "method": method,
                "prompts": len(rows),
                "geomean_speedup": round(geomean([r["speedup_vs_plain"] for r in rows]), 3),
                "worst_speedup": round(min(r["speedup_vs_plain"] for r in rows), 3),
                "mean_tokens_per_step": round(statistics.fmean(steps), 2) if steps else float("nan"),
                "mean_tokens_per_forward": round(statistics.fmean(forwards), 2) if forwards else float("nan"),
            }
        )
    return summary


def plot(table: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["weights"], r["prompt"]) for r in table})
    methods = sorted({r["method"] for r in table})
    fig, ax = plt.subplots(figsize=(max(8, len(groups) * 1.1), 4.5))
    width = 0.8 / len(methods)
    for j, method in enumerate(methods):
        values = [
            next((r["tokens_per_s"] for r in table if (r["weights"], r["prompt"]) == g and r["method"] == method), 0.0)
            for g in groups
        ]
        ax.bar([i + j * width for i in range(len(groups))], values, width, label=method)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
    ax.set_xticklabels([f"{w}\n{p}" for w, p in groups], fontsize=8)
    ax.set_ylabel("tokens/s (median)")
    ax.set_title("SmolLM2-135M: plain vs speculative decoding")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
