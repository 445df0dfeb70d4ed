"""`measure_cost_profile` asks ``should_stop`` before every forward and gives up at once
(`MeasurementStopped`): a server stopping while its worker measures exits without waiting for
the whole measurement (tests/server/test_serve_stop.py drives that through a real server)."""

from __future__ import annotations

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.spec_decode.draft_policy import MeasurementStopped, measure_cost_profile

import pytest
from support import drafters

VOCAB = 16
SIZES = {"max_tokens": 4, "max_rows": 2, "context": 4, "repeats": 1}


class StopAt:
    """A ``should_stop`` that says stop on its ``at``-th question (never: None); counts them."""

    def __init__(self, at: int | None):
        self.at, self.asked = at, 0

    def __call__(self) -> bool:
        self.asked += 1
        return self.at is not None and self.asked >= self.at


def test_the_measurement_stops_at_the_question_that_says_so():
    trunk = drafters.tiny_target(0, 2, VOCAB)
    never = StopAt(None)
    profile = measure_cost_profile(trunk, **SIZES, should_stop=never)
    assert profile.tokens == (1, 2, 4)
    # 3 trunk sizes: each asked before its context forward, its warm-up and its timed call
    assert never.asked == 9
    for at in (1, 5, never.asked):
        stop = StopAt(at)
        with pytest.raises(MeasurementStopped):
            measure_cost_profile(trunk, **SIZES, should_stop=stop)
        assert stop.asked == at  # nothing measured after the stop was seen
