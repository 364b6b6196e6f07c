"""Speculative decoding on the GPU: draft k tokens, verify them with ONE target forward, keep the longest
accepted prefix plus one token from the target.

One step, as the GPU sees it (k = drafts, m = position of the last committed token):

    spec_tokens = [last, d_0 .. d_{k-1}]          drafted on the GPU (or uploaded by a host drafter)
    target.forward(spec_tokens, pos=m)  → logits [k+1, V]          one command encoder, T = k+1
    spec_verify(logits, draft_logits, randoms) → [n, token, status, d_0..d_{k-1}]   one small readback
    target cache truncated to m+1+n (O(1)); the draft rolls back likewise

The accept test is u < p(d)/q(d) with p and q at the SAME temperature/top-k/top-p; a rejection samples the
residual max(0, p − q), full acceptance samples the bonus token from p's last row; temperature 0 reduces to
"accept while equal to the target's argmax". So the output is distributed exactly as the target's own
sampling and, greedy, identical to plain greedy decoding.

Random numbers come from the seeded mulberry32 stream, drawn in a fixed order per step: one per GPU-drafted
token while drafting, then k accept draws and one final draw, uploaded with the verification; a plain step
draws one. The same seed therefore reproduces the same tokens.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from doppler_py.errors import CapacityError, DopplerError, GenerationOptionError, InternalError, NumericalError
from doppler_py.gpu.kernels import Recorder
from doppler_py.gpu.tensor import Tensor
from doppler_py.model.generate import prefill
from doppler_py.model.kv_cache import KVCache
from doppler_py.model.transformer import Transformer
from doppler_py.ops.sampling import Sampler
from doppler_py.ops.speculative import MAX_DRAFT_TOKENS, STATUS_DRAFT_NONFINITE, STATUS_TARGET_NONFINITE, SpecVerify
from doppler_py.rng import Mulberry32
from doppler_py.sampling import SamplingParams
from doppler_py.speculative.drafters import Drafter
from doppler_py.speculative.policy import DraftLengthPolicy
from doppler_py.speculative.stats import SpecStats


@dataclass
class SpecResult:
    tokens: list[int]
    stats: SpecStats
    stopped_by: str


class StepSession:
    """The per-generation state a drafter works with: committed tokens, caches, the step buffers."""

    def __init__(self, engine: SpeculativeEngine, tokens: list[int], capacity: int, params: SamplingParams):
        self.engine = engine
        self.tokens = tokens
        self.capacity = capacity
        self.params = params
        self.rng = Mulberry32(params.seed or 0)
        self.target_cache: KVCache = engine.target.new_cache(capacity)
        self.draft_randoms: list[float] = []

    # -- used by drafters ---------------------------------------------------------------------------
    @property
    def draft_pick(self) -> Tensor:
        return self.engine.draft_pick

    def upload_draft(self, tokens: Sequence[int]) -> None:
        """A host drafter's proposal → spec_tokens[1..]."""
        self.engine.spec_tokens.view((len(tokens),), offset_bytes=4).write(np.asarray(tokens, dtype=np.uint32))

    def record_draft_sample(self, rec: Recorder, model: Transformer, i: int) -> None:
        """Sample draft token i from `model`'s last logits row; keep token and logits for the verifier."""
        engine = self.engine
        row_bytes = min(model.config.vocab_size, engine.vocab) * 4
        rec.copy(model.logits, engine.draft_row, row_bytes)
        p = self.params
        engine.draft_sampler.record(rec, rows=1, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p)
        rec.copy(engine.draft_pick, engine.spec_tokens, 4, dst_offset=4 * (1 + i))
        rec.copy(engine.draft_row, engine.draft_logits, engine.vocab * 4, dst_offset=i * engine.vocab * 4)

    def submit_draft(self, rec: Recorder, i: int) -> None:
        u = self.rng.random()
        self.draft_randoms.append(u)
        self.engine.draft_u.write(np.array([u], dtype=np.float32))
        rec.submit()


