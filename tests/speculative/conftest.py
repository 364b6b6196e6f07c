"""Tiny models for speculative-decoding tests (written with numpy; no download)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from doppler_py.ops.linear import REGISTER_TILED_MAX_ROWS, Linear
from doppler_py.testing.tiny import TinySpec, draft_spec

TARGET = TinySpec(
    vocab_size=48,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    weight_std=0.25,
    seed=11,
)
# A weaker draft with the same vocabulary (fewer layers, other weights) and one that differs only by padding.
DRAFT = draft_spec(vocab_size=48, seed=12)
PADDED_DRAFT = draft_spec(vocab_size=64, seed=13)


@pytest.fixture(scope="session")
def models(tiny_model):
    """name -> Transformer for "target", "draft", "padded_draft", loaded once per session."""
    specs = {"target": TARGET, "draft": DRAFT, "padded_draft": PADDED_DRAFT}
    return {name: tiny_model(spec, max_rows=32, max_positions=256) for name, spec in specs.items()}


def replay_accepted(drafts, tokens: list[int], prompt_len: int, k: int) -> int:
    """Drafts the engine accepts (greedy, k pinned) over a known greedy output `tokens` (prompt + answer) when
    `drafts(committed, n)` proposes n tokens after tokens[:committed]; the engine's last step is a plain one."""
    committed, accepted = prompt_len, 0
    while committed < len(tokens):
        remaining = len(tokens) - committed
        n = 0 if remaining <= 1 else min(k, remaining - 1)
        run = 0
        for d in drafts(committed, n):
            if d != tokens[committed + run]:
                break
            run += 1
        accepted, committed = accepted + run, committed + run + 1
    return accepted


def held_in_prompt(work, case: str) -> list[int]:
    """A prompt a head was trained on (where it has learnt something to propose; longer than the target's 32
    rows, so the prefill is chunked), or for "long" a whole training sequence followed by another prompt."""
    import json

    records = [json.loads(line) for line in (work / "answers.jsonl").read_text().splitlines()]
    if case == "long":
        return records[0]["prompt_ids"] + records[0]["answer_ids"] + records[1]["prompt_ids"]
    return records[int(case)]["prompt_ids"]


# Generations per joint-distribution check: enough to catch a wrongly wired verification (stale or misplaced
# uniforms, a wrong residual); the kernels' own statistical tests hold the sampling itself at higher power.
JOINT_TRIALS = 500


def check_two_token_joint(
    target, drafter, prompt=(3, 17, 5), trials: int = JOINT_TRIALS, new_tokens: int = 2, k: int = 2
) -> int:
    """Speculative samples of (t1, t2) against the exact joint p(t1) p(t2 | t1) of the target (T = 1.5, top-6);
    returns the number of token trees verified. Generations of `new_tokens` > 2 tokens let the first step
    verify k drafts (a step never drafts past the last token asked for)."""
    import numpy as np

    from doppler_py.sampling import SamplingParams
    from doppler_py.speculative.engine import SpeculativeEngine
    from doppler_py.testing.distribution import assert_samples_follow
    from doppler_py.testing.sampling_reference import filtered_probs

    prompt = list(prompt)
    params = SamplingParams(temperature=1.5, top_k=6)
    vocab = target.config.vocab_size
    cache = target.new_cache(len(prompt) + 2)
    p1 = filtered_probs(target.forward(prompt, cache, 0), params)
    joint = np.zeros((vocab, vocab))
    for t1 in np.flatnonzero(p1):
        cache.truncate(len(prompt))
        joint[t1] = p1[t1] * filtered_probs(target.forward([int(t1)], cache), params)
    target.release_cache(cache)

    engine = SpeculativeEngine(target, drafter)
    counts = np.zeros_like(joint)
    trees = 0
    for seed in range(trials):
        result = engine.generate(prompt, new_tokens, SamplingParams(temperature=1.5, top_k=6, seed=seed), k=k)
        t1, t2 = result.tokens[:2]
        counts[t1, t2] += 1
        trees += result.stats.tree_steps
    engine.close()
    assert_samples_follow(counts, joint)
    return trees


def proposal_paths(proposal) -> dict[tuple[int, ...], float]:
    """Each node of a proposal with values as (its path of tokens from the root) -> log of its value."""
    parents = list(proposal.parents) if proposal.parents is not None else list(range(-1, proposal.count - 1))
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(proposal.tokens, parents, strict=True):
        paths.append((*(paths[parent] if parent >= 0 else ()), token))
    return {path: float(np.log(value)) for path, value in zip(paths, proposal.values, strict=True)}


def matmul_pipelines(drafter, more: Sequence[Linear] = ()) -> set[tuple[int, int]]:
    """(id of the op, rows) of every matmul pipeline a drafter may run: each `Linear` it holds (alone or in a
    list) and `more`, at every row count up to its max_rows (past the register tiles, one tiled GEMM)."""
    held = [v for value in vars(drafter).values() for v in (value if isinstance(value, list) else [value])]
    linears = [op for op in held if isinstance(op, Linear)] + list(more)
    return {(id(op), rows) for op in linears for rows in range(1, min(op.max_rows, REGISTER_TILED_MAX_ROWS + 1) + 1)}


def compile_requests(drafter, monkeypatch) -> set[tuple[int, int]]:
    """(id of the op, rows) of every matmul pipeline `drafter.compile()` compiles."""
    asked: set[tuple[int, int]] = set()
    compile_one = Linear.compile
    monkeypatch.setattr(Linear, "compile", lambda op, rows: asked.add((id(op), rows)) or compile_one(op, rows))
    drafter.compile()
    return asked
