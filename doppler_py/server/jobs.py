"""Generations and their admission: a `Job` is one generation, run on a GPU worker thread with its events delivered
to the event loop; `GenerationQueue` admits a request's jobs (all or none; 429 when full) and runs them on the
engine's `parallel` workers; `_JobEvents` hands a request the events of its jobs as they come. An embeddings or
rerank request is a `Call`, admitted and counted beside the jobs (`GenerationQueue.call`: one more running or
waiting, the same 429 when full) and run on a thread of its own, one call at a time in the order admitted (the
engine shares the GPU between a call's forwards and the generations' steps)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from starlette.requests import Request

from doppler_py.api import Engine, GenerationResult
from doppler_py.server.disconnect import _DISCONNECTED, _unless_disconnected
from doppler_py.server.errors import _CLIENT_ERRORS, RequestError, _engine_error
from doppler_py.server.parsing import GenerationRequest

# ("piece", (text, its tokens' logprobs or None)) | ("done", GenerationResult) | ("error", Exception)
Event = tuple[str, Any]


class Job:
    """One generation: run on the GPU worker thread, its events delivered to the event loop's queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop, request: GenerationRequest, after: threading.Event | None):
        self.loop = loop
        self.request = request
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.cancel_requested = threading.Event()
        self.started = False  # set by the worker thread
        self.outcome = "queued"
        self.record: GenerationResult | None = None  # a completed generation's
        self.after = after  # set when this job may start (its request's first choice prefilled the prompt)
        self.prefilled = threading.Event()  # set once its prompt is prefilled (its first piece), or it ended
        # Set before its last event goes out, so a client that sends its next request at once finds the room free.
        self.ended = False

    @property
    def wanted(self) -> bool:
        """Running, or waiting for a client that is still there (an abandoned job is skipped at once)."""
        return not self.ended and (self.started or not self.cancel_requested.is_set())

    def cancel(self) -> None:
        self.cancel_requested.set()

    def _emit(self, event: Event) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is gone: the server is shutting down
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def _emit_last(self, event: Event) -> None:
        self.ended = True
        self._emit(event)

    def run(self, engine: Engine) -> None:
        """Worker thread: generate, stopping early (closing the engine's stream) once cancelled."""
        try:
            if self.after is not None:
                self.after.wait()
            self.started = True
            if self.cancel_requested.is_set():
                self.outcome = "cancelled"
                return
            try:
                self.outcome = self._generate(engine)
            except Exception as exc:  # reported to the client; the worker goes on with the next job
                self.outcome = "refused" if isinstance(exc, _CLIENT_ERRORS) else "failed"
                self._emit_last(("error", exc))
        finally:
            self.prefilled.set()

    def _generate(self, engine: Engine) -> str:
        request = self.request
        with contextlib.closing(engine.stream(request.prompt, options=request.options)) as pieces:
            for piece in pieces:
                if self.cancel_requested.is_set():
                    return "cancelled"
                self._emit(("piece", (piece, engine.piece_logprobs)))
                self.prefilled.set()
        self.record = engine.thread_result
        self._emit_last(("done", self.record))
        return "completed"

    async def result(self) -> GenerationResult:
        while True:
            kind, value = await self.events.get()
            if kind == "done":
                return value
            if kind == "error":
                raise value


class Call:
    """An embeddings or rerank request's blocking engine call, admitted and counted as a generation is
    (`GenerationQueue.call`); `record` stays None (no generation to count)."""

    def __init__(self, run: Callable[[], Any]):
        self._run = run
        self.cancel_requested = threading.Event()
        self.started = False  # set by the call thread
        self.ended = False
        self.outcome = "queued"
        self.record: GenerationResult | None = None

    @property
    def wanted(self) -> bool:
        return not self.ended and (self.started or not self.cancel_requested.is_set())

    def cancel(self) -> None:
        self.cancel_requested.set()

    def run(self) -> Any:
        """Call thread: the engine call's result (None when its client left before it started)."""
        self.started = True
        try:
            if self.cancel_requested.is_set():
                self.outcome = "cancelled"
                return None
            try:
                result = self._run()
            except Exception as exc:
                self.outcome = "refused" if isinstance(exc, _CLIENT_ERRORS) else "failed"
                raise
            self.outcome = "completed"
            return result
        finally:
            self.ended = True


