"""How many tokens to draft next, and when not to speculate at all.

One setting: a user's `k` pins the draft length for a generation; without it the policy chooses k within the
engine's capacity, starting at `START_K` and never above `K_CEILING`.

Draft length follows HF's heuristic: +2 after a step whose drafts were all accepted, −1 after a rejection.
On top of that a cost model decides whether speculation pays: with per-token acceptance α and k drafts, a
step yields E = (1 − α^(k+1)) / (1 − α) tokens for cost(step with k drafts) seconds, against cost(plain step)
per token for plain decoding. All costs are MEASURED on the running device as host wall time of whole steps
(which end with their one readback, so measuring adds no GPU wait): on a CPU adapter verifying k+1 tokens
costs far more than one, on a GPU nearly the same, so the same policy speculates aggressively on a GPU and
cautiously on lavapipe. Where the adapter stamps GPU time, a GPU drafter's step is split into its drafting
(priced per draft token) and the rest (the verification of that many rows), so each row count's cost follows
the live steps, not only its calibration. When no k predicts a speedup, speculation pauses for a number of
plain steps that doubles each time a probe confirms it.

A drafter that can value each draft as it goes (EAGLE, by its confidence: `confidence`) ends its own chain at
the first draft that did not pay for its drafting and its row (`worth_drafting`), and the engine verifies the
chain's best leading run, or takes a plain step (`tree_budget`); k is then only a ceiling (`gated`).

What "pays" means: a node pays when the tokens it is expected to add, per second it adds to its step, beat the
device's measured throughput (`CostModel.bar`: tokens per second over the recent steps, never below plain
decoding's). Maximising each step's E − bar × cost maximises tokens per second over the whole generation
(Dinkelbach), where maximising each step's own rate E / cost does not: it stops a confident chain while its
next draft still beats the generation's rate, and lets a weak chain verify drafts that only beat its own poor
rate (measured in docs/benchmarks.md, "Why the policy is what it is").

A generation whose steps share forwards with others' (speculative/batch.py) is priced with `SharedStepCosts`:
its plain step is the shared forward's measured time, and each extra row counts once for every generation it
delays, so it drafts where the batch's tokens per second gain.

A drafter whose steps have a fixed shape (lookahead decoding: its window is part of every proposal, and its
drafts are not a chain whose tail is the least likely part) is run in fixed mode: k is that shape's node count,
never adapted, and the pause rule compares the MEASURED tokens per step with the measured cost of its rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from doppler_py.errors import GenerationOptionError

if TYPE_CHECKING:
    from doppler_py.speculative.contract import Proposal

START_K = 4  # the first draft length of an unpinned generation
K_CEILING = 8  # an unpinned k never grows past this (nor past the engine's capacity)
_EMA = 0.3  # weight of the newest measurement
# The throughput follows the text over about ten steps: one step's tokens swing from 1 to k + 1.
_THROUGHPUT_EMA = 0.1
# A step timed at more than this many times the running cost counts as this ratio: a stall of the shared
# machine would otherwise stay in the cost of a row count the policy then stops using, and keep it from coming
# back. Only slow outliers are clipped: a device is never faster than
# it is, so a cost measured too high (a stall in the first measure) must be free to fall.
_OUTLIER_RATIO = 1.5


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens per step when each draft is accepted independently with probability alpha (incl. the bonus)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def _ema(old: float | None, new: float, weight: float = _EMA) -> float:
    return new if old is None else (1 - weight) * old + weight * new


def _cost_ema(old: float | None, new: float, weight: float = _EMA) -> float:
    """`_ema` of a time, with the newest measurement at most `_OUTLIER_RATIO` times the running value."""
    if old is not None and old > 0.0:
        new = min(new, old * _OUTLIER_RATIO)
    return _ema(old, new, weight)


@dataclass
class CostModel:
    """Measured seconds: target steps by number of verified rows (plain step = 1 row), drafting per token."""

    verify: dict[int, float] = field(default_factory=dict)
    draft_per_token: float | None = None
    # Recent steps' committed tokens and seconds (running means; their ratio is the measured throughput).
    step_tokens: float | None = None
    step_seconds: float | None = None

    def observe_verify(self, rows: int, seconds: float) -> None:
        """A target forward over `rows` rows + verification + readback, nothing drafted (plain step, calibration)."""
        self.verify[rows] = _cost_ema(self.verify.get(rows), seconds)

    def observe_step(self, drafts: int, seconds: float) -> None:
        """A whole speculative step: what it cost beyond verifying drafts + 1 rows is the drafting."""
        verify = self.verify_cost(drafts + 1)
        if drafts and verify is not None:
            self.draft_per_token = _cost_ema(self.draft_per_token, max(0.0, seconds - verify) / drafts)

    def observe_draft(self, drafts: int, seconds: float) -> None:
        """The drafting of a step, measured apart from its verification (GPU timestamps)."""
        self.draft_per_token = _cost_ema(self.draft_per_token, seconds / drafts)

    def observe_throughput(self, tokens: int, seconds: float) -> None:
        """A step (drafting, verification and readback) that committed `tokens` in `seconds`."""
        self.step_tokens = _ema(self.step_tokens, float(tokens), _THROUGHPUT_EMA)
        self.step_seconds = _cost_ema(self.step_seconds, seconds, _THROUGHPUT_EMA)

    def bar(self) -> float | None:
        """Tokens per second a node must add to be worth its cost: the measured throughput of recent steps, and
        never less than plain decoding's (a plain step is always there to take). None while nothing is measured."""
        plain = self.verify_cost(1)
        if plain is None:
            return None
        measured = self.step_tokens / self.step_seconds if self.step_tokens and self.step_seconds else 0.0
        return max(1.0 / plain, measured)

    def verify_cost(self, rows: int) -> float | None:
        """Measured cost for `rows`, else interpolated/extrapolated linearly from the measured points; never
        below the cost measured for fewer rows (more rows never cost less: a stale or noisy measure of a size
        the live steps no longer use must not make it look cheap)."""
        cost = self._verify_point(rows)
        fewer = [c for r, c in self.verify.items() if r < rows]
        return max([cost, *fewer]) if cost is not None else None

    def _verify_point(self, rows: int) -> float | None:
        if rows in self.verify:
            return self.verify[rows]
        points = sorted(self.verify.items())
        if not points:
            return None
        if len(points) == 1:
            return points[0][1] * rows / points[0][0] if rows > points[0][0] else points[0][1]
        lower = [p for p in points if p[0] < rows] or points[:1]
        upper = [p for p in points if p[0] > rows] or points[-1:]
        (r0, c0), (r1, c1) = (lower[-1], upper[0]) if lower[-1] != upper[0] else (points[-2], points[-1])
        return max(c0, c0 + (c1 - c0) * (rows - r0) / (r1 - r0))

    def speedup(self, alpha: float, k: int) -> float | None:
        plain, verify = self.verify_cost(1), self.verify_cost(k + 1)
        if plain is None or verify is None:
            return None
        step = k * (self.draft_per_token or 0.0) + verify
        return expected_tokens(alpha, k) * plain / step

    def shared(self, step_s: float, members: int) -> SharedStepCosts:
        """These costs as one of `members` generations whose steps share forwards taking `step_s` seconds with
        plain rows only (speculative/batch.py): see `SharedStepCosts`."""
        # Drafting on the GPU runs in the loop's turn, one generation's after another's: each draft delays every
        # member's step, as a verified row does.
        draft = None if self.draft_per_token is None else members * self.draft_per_token
        return SharedStepCosts(alone=self, step_s=step_s, members=members, draft_per_token=draft)


