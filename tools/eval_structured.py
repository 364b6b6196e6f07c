"""Is constrained output valid? JSON schemas, regexes and Lark grammars on SmolLM2-135M, each output checked
independently of llguidance (the library that makes the token masks).

    python tools/eval_structured.py --json build/structured.json

Every case (a chat prompt with a constraint) runs at each --temperatures (seeded) with each --speculative mode.
Checks: JSON with `jsonschema` (Draft 2020-12), regexes with Python's `re.fullmatch`, Lark grammars with the
`lark` package (Earley) or, for llguidance's own extensions (`%json`), by hand. An output is valid, invalid
(ended by itself, yet fails its check: a bug), cut (finish_reason "length", possibly unfinished; reported
apart, not checked) or an error (generate raised). At temperature 0 each speculative mode must also produce
plain decoding's tokens. Per run: tokens per target forward (generated / (steps + plain_steps)) and the drafts
the grammar forced (`stats["forced_tokens"]`).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def obj(properties: dict, required: list[str] | None = None) -> dict:
    """A closed object schema; every property required unless `required` names fewer."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


NAME = {"type": "string", "maxLength": 40}
TEXT = {"type": "string", "maxLength": 80}
DATE = {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}

# name: (schema, prompt). Small schemas with bounded strings keep runs short; the prompts give the model what
# to fill in, as extraction and form filling do.
SCHEMAS: dict[str, tuple[dict, str]] = {
    "person": (
        obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 130}, "city": NAME}, ["name", "age"]),
        "Extract the person as JSON with name, age and city: Maria Lopez is 34 years old and lives in Madrid.",
    ),
    "product": (
        obj(
            {
                "name": NAME,
                "price": {"type": "number", "minimum": 0},
                "currency": {"enum": ["USD", "EUR", "GBP"]},
                "in_stock": {"type": "boolean"},
            }
        ),
        "Turn this listing into JSON (name, price, currency, in_stock): Blue ceramic mug, 12.50 euros, available now.",
    ),
    "event": (
        obj({"title": TEXT, "date": DATE, "location": NAME}, ["title", "date"]),
        "Extract the event as JSON (title, date as YYYY-MM-DD, location): The spring concert takes place on "
        "14 April 2026 at the city hall.",
    ),
    "address": (
        obj(
            {
                "name": NAME,
                "address": obj(
                    {"street": TEXT, "city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                ),
                "country": {"enum": ["US", "DE", "FR", "ES"]},
            }
        ),
        "Fill in the shipping form as JSON: send it to Anna Schmidt, Lindenstrasse 12, 10115 Berlin, Germany.",
    ),
    "recipe": (
        obj(
            {
                "title": NAME,
                "ingredients": {"type": "array", "items": NAME, "minItems": 2, "maxItems": 6},
                "servings": {"type": "integer", "minimum": 1, "maximum": 12},
            }
        ),
        "Give a simple pancake recipe as JSON with a title, a list of ingredients and the number of servings.",
    ),
    "sentiment": (
        obj(
            {
                "sentiment": {"enum": ["positive", "negative", "neutral"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            }
        ),
        "Classify the sentiment of this review as JSON: 'The battery dies within an hour and support never replied.'",
    ),
    "weather-call": (
        obj(
            {
                "function": {"enum": ["get_weather", "get_forecast"]},
                "arguments": obj({"city": NAME, "unit": {"enum": ["celsius", "fahrenheit"]}}),
            }
        ),
        "Call a weather function for this request, answering with JSON: What's the temperature in Oslo right now, "
        "in celsius?",
    ),
    "meeting": (
        obj(
            {
                "attendees": {
                    "type": "array",
                    "items": obj(
                        {"name": NAME, "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"}},
                    ),
                    "minItems": 1,
                    "maxItems": 4,
                },
                "duration_minutes": {"type": "integer", "minimum": 15, "maximum": 240},
            }
        ),
        "Create a meeting as JSON: a 30 minute call with Tom (tom@acme.com) and Lisa (lisa@acme.com).",
    ),
    "order": (
        obj(
            {
                "order_id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
                "items": {
                    "type": "array",
                    "items": obj({"sku": NAME, "quantity": {"type": "integer", "minimum": 1}}),
                    "minItems": 1,
                    "maxItems": 3,
                },
                "total": {"type": "number", "minimum": 0},
            }
        ),
        "Extract the order as JSON: Order ORD-4821: 2 x SKU-100 and 1 x SKU-205, total 57.90.",
    ),
    "contact-anyof": (
        obj(
            {
                "name": NAME,
                "contact": {
                    "anyOf": [
                        obj({"email": {"type": "string", "maxLength": 60}}),
                        obj({"phone": {"type": "string", "pattern": "^[0-9 +-]{6,20}$"}}),
                    ]
                },
            }
        ),
        "Extract the contact as JSON (name, and an email or a phone): Call Peter Brown on +44 20 7946 0958.",
    ),
    "ticket": (
        obj(
            {
                "category": {"enum": ["billing", "technical", "account", "other"]},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
                "urgent": {"type": "boolean"},
            }
        ),
        "Triage this support ticket as JSON (category, tags, urgent): 'I was charged twice for my subscription "
        "this month, please refund one payment today.'",
    ),
    "book": (
        obj(
            {
                "title": TEXT,
                "author": NAME,
                "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
                "genres": {
                    "type": "array",
                    "items": {"enum": ["fiction", "science", "history", "fantasy", "mystery"]},
                    "minItems": 1,
                    "maxItems": 3,
                },
            }
        ),
        "Describe the book 'The Hobbit' by J.R.R. Tolkien (1937) as JSON with title, author, year and genres.",
    ),
    "review": (
        obj(
            {
                "rating": {"type": "integer", "minimum": 1, "maximum": 5},
                "pros": {"type": "array", "items": NAME, "maxItems": 3},
                "cons": {"type": "array", "items": NAME, "maxItems": 3},
                "summary": {"type": "string", "maxLength": 100},
            },
            ["rating", "summary"],
        ),
        "Summarise this review as JSON: 'Great screen and fast, but the speakers are weak. Four stars.'",
    ),
    "geo": (
        obj(
            {
                "city": NAME,
                "latitude": {"type": "number", "minimum": -90, "maximum": 90},
                "longitude": {"type": "number", "minimum": -180, "maximum": 180},
            }
        ),
        "Give the coordinates of Paris as JSON with city, latitude and longitude.",
    ),
    "math": (
        obj({"answer": {"type": "integer"}, "explanation": {"type": "string", "maxLength": 120}}),
        "What is 17 times 3? Answer as JSON with the answer and a short explanation.",
    ),
    "translation": (
        obj(
            {
                "source_language": {"enum": ["English", "French", "German", "Spanish"]},
                "target_language": {"enum": ["English", "French", "German", "Spanish"]},
                "translation": TEXT,
            }
        ),
        "Translate 'Good morning, my friend' into French. Answer as JSON with the source language, the target "
        "language and the translation.",
    ),
    "todo": (
        obj(
            {
                "tasks": {
                    "type": "array",
                    "items": obj(
                        {"title": NAME, "priority": {"enum": ["low", "medium", "high"]}, "done": {"type": "boolean"}}
                    ),
                    "minItems": 2,
                    "maxItems": 4,
                }
            }
        ),
        "Make a to-do list as JSON for moving house: pack boxes (high priority), book a van (done), "
        "change the address (low priority).",
    ),
    "quantity-anyof": (
        obj(
            {
                "item": NAME,
                "quantity": {"anyOf": [{"type": "integer", "minimum": 0}, {"enum": ["unknown"]}]},
                "unit": {"enum": ["kg", "g", "l", "pieces"]},
            }
        ),
        "Extract the stock entry as JSON (item, quantity, unit): we have 25 kg of flour left.",
    ),
    "flight": (
        obj(
            {
                "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "date": DATE,
                "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
                "class": {"enum": ["economy", "business"]},
            },
            ["from", "to", "date", "passengers"],
        ),
        "Book a flight as JSON (airport codes, date YYYY-MM-DD, passengers, class): two people from Boston (BOS) "
        "to Lisbon (LIS) on 3 May 2026, economy.",
    ),
    "company": (
        obj(
            {
                "company": obj({"name": NAME, "ceo": obj({"name": NAME, "since": {"type": "integer"}})}),
                "employees": {"type": "integer", "minimum": 1},
                "public": {"type": "boolean"},
            },
            ["company", "employees"],
        ),
        "Extract as JSON: Nordwind GmbH employs 240 people; Julia Berg has been its CEO since 2019.",
    ),
    "tool-anyof": (
        obj(
            {
                "tool": {"enum": ["search", "calculator"]},
                "input": {"anyOf": [obj({"query": TEXT}), obj({"expression": {"type": "string", "maxLength": 40}})]},
            }
        ),
        "Pick a tool and its input as JSON (search takes a query, calculator an expression): how much is 128 * 46?",
    ),
    "palette": (
        obj(
            {
                "name": NAME,
                "colors": {
                    "type": "array",
                    "items": {"type": "string", "pattern": "^#[0-9a-fA-F]{6}$"},
                    "minItems": 3,
                    "maxItems": 5,
                },
            }
        ),
        "Suggest a colour palette for an ocean-themed website as JSON: a name and 3 to 5 hex colours.",
    ),
}
JSON_OBJECTS = {
    "any-object": "Describe a cat as a JSON object with a few fields.",
    "any-config": "Write a small JSON configuration object for a web server (host, port, debug).",
}
# name: (pattern, prompt). Rust regex syntax, kept to what Python's `re` reads the same way.
REGEXES: dict[str, tuple[str, str]] = {
    "date": (r"[0-9]{4}-[0-9]{2}-[0-9]{2}", "When did the Apollo 11 moon landing happen? Answer as YYYY-MM-DD."),
    "phone": (r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", "Make up a US phone number for a pizza shop."),
    "email": (r"[a-z]+\.[a-z]+@[a-z]+\.(com|org)", "Suggest a work email address for Jane Doe at the company Acme."),
    "yes-no": (r"(Yes|No)\. [A-Z][a-z ,]{5,80}\.", "Is the Pacific the largest ocean? Answer yes or no and why."),
    "hex-color": (r"#[0-9a-fA-F]{6}", "What is the hex colour code of pure red?"),
    "time": (r"([01][0-9]|2[0-3]):[0-5][0-9]", "At what time does a typical office day start? Answer as HH:MM."),
    "three-words": (r"[A-Z][a-z]+(, [A-Z][a-z]+){2}", "Name three European capitals."),
}
ARITHMETIC = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""
SHOPPING = r"""
start: item "\n" item "\n" item
item: "- " QTY " " WORD
QTY: /[1-9][0-9]?/
WORD: /[a-z]{1,12}( [a-z]{1,12}){0,2}/
"""
SQL = r"""
start: "SELECT " columns " FROM " NAME where? ";"
columns: NAME (", " NAME)*
where: " WHERE " NAME " " OP " " value
OP: "=" | ">" | "<"
value: NUMBER | STRING
NAME: /[a-z_]+/
NUMBER: /[0-9]+/
STRING: /'[A-Za-z ]*'/
"""
TAGGED_SCHEMA = obj({"city": NAME, "population": {"type": "integer", "minimum": 0}})
# llguidance's %json embeds a JSON schema in a Lark rule: the `lark` package cannot read it, so it is checked by
# hand (the prefix, then the JSON under its schema).
TAGGED_JSON = f'start: "ANSWER: " data\ndata: %json {json.dumps(TAGGED_SCHEMA)}\n'
# name: (grammar, prompt, True: checked by the `lark` package, False: by hand)
GRAMMARS: dict[str, tuple[str, str, bool]] = {
    "arithmetic": (ARITHMETIC, "Write an arithmetic expression that equals 24 using the numbers 3 and 8.", True),
    "shopping": (SHOPPING, "Write a shopping list of three items with quantities for a picnic.", True),
    "sql": (SQL, "Write an SQL query that selects the name and age of users older than 30.", True),
    "tagged-json": (TAGGED_JSON, "What is the population of Vienna? Give the city and its population.", False),
}


@dataclass
class Case:
    kind: str  # json_schema, json_object, regex, grammar
    name: str
    messages: list[dict]
    options: dict  # what generate() takes: response_format, regex or grammar
    check: Callable[[str], str | None]  # the output → None when valid, else why not


def check_json(schema: dict | None) -> Callable[[str], str | None]:
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema) if schema is not None else None

    def check(text: str) -> str | None:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            return f"not JSON: {exc}"
        if validator is None:
            return None if isinstance(value, dict) else f"not a JSON object but {type(value).__name__}"
        error = jsonschema.exceptions.best_match(validator.iter_errors(value))
        return None if error is None else f"{error.message} at {list(error.absolute_path)}"

    return check


def check_regex(pattern: str) -> Callable[[str], str | None]:
    compiled = re.compile(pattern)
    return lambda text: None if compiled.fullmatch(text) else f"does not match {pattern!r}"


def check_lark(grammar: str) -> Callable[[str], str | None]:
    import lark

    parser = lark.Lark(grammar, parser="earley", lexer="dynamic")

    def check(text: str) -> str | None:
        try:
            parser.parse(text)
        except lark.exceptions.LarkError as exc:
            return f"lark: {str(exc).splitlines()[0]}"
        return None

    return check


def check_tagged_json(text: str) -> str | None:
    prefix = "ANSWER: "
    if not text.startswith(prefix):
        return f"does not start with {prefix!r}"
    return check_json(TAGGED_SCHEMA)(text[len(prefix) :])


def cases() -> list[Case]:
    out = [
        Case(
            "json_schema",
            name,
            user(prompt),
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": name, "schema": schema, "strict": True},
                }
            },
            check_json(schema),
        )
        for name, (schema, prompt) in SCHEMAS.items()
    ]
    out += [
        Case("json_object", name, user(prompt), {"response_format": {"type": "json_object"}}, check_json(None))
        for name, prompt in JSON_OBJECTS.items()
    ]
    out += [
        Case("regex", name, user(prompt), {"regex": pattern}, check_regex(pattern))
        for name, (pattern, prompt) in REGEXES.items()
    ]
    out += [
        Case("grammar", name, user(prompt), {"grammar": grammar}, check_lark(grammar) if by_lark else check_tagged_json)
        for name, (grammar, prompt, by_lark) in GRAMMARS.items()
    ]
    return out


