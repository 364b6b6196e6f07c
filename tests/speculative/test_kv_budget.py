"""The KV budget concurrent generations share (`speculative.kv_budget`): a generation whose cache does not fit waits
for running ones to end, one that never could is refused before anything is allocated, and what a generation
reserves is exactly what its caches take."""

from __future__ import annotations

import threading
import time

import pytest

from doppler_py.errors import CapacityError
from doppler_py.sampling import SamplingParams
from doppler_py.speculative.batch import StepBatch
from doppler_py.speculative.drafters.prompt_lookup import PromptLookupDrafter
from doppler_py.speculative.engine import SpeculativeEngine
from doppler_py.speculative.kv_budget import KVBudget
from doppler_py.speculative.stats import SpecStats
from doppler_py.testing.tiny import TINY_SPECS

GREEDY = SamplingParams()
PROMPTS = [[3, 17, 5, 9, 3, 17, 5, 22], [4, 8, 15, 16, 23, 42, 4, 8]]
NEW = 12


def test_a_reservation_waits_until_enough_is_released_and_too_much_is_refused():
    budget = KVBudget(100)
    budget.reserve(60)
    taken = threading.Event()

    def second() -> None:
        budget.reserve(50)
        taken.set()

    thread = threading.Thread(target=second)
    thread.start()
    assert not taken.wait(0.3) and budget.waiting == 1
    budget.release(60)
    assert taken.wait(10) and budget.reserved == 50 and budget.waiting == 0 and budget.waited == 1
    thread.join()
    with pytest.raises(CapacityError, match="more than the whole KV budget"):
        budget.reserve(101)
    assert budget.reserved == 50


@pytest.mark.parametrize("name", ["llama-tied-gqa", "qwen3_5-hybrid"])
def test_a_caches_bytes_are_known_before_it_is_made(tiny_model, name):
    model = tiny_model(TINY_SPECS[name], max_rows=32)
    cache = model.new_cache(77)
    try:
        assert model.cache_bytes(77) == cache.nbytes
    finally:
        model.release_cache(cache)


@pytest.mark.parametrize("bound", ["budget", "arena"])
def test_a_generation_that_does_not_fit_beside_another_waits_for_it_and_is_unchanged(models, bound):
    """`budget`: the bytes the generations reserve; `arena`: the slabs of batched generations (their KV memory
    itself, `model/kv_arena.py`), which a budget limits too."""
    target = models["target"]
    solo = SpeculativeEngine(target, PromptLookupDrafter())
    expected = [solo.generate(prompt, NEW, GREEDY).tokens for prompt in PROMPTS]
    one = target.cache_bytes(solo._capacity(len(PROMPTS[0]), NEW))
    solo.close()
    limit = one + one // 2  # room for one generation's cache, not two
    budget = KVBudget(limit) if bound == "budget" else None
    batch = StepBatch(target, kv_limit_bytes=limit) if bound == "arena" else None
    engines = [SpeculativeEngine(target, PromptLookupDrafter(), batch=batch) for _ in PROMPTS]
    outputs: list[list[int]] = [[], []]
    started = [0.0, 0.0]  # when each one's first tokens came
    closed: list[float] = []  # when the first one's cache was freed (its consumer may still be reading)
    close_context = engines[0].close_context
    engines[0].close_context = lambda ctx: (close_context(ctx), closed.append(time.monotonic()))
    first_running = threading.Event()

    def run(i: int) -> None:
        engines[i].kv_budget = budget
        steps = engines[i].iter_generate(PROMPTS[i], NEW, GREEDY, stats=SpecStats())
        for new in steps:
            if not outputs[i]:
                started[i] = time.monotonic()
                first_running.set()
                time.sleep(0.2 if i == 0 else 0)  # the first one holds its cache a while
            outputs[i].extend(new)

    threads = [threading.Thread(target=run, args=(0,))]
    threads[0].start()
    assert first_running.wait(60)
    threads.append(threading.Thread(target=run, args=(1,)))
    threads[1].start()
    for thread in threads:
        thread.join(120)
    for engine in engines:
        engine.close()
    assert outputs == expected
    if budget is not None:
        assert budget.waited == 1 and budget.reserved == 0
    else:
        assert batch is not None and not batch.arena.slabs
        batch.close()
    assert len(closed) == 1 and started[1] >= closed[0]  # the second produced nothing before the first had ended


def test_a_generation_that_could_never_fit_is_refused_before_anything_is_allocated(models):
    target = models["target"]
    engine = SpeculativeEngine(target, None)
    engine.kv_budget = KVBudget(1 << 10)
    try:
        with pytest.raises(CapacityError, match="KV budget"):
            engine.generate(PROMPTS[0], NEW, GREEDY)
        assert engine.kv_budget.reserved == 0
    finally:
        engine.close()
