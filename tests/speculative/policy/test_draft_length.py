"""The draft-length policy: HF's acceptance heuristic, the measured-cost cap, and auto-off with backoff."""

from __future__ import annotations

import pytest

from doppler_py.errors import GenerationOptionError
from doppler_py.speculative.policy.draft_length import (
    CostModel,
    DraftLengthPolicy,
    expected_tokens,
    tree_budget,
    worth_drafting,
)

# Verify costs shaped like lavapipe's (seconds by rows): T=5 ~2x T=1, T=9 ~4x.
CPU_COSTS = {1: 0.040, 2: 0.044, 3: 0.052, 5: 0.074, 9: 0.170}


def policy_with(costs: dict[int, float] | None = None, *, k: int | None = None, pinned: bool = False):
    """A policy with the engine's usual capacity of 16 whose generation starts at draft length k."""
    policy = DraftLengthPolicy(capacity=16)
    policy.reset(k if pinned else None)
    if k is not None:
        policy.k = k
    for rows, seconds in (costs or {}).items():
        policy.costs.observe_verify(rows, seconds)
    return policy


def test_expected_tokens_per_step_is_the_truncated_geometric_sum():
    assert expected_tokens(0.0, 4) == pytest.approx(1.0)
    assert expected_tokens(1.0, 4) == pytest.approx(5.0)
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_k_grows_by_two_after_full_acceptance_and_shrinks_by_one_after_a_rejection():
    policy = policy_with(k=2)
    policy.observe(drafted=2, accepted=2)
    assert policy.k == 4
    policy.observe(drafted=4, accepted=4)
    assert policy.k == 6
    policy.observe(drafted=6, accepted=1)
    assert policy.k == 5
    for _ in range(10):
        policy.observe(drafted=policy.k, accepted=0)
    assert policy.k == policy.k_min


def test_pinned_k_never_changes():
    policy = policy_with(k=3, pinned=True)
    policy.observe(drafted=3, accepted=3)
    policy.observe(drafted=3, accepted=0)
    assert policy.next_k(100) == 3


def test_measured_costs_cap_k_at_the_best_predicted_speedup():
    policy = policy_with(CPU_COSTS, k=8)
    policy.alpha = 0.9
    best = policy.best_k()
    assert best is not None and best < 8  # verifying 9 rows costs 4x one row here
    assert policy.next_k(100) == best
    # On a GPU-like device where verifying 9 rows costs barely more than one, the cap disappears.
    gpu = policy_with({1: 0.010, 5: 0.0105, 9: 0.011}, k=8)
    gpu.alpha = 0.9
    assert gpu.next_k(100) == 8


def test_speculation_pauses_when_acceptance_predicts_a_slowdown_and_the_pause_backs_off():
    policy = policy_with(CPU_COSTS, k=2)
    for _ in range(6):
        policy.observe(drafted=2, accepted=0)
        while policy.pause_steps:
            assert policy.next_k(100) == 0
    assert policy.next_pause > 4
    assert not policy.should_speculate()


def test_without_cost_awareness_the_step_structure_depends_on_acceptance_only():
    policy = policy_with(CPU_COSTS, k=4)
    policy.reset(cost_aware=False)
    for _ in range(5):
        policy.observe(drafted=policy.k, accepted=0)
    assert policy.pause_steps == 0
    assert policy.next_k(100) == policy.k_min


def test_draft_lengths_outside_the_engine_capacity_are_refused():
    policy = DraftLengthPolicy(capacity=16)
    with pytest.raises(GenerationOptionError, match=r"draft length\) must be an integer in 1\.\.16"):
        policy.reset(17)
    with pytest.raises(GenerationOptionError, match="draft length"):
        policy.reset(0)


def test_an_unpinned_k_starts_at_the_default_and_stays_within_a_small_capacity():
    policy = DraftLengthPolicy(capacity=3)
    policy.reset()
    assert policy.k == 3 and policy.k_max == 3
    for _ in range(4):
        policy.observe(drafted=policy.k, accepted=policy.k)
    assert policy.next_k(100) <= 3


