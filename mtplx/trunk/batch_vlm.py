"""Batch forms of mlx-vlm's own caches: Qwen3.8-Flash-Next (``qwen4_exp``) and GLM-5-Next's recurrent layers.

`mtplx.trunk.batch_cache` batches mlx-lm's cache kinds; a family hosted on mlx-vlm's own cache
classes (`mtplx.trunk.vlm_text.NATIVE_CACHE_FAMILIES`) batches where the model names a batch
layer for each of its kinds (`mtplx.trunk.vlm_text.BATCH_LAYERS`: this module's
`qwen4_exp_layer` and `glm5_next_layer`), under the same
contract: ragged rows at their own lengths, per-row rollback, rows joining from and leaving as
single-row caches of the family's own classes.

Qwen3.8-Flash-Next (mlx-vlm 0.7.10 ``models/qwen4_exp/language.py``):

* its QSA attention layers' ``QSAKVCache`` (K/V plus the QSA indexer's raw keys and their
  positions) -> `RaggedQSAKVCache`: the K/V as a `RaggedKVCache`, the indexer's keys and
  positions as a second one (`_IndexRows`) at the same lengths, so keeping n positions of a
  block is setting each row's length, as for plain K/V. The indexer's selection over ragged rows
  is `ragged_selection` (mlx-vlm's ``select_from_projected`` takes one past length for every
  row): each row's query ends, complete blocks and candidate mask are its own; the pooled block
  keys are pooled again from the raw keys every forward (the same per-block math as mlx-vlm's,
  which keeps them on a single-row cache between forwards). It names its longest row's end as
  a Python int and no left padding, so mlx-vlm's attention reads nothing to the host for it: a
  batch forward syncs as one row's does (``tests/trunk/test_batch_qsa_syncs.py``);
* its gated-delta and PLE layers' ``ArraysCache`` (conv window, recurrent state; PLE short-conv
  window and n-gram token history) stay mlx-vlm's ``ArraysCache`` holding B rows: mlx-vlm's
  operators record the state after every position of a block themselves (``update_recurrent`` /
  ``update_window``) once the cache ``start_speculation`` s, and ``commit_speculation`` takes one
  kept count per row (`mtplx.trunk.batch_cache.BatchCache.begin_block` starts it for any layer
  that has it).

The mlx-vlm ``ArraysCache`` batches only for these two families (whose every operator records
a block: GLM-5-Next's linear attention too, ``ShortConv1d`` and its gated delta; its sparse
layers' caches: `mtplx.trunk.batch_glm5_next`); other families keep their one-line reason. ``QSAQuantizedKVCache`` (``--kv-bits``) is not batched.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

from mtplx.trunk.batch_cache import RaggedKVCache, class_key
from mtplx.trunk.batch_glm5_next import VlmRaggedKV

import mlx.core as mx
import mlx.nn as nn

__all__ = ["RaggedQSAKVCache", "glm5_next_layer", "qwen4_exp_layer", "ragged_selection"]


_ARRAYS = "mlx_vlm.models.cache.ArraysCache"
_QSA = "mlx_vlm.models.qwen4_exp.language.QSAKVCache"


class _IndexRows(RaggedKVCache):
    """The QSA indexer's raw keys [B, 1, S, D] (as "keys") and their position ids [B, 1, S, P]
    (as "values"; P = 1 for text positions, 3 for MRoPE) of B rows, at the rows' lengths."""

    def _row_state(self, cache: Any) -> tuple:
        return cache.index_keys[:, None], _positions_as_rows(cache.index_position_ids)[:, None]


def _positions_as_rows(position_ids: mx.array) -> mx.array:
    """Position ids [B, T] or [3, B, T] -> [B, T, P]."""
    if position_ids.ndim == 2:
        return position_ids[..., None]
    return position_ids.transpose(1, 2, 0)


def _rows_as_positions(rows: mx.array) -> mx.array:
    """[B, T, P] -> position ids [B, T] (P = 1) or [3, B, T]."""
    if rows.shape[-1] == 1:
        return rows[..., 0]
    return rows.transpose(2, 0, 1)


