"""The prefix cache on the tiny models: a prompt sharing a prefix with an earlier sequence (prompt and answer)
prefills only its tail, and every output is the one without the cache (greedy, and seeded sampling), with plain
decoding and drafters that keep state over the prompt (a draft model's own cache; EAGLE's head, which starts after
a cached prefix). Hits are whole blocks; entries stay within the budget, least recently used evicted first."""

from __future__ import annotations

import pytest
from speculative.conftest import TARGET

from doppler_py.errors import GenerationOptionError
from doppler_py.model.prefix_cache import MIN_HIT, PrefixCache
from doppler_py.sampling import SamplingParams
from doppler_py.speculative.drafters.draft_model import DraftModelDrafter
from doppler_py.speculative.drafters.heads.eagle import EagleDrafter, load_head
from doppler_py.speculative.drafters.prompt_lookup import PromptLookupDrafter
from doppler_py.speculative.engine import SpeculativeEngine

SYSTEM = [(7 * i + 3) % 45 + 3 for i in range(40)]  # a shared "system prompt" longer than a prefill chunk
PARAMS = {"greedy": SamplingParams(), "sampled": SamplingParams(temperature=1.2, top_k=10, seed=7)}


def turns(engine: SpeculativeEngine, params: SamplingParams) -> list[tuple[list[int], int]]:
    """Three chat-like turns: each prompt is the last prompt, its answer and a new question. Returns each turn's
    tokens and the prompt tokens that came from the cache."""
    prompt, out = [*SYSTEM, 5, 9, 11], []
    for turn in range(3):
        result = engine.generate(prompt, 12, params, k=3)
        out.append((result.tokens, result.stats.cached_tokens))
        prompt = [*prompt, *result.tokens, 17 + turn, 4, 21]
    return out


def drafter_for(name, models, request):
    if name == "none":
        return None
    if name == "prompt-lookup":
        return PromptLookupDrafter()
    if name == "draft-model":
        return DraftModelDrafter(models["draft"], TARGET.vocab_size)
    return EagleDrafter(models["target"], load_head(request.getfixturevalue("head_dir"), models["target"]))


@pytest.mark.parametrize("params", PARAMS, ids=PARAMS)
@pytest.mark.parametrize("drafter", ["none", "prompt-lookup", "draft-model", "eagle"])
def test_every_turn_is_the_same_with_the_cache_and_later_turns_prefill_only_their_tail(
    models, request, drafter, params
):
    target = models["target"]
    runs = {}
    for cached in (False, True):
        engine = SpeculativeEngine(target, drafter_for(drafter, models, request))
        engine.prefix_cache = PrefixCache(target, 64 << 20) if cached else None
        runs[cached] = turns(engine, PARAMS[params])
        engine.close()
        if cached:
            engine.prefix_cache.clear()
    assert [tokens for tokens, _ in runs[True]] == [tokens for tokens, _ in runs[False]]
    hits = [cached for _, cached in runs[True]]
    if drafter == "eagle" and params == "sampled":  # its seeded drafts would differ after a hit: none taken
        assert hits == [0, 0, 0]
    else:
        # Each turn takes all of the last sequence the cache holds: its prompt and answer but the answer's last
        # token, whose K/V the last step never wrote.
        answers = [len(tokens) for tokens, _ in runs[True]]
        prompts = [len(SYSTEM) + 3 + sum(answers[:t]) + 3 * t for t in range(3)]
        assert hits == [0, prompts[0] + answers[0] - 1, prompts[1] + answers[1] - 1], hits
    assert all(cached == 0 for _, cached in runs[False])


def test_hits_are_the_shared_prefix_short_of_the_prompt_and_prefix_entries_are_replaced(models):
    target = models["target"]
    cache = PrefixCache(target, 64 << 20)
    kv = target.new_cache(128)
    sequence = list(range(3, 3 + 40))
    target.forward(sequence, kv, 0, logits="none")
    cache.store(sequence[:20], kv)
    cache.store(sequence, kv)  # holds the first as its prefix: replaces it
    assert len(cache) == 1
    cache.store(sequence[:30], kv)  # already held
    assert len(cache) == 1
    assert cache.lookup(sequence[:33])[1] == 32  # one token is always left to prefill
    assert cache.lookup([*sequence[:20], 99, 98])[1] == 20  # the shared prefix, to the token
    assert cache.lookup([*sequence[: MIN_HIT - 1], 99])[1] == 0  # too short to be worth a copy
    restored = target.new_cache(64)
    entry, length = cache.lookup(sequence)
    cache.restore(entry, length, restored)
    assert restored.length == 39
    for ours, theirs in zip(restored.keys + restored.values, kv.keys + kv.values, strict=True):
        assert (ours.numpy()[:39] == theirs.numpy()[:39]).all()
    target.release_cache(kv)
    target.release_cache(restored)
    cache.clear()


def test_entries_stay_within_the_budget_least_recently_used_first(models):
    target = models["target"]
    kv = target.new_cache(128)
    sequences = [[(s * 13 + i) % 45 + 3 for i in range(48)] for s in range(4)]
    per_entry = kv.bytes_per_token * 48
    cache = PrefixCache(target, 3 * per_entry)
    for s in sequences[:3]:
        kv.truncate(0)
        target.forward(s, kv, 0, logits="none")
        cache.store(s, kv)
    cache.lookup(sequences[0])  # the oldest is used again: the second becomes the least recently used
    kv.truncate(0)
    target.forward(sequences[3], kv, 0, logits="none")
    cache.store(sequences[3], kv)
    assert len(cache) == 3 and cache.nbytes <= 3 * per_entry
    assert cache.lookup(sequences[1])[1] == 0 and cache.lookup(sequences[0])[1] == 47  # all but the last token
    target.release_cache(kv)
    cache.clear()
    with pytest.raises(GenerationOptionError, match="budget"):
        PrefixCache(target, -1)


def test_the_api_reports_cached_tokens_and_kv_cache_mb_turns_the_cache_off(tiny_folder):
    from doppler_py.api import load

    folder = tiny_folder(TARGET)
    prompt = "abc " * 12
    for budget, hit in ((8, True), (0, False)):
        with load(folder, "f32", progress=False, kv_cache_mb=budget) as engine:
            first = engine.generate(prompt, max_tokens=6, chat=False, speculative=None)
            second = engine.generate(prompt + first.text + " de", max_tokens=6, chat=False, speculative=None)
        assert first.cached_tokens == 0 and (second.cached_tokens >= MIN_HIT) == hit
        assert second.stats["cached_tokens"] == second.cached_tokens
    with pytest.raises(GenerationOptionError, match="kv_cache_mb"):
        load(folder, "f32", progress=False, kv_cache_mb=-1)


@pytest.mark.realmodel
@pytest.mark.parametrize("speculative", [None, "auto"])
def test_smollm2_a_chats_second_turn_is_the_same_from_the_cache(smollm2_engine, speculative):
    engine = smollm2_engine
    first_turn = [{"role": "user", "content": "Name three colours of the rainbow."}]
    options = dict(max_tokens=16, speculative=speculative)
    engine.prefix_cache.clear()
    answer = engine.generate(first_turn, **options)
    second_turn = [
        *first_turn,
        {"role": "assistant", "content": answer.text},
        {"role": "user", "content": "And two more?"},
    ]
    hit = engine.generate(second_turn, **options)
    engine.prefix_cache.clear()
    cold = engine.generate(second_turn, **options)
    assert hit.cached_tokens >= MIN_HIT and cold.cached_tokens == 0
    assert hit.tokens == cold.tokens
