"""Concurrent generations batched on the GPU: their steps, and the prefills of those joining, share target forwards.

Each generation runs on its own thread with its own `SpeculativeEngine` (its stepper, drafter, policy and KV
cache). When a batch is attached (`SpeculativeEngine.batch`), a step does not run alone: it waits here until
every generation in the batch has its next step ready (or `gather_s` passed since the first arrived, or since the
batch before ended), and the last to arrive runs them all; steps that arrive meanwhile wait for the next batch:

    for each step:  begin (proposal, masks, uploads to its own stepper's buffers)
    ONE forward over every step's rows, stacked: step b's k_b + 1 rows at row0_b, each attending over its
                    own KV cache (`Transformer.record_batch`; Σ(k_b + 1) ≤ the model's logit rows and
                    `rows_alone`, else more forwards in turn), then the rows of prefill chunks waiting to go
                    (no logits) as far as rows are left
    for each step:  its logits rows moved to rows 0.. of target.logits, then its masks, verification and
                    log-probs, as when it runs alone (`Stepper.record_checks`)
    ONE submit; each step's readback and commit (`Stepper.finish`)

A step with nothing else waiting runs as it would without the batch (`Stepper.step`); while its generation is the
only member, its plain steps run several per submit, as they do alone (`SpeculativeEngine`'s plain runs), so a
server that batches loses nothing to one that does not while a single client uses it.

A generation that starts while others step prefills its prompt here too (`prefill`), in the chunks of its solo
prefill (so each row meets the same kernels and attention plan): each forward of their steps takes the chunks it
has room for after their rows, so the others keep stepping while it prefills instead of waiting for its whole
prompt, and the forward's matmuls serve both; a chunk that fits no such forward gets one of its own. With no step
waiting, its chunks run at once in forwards of their own.

The generations' KV caches are runs of the batch's arena (`model/kv_arena.py`): the steps whose caches sit in one
slab attend in one dispatch per layer, each through its own cache's blocks (`ops.attention.BatchedAttention`);
other rows (prefill chunks, caches in another slab) one call each. A step's tokens are those of its solo run: its
rows see only its own cache, attention computes each row as its own call would and each matmul row alone, whatever
the other rows hold, and its random numbers come from its own seeded stream. Generations join after their prefill
and leave before their KV cache is freed, so a batch changes between any two steps (continuous batching).

A member's draft length is priced from the batch's own measured forwards (`shared_costs`): its plain step takes
the shared forward's time, and each row it drafts delays every member's step by that row's cost, so it drafts only
where the batch as a whole makes more tokens per second (`policy.draft_length.SharedStepCosts`).

Only drafters that propose from the host without touching the target's buffers (`Drafter.batches`) take part:
another's GPU drafting or feature reads would use activation rows that other sequences' rows now fill.

Everything else that records GPU work on the shared model (prefix-cache copies, calibration, new engines) holds
`gpu_lock`, which the running batch holds too.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from doppler_py.errors import InternalError
from doppler_py.gpu.tensor import Tensor
from doppler_py.model.kv_cache import KVCache
from doppler_py.model.transformer import Transformer
from doppler_py.ops.linear import compile_rows
from doppler_py.ops.tree import MAX_TREE_ROWS
from doppler_py.speculative.contract import Proposal, StepContext
from doppler_py.speculative.policy.draft_length import CostModel, SharedStepCosts
from doppler_py.speculative.step import PendingStep, StepOutcome, Stepper

# How long the first step of a batch waits for the others: they are normally only a token's host work away
# (detokenising, stop strings), so this only bounds how long a stalled generation holds the others back.
GATHER_S = 0.05
FORWARD_EMA = 0.3  # weight of the newest forward in the running means `shared_costs` prices with


@dataclass(eq=False, kw_only=True)
class _Turn:
    """A piece of work waiting for a batch's forward."""

    taken: bool = False  # a leader took it into a batch
    done: bool = False
    error: BaseException | None = None


