"""The drafter contract: what the engine gives a drafter at each step, and what a drafter gives back.

A drafter owns its GPU buffers and its sampler. Each step the engine hands it a read-only `StepContext` and
asks for a `Proposal` of at most k tokens; after verification it says how many were accepted, and the drafter
rolls its own state (a KV cache, a position) back to match. Nothing else passes between them, so a new
drafter is one new file: implement `Drafter` and hand an instance to `SpeculativeEngine`.

    proposal = drafter.propose(ctx, k)      # tokens d_0..d_{n-1}, n <= k (n = 0: the engine steps plainly)
    ... the engine verifies them with ONE target forward over [last, d_0..d_{n-1}] ...
    drafter.commit(ctx, accepted)           # d_0..d_{accepted-1} and one target token were committed

Exactness does not depend on the drafter: whatever it proposes, the verifier keeps the output distributed as
the target's own sampling. A drafter only decides how often its proposals are accepted.

Besides those hooks a drafter declares what it can do, and the engine reads nothing else of it (`Drafter`;
`NoOpHooks` holds the defaults, so a drafter states only where it differs): `fixed_nodes` (a fixed step shape,
lookahead), `gates_chains` (it ends its chains by `StepContext.worth_drafting`), `tree_branches` (tokens per depth
when it drafts trees; 1: chains only) with `branches` (what this generation asked for), `feature_taps` (target
layers whose outputs it reads: the engine taps them), `reads_prompt_features` (it needs the target's features
of every prompt position, which a prefix from the prefix cache lacks), `reads_step_rows` and `reads_verified_logits`
(its hooks read what the last step left in the target's feature rows or logits rows: beside other sequences in a
shared forward, `speculative.batch` puts this sequence's rows back first), `continue_tokens` (a
chain drafted from tokens alone, to follow the tokens a grammar forces in the same step) and `compile()`
(builds its own pipelines ahead of use, thread-safe: the engine runs it with its warm-up). A drafter made of
others (`BestOfDrafter`) declares for the whole, from its parts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from doppler_py.gpu.tensor import Tensor
from doppler_py.model.kv_cache import KVCache
from doppler_py.model.transformer import Transformer
from doppler_py.ops.tree import is_chain
from doppler_py.rng import Mulberry32
from doppler_py.sampling import SamplingParams

if TYPE_CHECKING:
    from doppler_py.constraints.matcher import GrammarMatcher
    from doppler_py.ops.linear import Linear
    from doppler_py.ops.penalties import Penalties


@dataclass
class StepContext:
    """What a drafter may read during one generation. Only the engine changes it (between steps).

    tokens          the committed tokens (prompt + generated); the last one is not in the target cache yet: the
                    next verification feeds it
    target          the target model (its config and buffers)
    target_cache    the target's KV cache, holding tokens[:-1]; positions past its length are scratch that the
                    next verification overwrites
    hidden_rows     rows of `hidden` (the target's final residual stream, before the final norm) that hold the
                    positions len(tokens)-1-hidden_rows .. len(tokens)-2: the rows the last step verified and
                    kept, or (during the prefill) the chunk just consumed; 0 before anything ran. Valid until a
                    drafter runs the target itself.
    params          the sampling parameters of both the target and (for an exact check) the draft
    rng             the generation's seeded stream: a drafter that samples on the GPU draws one u per sampled
                    token, in order, so a seed fixes the output
    capacity        positions this generation may use in any KV cache
    worth_drafting  set where the engine prices steps (an unpinned draft length, not a seeded sampled run): given
                    the values (`Proposal.values`) of a chain drafted so far, whether its newest draft paid for
                    its drafting and its verified row on this device. A drafter that can value its drafts as it
                    goes (EAGLE, by its confidence) stops its chain at the first that did not; None: draft k.
    cached          prompt positions whose K/V came from the prefix cache (`model.prefix_cache`): the prefill,
                    and `prefilled`, begin there; the target's features of those positions were never computed
    grammar         the generation's constraint (`constraints.GrammarMatcher`, at the committed tokens), or None.
                    The step masks every verified row by it and the engine drafts the tokens it forces; a
                    drafter may ignore it (a draft the grammar refuses is cut before verification).
    logprobs        top alternatives per committed token the generation asks for (0..20; None: none): each step's
                    outcome then carries its tokens' log-probs (`StepOutcome.logprobs`)
    drafter         the generation's drafter, whose hooks its steps run (`PlainDecoding` where it does not draft:
                    no upkeep, no pipelines of its own)
    penalties       the generation's penalties, logit bias and min-p on the GPU (`ops.penalties`: its token counts
                    and buffers), made by the step at the first step that needs them; None while params set none.
                    Freed by `close`.
    """

    tokens: list[int]
    target: Transformer
    target_cache: KVCache
    params: SamplingParams
    rng: Mulberry32
    capacity: int
    hidden_rows: int = 0
    worth_drafting: Callable[[Sequence[float]], bool] | None = None
    cached: int = 0
    grammar: GrammarMatcher | None = None
    logprobs: int | None = None
    drafter: Drafter = field(default_factory=lambda: PlainDecoding())
    penalties: Penalties | None = None

    @property
    def hidden(self) -> Tensor:
        return self.target.x

    def close(self) -> None:
        """The generation ended: free its own GPU state (the KV cache is the engine's to release)."""
        if self.penalties is not None:
            self.penalties.release()
            self.penalties = None


@dataclass(frozen=True)
class Proposal:
    """A drafter's answer: n tokens proposed to follow the last committed token.

    tokens          the n draft ids: a host sequence (uploaded with the verification) or a GPU u32 tensor holding
                    them at elements 0..n-1 (copied on the GPU; the host never sees them before verification)
    draft_logits    f32 [>= n, target vocab] on the GPU: row i is the logits d_i was sampled from, at the same
                    temperature/top-k/top-p as the target (the verifier filters both alike); None when the
                    proposal is deterministic (q is one-hot at each d_i, e.g. n-gram lookup or a greedy draft)
    parents         the tree shape, one parent index per node (-1: the last committed token), each before its
                    children; None is a chain (node i's parent is i-1). A tree (`ops/tree.py`) comes from host
                    tokens, with distinct tokens among siblings and no draft_logits (its nodes are verified as
                    deterministic drafts); after a tree step ctx.hidden holds the root's and the accepted
                    path's rows, in order, as after a chain.
    values          for nodes in best-first order (non-increasing values, every parent before its children, so
                    every leading run of nodes is a tree; a GPU proposal must be a chain): node i's expected
                    accepted tokens by the drafter's measured or predicted acceptance. The engine may then
                    verify only a leading run (`policy.tree_budget`); None: all n nodes are verified.
    made            drafts the drafter made for this proposal, when the engine cut it shorter (`leading`): their
                    drafting is a cost of the step all the same; None: count
    forced          how many leading tokens a grammar forces, drafted by the engine (`StepContext.grammar`), not the
                    drafter: always accepted; the tokens after them, if any, continue them (`continue_tokens`)
    spelled         how many tokens after the forced ones spell the rest of the grammar's forced bytes (the engine's
                    drafts too, likely but not certain: `GrammarMatcher.forced_spelling`)
    """

    count: int
    tokens: Sequence[int] | Tensor = ()
    draft_logits: Tensor | None = None
    parents: Sequence[int] | None = None
    values: Sequence[float] | None = None
    made: int | None = None
    forced: int = 0
    spelled: int = 0

    @property
    def by_grammar(self) -> bool:
        """The engine drafted it from a grammar (its leading tokens at least), not the drafter."""
        return self.forced + self.spelled > 0

    @property
    def drafts_made(self) -> int:
        return self.count if self.made is None else self.made

    @property
    def on_gpu(self) -> bool:
        return isinstance(self.tokens, Tensor)

    def leading(self, n: int) -> Proposal:
        """The first n nodes of a best-first proposal (see `values`): a tree, or a chain when it is one."""
        if self.values is None or (self.on_gpu and self.parents is not None):
            raise ValueError("only a proposal with node values (a chain, if on the GPU) can be cut to leading nodes")
        made = self.drafts_made
        if n == 0:  # a plain step
            return Proposal(0, made=made)
        if self.on_gpu:  # the first n ids and logits rows of the buffers are the leading chain
            return Proposal(n, self.tokens, self.draft_logits, values=list(self.values)[:n], made=made)
        parents = list(self.parents) if self.parents is not None else list(range(-1, self.count - 1))
        shape = None if is_chain(parents[:n]) else parents[:n]
        values = list(self.values)[:n]
        return Proposal(n, list(self.tokens)[:n], self.draft_logits, parents=shape, values=values, made=made)


NO_PROPOSAL = Proposal(0)


class Drafter(Protocol):
    name: str
    fixed_nodes: int | None  # every step verifies a tree of this many nodes (lookahead); None: the policy's k
    gates_chains: bool  # ends its chains where `StepContext.worth_drafting` says a draft stops paying
    tree_branches: int  # tokens per depth of its trees; 1: it drafts chains only
    branches: int  # 1 (chains) or tree_branches (trees), set for each generation
    feature_taps: tuple[int, ...]  # target layers whose outputs it reads beside the final residual stream
    # It reads the target's features of every prompt position (`prefilled`): after a prefix from the prefix
    # cache it starts later and drafts differently, so a seeded sampled generation, whose tokens depend on the
    # drafts' random draws, does not take a prefix from the cache with it.
    reads_prompt_features: bool
    # Its hooks read the rows of ctx.hidden (and the taps) that the last step (or prefill chunk) left. In a forward
    # shared with other sequences those rows sit elsewhere and are overwritten, so the batch keeps this sequence's
    # rows and puts them back as rows 0.. before its hooks run (`speculative.batch`).
    reads_step_rows: bool
    # Its `commit` reads the target's logits rows of the step just verified (rows 0..), as the verification left them.
    reads_verified_logits: bool

    def matmuls(self) -> Sequence[Linear]:
        """The matmuls the drafter runs on the GPU (the compile gate counts their pipelines not compiled yet)."""

    def compile(self, max_rows: int | None = None) -> None:
        """Build the drafter's own pipelines for every shape it may run with at most `max_rows` rows (None: every
        shape; thread-safe; before first use)."""

    def start(self, ctx: StepContext) -> None:
        """A new generation of ctx.tokens (the prompt), before the target's prefill."""

    def prefilled(self, ctx: StepContext, begin: int) -> None:
        """The prefill consumed ctx.tokens[begin : begin + ctx.hidden_rows]; ctx.hidden holds their rows."""

    def join(self, ctx: StepContext) -> bool:
        """Take over a generation under way that began without a drafter (plain steps so far; ctx.hidden holds the
        last step's rows, the earlier rows are gone), as `start` and the prefill would have left it; False where
        this drafter cannot (it needs what was never kept): the generation goes on plainly."""

    def propose(self, ctx: StepContext, k: int) -> Proposal:
        """At most k tokens to follow ctx.tokens (NO_PROPOSAL when there is nothing worth proposing)."""

    def continue_tokens(self, tokens: Sequence[int], k: int) -> list[int]:
        """At most k tokens to follow `tokens` (the committed ones and some a grammar forces after them), drafted from
        those tokens alone, so the engine can verify them behind the forced ones in one step; [] where drafting needs
        more (the drafter's own state, the target's features of positions not run yet)."""

    def commit(self, ctx: StepContext, accepted: int) -> None:
        """The last proposal's first `accepted` tokens and one target token were appended to ctx.tokens (a plain
        step: accepted = 0 of nothing; plain steps batched in one submit while speculation pauses: accepted = 0
        once for all of them, ctx.hidden_rows tokens appended); roll back whatever state ran ahead of that."""

    def finish(self) -> None:
        """The generation ended (completed, failed or cancelled): free its per-generation state."""

    def close(self) -> None:
        """Free the drafter's own buffers; it is not used again."""


class NoOpHooks:
    """Defaults for a drafter's declarations and hooks: no fixed shape, no gating, chains only, no taps, no
    pipelines of its own, its hooks may read the step's feature rows; nothing to set up, roll back or free. A
    drafter overrides those it needs."""

    fixed_nodes: int | None = None
    gates_chains = False
    tree_branches = 1
    branches = 1
    feature_taps: tuple[int, ...] = ()
    reads_prompt_features = False
    reads_step_rows = True  # the safe default: a drafter that reads none of the target's rows says so
    reads_verified_logits = False

    def matmuls(self) -> Sequence[Linear]:
        return ()

    def compile(self, max_rows: int | None = None) -> None:
        pass

    def continue_tokens(self, tokens: Sequence[int], k: int) -> list[int]:
        return []

    def start(self, ctx: StepContext) -> None:
        pass

    def prefilled(self, ctx: StepContext, begin: int) -> None:
        pass

    def join(self, ctx: StepContext) -> bool:
        return False  # a drafter says where it can take over an answer under way

    def commit(self, ctx: StepContext, accepted: int) -> None:
        pass

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


class PlainDecoding(NoOpHooks):
    """No drafting: nothing is ever proposed, so every step is the verifier's n = 0 step."""

    name = "none"
    reads_step_rows = False

    def propose(self, ctx: StepContext, k: int) -> Proposal:
        return NO_PROPOSAL
