"""Per step, the better of prompt lookup and a trained head: an n-gram match where it promises more.

A trained head drafts ordinary text; prompt lookup wins where the answer copies the prompt (a long match is
often accepted whole, and costs no drafting). Each step asks lookup first (host only, free): its proposal is
taken when its length times lookup's measured acceptance rate beats the head's measured mean accepted per
step, else the head drafts. Both estimates are running means over this drafter's own steps, started from
priors, so the choice follows what is measured on the text at hand.

The head sees every verified row whoever proposed (its `commit` consumes the accepted rows' features), so it
is ready whenever it is chosen again.

What it declares (contract.Drafter), from its parts: the head's feature taps and pipelines; chains only (the
per-step choice is between two chains); and no gating, a declared choice: `--speculative eagle` ends EAGLE's
chains by its confidence with k as a ceiling, but here k also sizes lookup's match, which has no confidence to
end it, so the policy keeps pricing k for both from their measured acceptance.
"""

from __future__ import annotations

from collections.abc import Sequence

from doppler_py.ops.linear import Linear
from doppler_py.speculative.contract import NO_PROPOSAL, Drafter, NoOpHooks, Proposal, StepContext


class RunningMean:
    """A mean over the last ~`window` observations (exponential), starting from a prior."""

    def __init__(self, prior: float, window: int = 16):
        self.value, self.alpha = prior, 1.0 / window

    def add(self, x: float) -> None:
        self.value += self.alpha * (x - self.value)


class BestOfDrafter(NoOpHooks):
    def __init__(self, lookup: Drafter, head: Drafter):
        if lookup.fixed_nodes is not None or head.fixed_nodes is not None:
            raise ValueError("a drafter with a fixed step shape cannot share steps with another")
        self.lookup, self.head = lookup, head
        self.name = f"{head.name}+{lookup.name}"
        self.feature_taps = tuple(dict.fromkeys((*head.feature_taps, *lookup.feature_taps)))
        self.reads_prompt_features = head.reads_prompt_features or lookup.reads_prompt_features
        self.reads_step_rows = head.reads_step_rows or lookup.reads_step_rows
        self.reads_verified_logits = head.reads_verified_logits or lookup.reads_verified_logits
        self.lookup_rate = RunningMean(0.5)  # accepted / proposed, over lookup's steps
        self.head_accepted = RunningMean(1.0)  # accepted per step, over the head's steps
        self.last: tuple[Drafter, int] | None = None  # who proposed the last proposal, and how many tokens

    def continue_tokens(self, tokens: Sequence[int], k: int) -> list[int]:
        return self.lookup.continue_tokens(tokens, k)

    def matmuls(self) -> tuple[Linear, ...]:
        return (*self.lookup.matmuls(), *self.head.matmuls())

    def compile(self, max_rows: int | None = None) -> None:
        self.lookup.compile(max_rows)
        self.head.compile(max_rows)

    def start(self, ctx: StepContext) -> None:
        self.last = None
        self.lookup.start(ctx)
        self.head.start(ctx)

    def prefilled(self, ctx: StepContext, begin: int) -> None:
        self.lookup.prefilled(ctx, begin)
        self.head.prefilled(ctx, begin)

    def join(self, ctx: StepContext) -> bool:
        self.last = None
        return self.lookup.join(ctx) and self.head.join(ctx)

    def propose(self, ctx: StepContext, k: int) -> Proposal:
        matched = self.lookup.propose(ctx, k)
        proposal, source = matched, self.lookup
        if matched.count * self.lookup_rate.value <= self.head_accepted.value:
            drafted = self.head.propose(ctx, k)
            if drafted.count:  # else (a head that cannot draft here) the match, if any
                proposal, source = drafted, self.head
        self.last = (source, proposal.count) if proposal.count else None
        return proposal if proposal.count else NO_PROPOSAL

    def commit(self, ctx: StepContext, accepted: int) -> None:
        if self.last is not None:
            source, proposed = self.last
            if source is self.lookup:
                self.lookup_rate.add(accepted / proposed)
            else:
                self.head_accepted.add(accepted)
            self.last = None
        self.lookup.commit(ctx, accepted)
        self.head.commit(ctx, accepted)

    def finish(self) -> None:
        self.lookup.finish()
        self.head.finish()

    def close(self) -> None:
        self.lookup.close()
        self.head.close()
