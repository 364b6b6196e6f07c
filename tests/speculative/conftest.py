"""Tiny models for speculative-decoding tests (written with numpy; no download)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from support.tiny_specs import CORPUS_OPTIONS, DRAFT, HEAD_TARGETS, PADDED_DRAFT, TARGET  # noqa: F401

from doppler_py.ops.linear import REGISTER_TILED_MAX_ROWS, Linear

# A weaker draft with the same vocabulary (fewer layers, other weights) and one that differs only by padding.


# The self-distilled data every head trainer's test starts from (the EAGLE, Medusa and spark fixtures): prompts,
# the tiny target's answers and its features, made once per session and copied into each trainer's work folder.


@pytest.fixture(scope="session")
def head_targets(tiny_model):
    """A function family -> the Transformer of HEAD_TARGETS[family], loaded once per session ("llama": TARGET,
    the same model as `models["target"]`)."""
    return lambda family: tiny_model(HEAD_TARGETS[family], max_rows=32, max_positions=256)


@pytest.fixture(scope="session")
def models(tiny_model, head_targets):
    """name -> Transformer for "target", "draft", "padded_draft", loaded once per session."""
    drafts = {"draft": DRAFT, "padded_draft": PADDED_DRAFT}
    return {"target": head_targets("llama")} | {
        name: tiny_model(spec, max_rows=32, max_positions=256) for name, spec in drafts.items()
    }


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
    target, drafter, prompt=(3, 17, 5), trials: int = JOINT_TRIALS, new_tokens: int = 2, k: int = 2, grammar=None
) -> int:
    """Speculative samples of (t1, t2) against the exact joint p(t1) p(t2 | t1) of the target (T = 1.5, top-6);
    returns the number of token trees verified. Generations of `new_tokens` > 2 tokens let the first step
    verify k drafts (a step never drafts past the last token asked for). `grammar` (a function making a fresh
    `GrammarMatcher`): p is the target's distribution renormalised over the tokens the grammar allows."""
    import numpy as np
    from support.distribution import assert_samples_follow

    from doppler_py.sampling import SamplingParams
    from doppler_py.speculative.engine import SpeculativeEngine

    prompt = list(prompt)
    joint = exact_two_token_joint(target, prompt, grammar)
    engine = SpeculativeEngine(target, drafter)
    counts = np.zeros_like(joint)
    trees = 0
    for seed in range(trials):
        seeded = SamplingParams(temperature=1.5, top_k=6, seed=seed)
        result = engine.generate(prompt, new_tokens, seeded, k=k, grammar=None if grammar is None else grammar())
        t1, t2 = result.tokens[:2]
        counts[t1, t2] += 1
        trees += result.stats.tree_steps
    engine.close()
    assert_samples_follow(counts, joint)
    return trees


def exact_two_token_joint(target, prompt: Sequence[int], grammar=None):
    """The target's exact p(t1) p(t2 | t1) after `prompt` at `check_two_token_joint`'s sampling options (T = 1.5,
    top-6), renormalised over what `grammar` (a function making a fresh matcher) allows."""
    import numpy as np
    from support.decode import allowed

    from doppler_py.sampling import SamplingParams
    from doppler_py.testing.sampling_reference import filtered_probs

    prompt = list(prompt)
    params = SamplingParams(temperature=1.5, top_k=6)
    vocab = target.config.vocab_size
    cache = target.new_cache(len(prompt) + 2)

    def masked(logits, after: list[int]):
        if grammar is None:
            return logits
        matcher = grammar()
        matcher.advance(after)
        return np.where(allowed(matcher.mask(), vocab), logits, np.float32(-np.inf))

    p1 = filtered_probs(masked(target.forward(prompt, cache, 0), []), params)
    joint = np.zeros((vocab, vocab))
    for t1 in np.flatnonzero(p1):
        cache.truncate(len(prompt))
        joint[t1] = p1[t1] * filtered_probs(masked(target.forward([int(t1)], cache), [int(t1)]), params)
    target.release_cache(cache)
    return joint


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


