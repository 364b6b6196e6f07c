"""Stop strings: the text ends before the first stop string, whether it spans several tokens or ends inside a
run of accepted drafts, streamed pieces never show it, and the engine's generation is closed at once."""

from __future__ import annotations

import random

import pytest

from doppler_py.api import StopMatcher, load
from doppler_py.errors import GenerationOptionError
from doppler_py.options import check_stop
from doppler_py.testing.tiny import TinySpec

PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat"


@pytest.fixture(scope="module")
def engine(tiny_folder):
    with load(tiny_folder(TinySpec()), weights="f32", progress=False, warmup="now") as engine:
        yield engine


def first_stop(text: str, stops) -> int | None:
    hits = [i for s in stops if (i := text.find(s)) >= 0]
    return min(hits) if hits else None


@pytest.mark.parametrize("seed", range(40))
def test_matcher_releases_exactly_the_text_before_the_first_stop_for_any_split(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice("ab\nc") for _ in range(rng.randint(0, 30)))
    stops = ["".join(rng.choice("ab\nc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 4))]
    matcher, released = StopMatcher(stops), []
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 8))))
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        released.append(matcher.push(text[a:b]))
        assert not any(s in "".join(released) for s in stops)
    if matcher.stop_at is None:
        released.append(matcher.finish())
    end = first_stop(text, stops)
    assert "".join(released) == (text if end is None else text[:end])
    assert matcher.stop_at == end
    if end is None:
        assert matcher.matched is None
    else:
        assert text.startswith(matcher.matched, end) and matcher.matched == next(
            s for s in stops if text.startswith(s, end)
        )


def test_stop_options_are_checked():
    assert check_stop(None) == () and check_stop("x") == ("x",) and check_stop(["a", "b"]) == ("a", "b")
    for bad in (["a"] * 5, [""], [1], 3):
        with pytest.raises(GenerationOptionError):
            check_stop(bad)


def kept_tokens_are_those_before_the_stop(engine, full: list[int], result) -> None:
    """decode(tokens) is the text up to the kept tokens' end; the next token with text reaches the stop."""
    decode = lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    kept = len(result.tokens)
    assert result.tokens == full[:kept] and result.text.startswith(decode(result.tokens))
    later = [j for j in range(kept + 1, len(full) + 1) if len(decode(full[:j])) > len(decode(full[:kept]))]
    assert not later or len(decode(full[: later[0]])) > len(result.text)


def spy_steps(engine, mode: str) -> dict:
    """Wrap the drafter's engine so a test sees each step's tokens and whether the generation was closed."""
    spec = engine.speculative_engine(mode)
    seen = {"steps": [], "closed": False}
    original = spec.iter_generate

    def iter_generate(*args, **kwargs):
        try:
            for new in original(*args, **kwargs):
                seen["steps"].append(list(new))
                yield new
        finally:
            seen["closed"] = True

    spec.iter_generate = iter_generate
    return seen


@pytest.mark.parametrize("mode", [None, "prompt-lookup"])
def test_stop_string_spanning_tokens_ends_the_text_and_the_generation(engine, mode):
    options = dict(max_tokens=40, speculative=mode, chat=False)
    full = engine.generate(PROMPT, **options)
    assert full.finish_reason == "length" and len(full.text) >= 12
    stop = full.text[8:11]  # three characters: three tokens of the character tokenizer
    end = full.text.find(stop)
    seen = spy_steps(engine, mode or "none")
    try:
        pieces = list(engine.stream(PROMPT, stop=[stop, "never-there"], **options))
    finally:
        del engine.speculative_engine(mode or "none").iter_generate
    result = engine.last_result
    assert result.finish_reason == "stop" and result.text == full.text[:end] == "".join(pieces)
    assert all(stop not in piece for piece in pieces)
    assert seen["closed"] and sum(map(len, seen["steps"])) < 40  # stopped early, caches released
    kept_tokens_are_those_before_the_stop(engine, full.tokens, result)


def test_stop_string_ending_inside_a_run_of_accepted_drafts(tiny_folder):
    # The target drafting for itself: greedy, every draft is accepted, so each step commits k + 1 tokens.
    folder = tiny_folder(TinySpec())
    with load(folder, weights="f32", draft=folder, progress=False, warmup="now") as engine:
        options = dict(max_tokens=48, speculative="draft-model", k=4, chat=False)
        seen = spy_steps(engine, "draft-model")
        full = engine.generate(PROMPT, **options)
        del engine.speculative_engine("draft-model").iter_generate
        decode = lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        # A step that committed >= 3 tokens: the stop string ends after its second token.
        done, candidates = 0, []
        for step in seen["steps"]:
            if len(step) >= 3:
                end = len(decode(full.tokens[: done + 2]))
                stop = full.text[max(0, end - 3) : end]
                if len(stop) == 3 and full.text.find(stop) == end - 3:
                    candidates.append(stop)
            done += len(step)
        assert candidates, f"no multi-token step with a usable stop string: {seen['steps']}"
        pieces = list(engine.stream(PROMPT, stop=candidates[0], **options))
        result = engine.last_result
        assert result.finish_reason == "stop" and result.text == full.text[: full.text.find(candidates[0])]
        assert "".join(pieces) == result.text and result.accepted > 0
        kept_tokens_are_those_before_the_stop(engine, full.tokens, result)


def test_no_stop_match_keeps_the_whole_text(engine):
    full = engine.generate(PROMPT, max_tokens=12, chat=False)
    result = engine.generate(PROMPT, max_tokens=12, chat=False, stop=["\x00never"])
    assert result.text == full.text and result.tokens == full.tokens and result.finish_reason == "length"
