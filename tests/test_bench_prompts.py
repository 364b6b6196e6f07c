"""The speculative benchmark's prompts and summary: labelled groups, geometric means, the worst prompt.

No model runs here; `tools/bench_speculative.py` itself is run by hand (see README's results)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from doppler_py.training.data import SEED_PROMPTS

BENCH = Path(__file__).resolve().parents[1] / "tools" / "bench_speculative.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_speculative", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prompts_come_in_labelled_groups_with_six_open_ended_ones_unseen_in_training(bench):
    groups = {name: group for name, (group, _) in bench.PROMPTS.items()}
    assert set(groups.values()) == {bench.COPY_HEAVY, bench.OPEN_ENDED, bench.STRUCTURED}
    open_ended = [name for name, group in groups.items() if group == bench.OPEN_ENDED]
    structured = {name for name, group in groups.items() if group == bench.STRUCTURED}
    assert len(open_ended) >= 6 and len(structured) >= 6 and structured == set(bench.SCHEMAS)  # each with its schema
    assert groups["chat-echo"] == bench.COPY_HEAVY  # its answer echoes the question
    seeds = {line.strip() for line in SEED_PROMPTS.read_text().splitlines()}
    texts = {messages[-1]["content"] for _, messages in bench.PROMPTS.values()}
    assert not texts & seeds  # the heads' training seeds are not benchmarked


def test_summary_is_the_geometric_mean_and_worst_prompt_per_group_and_method(bench):
    rows = [
        {"weights": "q4_1", "group": "open-ended", "method": "eagle", "speedup_vs_plain": s, "tokens_per_step": t}
        for s, t in ((2.0, 2.0), (0.5, 1.0), (1.0, 1.5))
    ]
    rows.append({"weights": "q4_1", "group": "copy-heavy", "method": "eagle", "speedup_vs_plain": 3.0,
                 "tokens_per_step": 4.0})  # fmt: skip
    summary = {(r["group"], r["method"]): r for r in bench.summarise(rows)}
    open_ended = summary[("open-ended", "eagle")]
    assert math.isclose(open_ended["geomean_speedup"], 1.0) and open_ended["worst_speedup"] == 0.5
    assert open_ended["prompts"] == 3 and math.isclose(open_ended["mean_tokens_per_step"], 1.5)
    assert summary[("copy-heavy", "eagle")]["geomean_speedup"] == 3.0


@pytest.mark.parametrize(
    ("method", "expected"),
    [
        ("plain", {"speculative": None, "k": None, "tree": False}),
        ("eagle", {"speculative": "eagle", "k": None, "tree": False}),
        ("eagle-k4", {"speculative": "eagle", "k": 4, "tree": False}),
        ("eagle-tree-k8", {"speculative": "eagle", "k": 8, "tree": True}),
        ("lookup-tree", {"speculative": "prompt-lookup", "k": None, "tree": True}),
        ("auto", {"speculative": "auto", "k": None, "tree": None}),
    ],
)
def test_a_k_suffix_pins_the_draft_length_of_that_method_only(bench, method, expected):
    calls = []

    class Engine:
        def generate(self, prompt, **kwargs):
            calls.append(kwargs)
            stats = {"drafted": 0, "made": 0, "gpu_draft_s": None, "draft_s": 0.0, "tokens_per_step": 1.0,
                     "tokens_per_forward": 1.0, "acceptance_by_position": [], "plain_steps": 0, "steps": 0,
                     "tree_steps": 0, "forced_tokens": 0}  # fmt: skip
            return type("Result", (), {"stats": stats, "tokens": [1], "tokens_per_s": 1.0, "acceptance_rate": 0.0,
                                       "speculative": None})()  # fmt: skip

    bench.run_ours(Engine(), "hi", method, 4)
    assert {key: calls[0][key] for key in expected} == expected


def test_no_method_always_runs_right_after_the_same_one(bench):
    methods = ["plain", "eagle", "auto", "medusa"]
    follows_plain = set()
    for repeat in range(2):
        order = [m for i in range(6) for m in bench.method_order(methods, repeat, i)]
        assert all(sorted(order[i * 4 : i * 4 + 4]) == sorted(methods) for i in range(6))
        follows_plain |= {order[j + 1] for j in range(len(order) - 1) if order[j] == "plain"}
    assert follows_plain >= {"eagle", "auto", "medusa"}


def test_the_mask_cost_replays_the_answer_through_a_fresh_matcher(bench, tiny_folder):
    """Each token's mask and commit is timed on the host, and its share is of one constrained plain step; an answer
    the schema refuses raises instead of being timed."""
    from types import SimpleNamespace

    from doppler_py.errors import InternalError
    from doppler_py.testing.tiny import TinySpec
    from doppler_py.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(tiny_folder(TinySpec(vocab_size=128)))
    engine = SimpleNamespace(tokenizer=tokenizer, model=SimpleNamespace(config=SimpleNamespace(vocab_size=128)))
    answer = '{"name": "get_weather", "arguments": {"city": "Lisbon", "unit": "celsius", "days": 3}}'
    tokens = tokenizer.encode(answer, add_special_tokens=False)
    cost = bench.mask_cost(engine, "weather-tool", tokens, plain_tokens_per_s=20.0)
    assert cost["prompt"] == "weather-tool" and cost["tokens"] == len(tokens) == len(answer)
    assert 0 < cost["median_us"] <= 10 * cost["mean_us"]
    assert cost["share_of_plain_step"] == pytest.approx(cost["median_us"] * 1e-6 * 20.0, rel=0.01, abs=1e-4)
    with pytest.raises(InternalError, match="is not allowed"):
        bench.mask_cost(engine, "weather-tool", tokenizer.encode('{"city"', add_special_tokens=False), 20.0)
