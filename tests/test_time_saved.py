"""`time_saved_s` is measured, not guessed: it comes from live plain steps of this process, carries its
uncertainty, is None without enough of them, and is negative when speculation was slower. The engine's clock is
replaced by one that moves only when asked (a step costs what the test says it costs), so nothing here depends on
how fast this machine is."""

from __future__ import annotations

import time

import pytest

from doppler_py.api import PlainStepCosts, load
from doppler_py.speculative import LayerSkipDrafter
from doppler_py.testing.tiny import TinySpec

PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat"
TICK_S = 0.001  # each reading of the clock moves it this much
DRAFT_S = 0.02  # and each speculative proposal this much more: far more than a plain token costs


def step_seconds(result) -> float:
    """The decoding steps' own time in a result (what time_saved_s compares against)."""
    return result.stats["plain_s"] + result.stats["draft_s"] + result.stats["verify_s"]


def test_saving_matches_the_measured_difference_and_is_negative_when_speculation_is_slower(tiny_folder, monkeypatch):
    with load(tiny_folder(TinySpec()), weights="f32", progress=False, warmup="now") as engine:
        now = [0.0]

        def clock() -> float:
            now[0] += TICK_S
            return now[0]

        propose = LayerSkipDrafter.propose

        def slow_propose(self, ctx, k):
            now[0] += DRAFT_S
            return propose(self, ctx, k)

        monkeypatch.setattr(time, "perf_counter", clock)
        monkeypatch.setattr(LayerSkipDrafter, "propose", slow_propose)
        options = dict(max_tokens=40, chat=False, speculative="layer-skip", k=4)
        early = engine.generate(PROMPT, **options)
        assert early.drafted > 0 and early.time_saved_s is None  # no live plain step measured yet: no guess
        # Plain decoding runs in batches (one sample each) after a generation's first token: enough of them.
        for _ in range(12):
            plain = engine.generate(PROMPT, max_tokens=40, chat=False, speculative=None)
            assert plain.time_saved_s is None and plain.speculative is None  # nothing to save in plain decoding
            if len(engine.plain_costs.samples) >= PlainStepCosts.MIN_SAMPLES:
                break
        assert len(engine.plain_costs.samples) >= PlainStepCosts.MIN_SAMPLES
        spec = engine.generate(PROMPT, **options)
        per_token, _, _ = engine.plain_costs.estimate()
    assert spec.drafted > 0
    assert spec.time_saved_s is not None and spec.time_saved_s_err >= 0
    # What this process measured: the last plain generation's time per token × tokens, minus the speculative
    # steps' time; the engine takes the median plain token of all its live samples instead.
    plain_estimate = plain.stats["plain_s"] / plain.stats["generated"] * spec.stats["generated"]
    assert plain_estimate - step_seconds(spec) < 0 and spec.time_saved_s < 0
    # (the stats are rounded to 0.1 ms, three of them summed)
    assert spec.time_saved_s == pytest.approx(per_token * spec.stats["generated"] - step_seconds(spec), abs=2e-4)


def test_no_plain_cost_without_enough_live_plain_steps():
    assert PlainStepCosts().estimate() is None


@pytest.mark.parametrize("samples", [[0.01] * 8, [0.01, 0.012, 0.011, 0.013, 0.009, 0.01, 0.05, 0.011]])
def test_the_estimate_is_the_median_with_a_robust_spread(samples):
    costs = PlainStepCosts()
    costs.samples = list(samples)
    median, spread, n = costs.estimate()
    assert median == pytest.approx(sorted(samples)[3] / 2 + sorted(samples)[4] / 2) and n == 8
    assert 0 <= spread < 0.01  # one slow outlier does not blow the spread up
