"""Host cost of grammar-constrained decoding on SmolLM2's 49,152-token vocabulary: one token mask per step.

    python tools/bench_constraints.py --repeats 5 --json constraints.json

For each constraint a realistic output is tokenized with SmolLM2's tokenizer and walked token by token through
a fresh matcher: the mask before each token is timed (what a constrained decode step adds on the host, before
the mask is uploaded), then the token is committed. Also timed: building the llguidance tokenizer (once per
model), compiling a matcher (once per request), forced-token lookup, and the k+1 masks a speculative step with
k = 4 draft tokens needs (`draft_masks`, the walk and its rollback included). Medians and 95th percentiles are
over every position but the first of every repeat (a fresh matcher's first mask builds lexer states, reported
apart); the draft walk runs on its own pass, as llguidance caches masks of states it has seen.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

# A product record: strings (one bounded), an integer, numbers with bounds, enums, an array of strings, a
# boolean and a nested object, all required, nothing else allowed.
PRODUCT_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1},
        "name": {"type": "string", "maxLength": 80},
        "price": {"type": "number", "minimum": 0},
        "currency": {"enum": ["USD", "EUR", "GBP", "JPY"]},
        "status": {"enum": ["draft", "active", "archived"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "in_stock": {"type": "boolean"},
        "dimensions": {
            "type": "object",
            "properties": {"width_cm": {"type": "number"}, "height_cm": {"type": "number"}},
            "required": ["width_cm", "height_cm"],
            "additionalProperties": False,
        },
        "ratings": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 5}},
    },
    "required": ["id", "name", "price", "currency", "status", "tags", "in_stock", "dimensions", "ratings"],
    "additionalProperties": False,
}
PRODUCT = {
    "id": 48213,
    "name": "Trail running shoe — waterproof, size 44 👟",
    "price": 129.95,
    "currency": "EUR",
    "status": "active",
    "tags": ["running", "outdoor", "gore-tex", "men"],
    "in_stock": True,
    "dimensions": {"width_cm": 11.5, "height_cm": 31.0},
    "ratings": [5, 4, 5, 3, 5],
}
ANY_OBJECT = {
    "query": "weather in Paris",
    "results": [{"day": "Mon", "high": 21.5, "low": 12, "rain": False}, {"day": "Tue", "high": 18, "rain": True}],
    "source": None,
    "notes": 'Forecast from 3 models; "high" is °C',
}
CASES = {
    # name: (response_format, output text)
    "json_schema": (
        {"type": "json_schema", "json_schema": {"name": "product", "schema": PRODUCT_SCHEMA, "strict": True}},
        json.dumps(PRODUCT, ensure_ascii=False),
    ),
    "json_schema_indented": (
        {"type": "json_schema", "json_schema": {"name": "product", "schema": PRODUCT_SCHEMA, "strict": True}},
        json.dumps(PRODUCT, ensure_ascii=False, indent=2),
    ),
    "json_object": ({"type": "json_object"}, json.dumps(ANY_OBJECT, ensure_ascii=False)),
}
DRAFT_K = 4


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def smollm2_tokenizer():
    import tempfile

    from doppler_py.model.catalog import DEFAULT_MODEL, known_model_file
    from doppler_py.model.gguf import read_gguf, tokenizer_files
    from doppler_py.tokenizer import Tokenizer

    tokenizer_json, tokenizer_config = tokenizer_files(read_gguf(known_model_file(DEFAULT_MODEL)))
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "tokenizer.json").write_text(tokenizer_json)
        (Path(folder) / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
        return Tokenizer.from_dir(folder)


def bench_case(ll, tokenizer, response_format: dict, text: str, repeats: int) -> dict:
    from doppler_py.constraints import GrammarMatcher, constraint_from_options

    vocab = tokenizer.vocab_size
    ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_ids[0]]
    masks, first, drafts, forced, compile_ms = [], [], [], [], []
    for _ in range(repeats):
        # Plain decoding: one mask per step, then the sampled token is committed.
        start = time.perf_counter()
        matcher = GrammarMatcher(ll, constraint_from_options(response_format=response_format, tokenizer=ll), vocab)
        compile_ms.append((time.perf_counter() - start) * 1e3)
        row = np.empty(matcher.words, dtype=np.uint32)  # reused: the engine fills one staging row per step
        for position, token in enumerate(ids):
            start = time.perf_counter()
            matcher.mask(row)
            (masks if position else first).append((time.perf_counter() - start) * 1e3)
            matcher.advance([token])
        assert matcher.finished
        # Speculative decoding: forced tokens and the k+1 masks of a draft chain at every position (the chain is
        # the true continuation, so every draft is valid and all k+1 masks are computed).
        matcher.rollback(matcher.length)
        for position, token in enumerate(ids):
            start = time.perf_counter()
            matcher.forced_tokens()
            forced.append((time.perf_counter() - start) * 1e3)
            chain = ids[position : position + DRAFT_K]
            start = time.perf_counter()
            _, valid = matcher.draft_masks(chain)
            drafts.append((time.perf_counter() - start) * 1e3)
            assert valid == len(chain), (position, valid)
            matcher.advance([token])
    return {
        "tokens": len(ids),
        "repeats": repeats,
        "compile_ms_median": round(statistics.median(compile_ms), 3),
        "mask_ms_median": round(statistics.median(masks), 4),
        "mask_ms_p95": round(percentile(masks, 0.95), 4),
        "mask_ms_max": round(max(masks), 4),
        "first_mask_ms_median": round(statistics.median(first), 3),
        "forced_tokens_ms_median": round(statistics.median(forced), 4),
        f"draft_masks_k{DRAFT_K}_ms_median": round(statistics.median(drafts), 4),
        f"draft_masks_k{DRAFT_K}_ms_p95": round(percentile(drafts, 0.95), 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="fresh matchers walked over each output")
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args(argv)

    import llguidance

    from doppler_py.constraints.tokenizer_bridge import build_ll_tokenizer

    tokenizer = smollm2_tokenizer()
    start = time.perf_counter()
    ll = build_ll_tokenizer(tokenizer)
    tokenizer_ms = (time.perf_counter() - start) * 1e3
    report = {
        "vocab_size": tokenizer.vocab_size,
        "llguidance": llguidance.__version__,
        "ll_tokenizer_build_ms": round(tokenizer_ms, 1),
        "cases": {name: bench_case(ll, tokenizer, rf, text, args.repeats) for name, (rf, text) in CASES.items()},
    }
    header = f"{'constraint':<22}{'tokens':>7}{'compile ms':>11}{'1st mask':>9}"
    header += f"{'mask med':>10}{'mask p95':>10}{'mask max':>10}"
    header += f"{'ff med':>9}{f'k={DRAFT_K} med':>10}{f'k={DRAFT_K} p95':>10}"
    print(
        f"SmolLM2 vocabulary {tokenizer.vocab_size}; llguidance {llguidance.__version__}; "
        f"llguidance tokenizer built in {tokenizer_ms:.0f} ms; times in ms"
    )
    print(header)
    for name, r in report["cases"].items():
        print(
            f"{name:<22}{r['tokens']:>7}{r['compile_ms_median']:>11.2f}{r['first_mask_ms_median']:>9.3f}"
            f"{r['mask_ms_median']:>10.4f}"
            f"{r['mask_ms_p95']:>10.4f}{r['mask_ms_max']:>10.4f}{r['forced_tokens_ms_median']:>9.4f}"
            f"{r[f'draft_masks_k{DRAFT_K}_ms_median']:>10.4f}{r[f'draft_masks_k{DRAFT_K}_ms_p95']:>10.4f}"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
