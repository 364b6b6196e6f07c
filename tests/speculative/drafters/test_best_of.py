"""The per-step choice between prompt lookup and a head, with scripted drafters (no GPU)."""

from __future__ import annotations

from doppler_py.speculative.contract import NO_PROPOSAL, NoOpHooks, Proposal
from doppler_py.speculative.drafters.best_of import BestOfDrafter


class Scripted(NoOpHooks):
    """Proposes `count` tokens each step; records what it was told."""

    def __init__(self, name: str, count: int):
        self.name, self.count, self.proposed, self.commits = name, count, 0, []

    def start(self, ctx) -> None:
        pass

    def prefilled(self, ctx, begin: int) -> None:
        pass

    def propose(self, ctx, k: int) -> Proposal:
        if not self.count:
            return NO_PROPOSAL
        self.proposed += 1
        return Proposal(min(k, self.count), [1] * min(k, self.count))

    def commit(self, ctx, accepted: int) -> None:
        self.commits.append(accepted)

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


def run(best: BestOfDrafter, steps: int, accept) -> list[str]:
    """Who proposed at each step; `accept(source, n)` is how many of its n tokens the target accepts."""
    used = []
    for _ in range(steps):
        proposal = best.propose(None, 4)
        source = best.last[0] if best.last else None
        used.append(source.name if source else "-")
        best.commit(None, accept(source, proposal.count) if source else 0)
    return used


def test_a_long_match_is_taken_first_and_dropped_once_it_keeps_being_rejected():
    lookup, head = Scripted("lookup", 4), Scripted("head", 4)
    best = BestOfDrafter(lookup, head)
    used = run(best, 40, lambda source, n: 0 if source is lookup else 2)
    assert used[0] == "lookup"  # prior: 4 × 0.5 > 1 accepted per head step
    assert used[-10:] == ["head"] * 10  # measured: lookup's matches are rejected, the head's accepted
    assert len(lookup.commits) == len(head.commits) == 40  # both see every step, whoever proposed


def test_a_match_that_is_accepted_keeps_winning_and_a_head_that_cannot_draft_leaves_the_match():
    lookup, head = Scripted("lookup", 4), Scripted("head", 4)
    best = BestOfDrafter(lookup, head)
    assert run(best, 20, lambda source, n: n) == ["lookup"] * 20
    short = BestOfDrafter(Scripted("lookup", 1), Scripted("head", 0))
    assert run(short, 3, lambda source, n: 0) == ["lookup"] * 3  # 1 × 0.5 < 1, but the head has nothing
    assert run(BestOfDrafter(Scripted("lookup", 0), Scripted("head", 0)), 2, lambda s, n: 0) == ["-", "-"]
