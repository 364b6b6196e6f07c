"""Speculative decoding on the GPU: draft k tokens, verify them with ONE target forward, keep the longest
accepted prefix plus one token from the target.

One step, as the GPU sees it (n = drafts, m = position of the last committed token):

    spec_tokens = [last, d_0 .. d_{n-1}]          drafted on the GPU (or uploaded from a host drafter's list)
    target.forward(spec_tokens, pos=m)  → logits [n+1, V]          one command encoder, T = n+1
    spec_verify(logits, draft_logits, randoms) → [accepted, token, status, d_0..d_{n-1}]   one small readback
    target cache truncated to m+1+accepted (O(1)); the drafter rolls itself back (`Drafter.commit`)

The accept test is u < p(d)/q(d) with p and q at the SAME temperature/top-k/top-p; a rejection samples the
residual max(0, p − q), full acceptance samples the bonus token from p's last row; temperature 0 reduces to
"accept while equal to the target's argmax". So the output is distributed exactly as the target's own
sampling and, greedy, identical to plain decoding. A plain step is the same step with n = 0: the verifier
samples row 0 exactly as the sampler contract says (`doppler_py.testing.sampling_reference`) — the only way
a target token is chosen.

Random numbers come from the seeded mulberry32 stream in a fixed order per step: one per GPU-sampled draft
token while drafting (the drafter draws them), then n accept draws and one final draw uploaded with the
verification. The same seed therefore reproduces the same tokens.

Token trees (a proposal with `parents`, `ops/tree.py`): the forward runs the n + 1 tree rows at once, each
seeing the cache and its own ancestors; `ops.tree_verify` walks the tree on the GPU (one readback): greedily,
or by recursive rejection over each row's children (deterministic drafts: one uniform per node, then the final
draw), which keeps the target's distribution exactly. The accepted path's K/V are moved into place
(`ops.kv_compact`, no readback) and the cache truncated.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from doppler_py.errors import CapacityError, DopplerError, GenerationOptionError, InternalError, NumericalError
from doppler_py.gpu.kernels import Recorder
from doppler_py.gpu.tensor import Tensor
from doppler_py.model.transformer import Transformer
from doppler_py.ops.logprobs import LogProbs, check_top_logprobs
from doppler_py.ops.speculative import MAX_DRAFT_TOKENS, STATUS_DRAFT_NONFINITE, STATUS_TARGET_NONFINITE, SpecVerify
from doppler_py.ops.tree import MAX_TREE_ROWS, check_parents, compaction_moves, is_chain, layout_words
from doppler_py.ops.tree_verify import TreeVerify, random_words, result_words
from doppler_py.rng import Mulberry32
from doppler_py.sampling import SamplingParams
from doppler_py.speculative.contract import NO_PROPOSAL, Drafter, NoOpHooks, Proposal, StepContext
from doppler_py.speculative.policy.draft_length import DraftLengthPolicy, tree_budget, worth_drafting
from doppler_py.speculative.readiness.warmup import COMPILE_CONTEXT, PipelineWarmup
from doppler_py.speculative.stats import SpecStats
from doppler_py.speculative.timing import StepClock, StepTimes

# While pipelines compile in the background: the verified row counts at which speculation steps up when each
# step up must calibrate first, and the context of calibrations between steps (shorter than the 64 of a full
# one: the stream pauses less).
CALIBRATION_STAGES = (3, 5)
QUICK_CONTEXT = 32
# Plain decoding: at most this many steps per submit, sized to take about BATCH_TARGET_S.
MAX_PLAIN_BATCH = 16
BATCH_TARGET_S = 0.2


@dataclass
class SpecResult:
    tokens: list[int]
    stats: SpecStats
    stopped_by: str


@dataclass(frozen=True)
class StepOutcome:
    new: list[int]  # the committed tokens: accepted drafts, then the target's own token
    drafted: int
    accepted: int
    on_gpu: bool  # the drafts came from GPU work (else from the host)
    tree: bool = False  # the drafts were a token tree
    made: int = 0  # drafts made, verified or not (more than `drafted` where the engine cut the proposal)


class SpeculativeEngine:
    """Generation for `target`, speculative with `drafter` (None: plain decoding through the same step).

    `capacity` bounds the drafts of one step (the verification buffers are allocated once for it); the draft
    length within it is the policy's, or a user's pinned `k` per generation.
    """

    def __init__(self, target: Transformer, drafter: Drafter | None, *, capacity: int = MAX_DRAFT_TOKENS):
        self.target = target
        self.speculative = drafter is not None
        self.drafter: Drafter = drafter if drafter is not None else _NoDrafter()
        self.registry = target.registry
        self.capacity = min(capacity, MAX_DRAFT_TOKENS, target.max_logit_rows - 1)
        if self.capacity < 1:
            raise GenerationOptionError(f"a speculative engine needs room for one draft, got capacity {capacity}")
        self.policy = DraftLengthPolicy(capacity=self.capacity)
        # What the drafter declares (contract.Drafter): a fixed step shape (policy: fixed mode), chains ended by
        # its own confidence (policy: k is only the ceiling), the target layers it reads.
        self.fixed_nodes: int | None = self.drafter.fixed_nodes
        self.policy.gated = self.drafter.gates_chains
        target.tap_layers(self.drafter.feature_taps)
        if self.fixed_nodes is not None:
            self.policy.reset(fixed=self.fixed_nodes)
        gpu = target.gpu
        self.spec_tokens = Tensor.empty(gpu, self.capacity + 1, "u32", "spec_tokens")
        self.randoms = Tensor.empty(gpu, 2 * self.capacity + 1, "f32", "spec_randoms")
        self.result = Tensor.empty(gpu, self.capacity + 3, "u32", "spec_result")
        # Plain decoding in batches (`plain_batch`): each step's random number, and its (token, status) pair.
        self.batch_randoms = Tensor.empty(gpu, MAX_PLAIN_BATCH, "f32", "batch randoms")
        self.batch_out = Tensor.empty(gpu, 2 * MAX_PLAIN_BATCH, "u32", "batch tokens")
        self._plain_token_s: float | None = None  # measured seconds per plain token, for the batch size
        # One verifier per draft-logits buffer a drafter proposes from (None: one-hot proposals, plain steps).
        self._verifiers: dict[int | None, tuple[Tensor | None, _Verifier]] = {}
        # Made now, not at the first token tree: the tree policy may switch trees on mid-session, and a steady
        # engine allocates nothing per generation (tests/reliability/test_resources.py).
        self.tree_result = Tensor.empty(gpu, result_words(MAX_TREE_ROWS), "u32", "tree result")
        # Feature rows on their way into target.x and its taps (a copy may not read and write one buffer): a
        # tree's accepted path's, to rows 1, 2, ...; a plain batch's, one per step, to rows 0..n-1. MAX_TREE_ROWS
        # rows per feature buffer (`_scratch`).
        self.feature_scratch = Tensor.empty(
            gpu, (MAX_TREE_ROWS * len(target.feature_buffers), target.config.hidden_size), "f32", "feature rows"
        )
        self._tree_verify = TreeVerify(
            self.registry,
            target.logits,
            self.spec_tokens,
            target.tree,
            self.randoms,
            self.tree_result,
            vocab=target.config.vocab_size,
        )
        self.clock = StepClock(gpu)
        self.logprobs: int | None = None  # top alternatives per token while a generation asks for log-probs
        self.last_logprobs = None  # the last step's committed tokens' TokenLogprobs (None when not asked)
        self._logprob_op: LogProbs | None = None
        # Getting ready to speculate (see `prepare`): pipelines compiling in the background, a calibration due,
        # and who wants the measured costs (the on-disk cost cache).
        self.warmup: PipelineWarmup | None = None
        self.warmup_pending = False  # `prepare(background=True)` before the first token of a generation
        self.usable_rows = self.capacity + 1  # most rows a step may verify (fewer while `prepare` compiles)
        self.needs_calibration = False
        self.on_calibrated: Callable[[dict[int, float]], None] | None = None
        self.closed = False

    # -- getting ready ------------------------------------------------------------------------------------
    def prepare(self, *, costs: dict[int, float] | None = None, background: bool = False) -> None:
        """Make the engine ready to speculate. `costs`: verification costs measured earlier on this device and
        model (`cost_cache`), so no calibration is needed. `background`: take plain steps while a background
        thread compiles the verification pipelines (`PipelineWarmup`, started once the next generation's first
        token is out: before, it would compete with the prefill and the first step for the CPU and the
        compiler), and speculate with drafts as long as the compiled row counts allow meanwhile; else calibrate
        now, which compiles them all first."""
        for rows, seconds in (costs or {}).items():
            self.policy.costs.observe_verify(rows, seconds)
        self.needs_calibration = not costs
        self.warmup_pending = background
        self.usable_rows = 1
        if not background:
            if costs:  # nothing to measure, but "now" means every step size runs without compiling first
                self.calibrate(context=COMPILE_CONTEXT, repeats=1, store=False)
            self._use_rows(max(self.verify_rows()), between_steps=False)
            self.drafter.compile()

    def verify_rows(self) -> list[int]:
        """Every row count a step may verify: 1 (a plain step) to k_max + 1."""
        return [r for r in range(1, self.policy.k_max + 2) if r <= self.capacity + 1]

    def _ready(self, ctx: StepContext, first_step: bool) -> bool:
        """Whether this step may speculate (at most `policy.limit` drafts while pipelines still compile)."""
        # A seeded sampled generation (the policy's timing-blind mode): which steps speculate decides which
        # random numbers each token uses, so that must not depend on how long compiling takes.
        seeded = not self.policy.cost_aware
        if self.warmup_pending and (not first_step or seeded):
            self.warmup_pending = False
            self.warmup = PipelineWarmup(
                self.target,
                lambda shadow: SpeculativeEngine(shadow, None, capacity=self.capacity),
                self.verify_rows(),
                also=self.drafter.compile,
            )
        if self.warmup_pending:
            return False
        warmup = self.warmup
        if warmup is not None:
            if seeded:
                warmup.done.wait()
            if warmup.done.is_set():
                self.warmup = None
                warmup.finish()
                self._use_rows(max(self.verify_rows()), between_steps=True)
            elif warmup.compiled_rows > self.usable_rows and self._worth_a_step_up(warmup.compiled_rows):
                self._use_rows(warmup.compiled_rows, between_steps=True)
        return self.usable_rows >= 2

    def _worth_a_step_up(self, rows: int) -> bool:
        """With cached costs every newly compiled row count is used at once; a step up that must calibrate
        pauses the stream (~0.8 s on lavapipe), so then only at k = 2 and k = 4 (START_K) drafts. Those quick
        calibrations run while the thread still compiles, so the final one (`_use_rows`) measures every row
        count again once it is done, and only that one is stored."""
        return not self.needs_calibration or any(self.usable_rows < r <= rows for r in CALIBRATION_STAGES)

    def _use_rows(self, rows: int, *, between_steps: bool) -> None:
        """Steps may now verify up to `rows` rows: calibrate the new row counts if no costs were cached."""
        full = rows >= max(self.verify_rows())
        if self.needs_calibration:
            new_rows = [r for r in self.verify_rows() if self.usable_rows < r <= rows or r == 1 or full]
            if between_steps:
                self._calibrate_between_steps(new_rows, quick=not full)
            else:
                self.calibrate(new_rows)
        self.usable_rows = rows
        self.policy.limit = None if full else rows - 1
        if full and self.needs_calibration:
            self.needs_calibration = False
            if self.on_calibrated is not None:
                self.on_calibrated(dict(self.policy.costs.verify))

    def _calibrate_between_steps(self, rows: list[int], *, quick: bool) -> None:
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

    # -- the algorithm ------------------------------------------------------------------------------------
    def step(self, ctx: StepContext, k: int) -> StepOutcome:
        """draft → one target forward over the proposal → verify on the GPU → one readback → truncate and commit."""
        return self.verify(ctx, self.propose(ctx, k), k)

    def propose(self, ctx: StepContext, k: int) -> Proposal:
        """The drafter's proposal of at most k tokens, cut to the nodes worth verifying (values given)."""
        proposal = self.drafter.propose(ctx, k) if k else NO_PROPOSAL
        if proposal.values is not None and self.policy.adaptive and self.policy.cost_aware:
            # The node budget from this device's verify costs and the drafter's measured acceptance. Not in a
            # seeded sampled generation: its tokens must not depend on timing. A GPU chain valued by the drafter's
            # confidence may be cut to nothing (a plain step) where even its first draft is unlikely to pay.
            least = 0 if proposal.on_gpu and proposal.parents is None else 1
            proposal = proposal.leading(tree_budget(proposal.values, self.policy.costs, least))
        return proposal

    def verify(self, ctx: StepContext, proposal: Proposal, k: int) -> StepOutcome:
        """The second half of `step`: `proposal` (asked with k) verified by one target forward, then committed."""
        target, params, cache = self.target, ctx.params, ctx.target_cache
        pos = len(ctx.tokens) - 1  # the last committed token's position: its K/V are written now
        n = self._check(proposal, k)
        if proposal.parents is not None and not is_chain(proposal.parents):
            return self._tree_step(ctx, proposal, n, pos)
        self.clock.drafted()
        # u: one accept draw per draft, then the final draw (the residual, the bonus token, or a plain sample).
        u = np.array([ctx.rng.random() for _ in range(n + 1)], dtype=np.float32)
        self.randoms.view((n + 1,), offset_bytes=4 * n).write(u)
        host_drafts = [] if proposal.on_gpu else list(proposal.tokens)
        self.spec_tokens.view((1 + len(host_drafts),)).write(np.array([ctx.tokens[-1], *host_drafts], np.uint32))
        rec = self.registry.recorder()
        self.clock.stamp_verify(rec, done=False)
        if proposal.on_gpu:
            rec.copy(proposal.tokens, self.spec_tokens, 4 * n, dst_offset=4)
        rec.copy(self.spec_tokens, target.ids, 4 * (n + 1))
        # logits [n+1, V]: row i scores d_i (i < n), row n gives the token after the last accepted draft
        target.record_forward(rec, n + 1, cache, pos, logits="all" if n else "last")
        self._verifier(proposal.draft_logits).record(rec, n, params)
        if self.logprobs is not None:  # the committed tokens' log-probs from the rows just verified
            self._logprobs().record(rec, n + 1, params, self.logprobs)
        self.clock.stamp_verify(rec, done=True)
        rec.submit()
        accepted, final, status, *drafts = np.frombuffer(
            self.registry.gpu.queue.read_buffer(self.result.buffer, 0, 4 * (3 + n)), np.uint32
        ).tolist()
        check_status(status, pos, n)
        self.last_logprobs = None if self.logprobs is None else self._logprobs().read(accepted + 1, self.logprobs)
        cache.truncate(pos + 1 + accepted)  # rejected drafts' K/V stay behind the length, overwritten later
        new = [*drafts[:accepted], final]
        ctx.tokens.extend(new)
        ctx.hidden_rows = accepted + 1
        self.drafter.commit(ctx, accepted)
        return StepOutcome(new, n, accepted, proposal.on_gpu, made=proposal.drafts_made)

    def _check(self, proposal: Proposal, k: int) -> int:
        """The number of drafts, after refusing a proposal the verification cannot take."""
        n = proposal.count
        if not 0 <= n <= k:
            raise InternalError(f"drafter {self.drafter.name!r} proposed {n} tokens when asked for at most {k}")
        if proposal.parents is not None:
            check_parents(proposal.parents, n)
        return n

    def _tree_step(self, ctx: StepContext, proposal: Proposal, n: int, pos: int) -> StepOutcome:
        """`step` for a token tree: one forward over its rows, the walk on the GPU, one readback, then the
        accepted path's K/V moved into place."""
        name = self.drafter.name
        if proposal.draft_logits is not None:
            raise InternalError(
                f"drafter {name!r} proposed a tree with draft logits; tree nodes are verified as deterministic drafts"
            )
        if self.logprobs is not None:
            raise GenerationOptionError(f"drafter {name!r} proposed a token tree; log-probs are not given for trees")
        if proposal.on_gpu:
            raise InternalError(f"drafter {name!r} proposed a tree on the GPU; tree tokens come from the host so far")
        target, cache = self.target, ctx.target_cache
        self.clock.drafted()
        rows = n + 1
        if not ctx.params.greedy:  # one test per node, then the final draw, whatever path the walk takes
            u = np.array([ctx.rng.random() for _ in range(random_words(rows))], dtype=np.float32)
            self.randoms.view((u.size,)).write(u)
        self.spec_tokens.view((rows,)).write(np.array([ctx.tokens[-1], *proposal.tokens], np.uint32))
        target.tree.view((rows, 2)).write(layout_words(proposal.parents))
        rec = self.registry.recorder()
        self.clock.stamp_verify(rec, done=False)
        rec.copy(self.spec_tokens, target.ids, 4 * rows)
        target.record_forward(rec, rows, cache, pos, logits="all", tree=True)
        self._tree_verify.record(rec, rows, ctx.params)
        self.clock.stamp_verify(rec, done=True)
        rec.submit()
        words = np.frombuffer(
            self.registry.gpu.queue.read_buffer(self.tree_result.buffer, 0, 4 * result_words(rows)), np.uint32
        ).tolist()
        accepted, final, status = words[:3]
        check_status(status, pos, n)
        path_tokens, path = words[3 : 3 + 2 * accepted : 2], words[4 : 4 + 2 * accepted : 2]
        moves = compaction_moves(path)
        if moves:
            rec = self.registry.recorder()
            target.compact(rec, cache, pos, moves)
            self._compact_features(rec, moves)
            rec.submit()
        cache.truncate(pos + 1 + accepted)
        new = [*path_tokens, final]
        ctx.tokens.extend(new)
        ctx.hidden_rows = accepted + 1  # the root's and the accepted path's features, as after a chain
        self.drafter.commit(ctx, accepted)
        return StepOutcome(new, n, accepted, False, tree=True, made=proposal.drafts_made)

    def _scratch(self) -> Tensor:
        """`feature_scratch`, grown once if a drafter made since tapped more of the target's layers."""
        rows = MAX_TREE_ROWS * len(self.target.feature_buffers)
        if self.feature_scratch.shape[0] < rows:
            self.registry.release_tensors(self.feature_scratch)
            h = self.target.config.hidden_size
            self.feature_scratch = Tensor.empty(self.target.gpu, (rows, h), "f32", "feature rows")
        return self.feature_scratch

    def _compact_features(self, rec: Recorder, moves: list[tuple[int, int]]) -> None:
        """Move the accepted path's rows of target.x (the final residual stream a head drafts from) and of its
        taps into place, through `feature_scratch`, as the K/V rows are moved."""
        row_bytes, scratch = 4 * self.target.config.hidden_size, self._scratch()
        for b, features in enumerate(self.target.feature_buffers):
            base = b * MAX_TREE_ROWS * row_bytes
            for src, dst in moves:
                rec.copy(features, scratch, row_bytes, src_offset=src * row_bytes, dst_offset=base + dst * row_bytes)
            for _, dst in moves:
                rec.copy(scratch, features, row_bytes, src_offset=base + dst * row_bytes, dst_offset=dst * row_bytes)

    def _verifier(self, draft_logits: Tensor | None) -> _Verifier:
        key = None if draft_logits is None else id(draft_logits.buffer)
        if key not in self._verifiers:
            op = SpecVerify(
                self.registry,
                self.target.logits,
                draft_logits,
                self.spec_tokens,
                self.randoms,
                self.result,
                vocab=self.target.config.vocab_size,
                max_k=self.capacity,
            )
            # The tensor is kept so that its buffer's id, the key, cannot be reused by another buffer.
            self._verifiers[key] = (draft_logits, _Verifier(op, onehot=draft_logits is None))
        return self._verifiers[key][1]

    def _logprobs(self) -> LogProbs:
        if self._logprob_op is None:
            vocab, rows = self.target.config.vocab_size, self.capacity + 1
            self._logprob_op = LogProbs(self.registry, self.target.logits, self.result, vocab=vocab, max_rows=rows)
        return self._logprob_op

    # -- generation and bookkeeping -----------------------------------------------------------------------
    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        params: SamplingParams,
        *,
        k: int | None = None,
        stop_ids: Sequence[int] = (),
    ) -> SpecResult:
        """Generate up to `max_new_tokens` tokens after `prompt_ids` (stopping after any of `stop_ids`).

        `k` pins the draft length; None lets the policy choose it.
        """
        stats = SpecStats()
        tokens: list[int] = []
        for new in self.iter_generate(prompt_ids, max_new_tokens, params, stats=stats, k=k, stop_ids=stop_ids):
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
    ) -> Iterator[list[int]]:
        """Yield each step's new tokens as soon as they are verified; `stats` is filled in as it goes.

        logprobs: top alternatives per token (0..20; None: off); each step's log-probs are then in
        `last_logprobs` when its tokens are yielded (`doppler_py.ops.logprobs`). Closing the generator early
        (a cancelled stream) releases the step's KV caches.
        """
        check_top_logprobs(logprobs)
        start = time.perf_counter()
        ctx = self.open_context(prompt_ids, max_new_tokens, params, k=k)
        stats.prefill_s = time.perf_counter() - start
        stats.drafter = self.drafter.name
        self.logprobs = logprobs
        produced = 0
        try:
            while produced < max_new_tokens:
                remaining = max_new_tokens - produced
                if self.speculative:
                    speculate = self._ready(ctx, first_step=produced == 0)
                    stats.warmup_steps += not speculate
                    draft_len = self.policy.next_k(remaining) if speculate else 0
                    paused = self._paused_batch(remaining) if speculate and draft_len == 0 else 1
                    if paused > 1:
                        new = self._measured_batch(ctx, paused, stats)
                        self.drafter.commit(ctx, 0)
                    else:
                        new = self._measured_step(ctx, draft_len, stats)[:remaining]
                else:
                    new = self._measured_batch(ctx, self._batch_size(remaining, first=produced == 0), stats)
                for j, token in enumerate(new):
                    if token in stop_ids:
                        new, stats.stopped_by = new[: j + 1], "eos"
                        break
                produced += len(new)
                stats.generated = produced
                stats.total_s = time.perf_counter() - start
                yield new
                if stats.stopped_by == "eos":
                    break
        finally:
            stats.total_s = time.perf_counter() - start
            self.logprobs = None
            self.close_context(ctx)

    def open_context(
        self, prompt_ids: Sequence[int], max_new_tokens: int, params: SamplingParams, *, k: int | None = None
    ) -> StepContext:
        """A generation's start: the checks, the policy reset (`k` pins the draft length), a KV cache, the
        drafter started, and the prefill of every prompt token but the last (the first step feeds it). Steps
        (`step`, or `propose` then `verify`) follow; `close_context` ends it."""
        target = self.target
        tokens = target.check_ids(prompt_ids).tolist()
        check_fits(len(tokens), max_new_tokens, target.max_positions)
        self.policy.reset(k, cost_aware=params.greedy or params.seed is None, fixed=self.fixed_nodes)
        capacity = len(tokens) + max_new_tokens + self.capacity + 1
        cache = target.new_cache(capacity)
        ctx = StepContext(tokens, target, cache, params, Mulberry32(params.seed or 0), capacity)
        if self.policy.adaptive and self.policy.cost_aware:
            ctx.worth_drafting = lambda values: worth_drafting(values, self.policy.costs)
        try:
            self.drafter.start(ctx)
            for begin in range(0, len(tokens) - 1, target.max_rows):  # the last prompt token is fed by step 1
                chunk = tokens[begin : min(begin + target.max_rows, len(tokens) - 1)]
                target.forward(chunk, cache, begin, logits="none")
                ctx.hidden_rows = len(chunk)
                self.drafter.prefilled(ctx, begin)
        except BaseException:
            self.close_context(ctx)
            raise
        # Submits return before the GPU is done: wait, so the prefill is not billed to the first step
        # (which would also skew the measured plain-step cost the policy relies on).
        target.gpu.wait_idle()
        return ctx

    def close_context(self, ctx: StepContext) -> None:
        """A generation's end (completed, failed or cancelled): the drafter's state and the KV cache freed."""
        self.drafter.finish()
        self.target.release_cache(ctx.target_cache)

    def _batch_size(self, remaining: int, first: bool) -> int:
        """Plain steps for the next submit: one for a generation's first token (it shows at once), then as many
        as take about BATCH_TARGET_S by the measured cost per token, so the stream still moves several times a
        second; one when log-probs are asked for (they are read per step)."""
        if first or self.logprobs is not None or self._plain_token_s is None:
            return 1
        most = min(remaining, MAX_PLAIN_BATCH, self.target.max_rows)  # target.x keeps every step's row
        return max(1, min(most, int(BATCH_TARGET_S / self._plain_token_s)))

    def _paused_batch(self, remaining: int) -> int:
        """Plain steps for one submit while the policy pauses speculation: the pause's remaining steps, as many
        as `_batch_size` allows (the first of them already taken from the pause by `next_k`)."""
        n = min(1 + self.policy.pause_steps, self._batch_size(remaining, first=False))
        self.policy.pause_steps -= n - 1
        return n

    def _measured_batch(self, ctx: StepContext, n: int, stats: SpecStats) -> list[int]:
        """`n` plain steps (one submit, one readback) with their statistics and the KV-cache invariant check."""
        if n == 1:
            return self._measured_step(ctx, 0, stats)
        self._check_open()
        start = time.perf_counter()
        new = self.plain_batch(ctx, n)
        seconds = (time.perf_counter() - start) / n
        for _ in new:
            stats.record(0, 0, StepTimes(0.0, seconds, None, None))
        self._check_cache(ctx)
        self._observe_plain(seconds)
        return new

    def _observe_plain(self, seconds: float) -> None:
        """A plain token's measured cost, for sizing plain batches."""
        self._plain_token_s = seconds if self._plain_token_s is None else 0.7 * self._plain_token_s + 0.3 * seconds

    def plain_batch(self, ctx: StepContext, n: int) -> list[int]:
        """`n` plain steps in ONE submit: each step's token, chosen on the GPU exactly as a plain step chooses it,
        is copied into the next step's input id, and the n tokens come back in one readback. The same random
        numbers are drawn in the same order as n single steps, so the tokens are the same. Tokens after a stop
        token are the caller's to drop (the generation ends there). Each step's row of target.x (the final
        residual stream) and of its taps is kept, so ctx.hidden then holds all n rows for a drafter, as after a chain
        step."""
        if not 1 <= n <= MAX_PLAIN_BATCH:
            raise InternalError(f"a plain batch holds 1..{MAX_PLAIN_BATCH} steps, got {n}")
        target, cache = self.target, ctx.target_cache
        pos = len(ctx.tokens) - 1
        row_bytes = 4 * target.config.hidden_size
        self.batch_randoms.view((n,)).write(np.array([ctx.rng.random() for _ in range(n)], np.float32))
        self.spec_tokens.view((1,)).write(np.array([ctx.tokens[-1]], np.uint32))
        verifier = self._verifier(None)
        features, scratch = target.feature_buffers, self._scratch()
        rec = self.registry.recorder()
        rec.copy(self.spec_tokens, target.ids, 4)
        for j in range(n):
            # Each step's ops set their own positions: per-step uniform slots. Phase 0 (the ops' own slots) is not
            # used, since the last values set there would be the ones its dispatches run with.
            rec.phase = j + 1
            if j:
                rec.copy(self.result, target.ids, 4, src_offset=4)  # the last step's token is this one's input
            rec.copy(self.batch_randoms, self.randoms, 4, src_offset=4 * j)
            target.record_forward(rec, 1, cache, pos + j, logits="last")
            verifier.record(rec, 0, ctx.params)
            rec.copy(self.result, self.batch_out, 8, src_offset=4, dst_offset=8 * j)  # (token, status)
            for b, buffer in enumerate(features):
                rec.copy(buffer, scratch, row_bytes, dst_offset=(b * MAX_TREE_ROWS + j) * row_bytes)
        for b, buffer in enumerate(features):  # a copy may not read and write one buffer
            rec.copy(scratch, buffer, n * row_bytes, src_offset=b * MAX_TREE_ROWS * row_bytes)
        rec.submit()
        out = np.frombuffer(self.registry.gpu.queue.read_buffer(self.batch_out.buffer, 0, 8 * n), np.uint32)
        tokens, statuses = out[0::2].tolist(), out[1::2].tolist()
        for j, status in enumerate(statuses):
            check_status(status, pos + j, 0)
        ctx.tokens.extend(tokens)
        ctx.hidden_rows = n
        return tokens

    def _measured_step(self, ctx: StepContext, k: int, stats: SpecStats) -> list[int]:
        """One step with its timing, statistics, policy update and the KV-cache invariant check around it."""
        self._check_open()
        pipelines = self.registry.cache_sizes["pipelines"]
        self.clock.start(self.registry.recorder(), drafting=k > 0)
        outcome = self.step(ctx, k)
        times = self.clock.stop()
        stats.record(outcome.drafted, outcome.accepted, times, outcome.made)
        stats.tree_steps += outcome.tree
        # A step that compiled a pipeline (its own, or one a background warmup finished meanwhile on the same
        # CPU) timed the compiler, not the device: the first EAGLE step on lavapipe read 98 ms a draft against
        # 2 ms, and the policy paused speculation for most of a generation while that estimate decayed.
        if self.registry.cache_sizes["pipelines"] == pipelines:
            self._price(outcome, times)
        if outcome.drafted:
            self.policy.observe(outcome.drafted, outcome.accepted)
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
            # costs now (at this context, with this drafter's upkeep). Without this split the costs of 2+ rows
            # would stay those of the calibration: on lavapipe they read 88–116 ms for 2–4 rows where live steps
            # took 90–131 ms, and the policy drafted more than paid (k = 1 was faster). Drafts the engine cut
            # were drafted all the same.
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
        context = min(context, target.max_positions - max(rows) - 1)
        cache = target.new_cache(context + max(rows) + 1)
        tokens = [0] * (context + 1)
        ctx = StepContext(tokens, target, cache, SamplingParams(), Mulberry32(0), cache.max_seq)
        drafter, self.drafter = self.drafter, _Replay()
        logprobs, self.logprobs = self.logprobs, None  # between two steps of a generation that asked for them
        try:
            target.forward(tokens[:-1], cache, 0, logits="none")
            target.gpu.wait_idle()  # else the first row count's first step would wait for this prefill too
            for n in rows:
                best = float("inf")
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    self.step(ctx, n - 1)
                    best = min(best, time.perf_counter() - t0)
                    del tokens[context + 1 :]
                    cache.truncate(context)
                if store:
                    self.policy.costs.verify[n] = best  # a deliberate measurement replaces what steps estimated
        finally:
            self.drafter, self.logprobs = drafter, logprobs
            target.release_cache(cache)

    def close(self) -> None:
        """Free the step buffers and ops (the target and a draft model belong to the caller)."""
        if self.closed:
            return
        if self.warmup is not None:
            self.warmup.cancel()
            self.warmup = None
        self.drafter.close()
        for _, verifier in self._verifiers.values():
            verifier.op.release(self.registry)
        if self._logprob_op is not None:
            self._logprob_op.release(self.registry)
        self._tree_verify.release(self.registry)
        self.registry.release_tensors(
            self.spec_tokens,
            self.randoms,
            self.result,
            self.batch_randoms,
            self.batch_out,
            self.tree_result,
            self.feature_scratch,
        )
        self.clock.close()
        self.closed = True


