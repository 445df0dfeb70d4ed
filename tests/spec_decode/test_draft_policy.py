"""The batched loop's draft policy: cost interpolation, acceptance records, and the choice of a
cycle's draft length against figures worked out by hand."""

from __future__ import annotations

from mtplx.spec_decode.draft_policy import (
    ACCEPTANCE_MEMORY,
    FLOOR_REFRESH_CYCLES,
    LOOKUP_PRIOR_ACCEPTANCE,
    CostProfile,
    DraftOffer,
    DraftPolicy,
    RowAcceptance,
    drafter_records,
    row_bucket,
)

import pytest


def test_cost_profile_interpolates_and_extrapolates_linearly():
    profile = CostProfile((1, 4, 8), (0.1, 0.4, 1.2), (1, 2), (0.01, 0.03))
    assert profile.trunk(4) == pytest.approx(0.4)
    assert profile.trunk(6) == pytest.approx(0.8)  # halfway between 0.4 and 1.2
    assert profile.trunk(16) == pytest.approx(2.8)  # the last segment's slope, 0.2 per token
    assert profile.head(4) == pytest.approx(0.07)
    # 3 rows drafting 2: trunk over 9 tokens (1.4) plus two head forwards over 3 rows (0.05 each).
    assert profile.cycle(3, 2) == pytest.approx(1.4 + 2 * 0.05)


def test_a_block_drafters_forward_costs_once_per_drafting_cycle():
    """DFlash / DSpark: one block forward per cycle with K > 0, whatever K (by hand: 4 rows)."""
    profile = CostProfile((1, 8), (0.1, 0.1), (), (), (1, 8), (0.02, 0.06))
    assert profile.cycle(4, 0) == pytest.approx(0.1)  # no drafts: no block forward
    assert profile.cycle(4, 1) == profile.cycle(4, 3) == pytest.approx(0.1 + (0.02 + 3 * 0.04 / 7))
    # Rows keeping the prior's 0.4 / 0.35 / 0.3 commit 1.58 tokens at K = 3 (1 at K = 0): free
    # drafting pays; a block forward as dear as the trunk's doubles the cycle, and AR wins.
    offers = [DraftOffer(RowAcceptance(), 3)] * 4
    assert DraftPolicy(CostProfile((1, 8), (0.1, 0.1))).best_length(offers) == 3
    dear = CostProfile((1, 8), (0.1, 0.1), (), (), (1, 8), (0.1, 0.1))
    assert DraftPolicy(dear).best_length(offers) == 0


def test_cost_profile_round_trips_and_rejects_damaged_entries():
    profile = CostProfile((1, 2), (0.1, 0.15), (1,), (0.02,))
    assert CostProfile.from_dict(profile.as_dict()) == profile
    with_block = CostProfile((1, 2), (0.1, 0.15), (), (), (1, 4), (0.01, 0.02))
    assert CostProfile.from_dict(with_block.as_dict()) == with_block
    damaged = [
        {},
        {"tokens": [1, 2], "trunk_seconds": [0.1, 0.2], "block_rows": [1], "block_seconds": []},
        {"tokens": [1, 2], "trunk_seconds": [0.1]},
        {"tokens": [2, 1], "trunk_seconds": [0.1, 0.2]},
        {"tokens": [1], "trunk_seconds": [-1.0]},
        {"tokens": ["x"], "trunk_seconds": [0.1]},
    ]
    assert all(CostProfile.from_dict(d) is None for d in damaged)


def test_row_acceptance_counts_each_position_reached_and_fades():
    record = RowAcceptance()
    record.observe(3, 1)  # d1 kept, d2 rejected, d3 never reached
    assert record.reached == [1, 1, 0]
    assert record.accepted == [1, 0, 0]
    record.observe(2, 2)  # the earlier cycle now counts 0.95
    assert record.reached == pytest.approx([1.95, 1.95, 0])
    assert record.accepted == pytest.approx([1.95, 1, 0])


def test_expected_tokens_follow_the_smoothed_record():
    record = RowAcceptance()
    for _ in range(96):
        record.observe(1, 1)  # always kept
    # 96 cycles fading by 0.95 weigh sum(0.95^j, j < 96); the prior adds 0.4 * 4 over 4.
    weight = sum(ACCEPTANCE_MEMORY**j for j in range(96))
    assert record.expected_tokens(0) == 1.0
    assert record.expected_tokens(1) == pytest.approx(1 + (weight + 1.6) / (weight + 4))