def run_case(engine, case: Case, temperature: float, speculative: str | None, max_tokens: int, seed: int) -> dict:
    row = {"kind": case.kind, "name": case.name, "temperature": temperature, "speculative": speculative or "none"}
    try:
        result = engine.generate(
            case.messages,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            speculative=speculative,
            **case.options,
        )
    except Exception as exc:  # a crash is a finding: record it and go on
        return row | {"status": "error", "error": f"{type(exc).__name__}: {exc}", "text": None, "tokens": []}
    stats = result.stats
    forwards = stats["steps"] + stats["plain_steps"]
    if result.finish_reason == "length":
        status, why = "length", None
    else:
        why = case.check(result.text)
        status = "valid" if why is None else "invalid"
    return row | {
        "status": status,
        "error": why,
        "finish_reason": result.finish_reason,
        "text": result.text,
        "tokens": list(result.tokens),
        "generated": len(result.tokens),
        "tokens_per_forward": round(len(result.tokens) / forwards, 3) if forwards else None,
        "forced_tokens": stats["forced_tokens"],
        "drafted": stats["drafted"],
        "accepted": stats["accepted"],
        "steps": stats["steps"],
        "plain_steps": stats["plain_steps"],
        "tokens_per_s": round(result.tokens_per_s, 2),
        "elapsed_s": round(result.elapsed_s, 3),
    }


