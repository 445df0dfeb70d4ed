"""Checks of a generation request's arguments that need no model (so a typo costs no load time).

Messages name the argument as the API spells it (``max_tokens must be > 0 (got 0)``); the
CLI rewrites the name into the flag the user typed. Kept light (no mlx, no mlx-lm) so the
command line can run it before importing the engine.
"""

from __future__ import annotations

from mtplx.errors import MtplxError
from mtplx.sample.params import SamplerConfig

# mx.random.key takes an unsigned 64-bit seed.
SEED_LIMIT = 2**64


def check_generation_args(
    *, max_tokens: int, depth: int | None = None, seed: int | None = None, **sampling
) -> SamplerConfig:
    """Validate ``max_tokens``, ``depth`` and the sampling arguments; returns the sampler config."""
    if max_tokens <= 0:
        raise MtplxError(f"max_tokens must be > 0 (got {max_tokens})")
    if depth is not None and depth < 1:
        raise MtplxError(f"depth must be >= 1 (got {depth})")
    if seed is not None and not 0 <= seed < SEED_LIMIT:
        raise MtplxError(f"seed must be in [0, 2**64) (got {seed})")
    return SamplerConfig(**sampling)
