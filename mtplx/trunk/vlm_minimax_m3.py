"""MiniMax-M3's own caches (mlx-vlm) as rows of a batch, each at its own length.

A MiniMax-M3 trunk (`mtplx.trunk.vlm_text`, mlx-vlm's caches kept: ``NATIVE_CACHE_FAMILIES``)
holds an mlx-vlm ``KVCache`` on its dense layers and a ``MiniMaxM3KVCache`` on its block-sparse
ones: the layer's K/V plus the indexer's keys (one head, [B, 1, S, index_dim]), written by the
same forward at the same positions. In a batch (`mtplx.trunk.batch_cache.BatchCache`, which asks
`VlmTextModel.batch_layer` for these classes):

* a dense layer is a `RaggedVlmKVCache`: `RaggedKVCache` (per-row lengths, masks, rollback by
  setting lengths), extracted back as mlx-vlm's ``KVCache``;
* a sparse layer is a `RaggedIndexedKVCache`: the same for the K/V, plus the indexer's keys as
  a second ragged buffer at the same lengths (``update_index_and_fetch``), extracted back as a
  ``MiniMaxM3KVCache``.

The positions: mlx-vlm's indexer takes its query start as one Python int (``index_offset``), and
its language model, given more than one row and no ``position_ids``, derives positions from a
timeline shared by left-padded rows. A ragged batch passes ``position_ids`` (row r's block at
lengths[r]..: `mtplx.trunk.vlm_text.ragged_position_ids`): RoPE, the indexer's
causal block choice and its local block then follow each row's own positions, and the rows'
mask (`RaggedKVCache.make_mask`: keys past a row's length hidden) is the indexer's ``valid``
mask, so a short row's keys are chosen among its own blocks only. A row whose keys number at
most ``block_size * topk_blocks`` attends to all of them alone; in the batch the indexer runs on
the padded length and, under the row's mask, selects every one of the row's blocks (at most
``topk_blocks`` exist), so the same keys are attended.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mtplx.trunk.batch_cache import RaggedKVCache

import mlx.core as mx

__all__ = ["RaggedIndexedKVCache", "RaggedVlmKVCache", "batch_layer"]


def _vlm_kv_cache():
    from mlx_vlm.models.cache import KVCache

    return KVCache


def _minimax_cache():
    from mlx_vlm.models.minimax_m3_vl.language import MiniMaxM3KVCache

    return MiniMaxM3KVCache


def _row_copy(a: mx.array, row: int, n: int) -> mx.array:
    return mx.contiguous(a[row : row + 1, :, :n, :])


class RaggedVlmKVCache(RaggedKVCache):
    """`RaggedKVCache` whose rows join from and leave as mlx-vlm's ``KVCache`` (a MiniMax-M3 dense layer)."""

    def _row_state(self, cache: Any) -> tuple:
        keys, values = cache.state  # mlx-vlm's KVCache: (keys, values) up to its offset
        return keys, values

    def extract(self, row: int) -> Any:
        out = _vlm_kv_cache()()
        n = self.lengths[row]
        if n and self.keys is not None:
            out.update_and_fetch(_row_copy(self.keys, row, n), _row_copy(self.values, row, n))
        return out


class _RaggedIndexKeys(RaggedKVCache):
    """The indexer's keys of a batch: keys [slots, 1, capacity, index_dim], empty values (head
    dim 0, never written), rows joining from ``MiniMaxM3KVCache`` s."""

    def _row_state(self, cache: Any) -> tuple:
        if cache.index_offset != cache.offset:
            raise ValueError(
                f"a MiniMax-M3 row holds {cache.offset} K/V positions but {cache.index_offset} index keys"
            )
        keys = cache.index_keys
        return keys, mx.zeros((*keys.shape[:3], 0), keys.dtype)


class RaggedIndexedKVCache(RaggedVlmKVCache):
    """A MiniMax-M3 sparse layer's K/V and its indexer's keys for B rows at the same per-row
    lengths (the module docstring). ``set_lengths`` (a block's commit or abort) moves both."""

    def __init__(self):
        super().__init__()
        self.index = _RaggedIndexKeys()

    def set_lengths(self, lengths: Sequence[int]) -> None:
        super().set_lengths(lengths)
        self.index.set_lengths(lengths)

    @property
    def index_offset(self) -> int:
        """What mlx-vlm's attention reads as one row's query start; a batch forward passes
        ``position_ids`` (`mtplx.trunk.vlm_text.ragged_position_ids`), which the indexer uses instead."""
        return max(self.lengths, default=0)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple:
        before = list(self.lengths)
        fetched = super().update_and_fetch(keys, values)
        self.index.set_lengths(before)  # the indexer writes the same block next
        return fetched

    def update_index_and_fetch(self, keys: mx.array) -> mx.array:
        """Write the indexer's keys [B, 1, T, index_dim] at each row's length; all rows' up to the longest end."""
        return self.index.update_and_fetch(keys, mx.zeros((*keys.shape[:3], 0), keys.dtype))[0]

    def add_rows(self, caches: Sequence[Any]) -> None:
        self.index.add_rows(caches)
        super().add_rows(caches)

    def _row_state(self, cache: Any) -> tuple:
        return super()._row_state(cache.kv_cache)

    def remove_rows(self, keep: Sequence[int]) -> None:
        self.index.remove_rows(keep)
        super().remove_rows(keep)

    def extract(self, row: int) -> Any:
        """Row ``row`` as a fresh ``MiniMaxM3KVCache`` (its own copy of the K/V and the index keys)."""
        out = _minimax_cache()()
        n = self.lengths[row]
        if n and self.keys is not None:
            out.kv_cache.update_and_fetch(_row_copy(self.keys, row, n), _row_copy(self.values, row, n))
            out.update_index_and_fetch(_row_copy(self.index.keys, row, n))
        return out


def batch_layer(template: Any) -> RaggedKVCache | None:
    """The batch's cache for a MiniMax-M3 layer whose single-row cache is ``template`` (None: no such class)."""
    if type(template) is _minimax_cache():
        return RaggedIndexedKVCache()
    if type(template) is _vlm_kv_cache():
        return RaggedVlmKVCache()
    return None
