"""Generation with speculative decoding: the step (`step.py`: propose → verify → commit) in a loop, wrapped by
what measures and decides around it. Each step is timed (`timing.StepClock`), recorded (`stats.SpecStats`) and
priced: its time says what verifying its rows and drafting cost on this device, which the draft-length policy
(`policy/`) weighs against the drafter's acceptance to choose the next step's k, or a pause of plain steps.
Plain steps are batched several per submit, sized by their measured cost. Before a generation can speculate at
full width, the verification pipelines are compiled and their costs measured (`prepare`, `readiness/`).

Every generation runs in a loop (`batch.py`): a coroutine that yields its turns (a prefill, a step), which the loop
runs, alone or in forwards shared with the loop's other generations. An engine made without one has a loop of its
own, whose caches are plain (not paged): a lone generation is a batch of one.
"""

from __future__ import annotations

import contextlib
import functools
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from doppler_py.errors import CapacityError, DopplerError, GenerationOptionError, InternalError
from doppler_py.gpu.tensor import Tensor
from doppler_py.model.transformer import Transformer
from doppler_py.ops.linear import Linear
from doppler_py.ops.logprobs import TokenLogprob, check_top_logprobs
from doppler_py.ops.speculative import MAX_DRAFT_TOKENS
from doppler_py.rng import Mulberry32
from doppler_py.sampling import SamplingParams
from doppler_py.speculative.batch import Generation, PrefillTurn, StepBatch, StepTurn
from doppler_py.speculative.contract import NO_PROPOSAL, Drafter, PlainDecoding, Proposal, StepContext
from doppler_py.speculative.kv_budget import KVBudget
from doppler_py.speculative.policy.draft_length import DraftLengthPolicy, worth_drafting
from doppler_py.speculative.readiness.compile_gate import FIRST_STAGE_ROWS
from doppler_py.speculative.readiness.state import QUICK_CONTEXT, Readiness
from doppler_py.speculative.readiness.warmup import PipelineWarmup
from doppler_py.speculative.stats import SpecStats
from doppler_py.speculative.step import MAX_PLAIN_STEPS, StepOutcome, Stepper
from doppler_py.speculative.timing import StepClock, StepTimes

if TYPE_CHECKING:
    from doppler_py.constraints.matcher import GrammarMatcher
    from doppler_py.model.prefix_cache import PrefixCache

# Plain decoding: steps per submit (at most MAX_PLAIN_STEPS) sized to take about BATCH_TARGET_S.
BATCH_TARGET_S = 0.2


@dataclass
class SpecResult:
    tokens: list[int]
    stats: SpecStats
    stopped_by: str


