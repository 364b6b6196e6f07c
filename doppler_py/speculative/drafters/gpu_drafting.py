"""Drafting with a model on the GPU: one forward per draft token, each token sampled on the GPU and fed to the
next forward without the host seeing it.

`DraftSampler` is a drafter's own sampling state: the row it samples from (target-vocabulary wide), the
sampled tokens and the logits rows they came from (which the verifier reads to test and to form the
residual). `ModelDrafter` is the loop shared by the draft-model and layer-skip drafters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from doppler_py.errors import GenerationOptionError
from doppler_py.gpu.recorder import Recorder
from doppler_py.gpu.tensor import Tensor
from doppler_py.model.kv_cache import KVCache
from doppler_py.model.transformer import Transformer
from doppler_py.ops.penalties import Penalties
from doppler_py.ops.sampling import Sampler
from doppler_py.ops.speculative import MAX_DRAFT_TOKENS
from doppler_py.ops.top_tokens import TopTokens
from doppler_py.sampling import SamplingParams
from doppler_py.speculative.contract import NO_PROPOSAL, NoOpHooks, Proposal, StepContext
from doppler_py.speculative.trees.ranked import RankAcceptance, chain_with_leaves


class DraftSampler:
    """Samples draft token i from a model's last logits row into tokens[i], keeping the row in logits[i].

    row:    f32 [1, vocab]   the model's row, -inf beyond the model's own vocabulary (never proposed)
    u:      f32 [1]          this token's uniform, drawn from the generation's rng
    pick:   u32 [1]          the sampled id (a buffer of its own: a copy may not read and write one buffer)
    tokens: u32 [max_drafts] the draft ids (the proposal's tokens)
    logits: f32 [max_drafts, vocab]  the rows they were sampled from (the proposal's draft_logits)
    """

    def __init__(self, model: Transformer, vocab: int, max_drafts: int = MAX_DRAFT_TOKENS):
        gpu = model.gpu
        self.registry = model.registry
        self.vocab = vocab
        self.row_bytes = min(model.config.vocab_size, vocab) * 4
        self.row = Tensor.from_numpy(gpu, np.full((1, vocab), -np.inf, np.float32), "f32", "draft_row")
        self.u = Tensor.empty(gpu, 1, "f32", "draft_u")
        self.tokens = Tensor.empty(gpu, max_drafts, "u32", "draft_tokens")
        self.logits = Tensor.empty(gpu, (max_drafts, vocab), "f32", "draft_logits")
        self.pick = Tensor.empty(gpu, 1, "u32", "draft_pick")
        self.sampler = Sampler(self.registry, self.row, self.u, self.pick, vocab=vocab, max_rows=1)
        self.max_drafts = max_drafts

    def record(
        self, rec: Recorder, model: Transformer, i: int, params: SamplingParams, penalties: Penalties | None
    ) -> None:
        """Sample token i from `model.logits[0]`, copy it to the model's next input and keep its row."""
        rec.copy(model.logits, self.row, self.row_bytes)
        self.record_pick(rec, model.ids, i, params, penalties)

    def record_pick(
        self, rec: Recorder, next_ids: Tensor, i: int, params: SamplingParams, penalties: Penalties | None
    ) -> None:
        """Sample token i from `row` (already filled; first changed by the generation's `penalties`, when it has
        them, as the target's row i will be), copy it to `next_ids[0]` and keep its row."""
        if penalties is not None:
            penalties.record_draft(rec, self.row, self.tokens, i)
        self.sampler.record(rec, rows=1, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
        rec.copy(self.pick, self.tokens, 4, dst_offset=4 * i)
        rec.copy(self.pick, next_ids, 4)
        rec.copy(self.row, self.logits, self.vocab * 4, dst_offset=i * self.vocab * 4)

    def submit(self, rec: Recorder, u: float) -> None:
        self.u.write(np.array([u], dtype=np.float32))
        rec.submit()

    def close(self) -> None:
        self.registry.release_slot(self.sampler.bound.params)
        self.registry.release_tensors(self.row, self.u, self.pick, self.tokens, self.logits)


TREE_BRANCHES = 2  # tokens per depth of a drafter's tree when trees are on (the chain's and one sibling)
CHAIN_PRIOR_TOP1 = (0.6,)  # prior acceptance of a chain's next draft (the second-best: RANK_FALLOFF of it)
GREEDY = SamplingParams()


def checked_branches(value: int, tops: int, whose: str) -> int:
    """`value` as a drafter's tokens per depth: 1 (chains) or `tops` (its trees), else a GenerationOptionError."""
    if value not in (1, tops):
        raise GenerationOptionError(f"{whose} trees take 1 or {tops} tokens per depth, got {value}")
    return value


class TreeBranches:
    """A GPU drafter's token trees: its greedy chain (each draft the best token of its row) and each row's
    second-best token as a candidate side leaf, read back with the chain (`ops.top_tokens`: one small readback
    per step). The chain is drafted over half the node budget; of the chain and leaf candidates, the tree takes
    those with the most expected accepted tokens by the acceptance per depth and rank measured during the
    generation (`ranked_trees.RankAcceptance`, conditioned on the walk having followed the chain that far), in
    best-first order with their values, so the engine may verify fewer (`policy.tree_budget`). The nodes are
    deterministic given the context, so the tree is verified exactly at any temperature (`ops.tree_verify`).

    A subclass with other candidates (Medusa's heads) sets `tops` and overrides `build` and `observed`.
    `branches`: 1 (chains) or `tops` (trees), set per generation (`api.use_trees`)."""

    tops = TREE_BRANCHES

    def __init__(
        self,
        sampling: DraftSampler,
        branches: int = 1,
        *,
        rows: int | None = None,
        prior: Sequence[float] | None = CHAIN_PRIOR_TOP1,
    ):
        """`rows`: the most draft rows with candidates (default: every draft row); `prior`: top-1 per depth."""
        self.sampling = sampling
        self.branches = branches
        self.rows = rows or sampling.max_drafts
        self.top_ids = Tensor.empty(sampling.registry.gpu, self.rows * self.tops, "u32", "draft top tokens")
        self.top = TopTokens(
            sampling.registry, sampling.logits, self.top_ids, vocab=sampling.vocab, max_rows=self.rows, count=self.tops
        )
        self.acceptance = RankAcceptance(self.rows, self.tops, prior)
        self.last_best: np.ndarray | None = None  # the candidates behind the tree being verified

    @property
    def branches(self) -> int:
        return self._branches

    @branches.setter
    def branches(self, value: int) -> None:
        self._branches = checked_branches(value, self.tops, "this drafter's")

    def chain_length(self, budget: int) -> int:
        return min(budget - budget // 2, self.sampling.max_drafts)

    def record(self, rec: Recorder, depth: int) -> None:
        """Record the candidates of the first `depth` draft rows (into the last draft's submit)."""
        self.top.record(rec, depth)

    def read(self, depth: int, budget: int) -> tuple[Proposal, list[int]]:
        """The tree of at most `budget` nodes, and the best tokens' chain, once the drafts are done."""
        best = np.frombuffer(
            self.sampling.registry.gpu.queue.read_buffer(self.top_ids.buffer, 0, 4 * depth * self.tops), np.uint32
        ).reshape(depth, self.tops)
        self.last_best = best
        return self.build(best, budget), best[:, 0].tolist()

    def build(self, best: np.ndarray, budget: int) -> Proposal:
        return chain_with_leaves(best, budget, self.sampling.vocab, self.acceptance.rates)

    def observed(self, best: np.ndarray, committed: list[int]) -> list[int]:
        """Of the committed tokens at depths 0, 1, ..., those that tell how the candidates fared: a chain
        drafter's depth-d rows were drafted after the chain's tokens, so while the committed ones follow it."""
        return committed[: matching_prefix(committed, best[:, 0].tolist()) + 1]

    def reset(self) -> None:
        """A new generation: acceptance is measured afresh (a seeded one gives the same tokens whatever ran)."""
        self.acceptance.reset()
        self.last_best = None

    def observe(self, committed: Sequence[int]) -> None:
        """After a step that proposed a tree: `committed` is what the target gave at depths 0, 1, ..."""
        if self.last_best is not None:
            self.acceptance.observe(self.last_best, self.observed(self.last_best, list(committed)))
            self.last_best = None

    def close(self) -> None:
        self.top.release(self.sampling.registry)
        self.sampling.registry.release_tensors(self.top_ids)


class Branching:
    """For a drafter holding a `TreeBranches` as `branching`: how many ways it branches (`api.use_trees` sets
    `branches` to `tree_branches` when trees are on, to 1 when not)."""

    tree_branches = TREE_BRANCHES
    branching: TreeBranches

    @property
    def branches(self) -> int:
        return self.branching.branches

    @branches.setter
    def branches(self, value: int) -> None:
        self.branching.branches = value


def matching_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class ModelDrafter(NoOpHooks):
    """Drafts k tokens with `model` (its first `num_layers` layers) on its KV cache, one forward per token."""

    name = ""
    reads_step_rows = False  # it drafts from committed token ids, on its own cache

    def __init__(self, model: Transformer, vocab: int, num_layers: int | None = None):
        self.model = model
        self.num_layers = num_layers
        self.sampling = DraftSampler(model, vocab)

    def cache(self, ctx: StepContext) -> KVCache:
        raise NotImplementedError

    def pending(self, ctx: StepContext) -> list[int]:
        """Committed tokens the draft cache has not consumed yet (at least the last token)."""
        raise NotImplementedError

    def propose(self, ctx: StepContext, k: int) -> Proposal:
        k = min(k, self.sampling.max_drafts)
        if not self.draft(ctx, k, ctx.params):
            return NO_PROPOSAL
        return Proposal(k, self.sampling.tokens, self.sampling.logits)

    def draft(
        self, ctx: StepContext, k: int, params: SamplingParams, last: Callable[[Recorder], None] | None = None
    ) -> bool:
        """Draft k tokens into `sampling` (False, and nothing run, when the cache or the rows cannot take them).
        `last` records more work into the last draft's submit."""
        model, cache, pending = self.model, self.cache(ctx), self.pending(ctx)
        if len(pending) + k - 1 > model.max_rows or cache.free < len(pending) + k:
            return False
        model.ids.view((len(pending),)).write(model.check_ids(pending))
        rows, pos = len(pending), cache.length
        recurrent = cache.recurrent
        if recurrent is not None:
            # A hybrid model's drafts move its recurrent states on as they are fed; they come back to here after
            # the last draft, so the cache holds the pending tokens again as unfed (the next proposal feeds them
            # with what is committed after them) and, on the target's own cache, the verification starts here.
            model.settle(cache)
            recurrent.checkpoint(model.gpu)
        for i in range(k):
            rec = model.registry.recorder()
            model.record_forward(rec, rows, cache, pos, logits="last", num_layers=self.num_layers)
            self.sampling.record(rec, model, i, params, ctx.penalties)
            if last is not None and i == k - 1:
                last(rec)
            self.sampling.submit(rec, ctx.rng.random())
            pos, rows = pos + rows, 1
        if recurrent is not None:
            cache.truncate(recurrent.rollback(model.gpu))
        return True

    def close(self) -> None:
        self.finish()
        self.sampling.close()
