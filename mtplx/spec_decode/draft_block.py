"""The drafter contract: what every drafter returns to the cycle (`DraftBlock`) and the calls the
cycle makes (`Drafter`). Drafters return data; the loop (`mtplx.spec_decode.loop`) merges the
blocks per row by the row's sources and cuts them to its length. No drafter imports or mutates
the cycle's own data (`mtplx.spec_decode.block`); a structure test keeps it so.

Glossary: B rows (the batch, in its order); K the block's width (its longest row); V the vocabulary.

Batch-first, B = 1 allowed: a stream is a batch of one through the same drafters. A drafter
proposes for every row the cycle asks it to (``most[r]`` > 0: at most that many drafts for row r)
and returns a block over all B rows, length 0 for the others. Exactness never depends on what a
drafter proposes (`mtplx.sample.rejection.verify` is exact for any q): a draft at position i may
depend on the committed text, earlier drafts and randomness independent of the verify uniforms.
The next drafters (DFlash / DSpark block drafters with a per-position q and a confidence cut,
EAGLE-3 with its own KV cache, trees through ``parents``) return the same block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from mtplx.sample import ops as sample_ops
from mtplx.spec_decode.sources import Source

import mlx.core as mx

__all__ = [
    "DraftBlock",
    "Drafter",
    "Outcome",
    "Source",
    "gather_positions",
    "groups_by",
    "host_block",
    "pad_time",
    "padded_uniforms",
]


@dataclass
class DraftBlock:
    """One drafter's drafts for B rows.

    ``tokens`` [B, K] int32 (lazy where a model drew them; padding past a row's length is never
    read); ``lengths[r]`` = k_r drafts of row r (0: none); ``q`` [B, K, V] float32, the
    distribution each draft was drawn from (None: every draft a point mass); ``confidence``
    [B, K] the drafter's own confidence in each draft (None: none; a row's length policy may cut
    its block after an unsure draft: the adaptive head, DSpark's confidence head); ``sources[r]``
    the (source, count) segments of row r's drafts in block order; ``parents`` [B, K] a tree's
    parent positions (None: a linear chain, the only shape the cycle verifies today);
    ``invalid`` [] int32 the draft sampling's lazy INVALID_* flags (`sample.ops`) for the rows it
    drafted; ``host_tokens[r]`` row r's drafts when they are on the host already (lookup, forced
    tokens; None: read them if needed); ``host_reads[r]`` drafts read to the host while drafting."""

    tokens: mx.array
    lengths: list[int]
    sources: list[tuple[tuple[Source, int], ...]]
    q: mx.array | None = None
    confidence: mx.array | None = None
    parents: mx.array | None = None
    invalid: mx.array | None = None
    host_tokens: list[list[int] | None] | None = None
    host_reads: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.host_reads:
            self.host_reads = [0] * len(self.lengths)

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1]) if self.tokens.ndim == 2 else 0

    def drafted_rows(self) -> list[int]:
        return [i for i, n in enumerate(self.lengths) if n]


def host_block(drafts: Sequence[Sequence[int]], source: Source) -> DraftBlock:
    """A block of point masses known on the host (lookup, forced tokens), one list per row."""
    width = max((len(d) for d in drafts), default=0)
    tokens = mx.array([list(d) + [0] * (width - len(d)) for d in drafts], dtype=mx.int32)
    return DraftBlock(
        tokens.reshape(len(drafts), width),
        [len(d) for d in drafts],
        [((source, len(d)),) if d else () for d in drafts],
        host_tokens=[list(d) for d in drafts],
    )


class Drafter(Protocol):
    """A batch-first drafter. Per-row state lives on the rows (`rows.BatchRow`), so a row's join
    or leave touches nothing here; a drafter with a cache of its own across rows (the head
    chain, later EAGLE-3) keeps it in row order and follows `rows_moved`."""

    source: Source

    def propose(self, rows: Sequence, keys: Sequence, most: Sequence[int]) -> DraftBlock:
        """At most ``most[r]`` drafts for row r (0: none), after each row's history; ``keys[r]``
        the row's cycle keys (`block.CycleKeys`: ``.draft`` seeds its draws)."""
        ...

    def commit(self, rows: Sequence, outcome) -> None:
        """After the cycle's sync: ``outcome`` (`loop.CycleOutcome`) holds the trunk's output,
        each row's accepted count, its committed tokens and the (source, count) segments it
        verified. Called every cycle, for rows it did not draft for too."""
        ...


@dataclass
class Outcome:
    """What one cycle committed, per batch row (a drafter's `commit` reads it): the trunk's output
    over the block [B, K+1, ...], each row's accepted drafts, its committed tokens (the accepted
    drafts and the next token) and the (source, count) segments of the block it verified."""

    output: object  # trunk.model.TrunkOutput
    num_accepted: list[int]
    committed: list[list[int]]
    sources: list[tuple[tuple[Source, int], ...]]


# ------------------------------------------------------------------ array helpers drafters share
def gather_positions(x: mx.array, index: Sequence[int]) -> mx.array:
    """x[r, index[r]] for each row: [B, T, ...] -> [B, 1, ...]."""
    idx = mx.array(list(index), dtype=mx.int32).reshape(-1, 1, *([1] * (x.ndim - 2)))
    return mx.take_along_axis(x, idx, axis=1)


def pad_time(x: mx.array, width: int) -> mx.array:
    """x [B, T, ...] zero-padded (or cut) to ``width`` positions."""
    if x.shape[1] >= width:
        return x[:, :width] if x.shape[1] > width else x
    return mx.concatenate([x, mx.zeros((x.shape[0], width - x.shape[1], *x.shape[2:]), x.dtype)], axis=1)


def groups_by(items: Sequence, key) -> dict:
    out: dict = {}
    for i, item in enumerate(items):
        out.setdefault(key(item), []).append(i)
    return out


def padded_uniforms(count: int, width: int, key: mx.array | None) -> mx.array:
    """A row's draft uniforms (``count`` drawn from its key: a row draws as many as its depth,
    whatever the block's width, so its draws do not depend on the batch), padded with ones to
    ``width``; rows without a key get ones."""
    if key is None or count == 0:
        return mx.ones((width,), dtype=mx.float32)
    uniforms = sample_ops.draw_uniforms((count,), key)
    if count >= width:
        return uniforms[:width]
    return mx.concatenate([uniforms, mx.ones((width - count,), dtype=mx.float32)])