class SpeculativeEngine:
    """Generation for `target`, speculative with `drafter` (None: plain decoding through the same step).

    `capacity` bounds the drafts of one step (the verification buffers are allocated once for it); the draft
    length within it is the policy's, or a user's pinned `k` per generation.
    """

    def __init__(
        self,
        target: Transformer,
        drafter: Drafter | None,
        *,
        capacity: int = MAX_DRAFT_TOKENS,
        batch: StepBatch | None = None,
    ):
        self.target = target
        self.speculative = drafter is not None
        self.registry = target.registry
        self.capacity = min(capacity, MAX_DRAFT_TOKENS, target.max_logit_rows - 1)
        if self.capacity < 1:
            raise GenerationOptionError(f"a speculative engine needs room for one draft, got capacity {capacity}")
        self.policy = DraftLengthPolicy(capacity=self.capacity)
        # What the drafter declares (contract.Drafter): a fixed step shape (policy: fixed mode), chains ended by
        # its own confidence (policy: k is only the ceiling), the target layers it reads.
        drafter = drafter if drafter is not None else PlainDecoding()
        self.drafter = drafter
        self.fixed_nodes: int | None = drafter.fixed_nodes
        self.policy.gated = drafter.gates_chains
        target.tap_layers(drafter.feature_taps)
        if self.fixed_nodes is not None:
            self.policy.reset(fixed=self.fixed_nodes)
        self.steps = Stepper(target, self.policy, self.capacity)
        self.clock = StepClock(target.gpu)
        self._plain_token_s: float | None = None  # measured seconds per plain token, for the batch size
        # Getting ready to speculate (see `prepare`): the compile, its gate and the calibration.
        self.readiness = Readiness(self)
        # Earlier sequences' K/V (`model.prefix_cache`), shared by every engine of the model; None: none kept.
        self.prefix_cache: PrefixCache | None = None
        # The loop that runs this engine's generations (`batch.py`): shared with the target's other engines, whose
        # generations then share forwards, or one of its own.
        self.batch = batch or StepBatch(target, paged=False)
        self._own_batch = not batch  # none given: the loop is this engine's own, closed with it
        # The KV memory concurrent generations share (`kv_budget.py`), shared by every engine of the model; None:
        # no limit of our own.
        self.kv_budget: KVBudget | None = None
        self.closed = False

    # -- getting ready ------------------------------------------------------------------------------------
    def prepare(
        self,
        *,
        costs: dict[int, float] | None = None,
        background: bool = False,
        compile_now: bool = True,
        weigh: bool = False,
    ) -> None:
        """Make the engine ready to speculate (`readiness.state`). `costs`: verification costs measured earlier on
        this device and model (`cost_cache`), so no calibration is needed. `background`: take plain steps while a
        background thread compiles the verification pipelines (`PipelineWarmup`, started once the next
        generation's first token is out), and speculate with drafts as long as the compiled row counts allow
        meanwhile; else calibrate now, which compiles them all first. `compile_now=False` (with costs): the
        pipelines compile elsewhere (a batch's warm-up, `StepBatch.warm_up`) or on first use, so no step runs now.
        `weigh` (with `background`): start the compile only once it pays for itself (`readiness.compile_gate`)."""
        for rows, seconds in (costs or {}).items():
            self.policy.costs.observe_verify(rows, seconds)
        self.readiness.prepare(costs=bool(costs), background=background, compile_now=compile_now, weigh=weigh)

    # -- what `Readiness` asks of the engine (`readiness.state.Calibrator`) ---------------------------------
    def verify_rows(self) -> list[int]:
        """Every row count a step may verify: 1 (a plain step) to k_max + 1."""
        return [r for r in range(1, self.policy.k_max + 2) if r <= self.capacity + 1]

    def limit_drafts(self, rows: int | None) -> None:
        self.policy.limit = rows

    def compile_drafter(self) -> None:
        self.drafter.compile()

    def compile_stages(self) -> list[list[int]]:
        """The row counts a weighed compile makes usable, stage by stage (`readiness.compile_gate`): on a CPU
        adapter those of one-draft steps first (FIRST_STAGE_ROWS), then the rest; elsewhere all at once."""
        rows = self.verify_rows()
        first = [r for r in rows if r <= FIRST_STAGE_ROWS]
        return [first, rows] if self.target.gpu.on_cpu and len(first) < len(rows) else [rows]

    def drafter_matmuls(self) -> Sequence[Linear]:
        return self.drafter.matmuls()

    def start_warmup(self, rows: list[int]) -> PipelineWarmup:
        """Compile `rows` (and the drafter's pipelines for steps of that many rows; for the last stage, all of
        them) in a background thread."""
        last = max(rows) >= max(self.verify_rows())
        return PipelineWarmup(
            self.target,
            lambda shadow: SpeculativeEngine(shadow, None, capacity=self.capacity),
            rows,
            also=functools.partial(self.drafter.compile, None if last else max(rows)),
        )

    def measured_costs(self) -> dict[int, float]:
        return dict(self.policy.costs.verify)

    def best_speedup(self) -> float | None:
        return self.policy.best_speedup()

    def calibrate_between_steps(self, rows: list[int], *, quick: bool) -> None:
        """Calibration runs the target on its own KV cache but through the target's activation buffers, where
        drafters read the last verified rows' features (ctx.hidden): those are kept."""
        target = self.target
        saved = Tensor.empty(target.gpu, target.x.shape, "f32", "x during calibration")
        rec = self.registry.recorder()
        rec.copy(target.x, saved)
        rec.submit()
        try:
            self.calibrate(rows, context=QUICK_CONTEXT, repeats=1 if quick else 2)
        finally:
            rec = self.registry.recorder()
            rec.copy(saved, target.x)
            rec.submit()
            self.registry.release_tensors(saved)

    # -- generation and bookkeeping -----------------------------------------------------------------------
    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        params: SamplingParams,
        *,
        k: int | None = None,
        stop_ids: Sequence[int] = (),
        grammar: GrammarMatcher | None = None,
        adapter: str | None = None,
    ) -> SpecResult:
        """Generate up to `max_new_tokens` tokens after `prompt_ids` (stopping after any of `stop_ids`).

        `k` pins the draft length; None lets the policy choose it. `grammar`, `adapter`: see `iter_generate`.
        """
        stats = SpecStats()
        tokens: list[int] = []
        steps = self.iter_generate(
            prompt_ids, max_new_tokens, params, stats=stats, k=k, stop_ids=stop_ids, grammar=grammar, adapter=adapter
        )
        for new in steps:
            tokens.extend(new)
        return SpecResult(tokens, stats, stats.stopped_by)

    def iter_generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        params: SamplingParams,
        *,
        stats: SpecStats,
        k: int | None = None,
        stop_ids: Sequence[int] = (),
        logprobs: int | None = None,
        logprob_entries: list[TokenLogprob] | None = None,
        grammar: GrammarMatcher | None = None,
        adapter: str | None = None,
    ) -> Iterator[list[int]]:
        """Yield each step's new tokens as soon as they are verified; `stats` is filled in as it goes.

        logprobs: top alternatives per token (0..20; None: off); each step's log-probs are appended to
        `logprob_entries` (one per token, `doppler_py.ops.logprobs`) before its tokens are yielded: beside other
        generations the batch's loop may run this one's next steps before the caller reads them. Closing the
        generator early (a cancelled stream) releases the step's KV caches. grammar: the constraint the output
        follows (every step's rows masked by it, its forced tokens drafted; `step.py`), at no committed token yet.
        adapter: the LoRA adapter (a name in `target.adapters`) the target runs with for this generation; None: none.
        """
        check_top_logprobs(logprobs)
        entries = logprob_entries if logprobs is not None else None

        def generation(emit: Callable[[list[int]], None]) -> Generation:
            return self._generation(
                prompt_ids, max_new_tokens, params, stats, k, stop_ids, logprobs, grammar, emit, entries, adapter
            )

        yield from self.batch.run(generation)

    def _generation(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        params: SamplingParams,
        stats: SpecStats,
        k: int | None,
        stop_ids: Sequence[int],
        logprobs: int | None,
        grammar: GrammarMatcher | None,
        emit: Callable[[list[int]], None],
        logprob_entries: list[TokenLogprob] | None,
        adapter: str | None = None,
    ) -> Generation:
        """One generation as a coroutine: it opens (`_open`), then asks for one turn at a time (its prefill, a
        step), yielding it and taken back done, and passes each step's new tokens to `emit`; it ends at
        max_new_tokens or a stop id, closing its context either way (completed, failed or cancelled). The loop
        (`StepBatch.run`) runs the turns."""
        start = time.perf_counter()
        stats.drafter = self.drafter.name
        drafts = self.readiness.before_generation(max_new_tokens, params, stats, self._plain_token_s)
        # Where the compile does not pay yet, plainly: no upkeep, no pipelines of its own.
        drafter = self.drafter if drafts else PlainDecoding()
        ctx = self._open(prompt_ids, max_new_tokens, params, k=k, grammar=grammar, drafter=drafter, adapter=adapter)
        ctx.logprobs = logprobs
        produced = 0
        try:
            yield from self._prefill(ctx)
            stats.prefill_s = time.perf_counter() - start
            stats.cached_tokens = ctx.cached
            # Plain steps several per submit; not under a grammar (each step's mask comes from the tokens before it,
            # on the host) nor with log-probs (read per step). Beside others only while the generation steps alone
            # (`StepBatch._alone`).
            multi_step = grammar is None and logprobs is None
            while produced < max_new_tokens:
                remaining = max_new_tokens - produced
                proposal, speculate = None, True
                if self.speculative:
                    if ctx.drafter is self.drafter:
                        # Drafting within the row counts compiled so far: the next stage weighed (`compile_stages`).
                        self.readiness.weigh_during(remaining, stats, self._plain_token_s)
                        speculate = self.readiness.may_speculate(produced == 0, seeded=not self.policy.cost_aware)
                    else:  # began plainly: the compile not worth it at the start
                        speculate = self._join_when_ready(ctx, remaining, produced, stats)
                    self.policy.shared = self.batch.shared_costs(self.policy.costs)
                    k_step = self.policy.next_k(remaining) if speculate else 0
                    spelled, forced = grammar.forced_run() if speculate and grammar is not None else ([], 0)
                    if spelled:
                        proposal = self._forced_proposal(ctx, spelled, forced, k_step, remaining)
                        k_step = proposal.count
                    if not multi_step or k_step:
                        plain_steps = 1
                    elif speculate:
                        plain_steps = self._paused_batch(remaining)
                    else:  # not ready (compiling, or not worth compiling for this answer): plain decoding's batches
                        plain_steps = self._batch_size(remaining, first=produced == 0)
                else:
                    k_step = 0
                    plain_steps = self._batch_size(remaining, first=produced == 0) if multi_step else 1
                self._check_open()
                turn = StepTurn(
                    stepper=self.steps,
                    ctx=ctx,
                    k=k_step,
                    proposal=proposal,
                    plain_steps=plain_steps,
                    measure=functools.partial(self._measured_step, stats=stats),
                )
                yield turn
                made = turn.made if turn.made is not None else self._shared_result(turn, stats)
                if self.speculative and speculate and not k_step:  # next_k took the pause's first step
                    self.policy.pause_steps -= len(made) - 1
                new = made[:remaining]
                for j, token in enumerate(new):
                    if token in stop_ids:
                        new, stats.stopped_by = new[: j + 1], "eos"
                        break
                produced += len(new)
                stats.warmup_steps += len(new) if not speculate else 0
                stats.generated = produced
                stats.total_s = time.perf_counter() - start
                if logprob_entries is not None:
                    logprob_entries.extend(turn.outcome.logprobs[: len(new)])
                emit(new)
                if stats.stopped_by == "eos":
                    break
        finally:
            stats.total_s = time.perf_counter() - start
            self.readiness.tokens_generated += produced
            self.policy.shared = None
            self.close_context(ctx)

    def _join_when_ready(self, ctx: StepContext, remaining: int, produced: int, stats: SpecStats) -> bool:
        """Before a step of a generation that began plainly: the compile gate weighed again with this answer's plain
        tokens timed (`Readiness.weigh_during`); once speculation may start (the first row counts compiled), the
        drafter takes over the answer (`Drafter.join`, from the last step's rows), only while the generation runs
        alone in its loop: beside others the target's rows are not kept for a drafter that never ran."""
        readiness = self.readiness
        if not readiness.weigh_during(remaining, stats, self._plain_token_s):
            return False
        if not readiness.may_speculate(produced == 0, seeded=False) or self.batch.members > 1:
            return False
        with self._gpu_lock():
            joined = self.drafter.join(ctx)
        if joined:
            ctx.drafter = self.drafter
            stats.joined_at = produced
        return joined

    def _prefill(self, ctx: StepContext) -> Generation:
        """The prompt but its last token: for a drafter that reads none of the target's rows, as a turn of the loop
        (beside other generations its chunks ride along with their steps; alone, forwards of its own); for one that
        reads them, in forwards of its own between the loop's steps, its last chunk's rows kept from the others'.
        In a loop shared by concurrent generations, kept in the prefix cache at once, not only at the end, so a
        request sharing the prompt while this one still runs (a common system prompt, a request's other choices)
        prefills only its own tail; an engine's own loop runs one generation at a time, so its end stores it once."""
        tokens, cache, batch = ctx.tokens, ctx.target_cache, self.batch
        if ctx.cached >= len(tokens) - 1:
            return
        if ctx.drafter.reads_step_rows:
            with self._gpu_lock():
                self._prefill_chunks(ctx)
                batch.keep_prefill_rows(self.steps, ctx)
        else:
            layers = None if ctx.drafter.reads_prompt_features else self.target.prefill_layers
            ids = self.target.check_ids(tokens[ctx.cached : -1])
            yield PrefillTurn(cache=cache, start_pos=ctx.cached, ids=ids, layers=layers)
            ctx.hidden_rows = len(tokens) - 1 - ctx.cached
            ctx.drafter.prefilled(ctx, ctx.cached)
        if self.prefix_cache is not None and self.batch.paged:
            with self._gpu_lock():
                self.prefix_cache.store(tokens[:-1], cache)

    def _prefill_chunks(self, ctx: StepContext) -> None:
        """The prompt but its last token in forwards of the generation's own, chunk by chunk, each chunk's rows handed
        to the drafter (`Drafter.prefilled`); without a drafter reading the prompt's features, only the layers that
        write K/V run."""
        target, tokens = self.target, ctx.tokens
        layers = None if ctx.drafter.reads_prompt_features else target.prefill_layers
        for begin in range(ctx.cached, len(tokens) - 1, target.max_rows):
            chunk = tokens[begin : min(begin + target.max_rows, len(tokens) - 1)]
            target.forward(chunk, ctx.target_cache, begin, logits="none", num_layers=layers)
            ctx.hidden_rows = len(chunk)
            ctx.drafter.prefilled(ctx, begin)

    def _forced_proposal(self, ctx: StepContext, spelled: list[int], forced: int, k: int, remaining: int) -> Proposal:
        """The grammar's own drafts: the forced bytes `spelled` (`GrammarMatcher.forced_spelling`), whose first
        `forced` tokens are always accepted and the rest nearly always, so as many as pay, pause or not
        (`policy.forced_k`); after the whole spelling, the drafter's continuation of it where it drafts from
        tokens alone (`continue_tokens`), within the k the policy gave the drafter, and after that continuation
        the grammar's next spelling (a JSON value copied from the prompt, then the next key), and so on while room
        is left."""
        n = self.policy.forced_k(min(len(spelled), remaining - 1))
        tokens = spelled[:n]
        room = min(k, self.capacity - n, remaining - 1 - n)
        while n == len(spelled) and room > 0:
            more = ctx.drafter.continue_tokens([*ctx.tokens, *tokens], room)[:room]
            valid, then_spelled = ctx.grammar.walk([*tokens, *more])
            more = more[: max(0, valid - len(tokens))]  # up to the first draft the grammar refuses
            if not more:
                break
            then_spelled = then_spelled[: room - len(more)]
            tokens += more + then_spelled
            room -= len(more) + len(then_spelled)
            if not then_spelled:
                break
        if not tokens:
            return NO_PROPOSAL
        return Proposal(len(tokens), tokens, forced=min(n, forced), spelled=n - min(n, forced))

    def open_context(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        params: SamplingParams,
        *,
        k: int | None = None,
        grammar: GrammarMatcher | None = None,
    ) -> StepContext:
        """A generation's start for steps taken by hand (`steps.step`, as the router's `generate_draft` does):
        `_open`, then the prefill of every prompt token but the last (the first step feeds it), after the longest
        prefix the prefix cache holds (`ctx.cached`); `close_context` ends it."""
        ctx = self._open(prompt_ids, max_new_tokens, params, k=k, grammar=grammar, drafter=self.drafter)
        try:
            with self._gpu_lock():
                self._prefill_chunks(ctx)
        except BaseException:
            self.close_context(ctx)
            raise
        self.target.gpu.wait_idle()
        return ctx

    def _open(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        params: SamplingParams,
        *,
        k: int | None,
        grammar: GrammarMatcher | None,
        drafter: Drafter,
        adapter: str | None = None,
    ) -> StepContext:
        """A generation's start: the checks, the policy reset (`k` pins the draft length), a KV cache, the prefix
        cache's longest hit restored (`ctx.cached`), `drafter` (the engine's, or `PlainDecoding`) started and the
        prompt's pipelines compiled; its prefill follows. Under a KV budget it first waits until the cache fits
        beside the running generations'."""
        tokens = self.target.check_ids(prompt_ids).tolist()
        check_fits(len(tokens), max_new_tokens, self.target.max_positions)
        self.target.adapters.check(adapter)
        reserved = 0
        if self.kv_budget is not None:
            reserved = self.target.cache_bytes(self._capacity(len(tokens), max_new_tokens))
            self.kv_budget.reserve(reserved)
        try:
            return self._open_context(tokens, max_new_tokens, params, k, grammar, drafter, adapter)
        except BaseException:
            if self.kv_budget is not None:
                self.kv_budget.release(reserved)
            raise

    def _capacity(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """Positions a generation's caches hold: the prompt, the answer, and room for the last step's drafts."""
        return prompt_tokens + max_new_tokens + self.capacity + 1

    def _open_context(
        self,
        tokens: list[int],
        max_new_tokens: int,
        params: SamplingParams,
        k: int | None,
        grammar: GrammarMatcher | None,
        drafter: Drafter,
        adapter: str | None,
    ) -> StepContext:
        target = self.target
        self.policy.reset(k, cost_aware=params.greedy or params.seed is None, fixed=self.fixed_nodes)
        capacity = self._capacity(len(tokens), max_new_tokens)
        cache = self.batch.new_cache(capacity)
        cache.adapter = adapter  # every forward of this sequence's rows runs with it (`Transformer.adapters`)
        # An unseeded sampled generation draws from a stream of its own, so two answers to one prompt differ.
        seed = params.seed if params.seed is not None else secrets.randbits(32)
        ctx = StepContext(tokens, target, cache, params, Mulberry32(seed), capacity, grammar=grammar, drafter=drafter)
        if self.policy.adaptive and self.policy.cost_aware:
            ctx.worth_drafting = lambda values: worth_drafting(values, self.policy.costs)
        try:
            with self._gpu_lock():
                # A seeded sampled generation's tokens follow its drafts' draws: the same with a hit or without.
                seeded = not self.policy.cost_aware
                if self.prefix_cache is not None and not (seeded and ctx.drafter.reads_prompt_features):
                    entry, ctx.cached = self.prefix_cache.lookup(tokens, adapter)
                    if entry is not None:
                        self.prefix_cache.restore(entry, ctx.cached, cache)
                ctx.drafter.start(ctx)
            # The prompt but its last token (which step 1 feeds) is the generation's first turn (`_prefill`).
            target.compile_generation(len(tokens) - 1 - ctx.cached)
        except BaseException:
            self.close_context(ctx)
            raise
        return ctx

    def close_context(self, ctx: StepContext) -> None:
        """A generation's end (completed, failed or cancelled): its committed tokens' K/V kept in the prefix
        cache, the drafter's state and the KV cache freed."""
        with self._gpu_lock():
            ctx.drafter.finish()
            ctx.close()
            cache = ctx.target_cache
            # Not after a step cut short, nor once the engine (and so the model's buffers) was closed.
            if self.prefix_cache is not None and cache.length == len(ctx.tokens) - 1 and not self.closed:
                self.prefix_cache.store(ctx.tokens[: cache.length], cache)
            self.target.release_cache(cache)
        if self.kv_budget is not None:
            self.kv_budget.release(self.target.cache_bytes(ctx.capacity))

    def _gpu_lock(self) -> contextlib.AbstractContextManager:
        """Held while recording GPU work outside the loop's steps (`StepBatch.gpu`)."""
        return self.batch.gpu()

    def _batch_size(self, remaining: int, first: bool) -> int:
        """Plain steps for the next submit: one for a generation's first token (it shows at once), then as many
        as take about BATCH_TARGET_S by the measured cost per token, so the stream still moves several times a
        second."""
        if first or self._plain_token_s is None:
            return 1
        most = min(remaining, MAX_PLAIN_STEPS, self.target.max_rows)  # target.x keeps every step's row
        return max(1, min(most, int(BATCH_TARGET_S / self._plain_token_s)))

    def _paused_batch(self, remaining: int) -> int:
        """Plain steps for one submit while the policy pauses speculation: the pause's remaining steps, as many
        as `_batch_size` allows (the first of them already taken from the pause by `next_k`; the caller takes the
        others that ran: a batch may run fewer)."""
        return min(1 + self.policy.pause_steps, self._batch_size(remaining, first=False))

    def _observe_plain(self, seconds: float) -> None:
        """A plain token's measured cost, for sizing plain batches."""
        self._plain_token_s = seconds if self._plain_token_s is None else 0.7 * self._plain_token_s + 0.3 * seconds

    def _measured_step(self, turn: StepTurn, plain_steps: int, keep_rows: bool, *, stats: SpecStats) -> list[int]:
        """A step the loop runs with the forward to itself (`StepTurn.measure`; or `plain_steps` plain steps in one
        submit), with its timing, statistics, pricing, policy update and the KV-cache invariant check around it.
        `keep_rows`: see `Stepper.step`."""
        self._check_open()  # a stream still iterated after its engine was closed
        ctx, k = turn.ctx, turn.k
        pipelines = self.registry.cache_sizes["pipelines"]
        self.clock.start(self.registry.recorder(), drafting=k > 0)
        outcome = self.steps.step(
            ctx, k, plain_steps=plain_steps, proposal=turn.proposal, marks=self.clock, keep_rows=keep_rows
        )
        turn.outcome = outcome
        times = self.clock.stop()
        if plain_steps > 1:
            return self._plain_run(ctx, outcome, stats, times.total_s)
        stats.tree_steps += outcome.tree
        # A step that compiled a pipeline (its own, or one a background warmup finished meanwhile on the same
        # CPU) timed the compiler, not the device, and would leave the policy pausing speculation while that
        # estimate decayed.
        if self.registry.cache_sizes["pipelines"] == pipelines:
            self._price(outcome, times)
        return self._account(ctx, outcome, stats, times)

    def _plain_run(self, ctx: StepContext, outcome: StepOutcome, stats: SpecStats, seconds: float) -> list[int]:
        """Plain steps that ran in one submit: each token's share of the time, which sizes the next such run."""
        per_token = seconds / len(outcome.new)
        for _ in outcome.new:
            stats.record(0, 0, StepTimes(0.0, per_token, None, None))
        self._observe_plain(per_token)
        self._check_cache(ctx)
        return outcome.new

    def _shared_result(self, turn: StepTurn, stats: SpecStats) -> list[int]:
        """A step the loop ran together with other generations'. Its wall time is the forward's, which says nothing
        of what this step's rows cost alone, so it is not priced: the policy keeps the costs measured alone, and
        prices its steps from them and the loop's measured forwards (`StepBatch.shared_costs`, set before each
        step's k is chosen)."""
        return self._account(turn.ctx, turn.outcome, stats, StepTimes(0.0, turn.seconds, None, None))

    def _account(self, ctx: StepContext, outcome: StepOutcome, stats: SpecStats, times: StepTimes) -> list[int]:
        """A step's statistics, the drafter's acceptance for the policy, and the KV-cache invariant check."""
        stats.record(outcome.drafted, outcome.accepted, times, outcome.made)
        stats.forced_tokens += min(outcome.accepted, outcome.forced)
        # The grammar's drafts say nothing of the drafter's, nor do drafts of its that were never reached.
        grammar = outcome.forced + outcome.spelled
        if outcome.drafted > grammar and outcome.accepted >= grammar:
            self.policy.observe(outcome.drafted - grammar, outcome.accepted - grammar)
        self._check_cache(ctx)
        return outcome.new

    def _price(self, outcome: StepOutcome, times: StepTimes) -> None:
        """What a step's time says of the device's costs: of verifying its rows, of drafting, and the throughput
        the steps make (the bar a node must clear)."""
        costs = self.policy.costs
        costs.observe_throughput(len(outcome.new), times.total_s)
        if outcome.drafted == 0 and outcome.made:  # drafted on the GPU, then cut to a plain step
            drafting = times.gpu_draft_s if times.gpu_draft_s is not None else times.draft_s
            costs.observe_draft(outcome.made, drafting)
            costs.observe_verify(1, times.total_s - drafting)
            self._observe_plain(times.total_s - drafting)
        elif outcome.drafted == 0:
            costs.observe_verify(1, times.total_s)
            self._observe_plain(times.total_s)
        elif not outcome.on_gpu:  # a host drafter: the GPU did nothing but verify
            costs.observe_verify(outcome.drafted + 1, times.verify_s)
            costs.observe_step(outcome.drafted, times.total_s)
        elif times.gpu_draft_s is not None:
            # GPU stamps split the step: its drafting, and the rest, which is what a step verifying these rows
            # costs now (at this context, with this drafter's upkeep); else the costs of 2+ rows stay those of
            # the calibration, below what live steps take, and the policy drafts more than pays. Drafts the
            # engine cut were drafted all the same.
            costs.observe_verify(outcome.drafted + 1, times.total_s - times.gpu_draft_s)
            costs.observe_draft(outcome.made, times.gpu_draft_s)
        else:
            costs.observe_step(outcome.drafted, times.total_s)

    def _check_open(self) -> None:
        if self.closed:  # a stream still iterated after its engine was closed: its buffers are gone
            raise DopplerError("the engine was closed during this generation", advice="load the model again")

    @staticmethod
    def _check_cache(ctx: StepContext) -> None:
        # Every rollback path must leave the cache holding exactly the committed tokens before the last one
        # (which the next step feeds); anything else would attend to stale or missing positions silently.
        committed, cached = len(ctx.tokens), ctx.target_cache.length
        if cached != committed - 1:
            raise InternalError(
                f"the target KV cache holds {cached} positions after a step, but {committed} tokens are committed "
                f"(expected {committed - 1})"
            )

    def calibrate(
        self, rows: Sequence[int] | None = None, context: int = 64, repeats: int = 2, *, store: bool = True
    ) -> None:
        """Measure plain and verification steps of each row count (forward + verify + readback) at a typical
        context, so the adaptive policy knows cost(T=k+1)/cost(T=1) of THIS device from the start; live steps
        keep refining it. `store=False` only runs the steps (compiling their pipelines), keeping the costs."""
        target = self.target
        # Every verification size the policy may use (this also compiles their pipelines up front).
        rows = [r for r in (rows or self.verify_rows()) if r <= self.capacity + 1]
        for linear in target.linears():  # each matmul's own row tile: a step of more than 2 rows would otherwise
            for n in rows:  # run the small tiles a CPU adapter falls back on until it is compiled (`row_tile`)
                if n <= linear.max_rows:
                    linear.compile(n)
        context = min(context, target.max_positions - max(rows) - 1)
        cache = target.new_cache(context + max(rows) + 1)
        tokens = [0] * (context + 1)
        ctx = StepContext(tokens, target, cache, SamplingParams(), Mulberry32(0), cache.max_seq, drafter=_Replay())
        steps = self.steps
        try:
            target.forward(tokens[:-1], cache, 0, logits="none")
            target.gpu.wait_idle()  # else the first row count's first step would wait for this prefill too
            for n in rows:
                best = float("inf")
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    steps.step(ctx, n - 1)
                    best = min(best, time.perf_counter() - t0)
                    del tokens[context + 1 :]
                    cache.truncate(context)
                if store:
                    self.policy.costs.verify[n] = best  # a deliberate measurement replaces what steps estimated
        finally:
            target.release_cache(cache)

    def close(self) -> None:
        """Free the step buffers and ops (the target and a draft model belong to the caller)."""
        if self.closed:
            return
        if self._own_batch:
            self.batch.close()
        self.readiness.close()
        self.drafter.close()
        self.steps.close()
        self.clock.close()
        self.closed = True


class _Replay(PlainDecoding):
    """Calibration's drafter: proposes k zeros from the host, so a step verifies exactly k + 1 rows."""

    name = "calibration"

    def propose(self, ctx: StepContext, k: int) -> Proposal:
        return Proposal(k, [0] * k)


def check_max_tokens(max_new_tokens: int) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise GenerationOptionError(f"max_tokens must be a positive integer, got {max_new_tokens!r}")


def check_fits(prompt_tokens: int, max_new_tokens: int, context: int) -> None:
    """Refuse a request whose prompt and new tokens do not fit the model's context (its KV cache limit)."""
    check_max_tokens(max_new_tokens)
    if prompt_tokens + max_new_tokens > context:
        raise CapacityError(
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_new_tokens}) exceeds the context of {context} "
            f"tokens; at most {max(0, context - prompt_tokens)} new tokens fit after this prompt",
            advice="shorten the prompt or max_tokens, or load the model with a larger max_seq",
        )
