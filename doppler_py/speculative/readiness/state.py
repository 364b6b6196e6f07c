"""Whether a speculative engine may speculate yet, and how wide: the compile, its gate and the calibration, as one
small state machine the engine asks before each generation and each step.

    WEIGHING ──(the compile pays, `before_generation` or mid-answer `weigh_during`)──► PENDING ──(after the first
    token, `may_speculate`)──► COMPILING ──(the warm-up is done)──► READY, or WEIGHING for the next stage

`prepare(background=False)` goes straight to READY (it compiles and calibrates first); `prepare(background=True)`
starts at PENDING, or at WEIGHING with `weigh` (`compile_gate`: compile only once the tokens to come can repay it).
The engine may compile in stages (`compile_stages`: on a CPU adapter the row counts of one-draft steps first): each
stage is weighed, compiled and made usable on its own, and while the next is weighed the engine speculates with
the row counts compiled so far.
While COMPILING, steps verify at most the row counts compiled so far (`usable_rows`): with costs from the on-disk
cache every newly compiled count is used at once; without them each step up calibrates first, which pauses the
stream, so only at CALIBRATION_STAGES. A seeded sampled generation never speculates on timing: it waits for the
whole compile before its first step. The engine keeps the measuring itself (`Calibrator`); this object decides
when.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from doppler_py.model.transformer import Transformer
from doppler_py.sampling import SamplingParams
from doppler_py.speculative.readiness.compile_gate import compile_pays
from doppler_py.speculative.readiness.warmup import COMPILE_CONTEXT
from doppler_py.speculative.stats import SpecStats

# The verified row counts at which speculation steps up while pipelines compile and each step up must calibrate
# first (without cached costs), and the context of those calibrations between steps (shorter than the 64 of a full
# one: the stream pauses less).
CALIBRATION_STAGES = (3, 5)
QUICK_CONTEXT = 32


class Stage(enum.Enum):
    WEIGHING = "weighing"  # not worth compiling (more) yet: plain generations, or drafts within `usable_rows`
    PENDING = "pending"  # the compile starts once the next generation's first token is out
    COMPILING = "compiling"  # a background thread compiles; steps verify at most `usable_rows` rows
    READY = "ready"  # every row count usable


class Warmup(Protocol):
    """What `readiness.warmup.PipelineWarmup` offers (a test may hand a stand-in)."""

    compiled_rows: int  # every row count up to it is compiled
    done: threading.Event

    def finish(self) -> None: ...

    def cancel(self) -> None: ...


class Calibrator(Protocol):
    """The engine's side: its target, its row counts, its measuring, its policy's limit and costs, its drafter's
    compile."""

    target: Transformer

    def verify_rows(self) -> list[int]: ...

    def calibrate(
        self, rows: Sequence[int] | None = None, context: int = 64, repeats: int = 2, *, store: bool = True
    ) -> None: ...

    def calibrate_between_steps(self, rows: list[int], *, quick: bool) -> None: ...

    def limit_drafts(self, rows: int | None) -> None: ...

    def compile_drafter(self) -> None: ...

    def compile_stages(self) -> list[list[int]]: ...

    def drafter_matmuls(self) -> Sequence[object]: ...

    def start_warmup(self, rows: list[int]) -> Warmup: ...

    def measured_costs(self) -> dict[int, float]: ...

    def best_speedup(self) -> float | None: ...


class Readiness:
    """One engine's way to speculating (module docstring). `usable_rows`: the most rows a step may verify now."""

    def __init__(self, engine: Calibrator, compile_pays: Callable[..., tuple[bool, float, float]] = compile_pays):
        self.engine = engine
        self.compile_pays = compile_pays
        self.stage = Stage.READY
        self.usable_rows = max(engine.verify_rows())
        self.needs_calibration = False
        self.warmup: Warmup | None = None
        self.stage_rows: list[int] = []  # the row counts the warm-up weighed, pending or running compiles
        self.tokens_generated = 0  # by the engine's generations so far: what the compile gate weighs
        self.on_calibrated: Callable[[dict[int, float]], None] | None = None

    def prepare(self, *, costs: bool, background: bool, compile_now: bool = True, weigh: bool = False) -> None:
        """The engine is made ready to speculate (see `SpeculativeEngine.prepare`): `costs`, whether measured costs
        were loaded (no calibration needed)."""
        self.needs_calibration = not costs
        self.usable_rows = 1
        if background:
            self.stage = Stage.WEIGHING if weigh else Stage.PENDING
            return
        if costs and compile_now:  # nothing to measure, but "now": every step size runs without compiling first
            self.engine.calibrate(context=COMPILE_CONTEXT, repeats=1, store=False)
        self._use_rows(max(self.engine.verify_rows()), between_steps=False)
        self.engine.compile_drafter()
        self.stage = Stage.READY

    def before_generation(
        self, max_new_tokens: int, params: SamplingParams, stats: SpecStats, plain_token_s: float | None
    ) -> bool:
        """Whether the next generation drafts at all. WEIGHING: only once the compile pays over this generation's
        tokens and those generated before (`compile_gate`), which then moves to PENDING; a seeded sampled generation
        (its tokens must not depend on timing) always goes ahead."""
        seeded = not params.greedy and params.seed is not None
        if self.stage is not Stage.WEIGHING or seeded:
            return True
        return self._weigh(max_new_tokens + self.tokens_generated, plain_token_s, stats) or self.usable_rows >= 2

    def weigh_during(self, remaining: int, stats: SpecStats, plain_token_s: float | None) -> bool:
        """Before a step of a generation that began plainly (WEIGHING at its start): whether the compile pays now,
        weighed again over the `remaining` tokens of this answer plus those generated before it, with this
        answer's plain tokens timed; then PENDING, and the next `may_speculate` starts the compile. True also once
        another generation opened the gate. An answer drafting within the row counts compiled so far weighs the
        next stage here too (the verdict is then only the stage's). The answer's own tokens so far do not count:
        a compile opened late in an answer slows the rest of it for what only later answers could gain (a fresh
        128-token `generate` that counted them opened it past mid-answer and ended 2.4-4.7 s later than plain)."""
        if self.stage is not Stage.WEIGHING:
            return True
        if plain_token_s is None:  # nothing new to weigh before a plain token is timed
            return False
        return self._weigh(remaining + self.tokens_generated, plain_token_s, stats)

    def _weigh(self, tokens: int, plain_token_s: float | None, stats: SpecStats) -> bool:
        engine = self.engine
        rows = self._next_stage()
        pays, cost, gain = self.compile_pays(
            engine.target,
            rows,
            drafter=engine.drafter_matmuls(),
            tokens=tokens,
            plain_token_s=plain_token_s,
            # From verification costs of several rows (cached, or calibrated): live plain steps alone would
            # extrapolate them linearly from one row, which no device's costs follow.
            speedup=None if self.needs_calibration else engine.best_speedup(),
        )
        # The answer's best chance is what its stats report: the weighing that came closest (the tokens left
        # shrink as it goes, so the last weighing says little).
        if pays or stats.compile_gain_s is None or (gain is not None and gain >= stats.compile_gain_s):
            stats.compile_cost_s, stats.compile_gain_s = cost, gain
        if pays:
            self.stage, self.stage_rows = Stage.PENDING, rows
        return pays

    def _next_stage(self) -> list[int]:
        """The row counts of the first compile stage that goes past those usable now (all of them once none does)."""
        for rows in self.engine.compile_stages():
            if max(rows) > self.usable_rows:
                return rows
        return self.engine.verify_rows()

    def may_speculate(self, first_step: bool, seeded: bool) -> bool:
        """Before a step: whether it may draft (at most `usable_rows` - 1 drafts). PENDING starts the compile after
        the generation's first token (before, it would compete with the prefill and the first step for the CPU
        and the compiler), or at once for a seeded generation, which then waits for it: which steps speculate
        decides which random numbers each token uses."""
        if self.stage is Stage.WEIGHING:
            if not seeded or self.usable_rows < 2:
                return self.usable_rows >= 2
            # A seeded generation speculates with every row count or none, whatever the stages' timing: the rest
            # compiles now and it waits for it (below).
            self.stage, self.stage_rows = Stage.PENDING, self.engine.verify_rows()
        if self.stage is Stage.PENDING:
            if first_step and not seeded:
                return self.usable_rows >= 2
            if not self.stage_rows:  # PENDING from `prepare` (a background warm-up, not weighed): the whole compile
                self.stage_rows = self.engine.verify_rows()
            self.warmup = self.engine.start_warmup([r for r in self.stage_rows if r > self.usable_rows])
            self.stage = Stage.COMPILING
        if self.stage is Stage.COMPILING:
            warmup = self.warmup
            if seeded:
                warmup.done.wait()
            if warmup.done.is_set():
                self.warmup = None
                warmup.finish()
                rows = max(self.stage_rows)
                self._use_rows(rows, between_steps=True)
                if rows >= max(self.engine.verify_rows()):
                    self.stage = Stage.READY
                elif seeded:  # the rest at once, waited for
                    self.stage, self.stage_rows = Stage.PENDING, self.engine.verify_rows()
                    return self.may_speculate(first_step, seeded)
                else:
                    self.stage = Stage.WEIGHING
            elif warmup.compiled_rows > self.usable_rows and self._worth_a_step_up(warmup.compiled_rows):
                self._use_rows(warmup.compiled_rows, between_steps=True)
        return self.usable_rows >= 2

    def _worth_a_step_up(self, rows: int) -> bool:
        """With cached costs every newly compiled row count is used at once; a step up that must calibrate pauses
        the stream (~0.8 s on lavapipe), so then only at CALIBRATION_STAGES. Those quick calibrations run while the
        thread still compiles, so the final one (`_use_rows`) measures every row count again once it is done, and
        only that one is stored."""
        return not self.needs_calibration or any(self.usable_rows < r <= rows for r in CALIBRATION_STAGES)

    def _use_rows(self, rows: int, *, between_steps: bool) -> None:
        """Steps may now verify up to `rows` rows: calibrate the new row counts first if no costs were cached."""
        engine = self.engine
        full = rows >= max(engine.verify_rows())
        if self.needs_calibration:
            new_rows = [r for r in engine.verify_rows() if self.usable_rows < r <= rows or r == 1 or full]
            if between_steps:
                engine.calibrate_between_steps(new_rows, quick=not full)
            else:
                engine.calibrate(new_rows)
        self.usable_rows = rows
        engine.limit_drafts(None if full else rows - 1)
        if full and self.needs_calibration:
            self.needs_calibration = False
            if self.on_calibrated is not None:
                self.on_calibrated(engine.measured_costs())

    def close(self) -> None:
        if self.warmup is not None:
            self.warmup.cancel()
            self.warmup = None