@dataclass
class SharedStepCosts(CostModel):
    """A generation's costs while its steps share forwards with other generations' (speculative/batch.py).

    Its plain step takes the shared forward's time, `step_s`. Each row it verifies beyond its plain one costs what
    that row costs the device (`alone`'s measured verify_cost(r) - verify_cost(1): the same kernels take the
    extra rows, alone or beside others), and delays every member's step by that much (so does each token it drafts on
    the GPU, `draft_per_token`): priced `members` times, the gain a draft must beat is the whole batch's throughput,
    not the generation's own. Maximising each member's
    E(k) - (batch tokens/s) x (its extra seconds) maximises the batch's tokens per second (the Dinkelbach argument
    of the module docstring), so a device where extra rows are nearly free (a GPU) keeps drafting in a batch,
    and one where they cost much of a step (a CPU adapter) drafts less. Alone (members 1, step_s the plain cost)
    this is `alone` itself. Read-only: batched steps are not priced one by one."""

    alone: CostModel = field(default_factory=CostModel)
    step_s: float = 0.0
    members: int = 1

    def verify_cost(self, rows: int) -> float | None:
        plain, cost = self.alone.verify_cost(1), self.alone.verify_cost(rows)
        if plain is None or cost is None:
            return None
        return self.step_s + self.members * (cost - plain)


def step_gain(values: Sequence[float], n: int, costs: CostModel, bar: float, draft_per_token: float = 0.0) -> float:
    """What a step verifying the first n of nodes with these values gains over spending its time at `bar` tokens
    per second: (1 + Σ values[:n]) − bar · (verify_cost(n + 1) + n · draft_per_token)."""
    return 1.0 + sum(values[:n]) - bar * (costs.verify_cost(n + 1) + n * draft_per_token)