class RaggedQSAKVCache(VlmRaggedKV):
    """Qwen3.8-Flash-Next's ``QSAKVCache`` for B rows at their own lengths (the module docstring)."""

    # No left padding (every row starts at position 0), and the longest row's end, a Python int:
    # with both named, mlx-vlm 0.7.10's qwen3_5 attention (``_prepare_projected_qkv``) slices its
    # mask at ``_idx + L`` and the model's ``cache_position_offset`` returns ``_idx``, where each
    # would read ``offset.max()`` to the host (one sync per QSA layer per forward, and one more).
    left_padding = None

    def __init__(self):
        self.index = _IndexRows()
        super().__init__()

    @property
    def _idx(self) -> int:
        return max(self.lengths, default=0)

    def set_lengths(self, lengths) -> None:
        super().set_lengths(lengths)
        self.index.set_lengths(lengths)

    def _row_state(self, cache: Any) -> tuple:
        return cache.keys, cache.values

    def update_indexer(self, keys: mx.array, position_ids: mx.array) -> tuple[mx.array, mx.array]:
        """Write the indexer's raw keys [B, T, D] and position ids ([B, T] or [3, B, T]) at each
        row's length (before the block's K/V are); return both up to the longest end."""
        rows = _positions_as_rows(position_ids)
        rows = mx.broadcast_to(rows, (keys.shape[0], *rows.shape[1:]))
        held_keys, held_positions = self.index.update_and_fetch(keys[:, None], rows[:, None])
        return held_keys[:, 0], _rows_as_positions(held_positions[:, 0])

    def add_rows(self, caches) -> None:
        for c in caches:
            if c.offset and (c.index_keys is None or c.index_keys.shape[1] != c.offset):
                raise ValueError("a QSA cache row joining the batch must hold its indexer's keys")
        self.index.add_rows(caches)  # first: the K/V's set_lengths then sets the same lengths on both
        super().add_rows(caches)

    def remove_rows(self, keep) -> None:
        self.index.remove_rows(keep)
        super().remove_rows(keep)

    def extract(self, row: int) -> Any:
        """Row ``row`` as a fresh single-row ``QSAKVCache`` (its own copy; the pooled block keys
        are pooled again by its next forward)."""
        from mlx_vlm.models.qwen4_exp.language import QSAKVCache

        out = self.row_into(QSAKVCache(), row)
        n = out.offset
        if n:
            out.index_keys = mx.contiguous(self.index.keys[row : row + 1, 0, :n, :])
            out.index_position_ids = mx.contiguous(
                _rows_as_positions(self.index.values[row : row + 1, 0, :n, :])
            )
        return out


# --------------------------------------------------------------------------- the QSA indexer


