"""Batch forms of GLM-5-Next's (``glm5_next``) sparse-attention caches (mlx-vlm's own classes).

mlx-vlm 0.7.10 ``models/glm5_next/language.py``: a sparse layer's cache is ``CacheList(latent KV,
indexer validity KV, PoolingCache, projected KV)``, a layer sharing the previous indexer's choice
``CacheList(latent KV, projected KV)``; its linear-attention layers' ``ArraysCache`` s batch as
Qwen3.8-Flash-Next's do (`mtplx.trunk.batch_vlm`). In a batch (`mtplx.trunk.batch_cache`) such a
``CacheList`` becomes one of ragged members at the rows' lengths:

* the latent and the validity flags: `VlmRaggedKV` (a `RaggedKVCache` that leaves as mlx-vlm's
  ``KVCache``);
* the pool cache: `RaggedPoolCache`, each row's indexer keys and gates at its positions (as
  "keys" / "values") plus its completed pools (``pooled``, one entry per ``index_kpool``
  positions). A forward pools every complete window of the written positions again from the
  raw keys (mlx-vlm's ``_compress_pools``, per window), keeping a row's stored pools below its
  count (a joining row brings only its pools and its remainder, as mlx-vlm's ``PoolingCache``
  holds them); a row's length set to n keeps n // index_kpool pools, those past its stored
  count taken from the last forward. So rollback is again setting lengths;
* the projected KV (mlx-vlm's prefill-only cache of the latent's projections, read only while it
  holds exactly the positions before a forward of more than ``DECODE_BLOCK_SIZE``): `UnreadKV`,
  lengths only; a row leaves with it empty, so its next long forward projects the whole latent
  (mlx-vlm's path when the cache does not match).

The indexer's choice over ragged rows is `ragged_topk`: mlx-vlm's takes every row's queries to
end at the longest key (``kv_length - q_length + t``) and pools from the first valid key (its
left-padding convention); here row r's queries are at lengths[r] + t, a pool is a candidate for a
query when it ends at or before it, and the choice (top-k pools by score, chronological, then the
tail) is mlx-vlm's math.
"""

from __future__ import annotations

from typing import Any

from mtplx.trunk.batch_cache import RaggedKVCache, class_key

import mlx.core as mx
import mlx.nn as nn

__all__ = [
    "JoiningPools",
    "PoolRows",
    "RaggedPoolCache",
    "UnreadKV",
    "VlmRaggedKV",
    "list_layer",
    "ragged_topk",
]

_LIST = "mlx_vlm.models.cache.CacheList"
_SPARSE = ("KVCache", "KVCache", "PoolingCache", "KVCache")  # a sparse layer's members
_SHARED = ("KVCache", "KVCache")  # a layer reading the previous indexer's choice


class VlmRaggedKV(RaggedKVCache):
    """A `RaggedKVCache` whose rows join from and leave as mlx-vlm's ``KVCache``."""

    def _row_state(self, cache: Any) -> tuple:
        n = cache.offset
        return cache.keys[..., :n, :], cache.values[..., :n, :]

    def extract(self, row: int) -> Any:
        from mlx_vlm.models.cache import KVCache

        return self.row_into(KVCache(), row)

    def row_into(self, out: Any, row: int) -> Any:
        """``out``, a fresh single-row mlx-vlm K/V cache, given a copy of row ``row``'s K/V."""
        n = self.lengths[row]
        if n and self.keys is not None:
            out.keys = mx.contiguous(self.keys[row : row + 1, :, :n, :])
            out.values = mx.contiguous(self.values[row : row + 1, :, :n, :])
            out.offset = n
        return out


class UnreadKV(RaggedKVCache):
    """The projected KV: the rows' lengths only (never read in a batch: `size` matches no length)."""

    def add_rows(self, caches) -> None:
        self.set_lengths(self.lengths + [int(c.offset) for c in caches])

    def size(self) -> int:
        return -1

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple:
        raise RuntimeError("GLM-5-Next's projected KV is not kept in a batch")

    def extract(self, row: int) -> Any:
        from mlx_vlm.models.cache import KVCache

        return KVCache()


class _Raw:
    """A joining ``PoolingCache`` as the raw rows it stands for: positions (pools * ratio +
    remainder), the remainder's keys / gates at its last positions (the pooled ones zero)."""

    def __init__(self, pool: Any):
        self.offset = pool.size() * pool.ratio + pool.remainder
        self.keys = self.values = None
        if self.offset:
            start = self.offset - pool.remainder

            def place(buffer: mx.array) -> mx.array:
                lead = mx.zeros((1, start, buffer.shape[-1]), buffer.dtype)
                return mx.concatenate([lead, buffer[:, : pool.remainder]], axis=1)[:, None]

            self.keys, self.values = place(pool.buf_kv), place(pool.buf_gate)


