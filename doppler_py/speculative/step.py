"""The speculative step: propose → verify → commit, one body for chains, token trees and plain steps.

    proposal = drafter.propose(ctx, k), trimmed by the policy       d_0..d_{n-1}: host ids or a GPU buffer
    target.forward([last, d_0..d_{n-1}], pos=m) → logits [n+1, V]    ONE command encoder, T = n + 1 rows
    verify on the GPU → accepted, the target's own token, a status   ONE small readback
    cache truncated to the committed tokens (a tree's accepted path's K/V moved into place first); the drafter
    rolls itself back (`Drafter.commit`)

m is the last committed token's position. A chain is verified by `ops.speculative` (u < p(d)/q(d) with p and q
at the same temperature/top-k/top-p, a rejection sampling the residual max(0, p − q), full acceptance the bonus
token from p's last row; temperature 0 reduces to "accept while equal to the target's argmax"); a tree by
`ops.tree_verify` (each row sees the cache and its own ancestors; greedy, or recursive rejection over each row's
children, one uniform per node then the final draw). Either way the output is distributed exactly as the
target's own sampling and, greedy, equals plain decoding. A plain step is the same step with n = 0: the
verifier samples row 0 exactly as the sampler contract says (`doppler_py.testing.sampling_reference`) — the
only way a target token is chosen. Several plain steps may share one submit (`plain_steps`): each one's token
is copied on the GPU into the next one's input, and all come back in one readback.

Penalties, the logit bias and min-p (`ops.penalties`, contract `testing.penalty_reference`) change every verified
row in place before the verification: row r as if its path's drafts (a chain's earlier drafts, a tree row's
ancestors) were committed, so acceptance, residuals and bonus tokens all sample the penalised distribution and the
output is exactly plain decoding's with the same options. A draft's own distribution q is left as its drafter
sampled it (rejection sampling is exact for any q).

Random numbers come from the generation's seeded mulberry32 stream in a fixed order: one per GPU-sampled draft
token while drafting (the drafter draws them), then the verification's (a chain: n accept draws and the final
draw; a sampled tree: one per node and the final draw; a plain step: one). The same seed gives the same tokens.

Under a constraint (`ctx.grammar`), every verified row is masked to the tokens the grammar allows after the
drafts before it (`ops.token_mask`: -inf before any softmax, top-k or top-p), so the output is the target's
distribution renormalised over the allowed tokens, for every drafter and shape; a draft the grammar refuses is
cut (with its subtree) before verification, and the tokens the grammar forces come as a proposal of the engine's
own (`Proposal.forced`: always accepted, exact either way). The matcher then advances by the committed tokens
only.

The step has no clock: `StepMarks` lets whoever wraps it (the engine's timing, `timing.StepClock`) mark the end
of drafting and the verification's first and last GPU commands.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from doppler_py.errors import GenerationOptionError, InternalError, NumericalError
from doppler_py.gpu.recorder import Recorder
from doppler_py.gpu.tensor import Tensor
from doppler_py.model.transformer import Transformer
from doppler_py.ops.logprobs import LogProbs, TokenLogprob
from doppler_py.ops.penalties import Penalties
from doppler_py.ops.speculative import STATUS_DRAFT_NONFINITE, STATUS_TARGET_NONFINITE, SpecVerify
from doppler_py.ops.token_mask import TokenMask
from doppler_py.ops.tree import MAX_TREE_ROWS, check_parents, compaction_moves, is_chain, layout_words
from doppler_py.ops.tree_verify import TreeVerify, random_words, result_words
from doppler_py.sampling import SamplingParams
from doppler_py.speculative.contract import NO_PROPOSAL, Proposal, StepContext
from doppler_py.speculative.policy.draft_length import DraftLengthPolicy

# Plain steps one submit may hold (`Stepper.step`'s plain_steps).
MAX_PLAIN_STEPS = 16


@dataclass(frozen=True)
class StepOutcome:
    new: list[int]  # the committed tokens: accepted drafts, then the target's own token (per plain step)
    drafted: int
    accepted: int
    on_gpu: bool  # the drafts came from GPU work (else from the host)
    tree: bool = False  # the drafts were a token tree
    made: int = 0  # drafts made, verified or not (more than `drafted` where the policy trimmed the proposal)
    forced: int = 0  # leading drafts a grammar forced (the engine's, not the drafter's)
    spelled: int = 0  # drafts after those spelling the rest of the grammar's forced bytes (the engine's too)
    logprobs: list[TokenLogprob] | None = None  # the committed tokens' (where the generation asks for them)


class StepMarks(Protocol):
    """What a step tells whoever times it."""

    def drafted(self) -> None:
        """The proposal is made (its GPU work submitted, maybe not run)."""

    def verify_begins(self, rec: Recorder) -> None:
        """`rec` will hold the verification's commands: its first is next."""

    def verify_ends(self, rec: Recorder) -> None:
        """The verification's last command was recorded; `rec` is submitted next."""


