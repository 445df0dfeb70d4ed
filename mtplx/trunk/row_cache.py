"""`SingleRowCache`: the batch-cache contract (`batch_cache.BatchCache`) over one row's own mlx-lm
caches, for a batch of at most one row.

Every cache kind `rollback` supports works here: KV, quantized KV, rotating (sliding-window),
gated-delta recurrent state, and nested cache lists. The batched loop uses it where the ragged
batch cache cannot hold a model's caches (sliding-window and quantized KV; heads that read the
trunk's cache) and where a caller owns the live caches (a sharded engine's stream), so those
requests run through the one cycle, one at a time. The row's caches are the caller's own list
(never copied): what the cycle commits is what the caller's prompt-cache session holds.

Invariant: between cycles ``layers`` holds exactly the row's committed positions; a block is
rolled back with `rollback.begin_block` / `commit_block` / `abort_block` (one capture per cycle),
or, for a block during which the caches convert to quantized KV (`kv_quant`: a plan whose start
the block reaches), with `kv_quant.ConversionBlock` (back to the float caches when the row keeps
fewer positions than the start).
"""

from __future__ import annotations

from collections.abc import Sequence

from mtplx.trunk import kv_quant, rollback

__all__ = ["SingleRowCache"]


def _offset(cache: list) -> int:
    """Positions a single-row cache list holds (its first cache with an offset; 0 if none)."""
    for c in cache:
        if isinstance(c, list):
            found = _offset(c)
            if found:
                return found
        elif hasattr(c, "offset"):
            return int(c.offset)
    return 0


class SingleRowCache:
    """One row's caches behind `BatchCache`'s interface (``layers``, ``lengths``, rows join /
    leave / extract, ``set_lengths``, verify blocks)."""

    def __init__(self) -> None:
        self.layers: list = []
        self._rows = 0

    @property
    def lengths(self) -> list[int]:
        return [_offset(self.layers)] * self._rows

    def add_rows(self, rows: Sequence[list]) -> None:
        if self._rows + len(rows) > 1:
            raise ValueError("this model's caches are not batched: one row at a time")
        if rows:
            self.layers, self._rows = rows[0], 1

    def remove_rows(self, keep: Sequence[int]) -> None:
        if list(keep) not in ([], [0]):
            raise ValueError(f"a single-row cache keeps row 0 or nothing (got {list(keep)})")
        if not keep:
            self.layers, self._rows = [], 0

    def extract(self, row: int) -> list:
        """The row's caches themselves (the row leaves with them; nothing else holds them)."""
        if row != 0 or not self._rows:
            raise KeyError(f"no row {row} in a single-row cache")
        return self.layers

    def set_lengths(self, lengths: Sequence[int]) -> None:
        """KV caches only: drop entries past ``lengths[0]`` (a head's drafted entries)."""
        drop = _offset(self.layers) - lengths[0]
        if drop:
            rollback.trim_kv(self.layers, drop)

    def begin_block(self, block_len: int) -> rollback.BlockCapture | kv_quant.ConversionBlock | None:
        """A capture of the caches before a block of ``block_len`` positions; None for a one-position
        block (a plain AR step is always kept whole, so caches rollback refuses still decode AR)
        unless the caches convert to quantized KV during it (undone with the block)."""
        if kv_quant.conversion_split(self.layers, block_len) is not None:
            return kv_quant.ConversionBlock(self.layers, block_len)
        return rollback.begin_block(self.layers, block_len) if block_len > 1 else None

    def commit_block(self, capture, num_keep: Sequence[int]) -> None:
        (keep,) = num_keep
        if isinstance(capture, kv_quant.ConversionBlock):
            capture.commit(self.layers, keep)
        elif capture is not None:
            rollback.commit_block(self.layers, capture, keep)

    def abort_block(self, capture: rollback.BlockCapture | None) -> None:
        """Back to the state before the block. A one-position block has no capture (as a plain AR
        loop keeps none): an interrupted AR step leaves the caches as the forward left them, and
        the row's request ends there (its caches are not stored)."""
        if isinstance(capture, kv_quant.ConversionBlock):
            capture.abort(self.layers)
        elif capture is not None:
            rollback.abort_block(self.layers, capture)