def test_a_step_cost_beyond_the_verification_is_billed_to_drafting():
    costs = CostModel()
    costs.observe_verify(1, 1.0)
    costs.observe_verify(5, 2.0)
    costs.observe_step(4, 4.0)
    assert costs.draft_per_token == pytest.approx(0.5)
    assert costs.speedup(1.0, 4) == pytest.approx(5 * 1.0 / 4.0)


def test_verify_costs_are_interpolated_between_measured_sizes():
    costs = CostModel()
    costs.observe_verify(1, 1.0)
    costs.observe_verify(9, 5.0)
    assert costs.verify_cost(5) == pytest.approx(3.0)
    assert costs.verify_cost(1) == 1.0


def test_more_rows_never_cost_less_than_fewer_measured_ones():
    """A stale calibration of 4 rows below the live cost of 3 must not make a longer draft look cheaper."""
    costs = CostModel()
    for rows, seconds in ((1, 0.08), (2, 0.09), (3, 0.12), (4, 0.10), (6, 0.13)):
        costs.observe_verify(rows, seconds)
    assert [costs.verify_cost(r) for r in (1, 2, 3, 4, 5, 6)] == pytest.approx([0.08, 0.09, 0.12, 0.12, 0.12, 0.13])
    costs.observe_draft(1, 0.02)
    assert costs.speedup(0.5, 3) < costs.speedup(0.5, 2)  # the same verification and one draft more


def test_a_drafting_measured_apart_is_billed_per_draft():
    costs = CostModel()
    costs.observe_draft(4, 0.02)
    assert costs.draft_per_token == pytest.approx(0.005)


def test_one_stalled_step_moves_a_cost_by_at_most_a_bounded_share():
    """A 0.45 s stall among 0.13 s steps must not leave the cost of 3 rows at several plain steps."""
    costs = CostModel()
    costs.observe_verify(1, 0.09)
    costs.observe_verify(3, 0.13)
    costs.observe_verify(3, 0.45)
    assert costs.verify_cost(3) == pytest.approx(0.13 * (1 + 0.3 * 0.5))
    for _ in range(3):
        costs.observe_verify(3, 0.13)
    assert costs.verify_cost(3) < 0.14


def test_a_lasting_change_of_speed_is_still_followed():
    costs = CostModel()
    costs.observe_verify(2, 0.1)
    for _ in range(20):
        costs.observe_verify(2, 0.3)
    assert costs.verify_cost(2) == pytest.approx(0.3, rel=0.02)
    costs.observe_draft(1, 0.0)  # a drafting measured as nothing stays nothing, and may grow again
    costs.observe_draft(1, 0.0)
    assert costs.draft_per_token == 0.0
    costs.observe_draft(1, 0.01)
    assert costs.draft_per_token == pytest.approx(0.003)


def test_a_cost_first_measured_too_high_falls_at_the_full_rate():
    """Only slow outliers are clipped: a 98 ms first draft (a stall) must not take dozens of steps to unlearn."""
    costs = CostModel()
    costs.observe_draft(1, 0.098)
    costs.observe_draft(1, 0.002)
    assert costs.draft_per_token == pytest.approx(0.7 * 0.098 + 0.3 * 0.002)


def test_a_chains_newest_draft_is_worth_drafting_while_it_beats_the_measured_throughput():
    costs = CostModel()
    assert worth_drafting([0.01], costs)  # nothing measured: draft
    for rows, seconds in ((1, 1.0), (2, 1.2), (3, 1.4)):
        costs.observe_verify(rows, seconds)
    costs.observe_draft(1, 0.05)
    # No throughput measured: the bar is plain decoding's 1 token/s, and each draft (0.05 s) and its row (0.2 s)
    # pay when the draft adds more than 0.25 expected tokens, deep in a chain as at its start.
    assert worth_drafting([0.3], costs) and not worth_drafting([0.2], costs)
    assert worth_drafting([0.9, 0.3], costs) and not worth_drafting([0.9, 0.2], costs)
    # Steps made 1.6 tokens/s: a node must now add 1.6 × 0.25 = 0.4 tokens.
    costs.observe_throughput(2, 1.25)
    assert worth_drafting([0.45], costs) and not worth_drafting([0.35], costs)
    assert worth_drafting([0.95, 0.45], costs) and not worth_drafting([0.95, 0.35], costs)


