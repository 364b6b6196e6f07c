"""Plain decoding in batches: several steps per submit, each step's token (chosen on the GPU) fed to the next
step on the GPU, the tokens read back once per batch (`Stepper.step` with plain_steps). Tokens must be those of
one step per submit, for greedy and seeded sampling, whatever the batch size, with stop tokens inside a batch."""

from __future__ import annotations

import pytest
from support.decode import reference_decode

from doppler_py.sampling import SamplingParams
from doppler_py.speculative.engine import SpeculativeEngine
from doppler_py.speculative.stats import SpecStats
from doppler_py.speculative.step import MAX_PLAIN_STEPS

PROMPT = [3, 17, 5, 9, 3, 17, 5, 22, 40, 3, 17, 5, 9, 1, 30, 3, 17]
PARAMS = {
    "greedy": SamplingParams(temperature=0.0),
    "sampled": SamplingParams(temperature=1.3, top_k=12, top_p=0.95, seed=21),
}


def batched(target, params, new_tokens, batch, stop_ids=(), pieces=None, **options):
    """The plain engine's tokens with every batch forced to `batch` steps (the first token too), and its stats;
    `pieces` gets the token lists as they came."""
    engine = SpeculativeEngine(target, None)
    engine._batch_size = lambda remaining, first: min(batch, remaining)
    stats = SpecStats()
    pieces = [] if pieces is None else pieces
    try:
        pieces += engine.iter_generate(PROMPT, new_tokens, params, stats=stats, stop_ids=stop_ids, **options)
    finally:
        engine.close()
    return [t for new in pieces for t in new], stats


@pytest.mark.parametrize("params", PARAMS, ids=PARAMS)
@pytest.mark.parametrize("batch", [2, 5, MAX_PLAIN_STEPS])
def test_batched_plain_steps_give_the_tokens_of_single_steps(models, params, batch):
    expected = reference_decode(models["target"], PROMPT, 37, PARAMS[params])
    tokens, stats = batched(models["target"], PARAMS[params], 37, batch)
    assert tokens == expected  # 37 is no multiple of any batch: the last batch is shorter
    assert stats.plain_steps == 37 and stats.generated == 37


def test_a_stop_token_inside_a_batch_ends_the_generation_there(models):
    params = PARAMS["greedy"]
    full = reference_decode(models["target"], PROMPT, 30, params)
    stop = full[9]
    expected = reference_decode(models["target"], PROMPT, 30, params, stop_ids=[stop])
    tokens, stats = batched(models["target"], params, 30, 8, stop_ids=[stop])
    assert tokens == expected and tokens[-1] == stop and stats.stopped_by == "eos"


def test_the_batch_size_follows_the_measured_step_cost(models):
    engine = SpeculativeEngine(models["target"], None)
    try:
        assert engine._batch_size(100, first=True) == 1  # the first token shows at once
        engine._plain_token_s = 0.2 / 3
        assert engine._batch_size(100, first=False) == 3
        engine._plain_token_s = 1e-6
        assert engine._batch_size(100, first=False) == MAX_PLAIN_STEPS
        assert engine._batch_size(4, first=False) == 4
    finally:
        engine.close()


def test_a_generation_with_log_probs_takes_its_plain_steps_one_per_submit(models):
    """Log-probs are read per step: their generation's tokens come one at a time, each with its entry, whatever
    the batch size; the same generation without them comes in batches."""
    params = PARAMS["greedy"]
    with_logprobs, entries = [], []
    tokens, _ = batched(models["target"], params, 12, 6, pieces=with_logprobs, logprobs=2, logprob_entries=entries)
    assert [len(piece) for piece in with_logprobs] == [1] * 12
    assert [entry.token for entry in entries] == tokens
    without: list[list[int]] = []
    assert batched(models["target"], params, 12, 6, pieces=without)[0] == tokens
    assert [len(piece) for piece in without] == [6, 6]


def test_uniform_copies_for_each_step_are_given_back_with_their_ops(models, registry):
    """A batch gives the per-cache ops (RoPE, attention) a uniform slot per step; releasing the cache after the
    generation must return them too, or a long-running server's uniform arenas would grow without end."""
    batched(models["target"], PARAMS["greedy"], 12, 6)
    arenas = len(registry._arenas)
    free = len(registry._free_slots)
    for _ in range(5):
        batched(models["target"], PARAMS["greedy"], 12, 6)
    assert len(registry._arenas) == arenas and len(registry._free_slots) == free