STATUSES = ("valid", "invalid", "length", "error")


def tally(rows: list[dict], key: Callable[[dict], str]) -> dict[str, dict]:
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(key(row), []).append(row)
    out = {}
    for name, group in groups.items():
        counts = {s: sum(r["status"] == s for r in group) for s in STATUSES}
        measured = [r for r in group if r.get("tokens_per_forward") is not None]
        out[name] = {"runs": len(group)} | counts
        out[name]["mean_tokens_per_forward"] = (
            round(statistics.fmean(r["tokens_per_forward"] for r in measured), 3) if measured else None
        )
        out[name]["forced_tokens"] = sum(r.get("forced_tokens", 0) for r in measured)
        out[name]["generated"] = sum(r.get("generated", 0) for r in measured)
        out[name]["median_tokens_per_s"] = (
            round(statistics.median(r["tokens_per_s"] for r in measured), 2) if measured else None
        )
    return out


def print_tally(title: str, table: dict[str, dict]) -> None:
    print(
        f"\n{title:24s} {'runs':>5s} {'valid':>6s} {'invalid':>8s} {'length':>7s} {'error':>6s} "
        f"{'tok/fwd':>8s} {'forced':>7s} {'tokens':>7s} {'tok/s':>6s}"
    )
    for name, t in table.items():
        per_fwd = "" if t["mean_tokens_per_forward"] is None else f"{t['mean_tokens_per_forward']:.2f}"
        tps = "" if t["median_tokens_per_s"] is None else f"{t['median_tokens_per_s']:.1f}"
        print(
            f"{name:24s} {t['runs']:5d} {t['valid']:6d} {t['invalid']:8d} {t['length']:7d} {t['error']:6d} "
            f"{per_fwd:>8s} {t['forced_tokens']:7d} {t['generated']:7d} {tps:>6s}"
        )