def test_the_bar_is_the_measured_throughput_but_never_below_plain_decoding():
    costs = CostModel()
    assert costs.bar() is None
    costs.observe_verify(1, 0.1)
    assert costs.bar() == pytest.approx(10.0)  # plain decoding: 10 tokens/s
    costs.observe_throughput(3, 0.2)
    assert costs.bar() == pytest.approx(15.0)
    for _ in range(60):  # slow steps pull the throughput below plain decoding: the bar stays there
        costs.observe_throughput(1, 0.3)
    assert costs.bar() == pytest.approx(10.0)


def test_a_valued_chain_may_be_cut_to_a_plain_step_only_when_asked():
    costs = CostModel()
    for rows, seconds in ((1, 1.0), (2, 1.3), (3, 1.5)):
        costs.observe_verify(rows, seconds)
    assert tree_budget([0.2, 0.1], costs, least=0) == 0  # 1 + 0.2 - 1.3 < 1 - 1.0 at the plain bar, 1 token/s
    assert tree_budget([0.2, 0.1], costs) == 1  # trees: at least one node
    assert tree_budget([0.6, 0.5], costs, least=0) == 2


def test_forced_tokens_are_verified_as_many_as_give_the_most_tokens_per_second():
    policy = DraftLengthPolicy(capacity=8)
    assert policy.forced_k(5) == 5 and policy.forced_k(20) == policy.k_now and policy.forced_k(0) == 0  # unmeasured
    for rows, seconds in {1: 1.0, 2: 1.2, 3: 1.5, 4: 2.5, 5: 6.0, 6: 7.0}.items():
        policy.costs.observe_verify(rows, seconds)
    assert policy.forced_k(5) == 2  # 3 tokens in 1.5 s beat 2 in 1.2 s and 4 in 2.5 s
    policy.pause_steps = 10  # a pause (the drafter's acceptance) does not stop the grammar's own drafts
    assert policy.forced_k(1) == 1


def test_a_shared_step_prices_each_extra_row_once_per_generation_it_delays():
    alone = policy_with(CPU_COSTS).costs
    shared = alone.shared(step_s=0.100, members=4)
    assert shared.verify_cost(1) == pytest.approx(0.100)
    assert shared.verify_cost(5) == pytest.approx(0.100 + 4 * (0.074 - 0.040))
    assert shared.bar() == pytest.approx(1 / 0.100)
    # One member whose plain step takes its own plain cost is priced as alone.
    same = alone.shared(step_s=0.040, members=1)
    assert [same.verify_cost(r) for r in (1, 2, 4, 9)] == pytest.approx([alone.verify_cost(r) for r in (1, 2, 4, 9)])


def test_sharing_forwards_shortens_drafts_where_extra_rows_cost_and_not_where_they_are_nearly_free():
    policy = policy_with(CPU_COSTS, k=8)
    policy.alpha = 0.9
    alone_k = policy.next_k(100)  # 4 here: 3 extra rows cost 0.034 s against a plain step's 0.040 s
    policy.shared = policy.costs.shared(step_s=0.080, members=4)
    batched_k = policy.next_k(100)
    assert 1 <= batched_k < alone_k
    # Where drafting stops paying in the batch, speculation pauses there as alone.
    policy.alpha = 0.15
    assert policy.best_speedup() < 1.0 < policy_with(CPU_COSTS).costs.speedup(0.15, 1)
    gpu = policy_with({1: 0.010, 5: 0.0105, 9: 0.011}, k=8)
    gpu.alpha = 0.8
    gpu.shared = gpu.costs.shared(step_s=0.012, members=4)
    assert gpu.next_k(100) == 8