def tree_budget(values: Sequence[float], costs: CostModel, least: int = 1) -> int:
    """How many leading nodes of a best-first tree to verify, given node i adds `values[i]` expected accepted
    tokens: the count n >= least (1, or 0: a plain step) with the most expected tokens beyond what the step's
    time would make at the device's throughput (`step_gain`, `CostModel.bar`); all of them while nothing is
    measured. The drafting is left out: it is the same for every n (the tree is drafted already)."""
    bar = costs.bar()
    if bar is None:
        return len(values)
    return max(range(least, len(values) + 1), key=lambda n: step_gain(values, n, costs, bar), default=len(values))


def worth_drafting(values: Sequence[float], costs: CostModel) -> bool:
    """Whether the newest node of a chain with these node values paid for itself: the tokens it is expected to add
    beat what its drafting and its row would make at the device's throughput (`CostModel.bar`; True while
    nothing is measured). Values fall along a chain, so the first node that did not pay is where drafting stops
    (`StepContext.worth_drafting`)."""
    n = len(values)
    bar = costs.bar()
    if n == 0 or bar is None:
        return True
    draft = costs.draft_per_token or 0.0
    return step_gain(values, n, costs, bar, draft) > step_gain(values, n - 1, costs, bar, draft)


# Token trees spend verified rows on side branches instead of a longer chain. That pays where extra rows are
# nearly free (a GPU verifies T rows in about the time of one); on a CPU adapter the cost grows with the rows
# and the rows are better spent on the chain. Trees are used when verifying `rows` rows measured at most this
# many plain steps.
TREE_COST_RATIO = 1.5


def trees_pay(costs: CostModel, rows: int) -> bool:
    """Whether this device's measured costs make a tree of rows - 1 nodes worth proposing (False unmeasured)."""
    plain, wide = costs.verify_cost(1), costs.verify_cost(rows)
    return plain is not None and wide is not None and wide <= TREE_COST_RATIO * plain


