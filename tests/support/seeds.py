"""Seeds for randomized tests: two fixed seeds plus one fresh seed drawn inside the test.

The parametrize ids are stable ("seed0", "seed1", "fresh"), so ``--lf`` and
xdist see the same test names every run; ``resolve`` draws the fresh seed when
the test runs and prints it (pytest shows it on failure). Tests also name the
resolved seed in their assertion messages.
"""

from __future__ import annotations

import numpy as np
import pytest

FRESH = -1
SEEDS = [pytest.param(0, id="seed0"), pytest.param(1, id="seed1"), pytest.param(FRESH, id="fresh")]


def resolve(seed: int) -> int:
    """The seed to use: ``seed`` itself, or a new random one for the ``fresh`` case."""
    if seed != FRESH:
        return seed
    fresh = int(np.random.SeedSequence().entropy % 2**32)
    print(f"fresh seed: {fresh}")
    return fresh