class SpeculativeEngine:
    """Speculative generation for `target` with `drafter`; the buffers for a step are allocated once."""

    def __init__(
        self,
        target: Transformer,
        drafter: Drafter | None,
        *,
        k: int = 4,
        k_max: int = 8,
        adaptive: bool = True,
        capacity: int = MAX_DRAFT_TOKENS,
    ):
        self.target = target
        self.drafter = drafter
        self.registry = target.registry
        # Buffers hold `capacity` drafts per step; the policy's k_max (how far k may grow) stays within it.
        self.k_max = min(capacity, MAX_DRAFT_TOKENS, target.max_logit_rows - 1)
        if max(k, k_max) > self.k_max:
            raise GenerationOptionError(f"draft length {max(k, k_max)} exceeds this engine's capacity of {self.k_max}")
        self.policy = DraftLengthPolicy(k=k, k_max=max(k, k_max), adaptive=adaptive, k_limit=self.k_max)
        gpu, vocab = target.gpu, target.config.vocab_size
        self.vocab = vocab
        self.spec_tokens = Tensor.empty(gpu, self.k_max + 1, "u32", "spec_tokens")
        self.draft_logits = Tensor.empty(gpu, (self.k_max, vocab), "f32", "draft_logits")
        # A draft with a smaller (padded) vocabulary leaves the tail of the row at -inf: never proposed.
        self.draft_row = Tensor.from_numpy(gpu, np.full((1, vocab), -np.inf, np.float32), "f32", "draft_row")
        self.draft_u = Tensor.empty(gpu, 1, "f32", "draft_u")
        self.draft_pick = Tensor.empty(gpu, 1, "u32", "draft_pick")
        self.randoms = Tensor.empty(gpu, 2 * self.k_max + 1, "f32", "spec_randoms")
        self.result = Tensor.empty(gpu, self.k_max + 3, "u32", "spec_result")
        self.draft_sampler = Sampler(
            self.registry, self.draft_row, self.draft_u, self.draft_pick, vocab=vocab, max_rows=1
        )
        self.verifier = SpecVerify(
            self.registry,
            target.logits,
            self.draft_logits,
            self.spec_tokens,
            self.randoms,
            self.result,
            vocab=vocab,
            max_k=self.k_max,
        )
        self.closed = False

    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        params: SamplingParams,
        *,
        stop_ids: Sequence[int] = (),
        pin_k: bool = False,
    ) -> SpecResult:
        """Generate up to `max_new_tokens` tokens after `prompt_ids` (stopping after any of `stop_ids`)."""
        stats = SpecStats()
        tokens: list[int] = []
        run = self.iter_generate(prompt_ids, max_new_tokens, params, stats=stats, stop_ids=stop_ids, pin_k=pin_k)
        for new in run:
            tokens.extend(new)
        return SpecResult(tokens, stats, stats.stopped_by)

    def iter_generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        params: SamplingParams,
        *,
        stats: SpecStats,
        stop_ids: Sequence[int] = (),
        pin_k: bool = False,
    ) -> Iterator[list[int]]:
        """Yield each step's new tokens as soon as they are verified; `stats` is filled in as it goes.

        Closing the generator early (a cancelled stream) releases the step's KV caches.
        """
        target = self.target
        tokens = target.check_ids(prompt_ids).tolist()
        check_fits(len(tokens), max_new_tokens, target.max_positions)
        capacity = len(tokens) + max_new_tokens + self.k_max + 1
        session = StepSession(self, tokens, capacity, params)
        stats.drafter = self.drafter.name if self.drafter else "none"
        policy = self.policy
        policy.reset(adaptive=not pin_k, cost_aware=params.greedy or params.seed is None)
        start = time.perf_counter()
        produced = 0
        try:
            prefill(target, tokens, session.target_cache)
            if self.drafter:
                self.drafter.start(session)
            # Submits return before the GPU is done: wait, so the prefill is not billed to the first step
            # (which would also skew the measured plain-step cost the policy relies on).
            target.gpu.wait_idle()
            stats.prefill_s = time.perf_counter() - start
            while produced < max_new_tokens:
                k = policy.next_k(max_new_tokens - produced) if self.drafter else 0
                new = self._step(session, k, stats)[: max_new_tokens - produced]
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
            if self.drafter:
                self.drafter.close()
            target.release_cache(session.target_cache)

    def _step(self, session: StepSession, k: int, stats: SpecStats) -> list[int]:
        if self.closed:  # a stream still iterated after its engine was closed: its buffers are gone
            raise DopplerError("the engine was closed during this generation", advice="load the model again")
        new = self._take_step(session, k, stats)
        # Every rollback path must leave the cache holding exactly the committed tokens before the last one
        # (which the next step feeds); anything else would attend to stale or missing positions silently.
        committed, cached = len(session.tokens), session.target_cache.length
        if cached != committed - 1:
            raise InternalError(
                f"the target KV cache holds {cached} positions after a step, but {committed} tokens are committed "
                f"(expected {committed - 1})"
            )
        return new

    def _plain_token(self, session: StepSession) -> int:
        """One target forward at the last committed token and the GPU's choice of the next token.

        The choice is the verifier's k = 0 step, which samples exactly as `Sampler` does and also reports
        NaN/inf logits, so a plain step cannot turn a broken distribution into a token silently.
        """
        target, params, pos = self.target, session.params, len(session.tokens) - 1
        target.ids.view((1,)).write(target.check_ids(session.tokens[-1:]))
        self.randoms.view((1,)).write(np.array([session.rng.random()], dtype=np.float32))
        rec = self.registry.recorder()
        target.record_forward(rec, 1, session.target_cache, pos, logits="last")
        self.verifier.record_plain(rec, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
        rec.submit()
        _, token, status = np.frombuffer(target.gpu.queue.read_buffer(self.result.buffer, 0, 12), np.uint32).tolist()
        check_status(status, pos, 0)
        return token

    def _take_step(self, session: StepSession, k: int, stats: SpecStats) -> list[int]:
        target, params, cache = self.target, session.params, session.target_cache
        last, pos = session.tokens[-1], len(session.tokens) - 1
        t0 = time.perf_counter()
        draft = self.drafter.draft(session, k) if k > 0 and self.drafter else None
        if draft is None or draft.count == 0:
            token = self._plain_token(session)
            stats.plain_steps += 1
            elapsed = time.perf_counter() - t0
            stats.plain_s += elapsed
            self.policy.costs.observe_verify(1, elapsed)
            session.tokens.append(token)
            if self.drafter:
                self.drafter.commit(session, 0, 0)
            return [token]
        n_draft = draft.count
        if not draft.onehot:
            target.gpu.wait_idle()
        t1 = time.perf_counter()
        stats.draft_s += t1 - t0
        self.policy.costs.observe_draft(n_draft if not draft.onehot else 0, t1 - t0)

        u = session.draft_randoms[-n_draft:] if not draft.onehot else [0.0] * n_draft
        u = u + [session.rng.random() for _ in range(n_draft + 1)]
        session.draft_randoms.clear()
        self.randoms.view((len(u),)).write(np.asarray(u, dtype=np.float32))
        self.spec_tokens.view((1,)).write(np.array([last], dtype=np.uint32))
        rec = self.registry.recorder()
        rec.copy(self.spec_tokens, target.ids, 4 * (n_draft + 1))
        target.record_forward(rec, n_draft + 1, cache, pos, logits="all")
        self.verifier.record(
            rec, k=n_draft, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, onehot=draft.onehot
        )
        rec.submit()
        raw = target.gpu.queue.read_buffer(self.result.buffer, 0, 4 * (3 + n_draft))
        result = np.frombuffer(raw, dtype=np.uint32)
        accepted, final, status = int(result[0]), int(result[1]), int(result[2])
        drafts = result[3 : 3 + n_draft].tolist()
        elapsed = time.perf_counter() - t1
        stats.verify_s += elapsed
        self.policy.costs.observe_verify(n_draft + 1, elapsed)
        check_status(status, pos, n_draft)
        cache.truncate(pos + 1 + accepted)
        new = [*drafts[:accepted], final]
        session.tokens.extend(new)
        stats.record_step(n_draft, accepted)
        self.drafter.commit(session, accepted, n_draft)
        self.policy.observe(n_draft, accepted)
        return new

    def calibrate(self, rows: Sequence[int] | None = None, context: int = 64, repeats: int = 2) -> None:
        """Measure target steps of each row count (forward + sampling + readback) at a typical context.

        Seeds the cost model so the adaptive policy knows cost(T=k+1)/cost(T=1) of THIS device from the start;
        live steps keep refining it.
        """
        target = self.target
        # Every verification size the policy may use (this also compiles their pipelines up front).
        rows = rows or range(1, self.policy.k_max + 2)
        rows = [r for r in rows if r <= min(target.max_logit_rows, self.k_max + 1)]
        context = min(context, target.max_positions - max(rows))
        cache = target.new_cache(context + max(rows))
        try:
            target.forward([0] * context, cache, 0, logits="none")
            for n in rows:
                best = float("inf")
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    target.ids.view((n,)).write(np.zeros(n, dtype=np.uint32))
                    rec = self.registry.recorder()
                    target.record_forward(rec, n, cache, context, logits="all")
                    target.sampler.record(rec, rows=1, temperature=0.0)
                    rec.submit()
                    target.read_token_ids(1)
                    best = min(best, time.perf_counter() - t0)
                    cache.truncate(context)
                self.policy.costs.observe_verify(n, best)
        finally:
            target.release_cache(cache)

    def close(self) -> None:
        """Free the step buffers and ops (the target and a draft model belong to the caller)."""
        if self.closed:
            return
        if self.drafter:
            self.drafter.close()
        self.verifier.release(self.registry)
        self.registry.release_slot(self.draft_sampler.bound.params)
        self.registry.release_tensors(
            self.spec_tokens,
            self.draft_logits,
            self.draft_row,
            self.draft_u,
            self.draft_pick,
            self.randoms,
            self.result,
        )
        self.closed = True


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