class _Unmarked:
    def drafted(self) -> None:
        pass

    def verify_begins(self, rec: Recorder) -> None:
        pass

    def verify_ends(self, rec: Recorder) -> None:
        pass


UNMARKED = _Unmarked()


@dataclass(frozen=True)
class _Verdict:
    """One verification's readback: the accepted drafts, the target's token after them, the NaN/inf status bits,
    and (a tree) the rows of the accepted path."""

    accepted: list[int]
    token: int
    status: int
    path: list[int]


@dataclass(frozen=True)
class PendingStep:
    """A step between `Stepper.begin` and `Stepper.finish`: what its GPU work and its commit need."""

    ctx: StepContext
    proposal: Proposal
    n: int  # drafts verified
    tree: bool
    plain_steps: int
    pos: int  # the last committed token's position (row 0's)

    @property
    def rows(self) -> int:
        return self.n + 1


class Stepper:
    """The step for one target: its GPU buffers and verification ops, and the policy that trims proposals (each
    generation's drafter is its context's, `StepContext.drafter`). `capacity` bounds the drafts of one step."""

    def __init__(self, target: Transformer, policy: DraftLengthPolicy, capacity: int):
        self.target, self.policy, self.capacity = target, policy, capacity
        self.registry = target.registry
        gpu = target.gpu
        self.spec_tokens = Tensor.empty(gpu, capacity + 1, "u32", "spec_tokens")
        self.randoms = Tensor.empty(gpu, 2 * capacity + 1, "f32", "spec_randoms")
        self.result = Tensor.empty(gpu, capacity + 3, "u32", "spec_result")
        # Plain steps: each one's random number, and its (token, status) pair.
        self.plain_randoms = Tensor.empty(gpu, MAX_PLAIN_STEPS, "f32", "plain randoms")
        self.plain_out = Tensor.empty(gpu, 2 * MAX_PLAIN_STEPS, "u32", "plain tokens")
        self.plain_path = Tensor.empty(gpu, MAX_PLAIN_STEPS, "u32", "plain steps' tokens")  # the penalties' path
        # Made now, not at the first token tree: the policy may switch trees on mid-session, and a steady engine
        # allocates nothing per generation (tests/reliability/test_resources.py).
        self.tree_result = Tensor.empty(gpu, result_words(MAX_TREE_ROWS), "u32", "tree result")
        # This step's tree layout, copied into target.tree with the step's inputs: beside other sequences' steps
        # (`speculative.batch`) an upload straight into target.tree would be overwritten by theirs before it ran.
        self.tree_layout = Tensor.empty(gpu, (MAX_TREE_ROWS, 2), "u32", "step tree layout")
        # Feature rows on their way into target.x and its taps (a copy may not read and write one buffer): a
        # tree's accepted path's, to rows 1, 2, ...; plain steps', one per step, to rows 0..n-1. MAX_TREE_ROWS rows
        # per feature buffer (`_scratch`).
        self.feature_scratch = Tensor.empty(
            gpu, (MAX_TREE_ROWS * len(target.feature_buffers), target.config.hidden_size), "f32", "feature rows"
        )
        vocab = target.config.vocab_size
        self.tree_verify = TreeVerify(
            self.registry, target.logits, self.spec_tokens, target.tree, self.randoms, self.tree_result, vocab=vocab
        )
        # One chain verifier per draft-logits buffer a drafter proposes from (None: one-hot proposals, plain steps).
        self._verifiers: dict[int | None, tuple[Tensor | None, _ChainVerify]] = {}
        self._logprob_op: LogProbs | None = None
        self._token_mask: TokenMask | None = None  # made at the first constrained step

    def propose(self, ctx: StepContext, k: int) -> Proposal:
        """The drafter's proposal of at most k tokens, trimmed to the nodes worth verifying."""
        return self.policy.trim(ctx.drafter.propose(ctx, k)) if k else NO_PROPOSAL

    def step(
        self,
        ctx: StepContext,
        k: int,
        *,
        plain_steps: int = 1,
        proposal: Proposal | None = None,
        marks: StepMarks = UNMARKED,
        keep_rows: bool = False,
    ) -> StepOutcome:
        """Draft at most k tokens (or verify `proposal`, made earlier for this ctx with this k), verify them with one
        target forward on the GPU, commit what was accepted. `plain_steps` > 1 (with k = 0): that many plain steps
        in one submit. `keep_rows`: the step's feature rows are also kept in `feature_scratch` (`save_rows`)."""
        pending = self.begin(ctx, k, plain_steps=plain_steps, proposal=proposal)
        marks.drafted()
        target, rows = self.target, pending.rows
        rec = self.registry.recorder()
        marks.verify_begins(rec)
        self.record_inputs(rec, pending)
        for j in range(plain_steps):
            if plain_steps > 1:  # per-step uniform slots; phase 0's would hold the last step's values
                rec.phase = j + 1
            if j:
                self._plain_inputs(rec, j)
            logits = "all" if pending.n else "last"
            target.record_forward(rec, rows, ctx.target_cache, pending.pos + j, logits=logits, tree=pending.tree)
            self.record_checks(rec, pending, j)
        if plain_steps > 1:  # every step's rows are in feature_scratch already
            self._restore_features(rec, plain_steps)
        elif keep_rows:
            self.save_rows(rec, rows)
        marks.verify_ends(rec)
        rec.submit()
        return self.finish(pending)

    def begin(self, ctx: StepContext, k: int, *, plain_steps: int = 1, proposal: Proposal | None = None) -> PendingStep:
        """A step's host half before its GPU work: the proposal made (or `proposal` taken), masked and checked, the
        tokens, layout and random numbers uploaded to this stepper's own buffers."""
        if ctx.params.penalized or ctx.params.filters_min_p:  # before the drafts, which a GPU drafter penalises
            self._penalties(ctx).update(ctx.tokens)
        proposal = self.propose(ctx, k) if proposal is None else proposal
        if ctx.grammar is not None:
            proposal = self._mask_rows(ctx, proposal)
        n, tree = self._check(proposal, k, plain_steps, ctx)
        pending = PendingStep(ctx, proposal, n, tree, plain_steps, len(ctx.tokens) - 1)
        self._upload(ctx, proposal, tree, plain_steps)
        return pending

    def record_inputs(self, rec: Recorder, pending: PendingStep, row0: int = 0) -> None:
        """The forward's input ids: the last committed token and the drafts, as rows row0.. of target.ids; and a
        plain step's random number where the verifier reads it."""
        if pending.proposal.on_gpu:
            rec.copy(pending.proposal.tokens, self.spec_tokens, 4 * pending.n, dst_offset=4)
        rec.copy(self.spec_tokens, self.target.ids, 4 * pending.rows, dst_offset=4 * row0)
        if pending.tree:
            rec.copy(self.tree_layout, self.target.tree, 8 * pending.rows)
        if pending.n == 0:
            rec.copy(self.plain_randoms, self.randoms, 4)

    def save_rows(self, rec: Recorder, rows: int, row0: int = 0) -> None:
        """Keep rows row0..row0+rows-1 of target.x and its taps (this sequence's last step or prefill chunk) as rows
        0.. of `feature_scratch`, for `restore_rows` after other sequences' forwards have overwritten them. A tree
        step's compaction (`move_feature_rows`) passes its rows through the same scratch rows, so what is kept stays
        the committed rows afterwards too."""
        if rows > MAX_TREE_ROWS:
            raise InternalError(f"{rows} feature rows to keep; a sequence keeps at most {MAX_TREE_ROWS}")
        row_bytes, scratch = 4 * self.target.config.hidden_size, self._scratch()
        for b, buffer in enumerate(self.target.feature_buffers):
            rec.copy(
                buffer, scratch, rows * row_bytes, src_offset=row0 * row_bytes, dst_offset=b * MAX_TREE_ROWS * row_bytes
            )

    def restore_rows(self, rec: Recorder, rows: int) -> None:
        """The rows `save_rows` kept, back as rows 0..rows-1 of target.x and its taps."""
        self._restore_features(rec, rows)

    def record_checks(self, rec: Recorder, pending: PendingStep, j: int = 0) -> None:
        """After the forward, with the step's logits as rows 0.. of target.logits: the penalties, the grammar's masks,
        the log-probs' distribution, min-p, the verification, the log-probs' picks, and (plain step j) the token kept
        for the readback."""
        ctx, rows = pending.ctx, pending.rows
        if ctx.penalties is not None and j:  # plain step j counts the tokens the steps before it chose
            ctx.penalties.record_row(rec, self.target.logits, self.plain_path, j)
        elif ctx.penalties is not None:  # before the mask, as `testing.penalty_reference` orders them
            ctx.penalties.record_penalties(rec, rows, tree=pending.tree)
        if ctx.grammar is not None:
            self._masks().record(rec, rows)
        if ctx.logprobs is not None:
            self._logprobs().record_distribution(rec, rows, ctx.params)
        if ctx.penalties is not None:
            ctx.penalties.record_min_p(rec, rows)
        verifier = self.tree_verify if pending.tree else self._verifier(pending.proposal.draft_logits)
        verifier.record(rec, rows, ctx.params)
        if ctx.logprobs is not None:  # the committed tokens' log-probs from the rows just verified
            self._logprobs().record_pick(rec, rows, ctx.logprobs)
        if pending.n == 0:
            more = pending.plain_steps > j + 1
            self._plain_outputs(
                rec, j, keep_features=pending.plain_steps > 1, penalised=more and ctx.penalties is not None
            )

    def finish(self, pending: PendingStep) -> StepOutcome:
        """A submitted step's host half after its GPU work: the readback, the checks, and the commit."""
        ctx, proposal, n, tree, pos = pending.ctx, pending.proposal, pending.n, pending.tree, pending.pos
        verdicts = self._read(n, tree, pending.plain_steps)
        for j, verdict in enumerate(verdicts):
            check_status(verdict.status, pos + j, n)
        accepted = len(verdicts[0].accepted)
        logprobs = None if ctx.logprobs is None else self._logprobs().read(accepted + 1, ctx.logprobs)
        moves = compaction_moves(verdicts[0].path) if tree else []
        if moves:
            self._compact(ctx, pos, moves)
        new = [token for verdict in verdicts for token in (*verdict.accepted, verdict.token)]
        ctx.target_cache.truncate(pos + len(new))  # rejected drafts' K/V stay behind the length, overwritten later
        ctx.tokens.extend(new)
        ctx.hidden_rows = len(new)  # the rows verified and kept: the root's and the accepted path's, or each step's
        if ctx.grammar is not None:
            ctx.grammar.advance(new)
        # The grammar's drafts are none of the drafter's: it catches up as after plain steps.
        ctx.drafter.commit(ctx, 0 if proposal.by_grammar else accepted)
        made = proposal.drafts_made
        return StepOutcome(
            new, n, accepted, proposal.on_gpu, tree, made, proposal.forced, proposal.spelled, logprobs=logprobs
        )

    def _check(self, proposal: Proposal, k: int, plain_steps: int, ctx: StepContext) -> tuple[int, bool]:
        """The number of drafts and whether they are a tree, after refusing what the verification cannot take."""
        n, name = proposal.count, ctx.drafter.name
        if not 0 <= n <= k:
            raise InternalError(f"drafter {name!r} proposed {n} tokens when asked for at most {k}")
        # Log-probs are read, and a grammar's next mask computed, after each step.
        constrained = ctx.grammar is not None
        one_at_a_time = k or ctx.logprobs is not None or constrained
        if not 1 <= plain_steps <= MAX_PLAIN_STEPS or (plain_steps > 1 and one_at_a_time):
            raise InternalError(f"{plain_steps} plain steps in one submit (k = {k}, constrained {constrained})")
        if proposal.parents is None:
            return n, False
        check_parents(proposal.parents, n)
        if is_chain(proposal.parents):
            return n, False
        if proposal.draft_logits is not None:
            raise InternalError(f"drafter {name!r} proposed a tree with draft logits; tree nodes are deterministic")
        if proposal.on_gpu:
            raise InternalError(f"drafter {name!r} proposed a tree on the GPU; tree tokens come from the host")
        if ctx.logprobs is not None:
            raise GenerationOptionError(f"drafter {name!r} proposed a token tree; log-probs are not given for trees")
        return n, True

    def _upload(self, ctx: StepContext, proposal: Proposal, tree: bool, plain_steps: int) -> None:
        """The last committed token and the host's drafts, a tree's layout, and the verification's random numbers
        (drawn now, in the order the module docstring gives)."""
        n = proposal.count
        host_drafts = [] if proposal.on_gpu else list(proposal.tokens)
        self.spec_tokens.view((1 + len(host_drafts),)).write(np.array([ctx.tokens[-1], *host_drafts], np.uint32))
        if tree:
            self.tree_layout.view((n + 1, 2)).write(layout_words(proposal.parents))
            if not ctx.params.greedy:
                u = np.array([ctx.rng.random() for _ in range(random_words(n + 1))], np.float32)
                self.randoms.view((u.size,)).write(u)
        elif n:
            u = np.array([ctx.rng.random() for _ in range(n + 1)], np.float32)  # after the drafts' own draws
            self.randoms.view((n + 1,), offset_bytes=4 * n).write(u)
        else:
            u = np.array([ctx.rng.random() for _ in range(plain_steps)], np.float32)
            self.plain_randoms.view((plain_steps,)).write(u)

    def _mask_rows(self, ctx: StepContext, proposal: Proposal) -> Proposal:
        """Upload each row's mask (the grammar's allowed tokens after the drafts before it) and return the proposal
        without the drafts the grammar refuses: a chain cut at the first, a tree without their subtrees. GPU drafts
        are read back for it."""
        grammar = ctx.grammar
        tokens = [int(t) for t in (proposal.tokens.numpy()[: proposal.count] if proposal.on_gpu else proposal.tokens)]
        parents = list(proposal.parents) if proposal.parents is not None else list(range(-1, len(tokens) - 1))
        if is_chain(parents):
            rows, valid = grammar.draft_masks(tokens)
            self._masks().write(rows[: valid + 1])
            return proposal if valid == proposal.count else _leading_chain(proposal, valid)
        masks, keep = [grammar.mask()], []  # a tree: each node's row after its own path
        for node in range(len(tokens)):
            path = [node]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            if any(p not in keep for p in path[1:]):
                continue
            rows, valid = grammar.draft_masks([tokens[p] for p in reversed(path)])
            if valid == len(path):
                keep.append(node)
                masks.append(rows[-1])
        self._masks().write(np.stack(masks))
        if len(keep) == len(tokens):
            return proposal
        index = {node: i for i, node in enumerate(keep)}
        kept_parents = [index[parents[node]] if parents[node] >= 0 else -1 for node in keep]
        values = None if proposal.values is None else [proposal.values[node] for node in keep]
        return Proposal(
            len(keep),
            [tokens[node] for node in keep],
            parents=None if is_chain(kept_parents) else kept_parents,
            values=values,
            made=proposal.drafts_made,
        )

    def _penalties(self, ctx: StepContext) -> Penalties:
        """The generation's penalties (`StepContext.penalties`), made at its first step (ctx.tokens: the prompt)."""
        if ctx.penalties is None:
            target = self.target
            ctx.penalties = Penalties(
                self.registry,
                ctx.params,
                ctx.tokens,
                vocab=target.config.vocab_size,
                logits=target.logits,
                tokens=self.spec_tokens,
                layout=self.tree_layout,
            )
        return ctx.penalties

    def _masks(self) -> TokenMask:
        if self._token_mask is None:
            target = self.target
            vocab, rows = target.config.vocab_size, target.max_logit_rows
            self._token_mask = TokenMask(self.registry, target.logits, vocab=vocab, max_rows=rows)
        return self._token_mask

    def _plain_inputs(self, rec: Recorder, j: int) -> None:
        """Plain step j's (j ≥ 1) input, the token step j - 1 chose, and its random number."""
        rec.copy(self.result, self.target.ids, 4, src_offset=4)
        rec.copy(self.plain_randoms, self.randoms, 4, src_offset=4 * j)

    def _plain_outputs(self, rec: Recorder, j: int, *, keep_features: bool, penalised: bool) -> None:
        """Plain step j's (token, status), with more steps to come its row of target.x and of its taps (the next
        step's forward overwrites row 0), and when `penalised` its token on the later steps' path."""
        rec.copy(self.result, self.plain_out, 8, src_offset=4, dst_offset=8 * j)
        if penalised:
            rec.copy(self.result, self.plain_path, 4, src_offset=4, dst_offset=4 * j)
        if keep_features:
            row_bytes, scratch = 4 * self.target.config.hidden_size, self._scratch()
            for b, buffer in enumerate(self.target.feature_buffers):
                rec.copy(buffer, scratch, row_bytes, dst_offset=(b * MAX_TREE_ROWS + j) * row_bytes)

    def _restore_features(self, rec: Recorder, rows: int) -> None:
        """Rows 0..rows-1 of `feature_scratch` (every plain step's, or those `save_rows` kept) back into target.x and
        its taps, as rows 0..rows-1."""
        row_bytes, scratch = 4 * self.target.config.hidden_size, self._scratch()
        for b, buffer in enumerate(self.target.feature_buffers):
            rec.copy(scratch, buffer, rows * row_bytes, src_offset=b * MAX_TREE_ROWS * row_bytes)

    def _read(self, n: int, tree: bool, plain_steps: int) -> list[_Verdict]:
        """The step's one readback: a verdict per verification."""
        queue = self.registry.gpu.queue
        if n == 0:
            out = np.frombuffer(queue.read_buffer(self.plain_out.buffer, 0, 8 * plain_steps), np.uint32).tolist()
            return [_Verdict([], token, status, []) for token, status in zip(out[0::2], out[1::2], strict=True)]
        if tree:
            words = np.frombuffer(queue.read_buffer(self.tree_result.buffer, 0, 4 * result_words(n + 1)), np.uint32)
            accepted, token, status, *path_words = words.tolist()
            return [_Verdict(path_words[0 : 2 * accepted : 2], token, status, path_words[1 : 2 * accepted : 2])]
        words = np.frombuffer(queue.read_buffer(self.result.buffer, 0, 4 * (3 + n)), np.uint32)
        accepted, token, status, *drafts = words.tolist()
        return [_Verdict(drafts[:accepted], token, status, [])]

    def _compact(self, ctx: StepContext, pos: int, moves: list[tuple[int, int]]) -> None:
        """Move a tree's accepted path's K/V rows and feature rows into place."""
        rec = self.registry.recorder()
        self.target.compact(rec, ctx.target_cache, pos, moves)
        self.move_feature_rows(rec, moves)
        rec.submit()

    def move_feature_rows(self, rec: Recorder, moves: list[tuple[int, int]]) -> None:
        """Rows of target.x (the final residual stream a head drafts from) and of its taps moved (src, dst), through
        `feature_scratch`."""
        row_bytes, scratch = 4 * self.target.config.hidden_size, self._scratch()
        for b, features in enumerate(self.target.feature_buffers):
            base = b * MAX_TREE_ROWS * row_bytes
            for src, dst in moves:
                rec.copy(features, scratch, row_bytes, src_offset=src * row_bytes, dst_offset=base + dst * row_bytes)
            for _, dst in moves:
                rec.copy(scratch, features, row_bytes, src_offset=base + dst * row_bytes, dst_offset=dst * row_bytes)

    def _scratch(self) -> Tensor:
        """`feature_scratch`, grown once if a drafter made since tapped more of the target's layers (the rows it
        keeps, `save_rows`, go along)."""
        rows = MAX_TREE_ROWS * len(self.target.feature_buffers)
        old = self.feature_scratch
        if old.shape[0] < rows:
            h = self.target.config.hidden_size
            self.feature_scratch = Tensor.empty(self.target.gpu, (rows, h), "f32", "feature rows")
            rec = self.registry.recorder()
            rec.copy(old, self.feature_scratch, old.nbytes)
            rec.submit()
            self.registry.release_tensors(old)
        return self.feature_scratch

    def _verifier(self, draft_logits: Tensor | None) -> _ChainVerify:
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
            self._verifiers[key] = (draft_logits, _ChainVerify(op, onehot=draft_logits is None))
        return self._verifiers[key][1]

    def _logprobs(self) -> LogProbs:
        if self._logprob_op is None:
            vocab, rows = self.target.config.vocab_size, self.capacity + 1
            self._logprob_op = LogProbs(self.registry, self.target.logits, self.result, vocab=vocab, max_rows=rows)
        return self._logprob_op

    def close(self) -> None:
        """Free the step's buffers and ops (the drafter is its owner's to close)."""
        for _, verifier in self._verifiers.values():
            verifier.op.release(self.registry)
        if self._logprob_op is not None:
            self._logprob_op.release(self.registry)
        if self._token_mask is not None:
            self._token_mask.release(self.registry)
        self.tree_verify.release(self.registry)
        self.registry.release_tensors(
            self.spec_tokens,
            self.randoms,
            self.result,
            self.plain_randoms,
            self.plain_out,
            self.plain_path,
            self.tree_result,
            self.tree_layout,
            self.feature_scratch,
        )


@dataclass(frozen=True)
class _ChainVerify:
    op: SpecVerify
    onehot: bool

    def record(self, rec: Recorder, rows: int, params: SamplingParams) -> None:
        options = dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
        if rows == 1:
            self.op.record_plain(rec, **options)
        else:
            self.op.record(rec, k=rows - 1, onehot=self.onehot, **options)


def _leading_chain(proposal: Proposal, n: int) -> Proposal:
    """A chain's first n drafts (a GPU chain's are the first n entries of its buffers)."""
    values = None if proposal.values is None else list(proposal.values)[:n]
    tokens = proposal.tokens if proposal.on_gpu else list(proposal.tokens)[:n]
    logits = proposal.draft_logits if n else None
    made, forced = proposal.drafts_made, min(n, proposal.forced)
    spelled = min(n - forced, proposal.spelled)
    return Proposal(n, tokens if n else (), logits, values=values, made=made, forced=forced, spelled=spelled)


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
