"""A drafter written against the contract alone (`doppler_py.speculative`'s public names, nothing of the
engine's): this file is all it takes to add one. It also pins down the engine's side of the contract: what
the context holds at each call, how acceptance is counted, and which proposals are refused."""

from __future__ import annotations

import pytest
from support.decode import reference_decode

from doppler_py.errors import InternalError
from doppler_py.sampling import SamplingParams
from doppler_py.speculative import NO_PROPOSAL, NoOpHooks, Proposal, SpeculativeEngine, StepContext

GREEDY = SamplingParams()
PROMPT = [3, 17, 5, 9, 3, 17, 5, 22, 40]
NEW = 24


class OracleDrafter(NoOpHooks):
    """Knows the target's greedy continuation and proposes it, except that draft number `wrong_at` of every
    proposal is replaced by a wrong token; records what the engine showed it."""

    name = "oracle"

    def __init__(self, continuation: list[int], wrong_at: int | None, vocab: int):
        self.continuation = continuation
        self.wrong_at = wrong_at
        self.vocab = vocab
        self.seen: list[tuple[int, int, int]] = []  # (committed tokens, target cache length, hidden rows)
        self.commits: list[int] = []
        self.finished = self.closed = False

    def start(self, ctx: StepContext) -> None:
        self.prompt_len = len(ctx.tokens)

    def prefilled(self, ctx: StepContext, begin: int) -> None:
        self.seen.append((begin, ctx.target_cache.length, ctx.hidden_rows))

    def propose(self, ctx: StepContext, k: int) -> Proposal:
        self.seen.append((len(ctx.tokens), ctx.target_cache.length, ctx.hidden_rows))
        done = len(ctx.tokens) - self.prompt_len
        ids = list(self.continuation[done : done + k])
        if self.wrong_at is not None and self.wrong_at < len(ids):
            ids[self.wrong_at] = (ids[self.wrong_at] + 1) % self.vocab
        return Proposal(len(ids), ids) if ids else NO_PROPOSAL

    def commit(self, ctx: StepContext, accepted: int) -> None:
        self.commits.append(accepted)

    def finish(self) -> None:
        self.finished = True

    def close(self) -> None:
        self.closed = True


@pytest.fixture(scope="module")
def continuation(models):
    return reference_decode(models["target"], PROMPT, NEW + 8, GREEDY)


@pytest.mark.parametrize("wrong_at", [None, 0, 2])
def test_a_new_drafter_plugs_in_and_its_acceptance_is_counted_exactly(models, continuation, wrong_at):
    target = models["target"]
    drafter = OracleDrafter(continuation, wrong_at, target.config.vocab_size)
    engine = SpeculativeEngine(target, drafter)
    result = engine.generate(PROMPT, NEW, GREEDY, k=4)
    engine.close()
    assert result.tokens == continuation[:NEW]
    expected = 4 if wrong_at is None else wrong_at
    assert all(a == expected for a in drafter.commits[:-1])  # the last step may be cut by the token budget
    assert result.stats.accepted == sum(drafter.commits)
    # The prefill: one chunk of all but the last prompt token, whose rows the context then holds.
    assert drafter.seen[0] == (0, len(PROMPT) - 1, len(PROMPT) - 1)
    # Each step: the cache holds all committed tokens but the last, and the rows kept by the last step.
    for step, (committed, cached, hidden_rows) in enumerate(drafter.seen[1:]):
        assert cached == committed - 1
        assert hidden_rows == (len(PROMPT) - 1 if step == 0 else drafter.commits[step - 1] + 1)
    assert drafter.finished and drafter.closed


def test_a_proposal_longer_than_asked_is_an_internal_error(models, continuation):
    class Greedy(OracleDrafter):
        def propose(self, ctx: StepContext, k: int) -> Proposal:
            return Proposal(k + 1, [0] * (k + 1))

    engine = SpeculativeEngine(models["target"], Greedy(continuation, None, 48))
    with pytest.raises(InternalError, match="proposed 3 tokens when asked for at most 2"):
        engine.generate(PROMPT, 8, GREEDY, k=2)
    engine.close()


@pytest.mark.parametrize(
    ("parents", "error"),
    [([-1, 1], "parents must come before their children"), ([-1], "2 nodes came with 1 parent")],
)
def test_a_malformed_tree_is_refused(models, continuation, parents, error):
    class Tree(OracleDrafter):
        def propose(self, ctx: StepContext, k: int) -> Proposal:
            return Proposal(2, [1, 2], parents=parents)

    engine = SpeculativeEngine(models["target"], Tree(continuation, None, 48))
    with pytest.raises(InternalError, match=error):
        engine.generate(PROMPT, 8, GREEDY, k=2)
    engine.close()
