"""The readiness state machine (`speculative.readiness.state`), each transition on its own, with a stand-in engine
(no GPU): what is compiled, calibrated and limited at each step, and when speculation may start."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from doppler_py.sampling import SamplingParams
from doppler_py.speculative.readiness.compile_gate import PRIOR_SPEEDUP, weigh
from doppler_py.speculative.readiness.state import CALIBRATION_STAGES, Readiness, Stage
from doppler_py.speculative.stats import SpecStats

ROWS = [1, 2, 3, 4, 5, 6]
GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=1.0, seed=3)


class FakeWarmup:
    def __init__(self):
        self.compiled_rows = 0
        self.done = threading.Event()
        self.finished = self.cancelled = False

    def finish(self) -> None:
        self.finished = True

    def cancel(self) -> None:
        self.cancelled = True


class FakeEngine:
    """Records what the readiness object asks of an engine."""

    target = None

    def __init__(self):
        self.calls: list[tuple] = []
        self.limit: int | None = -1  # never set
        self.warmups: list[FakeWarmup] = []
        self.warmup_rows: list[list[int]] = []
        self.stages = [list(ROWS)]
        self.done_after: float | None = None  # seconds after which a started warm-up finishes on its own

    def verify_rows(self) -> list[int]:
        return list(ROWS)

    def calibrate(self, rows: Sequence[int] | None = None, context: int = 64, repeats: int = 2, *, store=True):
        self.calls.append(("calibrate", None if rows is None else list(rows), store))

    def calibrate_between_steps(self, rows: list[int], *, quick: bool) -> None:
        self.calls.append(("between steps", list(rows), quick))

    def limit_drafts(self, rows: int | None) -> None:
        self.limit = rows

    def compile_drafter(self) -> None:
        self.calls.append(("compile drafter",))

    def compile_stages(self) -> list[list[int]]:
        return self.stages

    def drafter_matmuls(self) -> tuple:
        return ()

    def start_warmup(self, rows: list[int]) -> FakeWarmup:
        self.warmups.append(FakeWarmup())
        self.warmup_rows.append(list(rows))
        if self.done_after is not None:
            threading.Timer(self.done_after, self.warmups[-1].done.set).start()
        return self.warmups[-1]

    def measured_costs(self) -> dict[int, float]:
        return {rows: 0.01 * rows for rows in ROWS}

    def best_speedup(self) -> float | None:
        return 1.4


def readiness(**prepare) -> tuple[Readiness, FakeEngine]:
    engine = FakeEngine()
    ready = Readiness(engine)
    if prepare:
        ready.prepare(**prepare)
    return ready, engine


def test_an_engine_never_prepared_is_ready_at_full_width():
    ready, engine = readiness()
    assert ready.stage is Stage.READY and ready.usable_rows == max(ROWS)
    assert ready.may_speculate(first_step=True, seeded=False) and not engine.calls


def test_prepared_now_without_costs_calibrates_every_row_count_and_is_ready():
    calibrated = []
    engine = FakeEngine()
    ready = Readiness(engine)
    ready.on_calibrated = calibrated.append
    ready.prepare(costs=False, background=False)
    assert ready.stage is Stage.READY and ready.usable_rows == max(ROWS) and engine.limit is None
    assert engine.calls == [("calibrate", ROWS, True), ("compile drafter",)]
    assert calibrated == [engine.measured_costs()] and not ready.needs_calibration


def test_prepared_now_with_costs_only_compiles():
    ready, engine = readiness(costs=True, background=False)
    assert ready.stage is Stage.READY and engine.calls == [("calibrate", None, False), ("compile drafter",)]
    ready, engine = readiness(costs=True, background=False, compile_now=False)
    assert ready.stage is Stage.READY and engine.calls == [("compile drafter",)]


def test_pending_starts_the_compile_after_the_first_token():
    ready, engine = readiness(costs=True, background=True)
    assert ready.stage is Stage.PENDING and ready.usable_rows == 1
    assert not ready.may_speculate(first_step=True, seeded=False) and not engine.warmups
    assert not ready.may_speculate(first_step=False, seeded=False)  # started, nothing compiled yet
    assert ready.stage is Stage.COMPILING and len(engine.warmups) == 1


def test_with_cached_costs_each_compiled_row_count_is_used_at_once():
    ready, engine = readiness(costs=True, background=True)
    ready.may_speculate(first_step=False, seeded=False)
    warmup = engine.warmups[0]
    warmup.compiled_rows = 2
    assert ready.may_speculate(first_step=False, seeded=False) and ready.usable_rows == 2 and engine.limit == 1
    warmup.compiled_rows = 4
    assert ready.may_speculate(first_step=False, seeded=False) and ready.usable_rows == 4 and engine.limit == 3
    assert not [call for call in engine.calls if call[0] != "compile drafter"]  # nothing measured


def test_without_costs_a_step_up_calibrates_first_and_only_at_the_stages():
    ready, engine = readiness(costs=False, background=True)
    ready.may_speculate(first_step=False, seeded=False)
    warmup = engine.warmups[0]
    warmup.compiled_rows = 2  # below the first stage: not worth pausing the stream for
    assert not ready.may_speculate(first_step=False, seeded=False) and ready.usable_rows == 1
    warmup.compiled_rows = CALIBRATION_STAGES[0]
    assert ready.may_speculate(first_step=False, seeded=False) and ready.usable_rows == CALIBRATION_STAGES[0]
    assert engine.calls == [("between steps", [1, 2, 3], True)]


def test_the_compile_done_makes_every_row_count_usable_and_stores_the_final_calibration():
    calibrated = []
    ready, engine = readiness(costs=False, background=True)
    ready.on_calibrated = calibrated.append
    ready.may_speculate(first_step=False, seeded=False)
    warmup = engine.warmups[0]
    warmup.compiled_rows = max(ROWS)
    warmup.done.set()
    assert ready.may_speculate(first_step=False, seeded=False)
    assert ready.stage is Stage.READY and ready.warmup is None and warmup.finished
    assert ready.usable_rows == max(ROWS) and engine.limit is None
    assert engine.calls == [("between steps", ROWS, False)] and len(calibrated) == 1


def test_a_seeded_generation_starts_the_compile_at_once_and_waits_for_it():
    ready, engine = readiness(costs=True, background=True)
    engine.done_after = 0.05
    assert ready.may_speculate(first_step=True, seeded=True)
    assert ready.stage is Stage.READY and ready.usable_rows == max(ROWS)


@pytest.mark.parametrize("pays", [False, True])
def test_weighing_holds_the_compile_until_it_pays(pays):
    asked = []

    def compile_pays(target, rows, *, tokens, plain_token_s, speedup, drafter):
        asked.append((tokens, plain_token_s, speedup))
        return pays, 12.0, 3.0

    engine = FakeEngine()
    ready = Readiness(engine, compile_pays=compile_pays)
    ready.prepare(costs=True, background=True, weigh=True)
    ready.tokens_generated = 40
    stats = SpecStats()
    assert ready.stage is Stage.WEIGHING and not ready.may_speculate(first_step=False, seeded=False)
    assert ready.before_generation(10, GREEDY, stats, plain_token_s=0.05) is pays
    assert asked == [(50, 0.05, 1.4)] and (stats.compile_cost_s, stats.compile_gain_s) == (12.0, 3.0)
    assert ready.stage is (Stage.PENDING if pays else Stage.WEIGHING) and not engine.warmups


def test_the_gate_weighs_the_compile_against_what_the_tokens_to_come_can_save():
    # 10 s of compiling against tokens × 0.1 s × (1 - 1/2)
    assert weigh(10.0, 100, 0.1, 2.0) == (False, 10.0, 5.0)
    assert weigh(10.0, 200, 0.1, 2.0) == (True, 10.0, 10.0)
    # Before a plain token is timed only a compile with nothing left to do passes.
    assert weigh(10.0, 10**6, None, 2.0) == (False, 10.0, None) and weigh(0.0, 1, None, None)[0]
    # No speedup measured yet: the prior; a predicted slowdown saves nothing, whatever the tokens.
    assert weigh(1.0, 100, 0.1, None)[2] == pytest.approx(100 * 0.1 * (1 - 1 / PRIOR_SPEEDUP))
    assert weigh(1.0, 10**6, 0.1, 0.9) == (False, 1.0, 0.0)


def test_the_compile_estimate_counts_each_missing_pipeline_at_its_row_tiles_cost():
    """Each missing matmul pipeline costs its row tile's weight times this process's seconds per unit of weight:
    after 2-row tiles took 1.2 s each, an 8-row tile is estimated at 2.9 × 1.2 s, not at the mean of those compiled."""
    from doppler_py.gpu.kernels import CompileRecord, PipelineCache
    from doppler_py.speculative.readiness.compile_gate import PRIOR_COMPILE_S, TILE_COMPILE_WEIGHTS, compile_estimate_s

    def key(rows: int) -> tuple:
        return ("matmul", "main", (("FORMAT", 3), ("ROWS", rows)))

    cache = PipelineCache()
    assert compile_estimate_s(cache, [key(2), key(8)]) == pytest.approx(PRIOR_COMPILE_S * (1 + TILE_COMPILE_WEIGHTS[8]))
    cache.records += [CompileRecord(key(2), 0.2, 1.0, "t", 0.0), CompileRecord(key(2), 0.0, 1.2, "t", 0.0)]
    cache.records.append(CompileRecord(("rmsnorm", "main", ()), 0.0, 50.0, "t", 0.0))  # not a matmul: not counted
    assert compile_estimate_s(cache, []) == 0.0
    assert compile_estimate_s(cache, [key(8), key(4)]) == pytest.approx(
        1.2 * (TILE_COMPILE_WEIGHTS[8] + TILE_COMPILE_WEIGHTS[4])
    )
    cache.records.append(CompileRecord(key(8), 0.0, 2.9 * 3.0, "t", 0.0))  # a slower phase: 3 s per unit of weight
    assert compile_estimate_s(cache, [key(1)]) == pytest.approx(TILE_COMPILE_WEIGHTS[1] * (2.4 + 8.7) / (2 + 2.9))


def test_an_answer_begun_plainly_weighs_the_compile_again_once_its_plain_tokens_are_timed():
    """Mid-answer (`weigh_during`): over the answer's remaining tokens plus those of earlier
    answers; once it pays, the next step starts the compile as after an answer's first token."""
    asked = []
    verdicts = iter([False, True])

    def compile_pays(target, rows, *, tokens, plain_token_s, speedup, drafter):
        asked.append((tokens, plain_token_s))
        return next(verdicts), 12.0, 3.0

    engine = FakeEngine()
    ready = Readiness(engine, compile_pays=compile_pays)
    ready.prepare(costs=True, background=True, weigh=True)
    ready.tokens_generated = 40
    stats = SpecStats()
    assert not ready.weigh_during(100, stats, plain_token_s=None) and not asked  # nothing timed yet
    assert not ready.weigh_during(99, stats, plain_token_s=0.05) and ready.stage is Stage.WEIGHING
    assert ready.weigh_during(90, stats, plain_token_s=0.04) and ready.stage is Stage.PENDING
    assert asked == [(139, 0.05), (130, 0.04)] and (stats.compile_cost_s, stats.compile_gain_s) == (12.0, 3.0)
    assert ready.weigh_during(80, stats, plain_token_s=0.04) and len(asked) == 2  # open: not weighed again
    assert not ready.may_speculate(first_step=False, seeded=False) and len(engine.warmups) == 1