def test_a_row_kept_from_drafting_is_tried_again():
    # One drafted token costs 22% more: drafting pays above 0.22 acceptance.
    policy = DraftPolicy(CostProfile((1, 2), (0.1, 0.122)))
    record = RowAcceptance()
    for _ in range(4):
        record.observe(1, 0)  # four early rejections: (0 + 1.6) / (3.71 + 4) = 0.208
    offer = [DraftOffer(record, 1)]
    assert policy.best_length(offer) == 0
    chosen = []
    for _ in range(10):  # each K = 0 cycle fades the record towards the prior (0.4): after
        # three, 1.6 / (3.71 * 0.95^3 + 4) = 0.223
        chosen.append(policy.best_length(offer))
        if chosen[-1] == 0:
            record.skip()
    assert chosen == [0, 0, 0] + [1] * 7, chosen
    # Negative control: a record that does not fade stays locked out.
    frozen = RowAcceptance()
    for _ in range(4):
        frozen.observe(1, 0)
    frozen.reached, frozen.accepted = [4.0], [0.0]
    assert all(policy.best_length([DraftOffer(frozen, 1)]) == 0 for _ in range(10))


def head_rows(n: int, depth: int = 1) -> list[DraftOffer]:
    """n new rows offering head drafts (the prior: 0.4 at the first position)."""
    return [DraftOffer(RowAcceptance(), depth) for _ in range(n)]


def test_compute_bound_cost_keeps_plain_ar_and_memory_bound_cost_drafts():
    fresh = head_rows(8, depth=3)
    # Cost proportional to tokens: drafting 1 doubles the cost for 1.4 tokens a row.
    compute_bound = DraftPolicy(CostProfile((1, 64), (0.01, 0.64)))
    assert compute_bound.best_length(fresh) == 0
    # Flat cost: every extra draft is free, so the deepest wins.
    memory_bound = DraftPolicy(CostProfile((1, 64), (0.1, 0.1)))
    assert memory_bound.best_length(fresh) == 3


def test_rows_that_do_not_draft_count_one_token_at_any_length():
    # 8 tokens cost 0.08 s, 16 cost 0.10 s. Four drafting rows at the prior (1.4 each at K=1):
    # K=0: 4 / 0.06 = 66.7 tok/s; K=1: 5.6 / 0.08 = 70 tok/s, so K=1 ...
    profile = CostProfile((4, 8, 16), (0.06, 0.08, 0.10))
    assert DraftPolicy(profile).best_length(head_rows(4)) == 1
    # ... but with four more rows that never draft: K=0: 8 / 0.08 = 100; K=1: 9.6 / 0.10 = 96.
    rows = [*head_rows(4), *[None] * 4]
    assert DraftPolicy(profile).best_length(rows) == 0


def test_measured_cycles_calibrate_the_choice():
    # The profile says drafting pays (flat cost) ...
    policy = DraftPolicy(CostProfile((1, 64), (0.1, 0.1)))
    rows = head_rows(8)
    assert policy.best_length(rows) == 1
    # ... but cycles that draft measure 3x slower than predicted (0.3 s), AR ones as predicted:
    # K=1 now gives 8 * 1.4 / 0.3 = 37 tok/s against K=0's 8 / 0.1 = 80.
    for _ in range(30):
        policy.observe_cycle(8, 1, 0.3)
        policy.observe_cycle(8, 0, 0.1)
    assert policy.calibration[(8, 1)] == pytest.approx(3.0)
    assert policy.best_length(rows) == 0
    policy.observe_cycle(8, 0, 1e6)  # one stall moves the mean by at most the limit
    assert policy.calibration[(8, 0)] <= 1.0 + 0.1 * (4.0 - 1.0) + 1e-9


def test_calibration_is_kept_per_row_bucket():
    # Cost proportional to tokens (0.01 s each). Plain AR cycles ran with 16 rows in, where the
    # ragged attention makes every cycle 2x the one-row profile; drafting cycles ran when 2 rows
    # were in, as predicted.
    policy = DraftPolicy(CostProfile((1, 64), (0.01, 0.64)))
    for _ in range(30):
        policy.observe_cycle(16, 0, 0.32)
        policy.observe_cycle(2, 1, 0.04)
    assert policy.calibration == pytest.approx({(16, 0): 2.0, (2, 1): 1.0})
    rows = head_rows(16)  # the prior: 1.4 tokens a row at K = 1
    # At 16 rows K = 1 was never measured, so it takes the bucket's 2.0 like K = 0:
    # K = 0 gives 16 / 0.32 = 50 tok/s, K = 1 gives 22.4 / 0.64 = 35. Keyed by K alone (K = 1 at
    # its 2-row ratio 1.0) it would have been 22.4 / 0.32 = 70 and drafting would have won.
    assert policy.cycle_seconds(16, 1) == pytest.approx(0.64)
    assert policy.best_length(rows) == 0
    # A bucket with nothing measured uses the profile as it is.
    assert policy.cycle_seconds(32, 1) == pytest.approx(0.64)
    assert [row_bucket(n) for n in (1, 2, 3, 16, 17)] == [1, 2, 4, 16, 32]


