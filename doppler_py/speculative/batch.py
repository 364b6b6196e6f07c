"""Concurrent generations batched on the GPU: their steps meet here and share one target forward.

Each generation runs on its own thread with its own `SpeculativeEngine` (its stepper, drafter, policy and KV
cache). When a batch is attached (`SpeculativeEngine.batch`), a step does not run alone: it waits here until
every generation in the batch has its next step ready (or `gather_s` passed since the first arrived, or since the
batch before ended), and the last to arrive runs them all; steps that arrive meanwhile wait for the next batch:

    for each step:  begin (proposal, masks, uploads to its own stepper's buffers)
    ONE forward over every step's rows, stacked: step b's k_b + 1 rows at row0_b, each attending over its
                    own KV cache (`Transformer.record_batch`; Σ(k_b + 1) ≤ the model's logit rows, else more
                    forwards in turn)
    for each step:  its logits rows moved to rows 0.. of target.logits, then its masks, verification and
                    log-probs, as when it runs alone (`Stepper.record_checks`)
    ONE submit; each step's readback and commit (`Stepper.finish`)

A step's tokens are those of its solo run: its rows see only its own cache, each matmul row is computed alone
whatever the other rows hold, and its random numbers come from its own seeded stream. Generations join after
their prefill and leave before their KV cache is freed, so a batch changes between any two steps (continuous
batching).

Only drafters that propose from the host without touching the target's buffers (`Drafter.batches`) take part:
another's GPU drafting or feature reads would use activation rows that other sequences' rows now fill.

Everything else that records GPU work on the shared model (prefills, prefix-cache copies, calibration, new
engines) holds `gpu_lock`, which the running batch holds too.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from doppler_py.errors import InternalError
from doppler_py.gpu.tensor import Tensor
from doppler_py.model.transformer import Transformer
from doppler_py.ops.linear import compile_rows
from doppler_py.speculative.contract import Proposal, StepContext
from doppler_py.speculative.step import PendingStep, StepOutcome, Stepper

# How long the first step of a batch waits for the others: they are normally only a token's host work away
# (detokenising, stop strings), so this only bounds how long a stalled generation holds the others back.
GATHER_S = 0.05


@dataclass(eq=False)
class _Request:
    stepper: Stepper
    ctx: StepContext
    k: int
    proposal: Proposal | None
    taken: bool = False  # a leader took it into a batch
    done: bool = False
    outcome: StepOutcome | None = None
    error: BaseException | None = None
    pending: PendingStep | None = field(default=None, repr=False)


class StepBatch:
    """The meeting point of the concurrent generations of one target model."""

    def __init__(self, target: Transformer, *, gather_s: float = GATHER_S):
        self.target = target
        self.gather_s = gather_s
        self.gpu_lock = threading.RLock()
        self._cond = threading.Condition()
        self._members = 0  # generations between `join` and `leave`
        self._arrived: list[_Request] = []
        self._running = False  # a batch's steps are running
        self._run_ended = 0.0  # when the last one ended (time.monotonic)
        self.sizes: Counter[int] = Counter()  # steps per batch run, over the batch's life (`/metrics`)
        self._logits_scratch: Tensor | None = None  # the batch's logits while each step's rows move into place
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

    def step(self, stepper: Stepper, ctx: StepContext, k: int, proposal: Proposal | None = None) -> StepOutcome:
        """`stepper.step(ctx, k, proposal=proposal)`, run together with the other members' next steps."""
        request = _Request(stepper, ctx, k, proposal)
        with self._cond:
            self._arrived.append(request)
            self._cond.notify_all()
            arrived_at = time.monotonic()
            batch = None
            while not request.taken:
                # One batch at a time: steps that arrive while one runs wait for it, and for its members, which
                # come back together, so the generations keep stepping in one batch rather than in turns.
                if self._running:
                    self._cond.wait()
                    continue
                left = max(arrived_at, self._run_ended) + self.gather_s - time.monotonic()
                if len(self._arrived) >= self._members or left <= 0:
                    batch, self._arrived = self._arrived, []
                    for member in batch:
                        member.taken = True
                    self._running = True
                    break
                self._cond.wait(left)
        if batch is not None:
            try:
                with self.gpu_lock:
                    self._run(batch)
            finally:
                with self._cond:
                    for member in batch:
                        member.done = True
                    self._running = False
                    self._run_ended = time.monotonic()
                    self._cond.notify_all()
        else:
            with self._cond:
                while not request.done:
                    self._cond.wait()
        if request.error is not None:
            raise request.error
        if request.outcome is None:
            raise InternalError("a batched step ended without an outcome")
        return request.outcome

    def _run(self, batch: list[_Request]) -> None:
        """Begin every step, run them in forwards of at most the model's logit rows, finish each."""
        ready = []
        for request in batch:
            try:
                request.pending = request.stepper.begin(request.ctx, request.k, proposal=request.proposal)
                ready.append(request)
            except Exception as exc:  # this generation's error (a drafter's, a grammar's), not the others'
                request.error = exc
        self.sizes[len(ready)] += 1
        limit = self.target.max_logit_rows
        group: list[_Request] = []
        for request in ready:
            if group and sum(r.pending.rows for r in group) + request.pending.rows > limit:
                self._forward(group)
                group = []
            group.append(request)
        if group:
            self._forward(group)

    def _forward(self, group: list[_Request]) -> None:
        target = self.target
        rec = target.registry.recorder()
        segments, row0 = [], 0
        for request in group:
            pending = request.pending
            request.stepper.record_inputs(rec, pending, row0)
            segments.append((pending.ctx.target_cache, pending.pos, pending.rows))
            row0 += pending.rows
        try:
            target.record_batch(rec, segments)
            copy = self._logits_copy() if len(group) > 1 else None
            row_bytes = 4 * target.config.vocab_size
            if copy is not None:
                rec.copy(target.logits, copy, row0 * row_bytes)
            row0 = 0
            for request in group:
                rows = request.pending.rows
                if row0:
                    rec.copy(copy, target.logits, rows * row_bytes, src_offset=row0 * row_bytes)
                request.stepper.record_checks(rec, request.pending)
                row0 += rows
            rec.submit()
        except Exception as exc:
            for request in group:
                request.error = exc
            return
        for request in group:
            try:
                request.outcome = request.stepper.finish(request.pending)
            except Exception as exc:
                request.error = exc

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