@dataclass
class DraftLengthPolicy:
    """Chooses each step's draft length within `capacity` (the engine's buffers); costs persist across runs."""

    capacity: int = K_CEILING
    costs: CostModel = field(default_factory=CostModel)
    limit: int | None = None  # fewer drafts allowed for now (verification pipelines still compiling); None: k_max
    k_min: int = 1
    max_pause: int = 64
    # Per generation (see `reset`):
    k: int = START_K
    pinned: bool = False
    fixed: bool = False  # k is a drafter's fixed step shape (see the module docstring)
    tokens_per_step: float | None = None  # fixed mode: measured committed tokens per speculative step
    # The drafter ends its own chains where a draft stops paying (`worth_drafting`): an unpinned k is then only
    # the ceiling, k_now, since the drafter's confidence says per step what a running acceptance says on average.
    gated: bool = False
    # Timing-based pauses make the step structure depend on the machine's speed; a seeded sampled run must
    # not (the same seed must give the same tokens), so the engine turns them off there.
    cost_aware: bool = True
    alpha: float = 0.6  # running estimate of per-token acceptance (prior: drafts are usually worth a try)
    pause_steps: int = 0  # plain steps left before speculation is probed again
    next_pause: int = 4

    # While the generation's steps share forwards with others (`CostModel.shared`, set by the engine per step):
    # what its steps are priced with instead of `costs`, which stay the device's costs measured alone.
    shared: SharedStepCosts | None = None

    @property
    def pricing(self) -> CostModel:
        return self.shared if self.shared is not None else self.costs

    @property
    def k_max(self) -> int:
        return self.capacity if self.fixed else min(K_CEILING, self.capacity)

    @property
    def k_now(self) -> int:
        """The most drafts a step may take now: k_max, or the limit while pipelines compile."""
        return self.k_max if self.limit is None else min(self.k_max, self.limit)

    def check_k(self, k: int | None) -> None:
        """Refuse a user's draft length the engine cannot verify in one step."""
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.capacity):
            raise GenerationOptionError(f"k (draft length) must be an integer in 1..{self.capacity}, got {k!r}")

    def reset(self, k: int | None = None, *, cost_aware: bool = True, fixed: int | None = None) -> None:
        """Start of a generation: `k` pins the draft length (None: adapt from START_K, or take `fixed`, a
        drafter's fixed step shape, whole); costs are kept."""
        self.check_k(k)
        same_shape = fixed is not None and self.fixed and k is None and self.k == min(fixed, self.capacity)
        self.pinned = k is not None
        self.fixed = fixed is not None
        self.k = k if k is not None else min(fixed or START_K, self.k_max)
        self.cost_aware = cost_aware
        self.alpha, self.pause_steps = 0.6, 0
        if same_shape:
            # A fixed shape's tokens per step were measured by earlier generations: a new one does not probe
            # again at once where they did not pay (the pause keeps growing as probes confirm it).
            speedup = self.fixed_speedup()
            if cost_aware and speedup is not None and speedup < 1.0:
                self.pause_steps = self.next_pause
            return
        self.next_pause = 4
        self.tokens_per_step = None

    @property
    def adaptive(self) -> bool:
        return not self.pinned

    def next_k(self, remaining: int) -> int:
        """Drafts for the next step; 0 = take a plain step. Never drafts past the token budget.

        The acceptance heuristic's k is capped by the k with the best predicted speedup: on a CPU adapter
        verifying 9 rows costs ~4x one row, so even at 90% acceptance 4 drafts beat 8.
        """
        if remaining <= 1:
            return 0
        if self.pause_steps > 0:
            self.pause_steps -= 1
            return 0
        k = self.k
        if self.adaptive and self.cost_aware and not self.fixed:
            if self.gated:
                k = self.k_now
            elif (best := self.best_k()) is not None:
                k = min(k, best)
        return min(k, remaining - 1, self.k_now)

    def best_k(self) -> int | None:
        """The draft length with the highest predicted speedup at the current acceptance estimate."""
        scored = [(s, k) for k in range(self.k_min, self.k_now + 1) if (s := self.pricing.speedup(self.alpha, k))]
        return max(scored)[1] if scored else None

    def observe(self, drafted: int, accepted: int) -> None:
        """Update after a speculative step."""
        if drafted == 0:
            return
        # Geometric MLE of α from this step: accepted successes before one failure (none if all accepted).
        failures = 0 if accepted == drafted else 1
        sample = accepted / (accepted + failures) if accepted + failures else 0.0
        self.alpha = (1 - _EMA) * self.alpha + _EMA * sample
        self.tokens_per_step = _ema(self.tokens_per_step, accepted + 1.0)
        if not self.adaptive:
            return
        if not self.fixed:
            self.k = min(self.k + 2, self.k_max) if accepted == drafted else max(self.k_min, self.k - 1)
        if not self.cost_aware:
            return
        best = self.best_speedup()
        if best is not None and best < 1.0:
            self.pause_steps = self.next_pause
            self.next_pause = min(self.max_pause, self.next_pause * 2)
        elif best is not None:
            self.next_pause = 4

    def best_speedup(self) -> float | None:
        if self.fixed:
            return self.fixed_speedup()
        estimates = [s for k in range(self.k_min, self.k_now + 1) if (s := self.pricing.speedup(self.alpha, k))]
        return max(estimates) if estimates else None

    def fixed_speedup(self) -> float | None:
        """Fixed mode: measured tokens per step × plain cost per token / the measured cost of a k-node step."""
        costs = self.pricing
        plain, verify = costs.verify_cost(1), costs.verify_cost(self.k + 1)
        if plain is None or verify is None or self.tokens_per_step is None:
            return None
        return self.tokens_per_step * plain / (verify + self.k * (costs.draft_per_token or 0.0))

    def forced_k(self, available: int) -> int:
        """How many of `available` tokens a grammar forces (or spells: `GrammarMatcher.forced_spelling`) one step
        should verify. They are (nearly) always accepted, so the count with the most tokens per second of
        verification (0: a plain step), whatever the drafter's acceptance or a pause; all of them (within k_now)
        where the costs are not measured yet."""
        n = min(available, self.k_now)
        costs = [self.pricing.verify_cost(m + 1) for m in range(n + 1)]
        if n < 1 or None in costs:
            return max(n, 0)
        return max(range(n + 1), key=lambda m: (m + 1) / costs[m])

    def trim(self, proposal: Proposal) -> Proposal:
        """The leading nodes of a valued proposal worth verifying, by this device's verification costs and the
        drafter's values (`tree_budget`); the whole proposal with a pinned k or in a seeded sampled generation (its
        tokens must not depend on timing). A GPU chain valued by the drafter's confidence may be cut to nothing (a
        plain step) where even its first draft is unlikely to pay."""
        if proposal.values is None or not (self.adaptive and self.cost_aware):
            return proposal
        least = 0 if proposal.on_gpu and proposal.parents is None else 1
        return proposal.leading(tree_budget(proposal.values, self.pricing, least))

    def should_speculate(self) -> bool:
        """The `auto` decision: speculate unless measured costs and acceptance predict a slowdown."""
        best = self.best_speedup()
        return best is None or best >= 1.0
