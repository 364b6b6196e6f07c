"""The Python port of SpeculativeDecoder against the JS original (doppler-gpu@0.5.1), token for token.

One Node process (tests/parity/js/driver.mjs) runs every case through the JS class; the port runs the same
cases here. Both sides use the same integer-hash mock models, whose logits are exact in float32, so the
only numbers that could differ are the decoders' own. Per step the two must agree on the new tokens, the
accept rate, the stats, the sequence of model calls (with the KV caches they received), the number of RNG
draws, and the bits of every float32 log-prob vector the decoder computed.
"""

from __future__ import annotations

import base64
import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest

from doppler_py.parity import SpeculativeDecoder
from doppler_py.rng import Mulberry32

pytestmark = pytest.mark.parity

DRIVER = Path(__file__).parent / "js" / "driver.mjs"
MASK32 = 0xFFFFFFFF


# --- the mock models: the Python twin of driver.mjs ----------------------------------------------------
def mix32(x):
    """A 32-bit integer mixer; works on Python ints and on uint32 arrays (where products wrap like Math.imul)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def context_hash(ids: list[int], salt: int) -> int:
    h = salt & MASK32
    for token in ids:
        h = mix32((h + (token + 1) * 0x9E3779B9) & MASK32)
    return h


def token_hashes(h: int, vocab: int) -> np.ndarray:
    salts = (np.arange(1, vocab + 1, dtype=np.uint32) * 0x85EBCA6B) & MASK32
    return mix32(salts ^ h)


def mock_logits(spec: dict, ids: list[int], vocab: int):
    values = np.zeros(vocab)
    for salt, spread in spec["components"]:
        values += ((token_hashes(context_hash(ids, salt), vocab) % spread).astype(np.float64) - spread / 2) / 8
    if spec["mask"]:
        salt, every = spec["mask"]
        values[token_hashes(context_hash(ids, salt), vocab) % every == 0] = -math.inf
    if spec["poison"]:
        salt, every = spec["poison"]
        h = context_hash(ids, salt)
        if h % every == 0:
            values[(h >> 8) % vocab] = math.inf
    if spec["format"] == "vector":
        return values.astype(np.float32)
    if spec["format"] == "list":
        return values.tolist()
    if spec["format"] == "rows":
        return np.stack([np.full(vocab, 7, dtype=np.float32), values.astype(np.float32)])
    assert spec["format"] == "f64"
    return values


class MockCache:
    def __init__(self, n: int, cloned: bool, counter: dict) -> None:
        self.n, self.cloned, self.counter = n, cloned, counter

    def clone(self) -> MockCache:
        self.counter["clones"] += 1
        return MockCache(self.n, True, self.counter)


class MockModel:
    def __init__(self, tag: str, spec: dict, vocab: int, calls: list) -> None:
        self.tag, self.spec, self.vocab, self.calls = tag, spec, vocab, calls

    def forward(self, input_ids: list[int], kv_cache=None) -> dict:
        cached = kv_cache is not None
        self.calls.append(
            [self.tag, len(input_ids), kv_cache.n if cached else -1, kv_cache.cloned if cached else False]
        )
        result = {"logits": mock_logits(self.spec, input_ids, self.vocab)}
        if self.spec["returns_cache"] and cached:
            result["new_kv_cache"] = MockCache(len(input_ids), False, kv_cache.counter)
        return result


def array_digest(values: np.ndarray) -> int:
    """driver.mjs arrayDigest: an order-sensitive checksum of float32 bits, NaNs canonical."""
    words = values.view(np.uint32).copy()
    words[np.isnan(values)] = 0x7FC00000
    positions = (np.arange(1, values.size + 1, dtype=np.uint32) * 0x27D4EB2F) & MASK32
    terms = ((words ^ positions) * 0x9E3779B1) & MASK32
    return (values.size + int(terms.sum(dtype=np.uint64))) & MASK32


# --- the cases -----------------------------------------------------------------------------------------
def _case(index, name, vocab, k, temperature, seed, steps, relation, spread=32, **options) -> dict:
    """A case; `relation` says how the draft model's logits relate to the main model's."""
    main_components = [[1 + 7 * index, spread]]
    draft_components = {
        "same": main_components,
        "near": [*main_components, [1000 + index, 2]],  # main ± 1/8
        "close": [*main_components, [1000 + index, 8]],  # main ± 1/2
        "flat": [[1000 + index, 2]],  # nearly uniform
        "far": [[1000 + index, spread]],  # independent of main
    }[relation]

    def model(components, side):
        return {
            "components": components,
            "mask": options.get(f"{side}_mask"),
            "poison": options.get(f"{side}_poison"),
            "format": options.get(f"{side}_format", "vector"),
            "returns_cache": options.get("returns_cache", True),
        }

    return {
        "name": name,
        "vocab": vocab,
        "k": k,
        "temperature": temperature,
        "seed": seed,
        "steps": steps,
        "relation": relation,
        "prompt": [index, 7, 3],
        "caches": options.get("caches", True),
        "main": model(main_components, "main"),
        "draft": model(draft_components, "draft"),
    }


_TABLE = [
    # name, vocab, k, temperature, seed, steps, relation, [spread], options
    ("v1_k1_T1_same", 1, 1, 1.0, 0, 4, "same"),
    ("v1_k8_T03_far", 1, 8, 0.3, 2**32 - 1, 3, "far"),
    ("v2_k2_T05_close", 2, 2, 0.5, 1, 8, "close"),
    ("v2_k1_T3_far", 2, 1, 3.0, 42, 8, "far"),
    ("v2_k8_T005_masked", 2, 8, 0.05, 25, 5, "close", 32, {"main_mask": [5, 2], "draft_mask": [6, 2]}),
    ("v3_k3_T07_near", 3, 3, 0.7, 7, 6, "near"),
    ("v5_k4_T1_same", 5, 4, 1.0, 2**32 - 1, 6, "same"),
    ("v5_k4_T2_same", 5, 4, 2.0, 0, 6, "same"),
    ("v7_k5_T005_close", 7, 5, 0.05, 3, 5, "close"),
    ("v8_k8_T05_same", 8, 8, 0.5, 24, 6, "same"),
    ("v10_k0_T1_close", 10, 0, 1.0, 22, 4, "close"),
    ("v12_k2_T3_near", 12, 2, 3.0, 2**40 + 7, 6, "near"),
    ("v16_k6_T13_close", 16, 6, 1.3, -1, 5, "close"),
    ("v16_k2_T01_far", 16, 2, 0.1, 1.5, 6, "far"),
    ("v20_k3_T1_no_new_cache", 20, 3, 1.0, 23, 6, "close", 32, {"returns_cache": False}),
    ("v31_k7_T25_near", 31, 7, 2.5, 2**32, 4, "near"),
    ("v40_k5_T015_far", 40, 5, 0.15, 0.999, 5, "far"),
    ("v50_k8_T1_close", 50, 8, 1.0, 123456789, 4, "close"),
    ("v64_k1_T05_lists", 64, 1, 0.5, 99, 8, "far", 32, {"main_format": "list", "draft_format": "list"}),
    ("v100_k3_T3_rows", 100, 3, 3.0, 2**31, 5, "close", 32, {"main_format": "rows"}),
    ("v128_k4_T07_f64", 128, 4, 0.7, 5, 5, "near", 256, {"main_format": "f64", "draft_format": "list"}),
    ("v200_k4_T09_close", 200, 4, 0.9, -12345.6, 5, "close"),
    ("v257_k5_T2_main_masked", 257, 5, 2.0, 11, 5, "close", 32, {"main_mask": [7, 5]}),
    ("v300_k2_T03_draft_masked", 300, 2, 0.3, 12, 6, "far", 32, {"draft_mask": [8, 3]}),
    ("v500_k6_T1_main_poisoned", 500, 6, 1.0, 13, 5, "close", 32, {"main_poison": [9, 2]}),
    ("v500_k3_T15_draft_poisoned", 500, 3, 1.5, 14, 5, "close", 32, {"draft_poison": [10, 2]}),
    ("v1000_k8_T005_close", 1000, 8, 0.05, 0, 3, "close", 256),
    ("v1000_k1_T1_flat", 1000, 1, 1.0, 15, 6, "flat"),
    ("v1024_k2_T25_far", 1024, 2, 2.5, 16, 4, "far", 256),
    ("v2048_k7_T05_near", 2048, 7, 0.5, 17, 3, "near"),
    ("v3000_k5_T3_close", 3000, 5, 3.0, 18, 3, "close"),
    ("v4096_k4_T01_close", 4096, 4, 0.1, 19, 3, "close", 256, {"draft_format": "rows"}),
    ("v4999_k3_T13_far", 4999, 3, 1.3, 2**32 - 1, 3, "far"),
    ("v5000_k8_T07_near", 5000, 8, 0.7, 0, 3, "near"),
    ("v5000_k1_T2_same", 5000, 1, 2.0, 20, 4, "same"),
    ("v5000_k6_T1_no_caches", 5000, 6, 1.0, 21, 3, "close", 256, {"caches": False}),
]
CASES = [_case(index, *row[:7], *row[7:8], **(row[8] if len(row) > 8 else {})) for index, row in enumerate(_TABLE)]

RNG_SEEDS = [0, 1, 42, 2**32 - 1, 2**32, -1, 1.9, -0.5, 2**40 + 3, 123456789]
RNG_DRAWS = 1000


def math_arguments() -> tuple[np.ndarray, np.ndarray]:
    """Arguments of the kinds the decoder hands to exp and log, for comparing numpy with V8."""
    rng = np.random.default_rng(2024)
    exp_args = np.concatenate(
        [
            rng.uniform(-104, 0, 100_000).astype(np.float32).astype(np.float64),  # float32 log-probs
            rng.uniform(-60, 0, 50_000),  # logit - max in the sum of exponentials
            rng.uniform(-30, 30, 50_000),  # main - draft log-prob in the acceptance test
        ]
    )
    log_args = rng.uniform(1, 5000, 50_000)  # sums of exponentials
    return exp_args, log_args


# --- running both sides --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def js_results(node_executable, doppler_gpu_dir) -> dict:
    exp_args, log_args = math_arguments()
    job = {
        "cases": CASES,
        "rng_seeds": RNG_SEEDS,
        "rng_draws": RNG_DRAWS,
        "math": {"exp": _b64(exp_args), "log": _b64(log_args)},
    }
    module = doppler_gpu_dir / "src" / "inference" / "speculative.js"
    done = subprocess.run(
        [node_executable, str(DRIVER), str(module)],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"driver failed:\n{done.stderr}"
    results: dict = {"cases": {}}
    for line in done.stdout.splitlines():
        record = json.loads(line)
        if record["kind"] == "case":
            results["cases"][record["name"]] = record
        else:
            results[record["kind"]] = record
    return results


def run_case_in_python(case: dict) -> dict:
    """The port on one case, observed exactly as driver.mjs observes the JS class."""
    decoder = SpeculativeDecoder(
        num_draft_tokens=case["k"],
        max_rejection_retries=3,
        enable_tree_draft=False,
        temperature=case["temperature"],
        random_seed=case["seed"],
    )
    observed = {"draws": 0, "digest": 0}
    draw = decoder.random

    def counted_draw() -> float:
        observed["draws"] += 1
        return draw()

    log_softmax = decoder.log_softmax

    def digested_log_softmax(logits):
        out = log_softmax(logits)
        observed["digest"] = mix32(observed["digest"] ^ array_digest(out))
        return out

    decoder.random = counted_draw
    decoder.log_softmax = digested_log_softmax
    calls: list = []
    counter = {"clones": 0}
    decoder.set_main_model(MockModel("main", case["main"], case["vocab"], calls))
    decoder.set_draft_model(MockModel("draft", case["draft"], case["vocab"], calls))

    context = list(case["prompt"])
    steps = []
    for _ in range(case["steps"]):
        calls.clear()
        observed.update(draws=0, digest=0)
        counter["clones"] = 0
        main_cache = MockCache(len(context), False, counter) if case["caches"] else None
        draft_cache = MockCache(len(context), False, counter) if case["caches"] else None
        result = decoder.step(context, main_cache, draft_cache)
        steps.append(
            {
                "new_tokens": result["new_tokens"],
                "accept_rate": result["accept_rate"],
                "same_main_cache": result["main_kv_cache"] is main_cache,
                "calls": [list(call) for call in calls],
                "clones": counter["clones"],
                "draws": observed["draws"],
                "digest": observed["digest"],
                "stats": dict(decoder.get_stats()),
            }
        )
        context = [*context, *result["new_tokens"]]
    decoder.reset_stats()
    return {"steps": steps, "stats_after_reset": dict(decoder.get_stats())}


def _b64(values: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(values, dtype="<f8").tobytes()).decode("ascii")


def _from_b64(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype="<f8")


# --- the tests -----------------------------------------------------------------------------------------
def test_cases_span_the_required_configurations():
    assert len(CASES) >= 30
    assert len({case["name"] for case in CASES}) == len(CASES)
    vocabs = {case["vocab"] for case in CASES}
    assert min(vocabs) == 1 and max(vocabs) == 5000
    assert {1, 2, 3, 4, 5, 6, 7, 8} <= {case["k"] for case in CASES}
    temperatures = {case["temperature"] for case in CASES}
    assert min(temperatures) == 0.05 and max(temperatures) == 3.0 and 1.0 in temperatures
    assert {0, 2**32 - 1} <= {case["seed"] for case in CASES}
    assert {"same", "near", "close", "far", "flat"} == {case["relation"] for case in CASES}
    assert all(case["steps"] >= 3 for case in CASES)


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_port_matches_js_step_by_step(js_results, case):
    js = js_results["cases"][case["name"]]
    ours = run_case_in_python(case)
    for index, (js_step, our_step) in enumerate(zip(js["steps"], ours["steps"], strict=True)):
        assert our_step == js_step, f"step {index} differs"
    assert ours["stats_after_reset"] == js["stats_after_reset"]


def test_cases_reach_every_verification_outcome(js_results):
    # Rejection at the first position, part-way, and full acceptance all occur, so every branch was compared.
    steps = [step for case in js_results["cases"].values() for step in case["steps"]]
    rates = {step["accept_rate"] for step in steps if step["stats"]["total_drafted"] > 0}
    assert 0 in rates and 1 in rates and any(0 < rate < 1 for rate in rates)
    assert all(step["same_main_cache"] for step in steps)


def test_rng_streams_match_js(js_results):
    for stream in js_results["rng"]["streams"]:
        rng = Mulberry32(stream["seed"])
        assert [rng.next_uint32() for _ in range(RNG_DRAWS)] == stream["values"], f"seed {stream['seed']}"


def test_numpy_exp_and_log_stay_within_one_ulp_of_v8_and_agree_after_float32_rounding(js_results):
    # V8's Math.exp/Math.log (fdlibm) and numpy's differ in the last bit of a double for some arguments;
    # the port stores exp of log-probs as float32, and there the two must agree.
    exp_args, log_args = math_arguments()
    v8_exp = _from_b64(js_results["math"]["exp"])
    v8_log = _from_b64(js_results["math"]["log"])
    ours_exp, ours_log = np.exp(exp_args), np.log(log_args)
    assert np.abs(ours_exp.view(np.int64) - v8_exp.view(np.int64)).max() <= 1
    assert np.abs(ours_log.view(np.int64) - v8_log.view(np.int64)).max() <= 1
    log_prob_args = slice(0, 100_000)
    assert np.array_equal(ours_exp[log_prob_args].astype(np.float32), v8_exp[log_prob_args].astype(np.float32))