def test_a_row_gains_nothing_past_what_its_drafter_offers():
    # Flat cost to 4 tokens, then 0.05 s a token. One row offers a depth-1 head, the other a
    # 3-token lookup match kept half the time at every position, as the records say.
    profile = CostProfile((1, 4, 8), (0.1, 0.1, 0.3))
    lookup = RowAcceptance((0.5,))
    head = DraftOffer(RowAcceptance(), 1)
    # At K = 3 the head row still drafts one token, so it commits its K = 1 figure:
    assert head.expected_tokens(3) == pytest.approx(head.expected_tokens(1)) == pytest.approx(1.4)
    # K = 3 over 2 rows forwards 8 tokens (0.3 s): 1.4 + (1 + 0.5 + 0.25 + 0.125) = 3.275 tokens,
    # 10.9 tok/s; K = 1 forwards 4 (0.1 s) for 1.4 + 1.5 = 29 tok/s, and wins.
    assert DraftPolicy(profile).best_length([head, DraftOffer(lookup, 3)]) == 1
    # Alone, the lookup row drafts its whole match where extra tokens are free (4 tokens, 0.1 s).
    assert DraftPolicy(profile).best_length([DraftOffer(lookup, 3)]) == 3


def test_lookup_and_head_keep_their_own_records():
    """A lookup match is judged by the row's lookup record, not by its head drafts: a row whose
    head drafts are always rejected still drafts its whole match when matches are kept."""
    records = drafter_records()
    assert records["lookup"].prior == LOOKUP_PRIOR_ACCEPTANCE
    for _ in range(20):
        records["head"].observe(1, 0)
        records["lookup"].observe(4, 4)
    # One drafted token costs 50% more than none, four cost 3x: head drafts kept 1 time in 15
    # (smoothed) do not pay; the match, kept 0.93-0.97 a position, does at its full length
    # (4.55 tokens / 0.3 s = 15 tok/s against 10 for none).
    policy = DraftPolicy(CostProfile((1, 2, 5), (0.1, 0.15, 0.3)))
    assert policy.best_length([DraftOffer(records["head"], 1)]) == 0
    assert policy.best_length([DraftOffer(records["lookup"], 4)]) == 4
    # Negative control: one pooled record (head rejections counted against the match: 0.49 at
    # the first position) gives up drafting altogether (2.66 tokens / 0.3 s = 8.9 tok/s).
    pooled = RowAcceptance()
    for _ in range(20):
        pooled.observe(1, 0)
        pooled.observe(4, 4)
    assert policy.best_length([DraftOffer(pooled, 4)]) == 0


def test_the_floor_is_timed_where_drafting_was_chosen_first():
    # The profile: 8 tokens 0.10 s, 16 tokens 0.12 s, so for 8 rows at the prior (1.4 tokens a
    # row at K = 1) drafting looks better: 11.2 / 0.12 = 93 tok/s against 8 / 0.10 = 80. The
    # machine disagrees: a drafting cycle takes 0.16 s (verification and the head are not in the
    # profile), 70 tok/s, so plain AR is the faster choice.
    profile = CostProfile((8, 16), (0.10, 0.12))
    measured = {0: 0.10, 1: 0.16}

    def run(policy: DraftPolicy, cycles: int) -> list[int]:
        rows, chosen = head_rows(8), []
        for _ in range(cycles):
            k = policy.choose(rows)
            policy.observe_cycle(8, k, measured[k])
            chosen.append(k)
        return chosen

    # The floor is timed first, then K = 1 once (unmeasured, it borrows the floor's 1.0 and looks
    # better); its 0.16 s (calibration 4/3) puts it at 70 tok/s, and AR stays.
    assert run(DraftPolicy(profile), 40) == [0, 1] + [0] * 38
    # Negative control, the floor never timed unasked: it borrows K = 1's 4/3 (60 tok/s against
    # 70), and the policy drafts every cycle at 0.875x the floor's rate.
    assert run(DraftPolicy(profile, floor_refresh=None), 40) == [1] * 40


def test_the_floor_is_timed_again_every_refresh_cycles():
    # Flat cost: drafting pays and is chosen, but every FLOOR_REFRESH_CYCLES drafting cycles in a
    # row (per row bucket) one plain AR cycle keeps the floor's calibration current.
    policy = DraftPolicy(CostProfile((1, 64), (0.1, 0.1)), floor_refresh=3)
    rows = head_rows(8)
    chosen = [policy.choose(rows) for _ in range(9)]
    assert chosen == [0, 1, 1, 1, 0, 1, 1, 1, 0]
    # Each row bucket keeps its own count: 2 rows start with their floor.
    assert policy.choose(head_rows(2)) == 0
    assert policy.floor_age == {8: 0, 2: 0}
    assert FLOOR_REFRESH_CYCLES == DraftPolicy(CostProfile((1,), (1.0,))).floor_refresh
    # A cycle that will not be timed (rows just joined or left) neither times the floor nor ages it.
    fresh = DraftPolicy(CostProfile((1, 64), (0.1, 0.1)), floor_refresh=3)
    assert [fresh.choose(rows, timed=False) for _ in range(5)] == [1] * 5
    assert fresh.floor_age == {}
    assert fresh.choose(rows) == 0