def same_as_plain(rows: list[dict]) -> list[dict]:
    """Greedy runs whose tokens differ from plain decoding's for the same case (speculation must not change a
    greedy answer, constrained or not)."""
    plain = {r["name"]: r["tokens"] for r in rows if r["temperature"] == 0 and r["speculative"] == "none"}
    return [
        {"name": r["name"], "speculative": r["speculative"]}
        for r in rows
        if r["temperature"] == 0
        and r["speculative"] != "none"
        and r["name"] in plain
        and r["tokens"] != plain[r["name"]]
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", default="keep")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--temperatures", default="0,0.8")
    parser.add_argument("--speculative", default="none,auto", help="modes, comma-separated (none: plain decoding)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default="json_schema,json_object,regex,grammar")
    parser.add_argument("--only", help="case names, comma-separated (default: all)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    import doppler_py

    temperatures = [float(t) for t in args.temperatures.split(",")]
    modes = [None if m == "none" else m for m in args.speculative.split(",")]
    kinds = args.kinds.split(",")
    chosen = [c for c in cases() if c.kind in kinds and (not args.only or c.name in args.only.split(","))]
    rows: list[dict] = []
    start = time.perf_counter()
    with doppler_py.load(weights=args.weights, progress=False, warmup="now") as engine:
        print(f"adapter: {engine.model.gpu.name} via {engine.model.gpu.backend}", file=sys.stderr)
        for mode in modes:  # warm-up: pipelines compile, speculation's costs are measured
            engine.generate(chosen[0].messages, max_tokens=16, speculative=mode, **chosen[0].options)
        for case in chosen:
            for temperature in temperatures:
                for mode in modes:
                    row = run_case(engine, case, temperature, mode, args.max_tokens, args.seed)
                    rows.append(row)
                    per_fwd = row.get("tokens_per_forward")
                    print(
                        f"{case.kind:11s} {case.name:15s} T={temperature:<3g} {row['speculative']:5s} "
                        f"{row['status']:7s} {row.get('generated', 0):4d} tok "
                        f"{'' if per_fwd is None else f'{per_fwd:.2f}':>5s} tok/fwd "
                        f"forced {row.get('forced_tokens', 0):3d} {row.get('tokens_per_s', 0):6.1f} tok/s "
                        f"{json.dumps(row['text'])[:100] if row['text'] is not None else row['error']}",
                        file=sys.stderr,
                    )
                    if row["status"] in ("invalid", "error"):
                        print(f"    {row['status']}: {row['error']}", file=sys.stderr)
    by_kind = tally(rows, lambda r: r["kind"])
    by_mode = tally(rows, lambda r: f"{r['speculative']} T={r['temperature']:g}")
    mismatches = same_as_plain(rows)
    print_tally("constraint kind", by_kind)
    print_tally("speculative, temperature", by_mode)
    print_tally("all", tally(rows, lambda r: "all"))
    greedy = sum(1 for r in rows if r["temperature"] == 0 and r["speculative"] != "none")
    print(f"\ngreedy speculative runs with plain decoding's tokens: {greedy - len(mismatches)}/{greedy}")
    for row in rows:
        if row["status"] in ("invalid", "error"):
            print(
                f"{row['status'].upper()}: {row['kind']} {row['name']} T={row['temperature']:g} "
                f"speculative={row['speculative']}: {row['error']}\n    output: {json.dumps(row['text'])}"
            )
    for m in mismatches:
        print(f"DIFFERS FROM PLAIN: {m['name']} speculative={m['speculative']}")
    print(f"\n{len(rows)} runs in {time.perf_counter() - start:.0f} s")
    if args.json:
        report = {
            "machine": {"platform": platform.platform(), "python": platform.python_version()},
            "max_tokens": args.max_tokens,
            "seed": args.seed,
            "by_kind": by_kind,
            "by_speculative_temperature": by_mode,
            "greedy_differs_from_plain": mismatches,
            "runs": rows,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