class GenerationQueue:
    """Runs jobs on the engine's `parallel` worker threads (their steps batched by the engine); admits a job while
    fewer than parallel + queue_size others are running or waiting (jobs whose clients left are not counted: the
    workers skip them)."""

    def __init__(self, engine: Engine, queue_size: int):
        if queue_size < 0:
            raise ValueError(f"queue_size must be >= 0, got {queue_size}")
        self.engine = engine
        self.queue_size = queue_size
        self.jobs: set[Job | Call] = set()  # admitted and not finished; touched on the event loop thread only
        self.counts: Counter[str] = Counter()
        self.totals: Counter[str] = Counter()  # over completed generations (`metrics`)
        self.workers = engine.parallel
        self._executor = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="doppler-gpu")
        self._calls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="doppler-calls")

    def submit(self, request: GenerationRequest) -> list[Job]:
        """The jobs of the request's generations (`GenerationRequest.generations`), admitted all or none. Beside other
        generations with a prefix cache, choices after the first start once it has prefilled the prompt."""
        generations = request.generations()
        capacity = self.workers + self.queue_size
        if len(generations) > capacity:
            raise RequestError(
                400,
                f"'n' asks for {len(generations)} generations; this server runs {self.workers} at once and queues "
                f"{self.queue_size}",
                param="n",
            )
        self._admit(len(generations))
        loop = asyncio.get_running_loop()
        jobs: list[Job] = []
        stagger = self.engine.parallel > 1 and self.engine.prefix_cache.budget_bytes > 0
        for generation in generations:
            job = Job(loop, generation, jobs[0].prefilled if jobs and stagger else None)
            jobs.append(job)
            self.jobs.add(job)
            future = loop.run_in_executor(self._executor, job.run, self.engine)
            future.add_done_callback(lambda _, job=job: self._finished(job))
        return jobs

    def _admit(self, count: int) -> None:
        """429 unless `count` more fit beside the jobs and calls running or waiting."""
        if sum(job.wanted for job in self.jobs) + count > self.workers + self.queue_size:
            self.counts["rejected"] += 1
            raise RequestError(
                429,
                f"the server is busy ({self.workers} running, {self.queue_size} waiting); retry later",
                kind="rate_limit_error",
                code="queue_full",
            )

    async def call(self, request: Request, run: Callable[[], Any]) -> Any:
        """`run` (a blocking engine call: embeddings, rerank) admitted as one more job (429 when full) and run on the
        call thread: its result, or _DISCONNECTED when the client went away first (a call not yet started then never
        runs: it is skipped); the engine's errors raised as the request's (`_engine_error`)."""
        self._admit(1)
        call = Call(run)
        self.jobs.add(call)
        future = asyncio.get_running_loop().run_in_executor(self._calls, call.run)
        future.add_done_callback(lambda _: self._finished(call))
        try:
            # Shielded: a client that leaves does not cancel the future, so the call stays counted until its thread
            # is done with it (a call that has not started then returns at once, cancelled).
            result = await _unless_disconnected(request, asyncio.shield(future))
        except Exception as exc:
            raise _engine_error(exc) from None
        if result is _DISCONNECTED:
            call.cancel()
        return result

    def _finished(self, job: Job | Call) -> None:
        self.jobs.discard(job)
        self.counts[job.outcome] += 1
        if job.record is not None:
            result = job.record
            self.totals.update(
                prompt_tokens=result.prompt_tokens,
                cached_prompt_tokens=result.cached_tokens,
                completion_tokens=len(result.tokens),
                drafted_tokens=result.drafted,
                accepted_tokens=result.accepted,
                forced_tokens=result.stats.get("forced_tokens", 0),
            )

    def status(self) -> dict[str, int]:
        return {
            "running": sum(job.started for job in self.jobs),
            "waiting": sum(not job.started and job.wanted for job in self.jobs),
            "parallel": self.workers,
            "queue_size": self.queue_size,
            **{name: self.counts[name] for name in ("completed", "cancelled", "refused", "failed", "rejected")},
        }

    def shutdown(self) -> None:
        for job in list(self.jobs):
            job.cancel()
        self._executor.shutdown(wait=True, cancel_futures=False)
        self._calls.shutdown(wait=True, cancel_futures=False)


class _JobEvents:
    """The events of a request's jobs as they come, each as (its job's index, event); `open`: jobs not ended."""

    def __init__(self, jobs: list[Job]):
        self.open = len(jobs)
        self._queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        self._tasks = [asyncio.ensure_future(self._forward(i, job)) for i, job in enumerate(jobs)]

    async def _forward(self, i: int, job: Job) -> None:
        while True:
            event = await job.events.get()
            self._queue.put_nowait((i, event))
            if event[0] != "piece":
                return

    async def get(self) -> tuple[int, Event]:
        i, event = await self._queue.get()
        if event[0] != "piece":
            self.open -= 1
        return i, event

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()


def _cancel(jobs: list[Job]) -> None:
    for job in jobs:
        job.cancel()
