"""`BatchDecoder`'s trunk tap: what a row's tap sees is the trunk's output at exactly the positions
the row committed (prompt included), in order, as a teacher-forced forward over its tokens gives it.

Rows mix drafters (head drafts with rejections, plain AR), join mid-run and leave early, on a plain
and a hybrid (gated-delta) trunk; a tap shifted by one position is caught.
"""

from __future__ import annotations

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.sample.params import SamplerConfig
from mtplx.spec_decode.loop import BatchDecoder, RowSpec
from mtplx.spec_decode.settings import DecodeSettings
from mtplx.trunk.model import TrunkOutput

import mlx.core as mx
import numpy as np
import pytest
from support.decoding import SOURCES
from support.models import make_loop_pair

VOCAB = 16
SPECS = [
    RowSpec(DecodeSettings(sampler=SamplerConfig(temperature=1.0), depth=3), SOURCES["head"]),
    RowSpec(DecodeSettings(sampler=SamplerConfig(temperature=0.0), depth=2), SOURCES["head"]),
    RowSpec(DecodeSettings(sampler=SamplerConfig(temperature=1.0, top_p=0.9)), SOURCES["none"]),
]
PROMPTS = [[3, 1, 4, 1, 5, 9, 2], [6, 5], [3, 5, 8, 9, 7]]


def _tapped_run(
    trunk, head, with_taps: bool = True
) -> tuple[list[list[int]], list[list[TrunkOutput]], list[tuple[int, int]]]:
    """Each row's tokens (prompt + committed), what its tap saw, and every cycle's (drafted, accepted).

    Rows prefill in chunks of 2 tokens; row 2 joins after two cycles, row 1 leaves after four."""
    decoder = BatchDecoder(trunk, head)
    tokens = [list(p) for p in PROMPTS]
    seen: list[list[TrunkOutput]] = [[] for _ in PROMPTS]
    cycles: list[tuple[int, int]] = []
    rows: dict[int, int] = {}

    def join(r: int) -> None:
        pending = decoder.start(
            PROMPTS[r], SPECS[r], mx.random.key(7 + r), trunk_tap=seen[r].append if with_taps else None
        )
        while not decoder.prefill(pending, max_tokens=2):
            pass
        row_id, first = decoder.admit(pending)
        rows[row_id] = r
        tokens[r].extend(first.tokens)

    join(0)
    join(1)
    for cycle in range(10):
        if cycle == 2:
            join(2)
        for row_id, step in decoder.step().items():
            tokens[rows[row_id]].extend(step.tokens)
            cycles.append((step.num_drafted, step.num_accepted))
        if cycle == 3:
            decoder.leave([row_id for row_id, r in rows.items() if r == 1])
    return tokens, seen, cycles


def _worst_difference(trunk, tokens: list[int], seen: list[TrunkOutput], shift: int = 0) -> float:
    """Largest difference between what the tap saw and a teacher-forced forward over every token
    but the last (the pending one, never forwarded); ``shift`` moves the reference by that many positions."""
    forwarded = len(tokens) - 1
    hidden = mx.concatenate([o.hidden_pre_norm for o in seen], axis=1)[0]
    logits = mx.concatenate([o.logits for o in seen], axis=1)[0]
    assert hidden.shape[0] == forwarded and logits.shape[0] == forwarded  # each position once
    ref = trunk(mx.array(tokens[: forwarded + shift])[None])  # one row, no padding, no cache
    ref_hidden, ref_logits = ref.hidden_pre_norm[0, shift:], ref.logits[0, shift:]
    return max(
        float(np.abs(np.asarray(hidden) - np.asarray(ref_hidden)).max()),
        float(np.abs(np.asarray(logits) - np.asarray(ref_logits)).max()),
    )


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_rows_tap_sees_the_trunk_at_exactly_its_committed_positions(family):
    trunk, head = make_loop_pair(VOCAB, family=family)
    tokens, seen, cycles = _tapped_run(trunk, head)
    # The run exercised what the tap must get right: accepted drafts and rejected ones.
    assert any(accepted > 0 for _, accepted in cycles)
    assert any(accepted < drafted for drafted, accepted in cycles)
    for r in range(len(PROMPTS)):
        assert _worst_difference(trunk, tokens[r], seen[r]) < 1e-4, r
        # Negative control: the reference one position later is caught.
        assert _worst_difference(trunk, tokens[r], seen[r], shift=1) > 1e-3, r


def test_a_tap_does_not_change_what_rows_decode():
    trunk, head = make_loop_pair(VOCAB)
    tapped, seen, _ = _tapped_run(trunk, head)
    plain, unseen, _ = _tapped_run(trunk, head, with_taps=False)
    assert tapped == plain and all(seen) and not any(unseen)
