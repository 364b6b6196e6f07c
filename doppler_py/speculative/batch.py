"""The loop that runs generations: one thread owns the GPU and every running sequence, and their steps, and the
prefills of those joining, share target forwards. A lone generation is a batch of one.

Each generation is a coroutine (`SpeculativeEngine._generation`) with its own engine (stepper, drafter, policy, KV
cache): it decides its next turn (a step of k drafts, plain steps, a prefill) and yields it, and is sent it back
done. Its consumer's thread opens it (waits for KV room, restores a cached prefix, compiles the prompt's pipelines)
up to its first turn, hands it to the loop (`run`) and then only reads its tokens from a queue. The loop:

    step():  every running generation resumed with its finished turn until it yields its next one
             plan_forwards(...)   pure: which steps and prefill chunks go into which forward
             for each step:  begin (proposal, masks, uploads to its own stepper's buffers)
             ONE forward over every step's rows, stacked: step b's k_b + 1 rows at row0_b, each attending over its
                 own KV cache (`Transformer.record_batch`; Σ(k_b + 1) ≤ the model's logit rows and `rows_alone`,
                 else more forwards in turn), then the rows of prefill chunks waiting to go (no logits)
             for each step:  its logits rows moved to rows 0.. of target.logits, then its masks, verification and
                 log-probs, as when it runs alone (`Stepper.record_checks`)
             ONE submit; each step's readback and commit (`Stepper.finish`)

A step with nothing else to run has the forward to itself (`Stepper.step`), timed and priced by its engine
(`StepTurn.measure`); while its generation is the only one running, its plain steps run several per submit, so a
server that batches loses nothing to one that does not while a single client uses it. A prompt with nothing beside
it prefills in the chunks of a forward of its own (`Transformer.forward`, only the layers that write K/V when no
drafter reads its rows), and the loop waits for it, so its time is not billed to the first step.

A generation that starts while others step prefills its prompt here too (a `PrefillTurn`), in the chunks of its
solo prefill (so each row meets the same kernels and attention plan): each forward of their steps takes the chunks
it has room for after their rows, so the others keep stepping while it prefills instead of waiting for its whole
prompt, and the forward's matmuls serve both; a chunk that fits no such forward gets one of its own.

A loop made `paged` (a server's, for concurrent clients) gives the generations' KV caches as runs of its arena
(`model/kv_arena.py`), else each its own cache (an engine's own loop): the steps whose caches sit in one slab
attend in one dispatch per layer, each through its own cache's blocks (`ops.attention.BatchedAttention`);
other rows (prefill chunks, caches in another slab) one call each. A step's tokens are those of its solo run: its
rows see only its own cache, attention computes each row as its own call would and each matmul row alone, whatever
the other rows hold, and its random numbers come from its own seeded stream. Generations join after their first
turn and leave once ended, so the set changes between any two steps (continuous batching).

A member's draft length is priced from the batch's own measured forwards (`shared_costs`): its plain step takes
the shared forward's time, and each row it drafts delays every member's step by that row's cost, so it drafts only
where the batch as a whole makes more tokens per second (`policy.draft_length.SharedStepCosts`).

Every drafter takes part. A drafter whose hooks read the rows its last step left in the target's feature buffers
(`Drafter.reads_step_rows`) gets its own sequence's rows back as rows 0.. before they run (`_place`): each forward
keeps every step's rows in its stepper (`Stepper.save_rows`).

Everything else that records GPU work on the shared model (prefix-cache copies, calibration, new engines) does so
inside `gpu()`, which the loop waits for between its steps.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from doppler_py.errors import DopplerError
from doppler_py.gpu.tensor import Tensor
from doppler_py.model.kv_cache import KVCache
from doppler_py.model.transformer import Transformer
from doppler_py.ops.linear import compile_rows
from doppler_py.ops.tree import MAX_TREE_ROWS
from doppler_py.speculative.contract import Proposal, StepContext
from doppler_py.speculative.policy.draft_length import CostModel, SharedStepCosts
from doppler_py.speculative.step import PendingStep, StepOutcome, Stepper

FORWARD_EMA = 0.3  # weight of the newest forward in the running means `shared_costs` prices with


@dataclass(eq=False, kw_only=True)
class Turn:
    """What a generation asks of the loop next; `error`: its work failed (thrown back into the generation)."""

    error: BaseException | None = None

    @property
    def finished(self) -> bool:
        raise NotImplementedError


@dataclass(eq=False, kw_only=True)
class StepTurn(Turn):
    """One step of k drafts (`proposal`: drafts made already, the grammar's), or `plain_steps` plain ones when it
    runs alone. `measure(turn, plain_steps, keep_rows)` runs it with the forward to itself, timed and priced by its
    engine, and returns its new tokens. Done: `outcome`, the `seconds` its turn of the loop took, and `made` where it
    was measured (it ran alone)."""

    stepper: Stepper
    ctx: StepContext
    k: int
    measure: Callable[[StepTurn, int, bool], list[int]]
    proposal: Proposal | None = None
    plain_steps: int = 1
    outcome: StepOutcome | None = None
    seconds: float = 0.0
    made: list[int] | None = None
    pending: PendingStep | None = field(default=None, repr=False)

    @property
    def finished(self) -> bool:
        return self.outcome is not None or self.made is not None or self.error is not None


@dataclass(eq=False, kw_only=True)
class PrefillTurn(Turn):
    """A generation's prompt (but its last token): its K/V written at positions start_pos.., no logits. `layers`:
    the layers its forwards of its own must run (None: all)."""

    cache: KVCache
    start_pos: int
    ids: np.ndarray
    layers: int | None = None
    rows_done: int = 0  # rows whose forward was submitted

    @property
    def rows_left(self) -> int:
        return self.ids.size - self.rows_done

    @property
    def finished(self) -> bool:
        return self.rows_left == 0 or self.error is not None


Generation = Generator[Turn, Turn, None]
_END = object()  # a sequence's last queue item when its generation ended by itself


class _Sequence:
    """A generation in the loop: its coroutine, the turn it waits on, and the queue its consumer reads (token lists,
    then _END or the exception it ended with)."""

    def __init__(self):
        self.tokens: queue.SimpleQueue = queue.SimpleQueue()
        self.generation: Generation | None = None
        self.turn: Turn | None = None
        self.cancelled = False  # its consumer left: close it at the next step
        self.ended = threading.Event()

    def advance(self) -> tuple[Turn | None, object]:
        """(its next turn, None) — the one in hand while unfinished (a prefill with rows left), else its generation
        resumed with the finished one, or with its error thrown in; (None, how it ended) once it ended."""
        turn = self.turn
        if self.cancelled:
            try:
                self.generation.close()  # its cleanup (KV cache freed) runs now, on the loop's thread
            except Exception as exc:
                return None, exc
            return None, _END
        if not turn.finished:
            return turn, None
        try:
            self.turn = self.generation.throw(turn.error) if turn.error is not None else self.generation.send(turn)
        except StopIteration:
            return None, _END
        except Exception as exc:  # its own error: it reaches its consumer, and the others go on
            return None, exc
        return self.turn, None

    def end(self, last: object) -> None:
        self.tokens.put(last)
        self.ended.set()


def plan_forwards(
    steps: Sequence[tuple[int, bool]], prefills: Sequence[int], *, max_rows: int, logit_rows: int, rows_alone: int
) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """Which forwards one turn of the loop runs: per forward, the steps it holds (indices into `steps`, each (rows,
    whether a token tree)) and the prefill chunks after them ((index into `prefills`, whose items are the prompt rows
    left, rows)). Steps go in order, a forward holding at most `logit_rows` and `rows_alone` rows (past that a row's
    result would differ from its solo one) and one token tree (its layout has one home, which its verification
    reads). A prompt goes in the chunks its solo prefill takes (max_rows rows from its start), so each chunk's rows
    meet the same kernels and attention plan as alone: whole chunks beside the steps where they fit. Without steps,
    prefills run whole in forwards of their own; with steps, a prefill that found no room gets one forward of its own,
    and one that did waits for the next turn with its rest."""
    forwards: list[tuple[list[int], list[tuple[int, int]]]] = []
    used: list[int] = []  # rows per forward
    trees: list[bool] = []
    for index, (rows, tree) in enumerate(steps):
        if not forwards or used[-1] + rows > min(logit_rows, rows_alone) or (tree and trees[-1]):
            forwards.append(([], []))
            used.append(0)
            trees.append(False)
        forwards[-1][0].append(index)
        used[-1] += rows
        trees[-1] = trees[-1] or tree
    for index, left in enumerate(prefills):
        taken = 0
        while taken < left:
            n = min(max_rows, left - taken)
            # Only a prompt's last chunk can be short enough to go beside steps, and with steps a chunk of its own
            # ends the prompt's turn: its chunks still run in order.
            room = next((f for f, (held, _) in enumerate(forwards) if held and used[f] + n <= rows_alone), None)
            if room is None and steps and taken:
                break  # the rest rides with the next steps
            if room is not None:
                forwards[room][1].append((index, n))
                used[room] += n
            else:  # no steps, or none with room: a forward of its own
                forwards.append(([], [(index, n)]))
                used.append(n)
                trees.append(False)
            taken += n
            if room is None and steps:
                break  # with steps, one forward of its own per turn: the rest waits for the next
    return forwards


class StepBatch:
    """The loop of the concurrent generations of one target model (module docstring)."""

    def __init__(self, target: Transformer, *, paged: bool = True, kv_limit_bytes: int | None = None):
        self.target = target
        # The members' KV caches (`new_cache(arena=)`); None: each its own.
        self.arena = target.new_arena(kv_limit_bytes) if paged else None
        self.gpu_lock = threading.RLock()  # held by the loop while it steps, and by `gpu()`
        self._cond = threading.Condition()
        self._sequences: list[_Sequence] = []  # running: the loop's own (only its thread changes the list)
        self._arrivals: list[_Sequence] = []  # handed over by their consumers, running from the next step on
        self._gpu_waiters = 0  # threads waiting in `gpu()`: the loop lets them go first
        self._loop_thread: threading.Thread | None = None
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
    def paged(self) -> bool:
        """Whether its generations' caches are runs of one arena: a loop shared by concurrent generations."""
        return self.arena is not None

    @property
    def members(self) -> int:
        """Generations running in the loop."""
        return len(self._sequences)

    def new_cache(self, capacity: int) -> KVCache:
        """A generation's target cache: its own, or in a paged loop a run of the arena, waiting (not holding the GPU)
        while the arena's limit leaves no run that long (`KVArena.wait_for_room`)."""
        arena = self.arena
        if arena is None:
            return self.target.new_cache(capacity)
        while True:
            with self.gpu():  # every take holds it, so room seen here is room taken
                if arena.has_room(capacity):
                    return self.target.new_cache(capacity, arena=arena)
            arena.wait_for_room(capacity)

    @contextlib.contextmanager
    def gpu(self) -> Iterator[None]:
        """GPU work on the shared model from outside the loop (or from a generation's own code inside it): between
        the loop's steps."""
        with self._cond:
            self._gpu_waiters += 1
        try:
            with self.gpu_lock:
                yield
        finally:
            with self._cond:
                self._gpu_waiters -= 1
                self._cond.notify_all()

    # -- the loop ----------------------------------------------------------------------------------------------
    def run(self, make: Callable[[Callable[[list[int]], None]], Generation]) -> Iterator[list[int]]:
        """Run a generation in the loop: `make(emit)` is its coroutine (`SpeculativeEngine._generation`), which
        passes its tokens to `emit`. It is opened here, on the caller's thread, up to its first turn; the loop runs
        every turn after. Yields its tokens as they come, raises what it failed with; closing this iterator early
        cancels it and returns once the loop has closed it (its KV cache freed)."""
        sequence = _Sequence()
        sequence.generation = make(sequence.tokens.put)
        try:
            sequence.turn = next(sequence.generation)
        except StopIteration:
            return
        with self._cond:
            if self._stop.is_set():
                sequence.generation.close()
                raise DopplerError("the engine was closed", advice="load the model again")
            self._arrivals.append(sequence)
            if self._loop_thread is None:
                self._loop_thread = threading.Thread(target=self._loop, name="doppler-loop", daemon=True)
                self._loop_thread.start()
            self._cond.notify_all()
        try:
            while True:
                item = sequence.tokens.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not sequence.ended.is_set():
                sequence.cancelled = True
                with self._cond:
                    self._cond.notify_all()
                sequence.ended.wait()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop.is_set() and (self._gpu_waiters or not (self._sequences or self._arrivals)):
                    self._cond.wait()
                if self._stop.is_set():
                    return
                self._sequences += self._arrivals
                self._arrivals = []
            try:
                with self.gpu_lock:
                    self.step()
            except BaseException as exc:  # a bug in the loop itself: no generation may wait for it forever
                self._end_all(exc)
                raise

    def step(self) -> None:
        """One turn of the loop: every running generation resumed with its finished turn until it asks for its next
        one; those turns run together (`_run`); each step's wall time is the turn's."""
        turns: list[Turn] = []
        for sequence in list(self._sequences):
            turn, ended = sequence.advance()
            if turn is None:
                self._sequences.remove(sequence)
                sequence.end(ended)
            else:
                turns.append(turn)
        if not turns:
            return
        start = time.perf_counter()
        try:
            self._run(turns)
        except Exception as exc:  # outside any one generation's work: every unfinished one fails with it
            for turn in turns:
                if not turn.finished:
                    turn.error = exc
        seconds = time.perf_counter() - start
        for turn in turns:
            if isinstance(turn, StepTurn):
                turn.seconds = seconds

    def shared_costs(self, alone: CostModel) -> SharedStepCosts | None:
        """What a member's next step is priced with (`CostModel.shared`), given the device's costs measured alone:
        None while fewer than two generations step or no forward of steps was timed yet. A plain step takes the
        measured forwards' time less their draft rows, priced as `alone` prices them."""
        members, measured = len(self._sequences), self._forwards_measured
        plain = alone.verify_cost(1)
        if members < 2 or measured is None or plain is None:
            return None
        wall, steps, rows = measured
        drafts_s = steps * (alone.verify_cost(rows / steps) - plain)
        return alone.shared(max(wall - drafts_s, plain), members)

    def _observe_forward(self, steps: int, rows: int, seconds: float) -> None:
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

    def _run(self, turns: list[Turn]) -> None:
        """Begin every step, run the forwards `plan_forwards` plans, finish each step. A step alone runs as without
        the batch (`_alone`)."""
        if len(turns) == 1 and isinstance(turns[0], StepTurn):
            self._alone(turns[0])
            return
        ready = []
        for turn in turns:
            if not isinstance(turn, StepTurn):
                continue
            try:
                self._place(turn.stepper, turn.ctx, turn.ctx.hidden_rows)
                turn.pending = turn.stepper.begin(turn.ctx, turn.k, proposal=turn.proposal)
                ready.append(turn)
            except Exception as exc:  # this generation's error (a drafter's, a grammar's), not the others'
                turn.error = exc
        if ready:
            self.sizes[len(ready)] += 1
        target = self.target
        prefills = [turn for turn in turns if isinstance(turn, PrefillTurn)]
        plan = plan_forwards(
            [(turn.pending.rows, turn.pending.tree) for turn in ready],
            [turn.rows_left for turn in prefills],
            max_rows=target.max_rows,
            logit_rows=target.max_logit_rows,
            rows_alone=target.rows_alone,
        )
        for steps, pieces in plan:
            self._forward([ready[i] for i in steps], [(prefills[i], n) for i, n in pieces])

    def _alone(self, request: StepTurn) -> None:
        """A step with no other work in its turn: `Stepper.step` itself (which the batched forward equals for one
        step), measured by its engine; while the generation is the only one running, its plain steps several per
        submit (one that arrives meanwhile joins after that submit)."""
        plain_steps = request.plain_steps if request.k == 0 and len(self._sequences) == 1 else 1
        stepper = request.stepper
        start = time.perf_counter()
        try:
            self._place(stepper, request.ctx, request.ctx.hidden_rows)
            keep = request.ctx.drafter.reads_step_rows
            request.made = request.measure(request, plain_steps, keep)
        except Exception as exc:
            request.error = exc
            return
        if keep:
            self._in_place = (stepper, self.target.forwards)
        self.sizes[1] += 1
        self._observe_forward(1, request.outcome.drafted + 1, (time.perf_counter() - start) / plain_steps)

    def _forward(self, steps: list[StepTurn], pieces: list[tuple[PrefillTurn, int]]) -> None:
        """One forward: the steps' rows, then each prefill piece's next n rows (no logits)."""
        if not steps:
            self._prefill_alone(pieces)
            return
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
                if request.ctx.drafter.reads_step_rows:
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
                if copy is not None and request.ctx.drafter.reads_verified_logits:  # as its checks left them
                    rec.copy(target.logits, copy, rows * row_bytes, dst_offset=row0 * row_bytes)
            rec.submit()
        except Exception as exc:
            for request in [*steps, *(prefill for prefill, _ in pieces)]:
                request.error = exc
            return
        if steps:
            self.prefill_rows_beside_steps += sum(n for _, n in pieces)
            self._in_place = (steps[0].stepper, target.forwards)
        for request, row0 in zip(steps, firsts, strict=True):
            try:
                self._place(request.stepper, request.ctx, request.pending.rows)
                # Even the last step's: an earlier one's put back before its commit would be in their place.
                if copy is not None and request.ctx.drafter.reads_verified_logits:
                    rows = request.pending.rows
                    rec = target.registry.recorder()
                    rec.copy(copy, target.logits, rows * row_bytes, src_offset=row0 * row_bytes)
                    rec.submit()
                request.outcome = request.stepper.finish(request.pending)
            except Exception as exc:
                request.error = exc
        if steps and not pieces and all(request.error is None for request in steps):
            self._observe_forward(len(steps), logit_rows, time.perf_counter() - start)

    def _prefill_alone(self, pieces: list[tuple[PrefillTurn, int]]) -> None:
        """Prompt rows with no step beside them: as the generation's solo prefill runs them (`Transformer.forward`,
        its `layers`), waited for, so that their time is not billed to the next step (nor skews the plain-step cost
        the draft-length policy prices with)."""
        target = self.target
        try:
            for prefill, n in pieces:
                ids = prefill.ids[prefill.rows_done : prefill.rows_done + n]
                target.forward(
                    ids, prefill.cache, prefill.start_pos + prefill.rows_done, logits="none", num_layers=prefill.layers
                )
                prefill.rows_done += n
            target.gpu.wait_idle()
        except Exception as exc:
            for prefill, _ in pieces:
                prefill.error = exc

    def _place(self, stepper: Stepper, ctx: StepContext, rows: int) -> None:
        """Before a member's drafter hooks run: its kept feature rows (`Stepper.save_rows`) back as rows 0.. of the
        target's feature buffers, unless they are still there (no forward since they were put there)."""
        if not ctx.drafter.reads_step_rows or rows == 0 or self._in_place == (stepper, self.target.forwards):
            return
        rec = self.target.registry.recorder()
        stepper.restore_rows(rec, rows)
        rec.submit()
        self._in_place = (stepper, self.target.forwards)

    def keep_prefill_rows(self, stepper: Stepper, ctx: StepContext) -> None:
        """After a member's prefill in forwards of its own (its drafter reads the rows): its last chunk's final rows
        kept as its step rows (at most a tree's worth: enough for every drafter's hooks, which read the newest)."""
        if not ctx.drafter.reads_step_rows or ctx.hidden_rows == 0:
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

    def stop(self) -> None:
        """Stop the loop (after the step in hand) and the warm-up; generations still running end with an error."""
        with self._cond:
            self._stop.set()
            self._cond.notify_all()
        if self._loop_thread is not None:
            self._loop_thread.join()
            self._loop_thread = None
        self._end_all(DopplerError("the engine was closed during this generation", advice="load the model again"))

    def _end_all(self, error: BaseException) -> None:
        with self._cond:
            sequences, self._sequences, self._arrivals = [*self._sequences, *self._arrivals], [], []
        for sequence in sequences:
            sequence.end(error)

    def close(self) -> None:
        self.stop()
        if self._warmup is not None:
            self._warmup.join()
            self._warmup = None
        if self._logits_scratch is not None:
            self.target.registry.release_tensors(self._logits_scratch)
            self._logits_scratch = None
        if self.arena is not None:
            self.target.release_arena(self.arena)
