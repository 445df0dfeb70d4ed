"""`GenerationStats`: the fields added for the CLI, server and drafters (one schema), on the default model."""

from __future__ import annotations

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.engine.engine import Engine

import pytest


@pytest.fixture(scope="module")
def engine(default_model_dir):
    return Engine.load(depth=3)


def test_mtp_stats_count_the_head_drafts_and_full_cycles(engine):
    chunks = list(engine.stream("Say only the word yes.", chat=True, max_tokens=200, mtp=True, depth=3))
    stats = chunks[-1].stats
    assert chunks[-1].finish_reason == "stop"  # EOS: the last cycle was cut short
    # One chunk per decode step: the first comes from prefill, the last is the cut cycle.
    full = [len(c.token_ids) for c in chunks[1:-1]]
    assert full, "the reply must be long enough to have full cycles"
    assert stats.tokens_per_full_cycle == pytest.approx(sum(full) / len(full))
    head = stats.drafters["head"]
    assert head["drafted"] == 3 * stats.cycles
    # A full greedy cycle commits its accepted drafts plus one token from the verifier.
    accepted_in_full = sum(n - 1 for n in full)
    assert accepted_in_full <= head["accepted"] <= accepted_in_full + 3
    assert stats.prompt_tokens == stats.prefilled_tokens + stats.cached_tokens
    assert stats.cached_tokens == 0 and stats.prefilled_tokens == len(
        engine.encode_prompt("Say only the word yes.", chat=True)
    )
    # Counted here from the stream, not from the tracker: every token streamed, one cycle per chunk
    # after the first (prefill's), and the tokens those cycles committed.
    streamed = [t for chunk in chunks for t in chunk.token_ids]
    assert stats.generated_tokens == len(streamed) and stats.cycles == len(chunks) - 1
    assert stats.tokens_per_cycle == pytest.approx((len(streamed) - len(chunks[0].token_ids)) / stats.cycles)


def test_ar_stats_have_no_drafter(engine):
    stats = engine.generate("hello", max_tokens=4, mtp=False).stats
    assert stats.mode == "ar" and stats.drafters == {}
    assert stats.generated_tokens == 4 and stats.tokens_per_full_cycle == 1.0


def test_cli_stats_name_lookup_without_a_depth_and_count_cycles_per_position():
    from mtplx.cli.report import format_stats
    from mtplx.engine.engine import GenerationStats

    stats = GenerationStats(
        mode="mtp",
        depth=1,
        cycles=40,
        acceptance_per_position=[0.4, 0.0, 0.0],
        drafted_per_position=[39, 1, 1],
        drafters={"head": {"drafted": 38, "accepted": 16}, "lookup": {"drafted": 3, "accepted": 0}},
    )
    lines = format_stats(stats).splitlines()
    assert "Drafter: head, depth 1: drafted 38, accepted 16 (0.42)" in lines
    assert "Drafter: lookup: drafted 3, accepted 0 (0.00)" in lines
    assert (
        "Acceptance per draft position (cycles drafting it): 1: 0.40 (39), 2: 0.00 (1), 3: 0.00 (1)" in lines
    )