@dataclass(eq=False, kw_only=True)
class _Step(_Turn):
    stepper: Stepper
    ctx: StepContext
    k: int
    proposal: Proposal | None
    plain_steps: int = 1  # plain steps (k = 0) it may take in one submit when it steps alone
    alone: bool = False  # it ran as without the batch: its wall time is its own
    outcome: StepOutcome | None = None
    pending: PendingStep | None = field(default=None, repr=False)


@dataclass(eq=False, kw_only=True)
class _Prefill(_Turn):
    """A joining generation's prompt (but its last token): its K/V written at positions start_pos.., no logits."""

    cache: KVCache
    start_pos: int
    ids: np.ndarray
    rows_done: int = 0  # rows whose forward was submitted

    @property
    def rows_left(self) -> int:
        return self.ids.size - self.rows_done


def _rows(steps: list[_Step], pieces: list[tuple[_Prefill, int]]) -> int:
    return sum(request.pending.rows for request in steps) + sum(n for _, n in pieces)


class StepBatch:
    """The meeting point of the concurrent generations of one target model."""

    def __init__(self, target: Transformer, *, gather_s: float = GATHER_S, kv_limit_bytes: int | None = None):
        self.target = target
        self.gather_s = gather_s
        self.arena = target.new_arena(kv_limit_bytes)  # the members' KV caches (`new_cache(arena=)`)
        self.gpu_lock = threading.RLock()
        self._cond = threading.Condition()
        self._members = 0  # generations between `join` and `leave`
        self._arrived: list[_Turn] = []
        self._running = False  # a batch's forwards are running
        self._run_ended = 0.0  # when the last one ended (time.monotonic)
        self.sizes: Counter[int] = Counter()  # steps per batch run, over the batch's life (`/metrics`)
        self.paged_forwards = 0  # forwards whose attention ran once per layer for several steps (`record_batch`)
        self.prefill_rows_beside_steps = 0  # prompt rows prefilled in the forwards of running generations' steps
        # Running means of the forwards of steps alone (no prompt rows): wall seconds, steps, rows (`shared_costs`).
        self._forwards_measured: tuple[float, float, float] | None = None
        self._logits_scratch: Tensor | None = None  # the batch's logits while each step's rows move into place
        # Whose kept feature rows are rows 0.. of the target's feature buffers, and the target's forward count when
        # they were put there (a forward since overwrote them): `_place`.
        self._in_place: tuple[Stepper, int] | None = None
        self._warmup: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def members(self) -> int:
        return self._members

    def join(self) -> None:
        """A generation's first step is next (its prefill is done)."""
        with self._cond:
            self._members += 1

    def leave(self) -> None:
        """A generation took its last step (or failed): the others no longer wait for it."""
        with self._cond:
            self._members -= 1
            self._cond.notify_all()

    def step(
        self, stepper: Stepper, ctx: StepContext, k: int, proposal: Proposal | None = None, *, plain_steps: int = 1
    ) -> tuple[StepOutcome, bool]:
        """`stepper.step(ctx, k, proposal=proposal)`, run together with the other members' next steps; and whether
        it ran alone, as without the batch. A generation that steps alone (the only member, nothing else waiting)
        takes `plain_steps` plain steps in one submit as it would without the batch; beside others, one."""
        request = _Step(stepper=stepper, ctx=ctx, k=k, proposal=proposal, plain_steps=plain_steps)
        self._take_turn(request)
        if request.outcome is None:
            raise InternalError("a batched step ended without an outcome")
        return request.outcome, request.alone

    def shared_costs(self, alone: CostModel) -> SharedStepCosts | None:
        """What a member's next step is priced with (`CostModel.shared`), given the device's costs measured alone:
        None while fewer than two generations step or no forward of steps was timed yet. A plain step takes the
        measured forwards' time less their draft rows, priced as `alone` prices them."""
        with self._cond:
            members, measured = self._members, self._forwards_measured
        plain = alone.verify_cost(1)
        if members < 2 or measured is None or plain is None:
            return None
        wall, steps, rows = measured
        drafts_s = steps * (alone.verify_cost(rows / steps) - plain)
        return alone.shared(max(wall - drafts_s, plain), members)

    def _observe_forward(self, steps: int, rows: int, seconds: float) -> None:
        with self._cond:
            old = self._forwards_measured
            if old is None:
                self._forwards_measured = (seconds, float(steps), float(rows))
            else:
                wall, mean_steps, mean_rows = ((1 - FORWARD_EMA) * value for value in old)
                self._forwards_measured = (
                    wall + FORWARD_EMA * seconds,
                    mean_steps + FORWARD_EMA * steps,
                    mean_rows + FORWARD_EMA * rows,
                )

    def prefill(self, cache: KVCache, start_pos: int, ids: Sequence[int]) -> None:
        """Write the K/V of `ids` at positions start_pos.. of `cache`: as many rows as fit beside the members' next
        steps in each of their forwards (in forwards of its own when no step waits, or when none has room);
        returns once the last rows' forward is submitted."""
        prompt = self.target.check_ids(ids)
        if prompt.size:
            self._take_turn(_Prefill(cache=cache, start_pos=start_pos, ids=prompt))

    def _take_turn(self, request: _Turn) -> None:
        """Queue `request` for the next batch; the arrival that completes a batch runs it (module docstring). A
        prefill whose rows did not all fit goes back into the queue for the next batch."""
        with self._cond:
            self._arrived.append(request)
            self._cond.notify_all()
            arrived_at = time.monotonic()
        while True:
            batch = None
            with self._cond:
                while not request.done:
                    # One batch at a time: steps that arrive while one runs wait for it, and for its members, which
                    # come back together, so the generations keep stepping in one batch rather than in turns.
                    if self._running or request.taken:
                        self._cond.wait()
                        continue
                    left = max(arrived_at, self._run_ended) + self.gather_s - time.monotonic()
                    steps = sum(isinstance(turn, _Step) for turn in self._arrived)
                    if steps >= self._members or left <= 0:
                        batch, self._arrived = self._arrived, []
                        for member in batch:
                            member.taken = True
                        self._running = True
                        break
                    self._cond.wait(left)
            if batch is None:
                break
            try:
                with self.gpu_lock:
                    self._run(batch)
            except Exception as exc:  # outside any one request's work: every unfinished one fails with it
                for member in batch:
                    unfinished = member.outcome is None if isinstance(member, _Step) else member.rows_left > 0
                    if member.error is None and unfinished:
                        member.error = exc
            finally:
                with self._cond:
                    for member in batch:
                        if isinstance(member, _Prefill) and member.rows_left and member.error is None:
                            member.taken = False
                            self._arrived.append(member)
                        else:
                            member.done = True
                    self._running = False
                    self._run_ended = time.monotonic()
                    self._cond.notify_all()
        if request.error is not None:
            raise request.error

    def _run(self, batch: list[_Turn]) -> None:
        """Begin every step, run them in forwards of at most the model's logit rows with prefill rows where rows
        are left, finish each step. Without steps, prefills run whole in forwards of their own; with steps, a prefill
        that found no room gets one forward of its own, and one that did waits for the next batch with its rest.
        A step alone runs as without the batch (`_alone`)."""
        if len(batch) == 1 and isinstance(batch[0], _Step):
            self._alone(batch[0])
            return
        ready = []
        for request in batch:
            if not isinstance(request, _Step):
                continue
            try:
                self._place(request.stepper, request.ctx.hidden_rows)
                request.pending = request.stepper.begin(request.ctx, request.k, proposal=request.proposal)
                ready.append(request)
            except Exception as exc:  # this generation's error (a drafter's, a grammar's), not the others'
                request.error = exc
        if ready:
            self.sizes[len(ready)] += 1
        target = self.target
        # A step's rows share a forward only as far as each row's result stays its solo one (`rows_alone`).
        alone = target.rows_alone
        forwards: list[tuple[list[_Step], list[tuple[_Prefill, int]]]] = []
        for request in ready:
            rows = request.pending.rows
            full = not forwards or _rows(forwards[-1][0], []) + rows > min(target.max_logit_rows, alone)
            # One token tree per forward: its layout has one home (`Transformer.tree`), which its verification reads.
            if full or (request.pending.tree and any(step.pending.tree for step in forwards[-1][0])):
                forwards.append(([], []))
            forwards[-1][0].append(request)
        # A prompt goes in the chunks its solo prefill takes (max_rows rows from its start), so each chunk's rows
        # meet the same kernels and attention plan as alone: whole chunks beside the steps where they fit.
        for prefill in (turn for turn in batch if isinstance(turn, _Prefill)):
            taken = 0
            while taken < prefill.rows_left:
                n = min(target.max_rows, prefill.rows_left - taken)
                # Only a prompt's last chunk can be short enough to go beside steps, and with steps a chunk of
                # its own ends the prompt's turn: its chunks still run in order.
                room = next((pieces for steps, pieces in forwards if steps and _rows(steps, pieces) + n <= alone), None)
                if room is None and ready and taken:
                    break  # the rest rides with the next steps
                if room is not None:
                    room.append((prefill, n))
                else:  # no steps, or none with room: a forward of its own
                    forwards.append(([], [(prefill, n)]))
                taken += n
                if room is None and ready:
                    break  # with steps, one forward of its own per batch: the rest waits for the next
        for steps, pieces in forwards:
            self._forward(steps, pieces)

    def _alone(self, request: _Step) -> None:
        """A step with no other work waiting: `Stepper.step` itself, which the batched forward equals for one step;
        while the generation is the only member, its plain steps several per submit. A member that joins meanwhile
        waits for that submit (its prefill's first turn)."""
        plain_steps = request.plain_steps if request.k == 0 and self._members == 1 else 1
        stepper = request.stepper
        start = time.perf_counter()
        try:
            self._place(stepper, request.ctx.hidden_rows)
            keep = stepper.drafter.reads_step_rows
            outcome = stepper.step(
                request.ctx, request.k, plain_steps=plain_steps, proposal=request.proposal, keep_rows=keep
            )
        except Exception as exc:
            request.error = exc
            return
        if keep:
            self._in_place = (stepper, self.target.forwards)
        self.sizes[1] += 1
        request.outcome, request.alone = outcome, True
        self._observe_forward(1, outcome.drafted + 1, (time.perf_counter() - start) / plain_steps)

    def _forward(self, steps: list[_Step], pieces: list[tuple[_Prefill, int]]) -> None:
        """One forward: the steps' rows, then each prefill piece's next n rows (no logits)."""
        target = self.target
        start = time.perf_counter()
        rec = target.registry.recorder()
        segments, row0, tree, firsts = [], 0, None, []
        for n, request in enumerate(steps):
            pending = request.pending
            request.stepper.record_inputs(rec, pending, row0)
            segments.append((pending.ctx.target_cache, pending.pos, pending.rows))
            tree = n if pending.tree else tree
            firsts.append(row0)
            row0 += pending.rows
        logit_rows = row0
        try:
            for prefill, n in pieces:
                target.ids.view((n,), offset_bytes=4 * row0).write(
                    prefill.ids[prefill.rows_done : prefill.rows_done + n]
                )
                segments.append((prefill.cache, prefill.start_pos + prefill.rows_done, n))
                prefill.rows_done += n
                row0 += n
            if target.record_batch(rec, segments, logit_rows, tree=tree):
                self.paged_forwards += 1
            for request, row0 in zip(steps, firsts, strict=True):
                if request.stepper.drafter.reads_step_rows:
                    request.stepper.save_rows(rec, request.pending.rows, row0)
            copy = self._logits_copy() if len(steps) > 1 else None
            row_bytes = 4 * target.config.vocab_size
            if copy is not None:
                rec.copy(target.logits, copy, logit_rows * row_bytes)
            for request, row0 in zip(steps, firsts, strict=True):
                rows = request.pending.rows
                if row0:
                    rec.copy(copy, target.logits, rows * row_bytes, src_offset=row0 * row_bytes)
                request.stepper.record_checks(rec, request.pending)
                if copy is not None and request.stepper.drafter.reads_verified_logits:  # as its checks left them
                    rec.copy(target.logits, copy, rows * row_bytes, dst_offset=row0 * row_bytes)
            rec.submit()
        except Exception as exc:
            for request in [*steps, *(prefill for prefill, _ in pieces)]:
                request.error = exc
            return
        if steps:
            self.prefill_rows_beside_steps += sum(n for _, n in pieces)
            self._in_place = (steps[0].stepper, target.forwards)
        for n, (request, row0) in enumerate(zip(steps, firsts, strict=True)):
            try:
                self._place(request.stepper, request.pending.rows)
                if n != len(steps) - 1 and request.stepper.drafter.reads_verified_logits:
                    rows = request.pending.rows
                    rec = target.registry.recorder()
                    rec.copy(copy, target.logits, rows * row_bytes, src_offset=row0 * row_bytes)
                    rec.submit()
                request.outcome = request.stepper.finish(request.pending)
            except Exception as exc:
                request.error = exc
        if steps and not pieces and all(request.error is None for request in steps):
            self._observe_forward(len(steps), logit_rows, time.perf_counter() - start)

    def _place(self, stepper: Stepper, rows: int) -> None:
        """Before a member's drafter hooks run: its kept feature rows (`Stepper.save_rows`) back as rows 0.. of the
        target's feature buffers, unless they are still there (no forward since they were put there)."""
        if not stepper.drafter.reads_step_rows or rows == 0 or self._in_place == (stepper, self.target.forwards):
            return
        rec = self.target.registry.recorder()
        stepper.restore_rows(rec, rows)
        rec.submit()
        self._in_place = (stepper, self.target.forwards)

    def keep_prefill_rows(self, stepper: Stepper, ctx: StepContext) -> None:
        """After a member's prefill in forwards of its own (its drafter reads the rows): its last chunk's final rows
        kept as its step rows (at most a tree's worth: enough for every drafter's hooks, which read the newest)."""
        if not stepper.drafter.reads_step_rows or ctx.hidden_rows == 0:
            return
        keep = min(ctx.hidden_rows, MAX_TREE_ROWS)
        rec = self.target.registry.recorder()
        stepper.save_rows(rec, keep, ctx.hidden_rows - keep)
        stepper.restore_rows(rec, keep)
        rec.submit()
        ctx.hidden_rows = keep
        self._in_place = (stepper, self.target.forwards)

    def _logits_copy(self) -> Tensor:
        target = self.target
        if self._logits_scratch is None:
            shape = (target.max_logit_rows, target.config.vocab_size)
            self._logits_scratch = Tensor.empty(target.gpu, shape, "f32", "batch logits")
        return self._logits_scratch

    def warm_up(self, *, background: bool) -> None:
        """Compile the target's matmul pipelines for every row count a batch may run (`compile_rows`), now or in a
        background thread while the first generations step (then a step that needs one first compiles it)."""
        if not background:
            compile_rows(self.target.linears())
            return
        self._warmup = threading.Thread(
            target=compile_rows, args=(self.target.linears(), self._stop), name="doppler-batch-warmup", daemon=True
        )
        self._warmup.start()

    def close(self) -> None:
        if self._warmup is not None:
            self._stop.set()
            self._warmup.join()
            self._warmup = None
        if self._logits_scratch is not None:
            self.target.registry.release_tensors(self._logits_scratch)
            self._logits_scratch = None
        self.target.release_arena(self.arena)