def test_a_seeded_generation_is_never_held_by_the_weighing():
    ready, _ = readiness(costs=True, background=True, weigh=True)
    ready.compile_pays = lambda *args, **kwargs: pytest.fail("a seeded generation must not be weighed")
    assert ready.before_generation(10, SEEDED, SpecStats(), plain_token_s=None)
    assert ready.stage is Stage.WEIGHING  # its steps stay plain: which ones speculate must not depend on timing


def test_closing_cancels_a_running_compile():
    ready, engine = readiness(costs=True, background=True)
    ready.may_speculate(first_step=False, seeded=False)
    ready.close()
    assert engine.warmups[0].cancelled and ready.warmup is None


def test_a_staged_compile_weighs_compiles_and_uses_each_stage_on_its_own():
    """On a CPU adapter the engine compiles in stages (`compile_stages`): the gate weighs the one-draft row counts
    first; once they are compiled the answers draft within them while the rest is weighed, which then compiles
    and makes every row count usable."""
    weighed, verdicts = [], iter([True, False, True])

    def compile_pays(target, rows, *, tokens, plain_token_s, speedup, drafter):
        weighed.append(list(rows))
        return next(verdicts), 1.0, 2.0

    engine = FakeEngine()
    engine.stages = [[1, 2], list(ROWS)]
    ready = Readiness(engine, compile_pays=compile_pays)
    ready.prepare(costs=True, background=True, weigh=True)
    stats = SpecStats()
    assert ready.before_generation(10, GREEDY, stats, plain_token_s=0.05) and ready.stage is Stage.PENDING
    assert not ready.may_speculate(first_step=False, seeded=False) and engine.warmup_rows == [[2]]
    engine.warmups[0].compiled_rows = 2
    engine.warmups[0].done.set()
    assert ready.may_speculate(first_step=False, seeded=False)
    assert ready.stage is Stage.WEIGHING and ready.usable_rows == 2 and engine.limit == 1
    assert ready.before_generation(10, GREEDY, stats, plain_token_s=0.05)  # the rest does not pay: drafts of one
    assert ready.may_speculate(first_step=True, seeded=False) and ready.stage is Stage.WEIGHING
    assert ready.weigh_during(5, stats, plain_token_s=0.05) and ready.stage is Stage.PENDING
    assert weighed == [[1, 2], ROWS, ROWS]
    assert ready.may_speculate(first_step=False, seeded=False) and engine.warmup_rows[1] == [3, 4, 5, 6]
    engine.warmups[1].compiled_rows = max(ROWS)
    engine.warmups[1].done.set()
    assert ready.may_speculate(first_step=False, seeded=False)
    assert ready.stage is Stage.READY and ready.usable_rows == max(ROWS) and engine.limit is None