class JoiningPools:
    """A joining ``PoolingCache``'s completed pools as rows [1, 1, pools, D] (empty values)."""

    def __init__(self, pool: Any):
        self.offset = pool.size()
        self.keys = None if pool.pooled is None else pool.pooled[:, None]
        self.values = None if pool.pooled is None else mx.zeros((*self.keys.shape[:3], 0), self.keys.dtype)


class PoolRows(RaggedKVCache):
    """Completed pools of B rows [slots, 1, P, D] (empty values) at each row's pool count; rows
    join as `JoiningPools` (DeepSeek-V4's compressor caches keep theirs here too)."""

    def _row_state(self, cache: Any) -> tuple:
        return cache.keys, cache.values


class RaggedPoolCache(RaggedKVCache):
    """GLM-5-Next's ``PoolingCache`` for B rows (the module docstring): the indexer's keys / gates
    [B, 1, S, D] at the rows' lengths, and ``pooled`` [B, 1, P, D] at their pool counts."""

    def __init__(self, ratio: int):
        self.ratio = ratio
        self.pooled = PoolRows()
        self._merged: mx.array | None = None  # the last forward's pools [B, P, D] (stored, then fresh)
        self._writing = False
        super().__init__()

    def _row_state(self, cache: Any) -> tuple:
        return cache.keys, cache.values

    def set_lengths(self, lengths) -> None:
        super().set_lengths(lengths)
        if self._writing:  # a forward's own write (`pools`): the pools follow at the commit
            return
        counts = [n // self.ratio for n in self.lengths]
        grown = [r for r, (c, old) in enumerate(zip(counts, self.pooled.lengths)) if c > old]
        if grown:
            if self._merged is None or self._merged.shape[0] != len(counts):
                raise RuntimeError("pool counts grew without a forward of these rows")
            pools = self._merged[:, None]
            self.pooled.set_lengths([0] * len(counts))
            self.pooled.update_and_fetch(pools, mx.zeros((*pools.shape[:3], 0), pools.dtype))
            self._merged = None
        self.pooled.set_lengths(counts)

    def pools(self, indexer: nn.Module, keys: mx.array, gates: mx.array) -> mx.array:
        """Write a block's indexer keys / gates [B, T, D] at each row's length; return the pools
        [B, P, D] of every complete window of the longest row (a row's own past its count are
        from its raw keys; beyond its written positions, unused)."""
        self._writing = True
        try:
            held_keys, held_gates = self.update_and_fetch(keys[:, None], gates[:, None])
        finally:
            self._writing = False
        count = held_keys.shape[2] // self.ratio
        if count == 0:
            self._merged = mx.zeros((keys.shape[0], 0, keys.shape[-1]), keys.dtype)
            return self._merged
        span = count * self.ratio
        fresh = indexer._compress_pools(held_keys[:, 0, :span], held_gates[:, 0, :span])
        stored = self.pooled.keys
        if stored is not None:
            have = min(stored.shape[2], count)
            stored = stored[: keys.shape[0], 0, :have]
            if have < count:
                stored = mx.pad(stored, [(0, 0), (0, count - have), (0, 0)])
            kept = mx.arange(count)[None, :, None] < self.pooled.offset[:, None, None]
            fresh = mx.where(kept, stored, fresh)
        self._merged = fresh
        return fresh

    def add_rows(self, caches) -> None:
        self._merged = None
        self.pooled.add_rows([JoiningPools(c) for c in caches])  # first: set_lengths then finds the counts
        super().add_rows([_Raw(c) for c in caches])

    def remove_rows(self, keep) -> None:
        self._merged = None
        self.pooled.remove_rows(keep)
        super().remove_rows(keep)

    def extract(self, row: int) -> Any:
        """Row ``row`` as a fresh mlx-vlm ``PoolingCache`` (its pools and its remainder)."""
        from mlx_vlm.models.cache import PoolingCache

        out = PoolingCache(self.ratio)
        n = self.lengths[row]
        count, remainder = divmod(n, self.ratio)
        if count:
            out.pooled = mx.contiguous(self.pooled.keys[row : row + 1, 0, :count])
        if n:
            width = self.keys.shape[-1]
            out.buf_kv = mx.zeros((1, self.ratio, width), self.keys.dtype)
            out.buf_gate = mx.zeros((1, self.ratio, self.values.shape[-1]), self.values.dtype)
            if remainder:
                start = count * self.ratio
                out.buf_kv[:, :remainder] = self.keys[row : row + 1, 0, start:n]
                out.buf_gate[:, :remainder] = self.values[row : row + 1, 0, start:n]
            out.remainder = remainder
        return out


# --------------------------------------------------------------------------- the indexer


def ragged_topk(indexer: nn.Module, x, q_resid, cache: VlmRaggedKV, pool_cache: RaggedPoolCache, offset):
    """mlx-vlm 0.7.10 ``Glm5NextIndexer.__call__`` over ragged rows (the module docstring): the
    latent positions each query attends to [B, T, width], -1 for none."""
    from mlx_vlm.models.glm5_next.language import _score_index_keys

    batch, q_length, _ = x.shape
    kpool = indexer.index_kpool
    keys, gates = indexer._project_keys(x)
    cache.update_and_fetch(
        mx.ones((batch, 1, q_length, 1), mx.bool_), mx.zeros((batch, 1, q_length, 0), mx.bool_)
    )
    pool_keys = pool_cache.pools(indexer, keys, gates.astype(keys.dtype))
    pool_count = pool_keys.shape[1]
    query_positions = offset[:, None].astype(mx.int32) + mx.arange(q_length, dtype=mx.int32)[None]  # [B, T]
    select_k = min(indexer.index_topk // kpool, pool_count)
    if pool_count == 0:
        topk = mx.zeros((batch, q_length, 0), dtype=mx.int32)
    else:
        pool_ends = mx.arange(pool_count, dtype=mx.int32) * kpool + kpool - 1
        candidates = pool_ends[None, None] <= query_positions[..., None]  # [B, T, pools]
        if select_k == pool_count:
            selected = mx.broadcast_to(mx.arange(pool_count, dtype=mx.int32)[None, None], candidates.shape)
        else:
            q, weights = indexer._project_queries(x, q_resid)
            scores = _score_index_keys(q, pool_keys, weights, indexer.softmax_scale)
            scores = mx.where(candidates, scores, mx.finfo(mx.float32).min)
            selected = mx.argpartition(-scores, kth=select_k - 1, axis=-1)[..., :select_k].astype(mx.int32)
        valid = mx.take_along_axis(candidates, selected, axis=-1)
        order = mx.argsort(mx.where(valid, selected, pool_count), axis=-1)  # chronological, invalid last
        selected = mx.take_along_axis(selected, order, axis=-1)
        valid = mx.take_along_axis(valid, order, axis=-1)
        topk = (selected[..., None] * kpool + mx.arange(kpool, dtype=mx.int32)).reshape(batch, q_length, -1)
        topk = mx.where(mx.repeat(valid[..., None], kpool, axis=-1).reshape(batch, q_length, -1), topk, -1)
    if topk.shape[-1] < indexer.index_topk:
        topk = mx.pad(topk, [(0, 0), (0, 0), (0, indexer.index_topk - topk.shape[-1])], constant_values=-1)
    topk = topk[..., : indexer.index_topk]
    if indexer.always_select_tail and kpool > 1:
        visible = query_positions + 1
        tail_count = visible % kpool
        tail = (visible - tail_count)[..., None] + mx.arange(kpool - 1, dtype=mx.int32)
        tail_valid = mx.arange(kpool - 1)[None, None] < tail_count[..., None]
        topk = mx.concatenate([topk, mx.where(tail_valid, tail, -1)], axis=-1)
    return topk.astype(mx.int32)


_ORIGINAL_INDEXER: list = []


def _install_ragged_indexer() -> None:
    """``Glm5NextIndexer.__call__`` -> `ragged_topk` for a `RaggedPoolCache`, mlx-vlm's own for
    any other cache (idempotent)."""
    from mlx_vlm.models.glm5_next.language import Glm5NextIndexer

    if _ORIGINAL_INDEXER:
        return
    original = Glm5NextIndexer.__call__
    _ORIGINAL_INDEXER.append(original)

    def indexer_call(self, x, q_resid, padding_mask=None, cache=None, pool_cache=None, offset=0):
        if isinstance(pool_cache, RaggedPoolCache):
            if padding_mask is not None:
                raise ValueError("a batch of GLM-5-Next rows takes no padding mask")
            return ragged_topk(self, x, q_resid, cache, pool_cache, offset)
        return original(self, x, q_resid, padding_mask, cache, pool_cache, offset)

    Glm5NextIndexer.__call__ = indexer_call


# --------------------------------------------------------------------------- the batch layer


def _members(cache: Any) -> tuple[str, ...]:
    return tuple(type(m).__name__ for m in cache.caches)


def list_layer(template: Any) -> Any:
    """The batch layer for a GLM-5-Next layer's ``CacheList`` (a trunk's or its head's), None for
    any other cache."""
    from mtplx.trunk.compat import CacheList

    if class_key(template) != _LIST or {type(m).__module__ for m in template.caches} != {
        "mlx_vlm.models.cache"
    }:
        return None
    if _members(template) == _SHARED:
        return CacheList(VlmRaggedKV(), UnreadKV())
    if _members(template) != _SPARSE:
        return None
    _install_ragged_indexer()
    return CacheList(VlmRaggedKV(), VlmRaggedKV(), RaggedPoolCache(template.caches[2].ratio), UnreadKV())