@dataclass(frozen=True)
class _Verifier:
    op: SpecVerify
    onehot: bool

    def record(self, rec: Recorder, n: int, params: SamplingParams) -> None:
        options = dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
        if n == 0:
            self.op.record_plain(rec, **options)
        else:
            self.op.record(rec, k=n, onehot=self.onehot, **options)


class _NoDrafter(NoOpHooks):
    """Plain decoding: nothing is ever proposed, so every step is the verifier's n = 0 step."""

    name = "none"

    def propose(self, ctx: StepContext, k: int) -> Proposal:
        return NO_PROPOSAL


class _Replay(_NoDrafter):
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


def check_status(status: int, pos: int, n_draft: int) -> None:
    """Raise `NumericalError` for the NaN/inf bits of a verification's status word (positions pos..pos+n_draft)."""
    if status & STATUS_TARGET_NONFINITE:
        raise NumericalError(
            f"the target model produced NaN/inf logits at positions {pos}..{pos + n_draft}",
            advice="its weights or activations overflow: check the model file, or load it with weights='f32'",
        )
    if status & STATUS_DRAFT_NONFINITE:
        raise NumericalError(
            f"the draft model produced NaN/inf logits at positions {pos}..{pos + n_draft - 1}",
            advice="check the draft model file, or load it with f32 weights, or use another speculative mode",
        )