def test_a_seeded_generation_between_stages_waits_for_the_rest():
    """Which steps of a seeded generation speculate must not depend on when a stage paid: it compiles every row
    count and waits, as from PENDING."""
    ready, engine = readiness(costs=True, background=True, weigh=True)
    engine.stages = [[1, 2], list(ROWS)]
    ready.stage, ready.usable_rows = Stage.WEIGHING, 2
    engine.done_after = 0.05
    assert ready.may_speculate(first_step=True, seeded=True)
    assert engine.warmup_rows == [[3, 4, 5, 6]] and ready.stage is Stage.READY and ready.usable_rows == max(ROWS)


def test_an_answer_s_stats_keep_its_closest_weighing():
    """The tokens left shrink as an answer goes on, so its last weighing says little: the stats keep the one with
    the largest gain (what the stats line reports as what the answer could have saved)."""
    gains = iter([2.0, 1.5, 0.1])
    ready = Readiness(FakeEngine(), compile_pays=lambda *a, **k: (False, 3.0, next(gains)))
    ready.prepare(costs=True, background=True, weigh=True)
    stats = SpecStats()
    for remaining in (100, 70, 5):
        assert not ready.weigh_during(remaining, stats, plain_token_s=0.05)
    assert (stats.compile_cost_s, stats.compile_gain_s) == (3.0, 2.0)