def ragged_selection(indexer: nn.Module, qk: mx.array, cache: RaggedQSAKVCache, position_ids) -> Any:
    """mlx-vlm 0.7.10 ``Qwen4ExpQSAIndexer.select_from_projected`` over ragged rows (no left
    padding; row r holds positions 0..lengths[r]-1 and the block writes at lengths[r]): the same
    math, with each row's query ends ``lengths[r] + t + 1`` (mlx-vlm takes one past length for
    every row). A row's blocks past its own complete ones score -inf and are never selected, so
    a short row beside a long one selects as alone; padded positions of its block select too,
    and are dropped with the block's tail."""
    batch, seq_len, _ = qk.shape
    lengths = cache.offset  # [B], this block's first position per row
    if position_ids is None:
        position_ids = lengths[:, None] + mx.arange(seq_len, dtype=mx.int32)[None]
    heads, dim, ratio = indexer.n_heads, indexer.head_dim, indexer.compress_ratio
    qk = qk.reshape(batch, seq_len, heads + indexer.kv_heads, dim)
    query = indexer.q_layernorm(qk[:, :, :heads]).transpose(0, 2, 1, 3)
    raw_keys, full_position_ids = cache.update_indexer(qk[:, :, heads:].squeeze(2), position_ids)
    key_len = raw_keys.shape[1]
    num_blocks = key_len // ratio
    if seq_len == 1 and num_blocks <= indexer.block_topk:
        return None  # every row attends to all of its keys (mlx-vlm's dense path)
    query = indexer._apply_rope(query, position_ids)
    block_ids = mx.arange(num_blocks, dtype=mx.int32)
    if num_blocks:
        blocks = raw_keys[:, : num_blocks * ratio].reshape(batch, num_blocks, ratio, dim)
        pooled = indexer.k_layernorm(mx.mean(blocks.astype(mx.float32), axis=2).astype(raw_keys.dtype))
        pooled = indexer._apply_rope(mx.expand_dims(pooled, 1), full_position_ids[..., block_ids * ratio])
    else:
        pooled = mx.zeros((batch, 1, 0, dim), dtype=raw_keys.dtype)
    scores = query.astype(mx.float32) @ pooled.astype(mx.float32).transpose(0, 1, 3, 2)
    scores = mx.sum(mx.maximum(scores, 0), axis=1) / math.sqrt(dim)  # [B, T, blocks]
    query_ends = lengths[:, None].astype(mx.int32) + mx.arange(seq_len, dtype=mx.int32)[None] + 1
    complete_counts = query_ends // ratio  # [B, T]
    scores = mx.where(block_ids[None, None] < complete_counts[..., None], scores, -mx.inf)
    if num_blocks < indexer.block_topk:
        scores = mx.pad(
            scores, [(0, 0), (0, 0), (0, indexer.block_topk - num_blocks)], constant_values=-mx.inf
        )
    selected = mx.argpartition(scores, kth=-indexer.block_topk, axis=-1)[..., -indexer.block_topk :]
    selected = selected.astype(mx.int32)
    return SimpleNamespace(
        selected_blocks=mx.where(selected < complete_counts[..., None], selected, -1),
        query_ends=query_ends,
        complete_counts=complete_counts,
        left_padding=mx.zeros((batch,), dtype=mx.int32),
        key_len=key_len,
        zero_padding=False,  # the attention takes the rows' mask with the selection's (build_mask)
    )


_ORIGINAL_SELECTION: list = []  # mlx-vlm's select_from_projected, once replaced


def _install_ragged_selection() -> None:
    """``Qwen4ExpQSAIndexer.select_from_projected`` -> `ragged_selection` for a `RaggedQSAKVCache`,
    mlx-vlm's own for any other cache (idempotent)."""
    from mlx_vlm.models.qwen4_exp.language import Qwen4ExpQSAIndexer

    if _ORIGINAL_SELECTION:
        return
    original = Qwen4ExpQSAIndexer.select_from_projected
    _ORIGINAL_SELECTION.append(original)

    def select_from_projected(self, qk, cache, position_ids):
        if isinstance(cache, RaggedQSAKVCache):
            return ragged_selection(self, qk, cache, position_ids)
        return original(self, qk, cache, position_ids)

    Qwen4ExpQSAIndexer.select_from_projected = select_from_projected


# --------------------------------------------------------------------------- registration


def _arrays_layer(template: Any) -> Any:
    return type(template)(len(template.cache))


def _qsa_layer(template: Any) -> RaggedQSAKVCache:
    _install_ragged_selection()
    return RaggedQSAKVCache()


def qwen4_exp_layer(template: Any) -> Any:
    """The batch layer for a Qwen3.8-Flash-Next cache ``template`` (None: not one this module batches)."""
    key = class_key(template)
    if key == _QSA:
        return _qsa_layer(template)
    if key == _ARRAYS:
        return _arrays_layer(template)
    return None


def glm5_next_layer(template: Any) -> Any:
    """The batch layer for a GLM-5-Next cache ``template`` (None: not one this module batches)."""
    from mtplx.trunk import batch_glm5_next

    if class_key(template) == _ARRAYS:
        return _arrays_layer(template)
    return batch_glm5_next.list_layer(template)