def check_drafts_follow_their_reported_rows(
    target, drafter, monkeypatch, prompt=(3, 17, 5), seeds: int = 6, new_tokens: int = 12, k: int = 3
) -> int:
    """What a sampled drafter owes the verifier, checked exactly per draft instead of statistically per generation:
    each GPU pick is the sampler's pick (`allowed_picks`, the kernel tests' float margins) from the row at that
    position of the proposal's `draft_logits`, with the one uniform the drafter drew for it from the generation's
    stream, and is the token at that position of the proposal; a proposal without draft rows (deterministic
    nodes) draws no uniform but for greedy picks, which ignore theirs. The verification paths themselves are
    held to the target's joint distribution once each (test_engine, test_trees, test_eagle). Returns how many
    proposals had draft rows ("sampled", their picks checked) and how many were trees ("trees")."""
    from kernels.test_sample import allowed_picks

    from doppler_py.rng import Mulberry32
    from doppler_py.sampling import SamplingParams
    from doppler_py.speculative.drafters.gpu_drafting import DraftSampler
    from doppler_py.speculative.engine import SpeculativeEngine

    draws: list[float] = []
    picks: list[tuple[int, bool]] = []  # (position, greedy?) of each GPU pick, in order
    record_pick, submit, random = DraftSampler.record_pick, DraftSampler.submit, Mulberry32.random

    def counted_random(rng):
        u = random(rng)
        draws.append(u)
        return u

    def remembered_pick(sampler, rec, next_ids, i, params, penalties):
        sampler.checked = (i, params)
        return record_pick(sampler, rec, next_ids, i, params, penalties)

    def checked_submit(sampler, rec, u):
        submit(sampler, rec, u)
        i, params = sampler.checked
        read = sampler.registry.gpu.queue.read_buffer
        row = np.frombuffer(read(sampler.row.buffer), np.float32)
        pick = int(np.frombuffer(read(sampler.pick.buffer), np.uint32)[0])
        assert draws and u == draws[-1], "a GPU pick's uniform is not the draw just made from the generation's rng"
        assert pick in allowed_picks(row, u, params), (i, u, pick)
        token = int(np.frombuffer(read(sampler.tokens.buffer, 4 * i, 4), np.uint32)[0])
        kept = np.frombuffer(read(sampler.logits.buffer, 4 * i * sampler.vocab, 4 * sampler.vocab), np.float32)
        assert token == pick and np.array_equal(kept, row), f"draft {i} is not reported where it was sampled from"
        picks.append((i, params.greedy))

    propose = type(drafter).propose

    def checked_propose(self, ctx, n):
        draws.clear()
        picks.clear()
        proposal = propose(self, ctx, n)
        assert len(draws) == len(picks), "a drafter drew a random number for something other than a GPU pick"
        if proposal.draft_logits is None:
            assert all(greedy for _, greedy in picks), "a proposal without draft rows depends on its random numbers"
            seen["trees"] += proposal.parents is not None
        else:
            assert proposal.on_gpu and [i for i, _ in picks] == list(range(len(picks)))
            assert proposal.count <= len(picks)
            seen["sampled"] += 1
        return proposal

    seen = {"sampled": 0, "trees": 0}
    monkeypatch.setattr(Mulberry32, "random", counted_random)
    monkeypatch.setattr(DraftSampler, "record_pick", remembered_pick)
    monkeypatch.setattr(DraftSampler, "submit", checked_submit)
    monkeypatch.setattr(type(drafter), "propose", checked_propose)
    engine = SpeculativeEngine(target, drafter)
    try:
        for seed in range(seeds):
            params = SamplingParams(temperature=1.5, top_k=6, seed=seed)
            engine.generate(list(prompt), new_tokens, params, k=k)
    finally:
        engine.close()
    return seen
