"""Batch forms of DeepSeek-V4's (``deepseek_v4``) caches: rows at their own lengths in one forward.

mlx-vlm 0.7.10 ``models/deepseek_v4/language.py`` gives a layer a sliding-window
``RotatingKVCache`` (window ``sliding_window``, one K=V head, empty values), or a ``CacheList`` of
that window and one ``PoolingCache`` per compressor (the attention's, and a sparse layer's
indexer's). mlx-vlm's own batch forms pad rows to one shared timeline and its ``PoolingCache``
commits only uniform lengths ("PoolingCache requires uniform batch commit lengths"), so these are
mtplx's own, with mlx-vlm's single-row math as the reference (`mtplx.trunk.batch_cache`: the
batch's contract; `mtplx.trunk.vlm_text.BATCH_LAYERS`: asked per layer, a head's caches too):

* the window: `RaggedWindowKV`, a ring of C slots per row (position p at slot p mod C). Row r's
  query at position q sees the slots holding positions q - W < p <= q (mlx-vlm's window: the
  query and the W - 1 before it). C >= W + (positions written since the rows' lengths were last
  set) - 1, so moving a row back to its kept count (setting lengths) never finds a position
  it still needs overwritten; C also covers a verify block of mlx-vlm's one-token-at-a-time
  path (``DECODE_BLOCK_SIZE``), so every layer's ring has the same width and the first layer's
  mask fits them all. A join or leave copies every row's ring (W-sized).
* a compressor's pools: `RaggedCompressorCache`, each row's completed pools (`PoolRows`, at its
  count), its open window (the remainder: ``length % ratio`` positions) and, for the ratio-4
  overlapping compressor, the last completed window's raw ``(kv, gate)`` its next window
  overlaps with (`mtplx.trunk.vlm_deepseek_v4`'s ``overlap_window``; a row without one overlaps
  with mlx-vlm's zero / ``-inf`` predecessor, as alone). `compress_rows` is mlx-vlm's
  ``Compressor.__call__`` (with mtplx's overlap) for rows whose windows end at different
  positions: each row's open window and the block concatenated, the windows each completes
  pooled (`_overlap_compress_kv` / `_simple_compress_kv`) with rope at its pool positions. A
  verify block records its inputs (``start_speculation``); at the commit row r keeps n_r
  positions: its count, open window and overlap window are those after its first n_r positions
  (pools completed within them were computed by the block and stay).
* the mask of pools: row r's query at q sees pools i < (q + 1) // ratio (mlx-vlm's rule), every
  forward, one-position ones too (alone a one-position forward sees all its pools; in a batch a
  shorter row's pools end before the longest row's).
* the indexer (`ragged_indexer`): mlx-vlm's scoring with that mask; where alone a row would take
  mlx-vlm's HISA path (its pool count reaches ``index_block * index_keep`` and exceeds
  ``index_topk``), that row's choice is HISA's on its own pools (one call per such row).

Rows join from and leave as mlx-vlm's (or, for a head's window, mlx-lm's) single-row classes.
"""

from __future__ import annotations

from typing import Any

from mtplx.trunk.batch_cache import RaggedKVCache, class_key
from mtplx.trunk.batch_glm5_next import JoiningPools, PoolRows
from mtplx.trunk.compat import CacheList
from mtplx.trunk.vlm_deepseek_v4 import ATTRIBUTE

import mlx.core as mx
import mlx.nn as nn
import numpy as np

__all__ = ["RaggedCompressorCache", "RaggedWindowKV", "deepseek_v4_layer", "ragged_indexer"]

_RING_STEP = 16  # ring growth, in slots


def _decode_block() -> int:
    """mlx-vlm's longest block forwarded one position at a time (``linear.DECODE_BLOCK_SIZE``)."""
    from mlx_vlm.models.linear import DECODE_BLOCK_SIZE

    return DECODE_BLOCK_SIZE


# --------------------------------------------------------------------------- the sliding window


class RaggedWindowKV(RaggedKVCache):
    """Sliding-window K/V of B rows in rings (the module docstring): keys / values [B, H, C, D]."""

    def __init__(self, window: int, single_row_type: type):
        super().__init__()
        self.window = window
        self.single_row_type = single_row_type  # what a row leaves as (mlx-vlm's or mlx-lm's)
        self._base: list[int] = []  # lengths when last set from outside (a commit, a join)

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def set_lengths(self, lengths) -> None:
        super().set_lengths(lengths)
        self._base = list(self.lengths)

    def _advance(self, block_len: int) -> None:
        RaggedKVCache.set_lengths(self, [n + block_len for n in self.lengths])

    def _capacity_for(self, block_len: int) -> int:
        """Slots the ring needs before a write of ``block_len`` positions."""
        ahead = max((n + block_len - b for n, b in zip(self.lengths, self._base)), default=block_len)
        needed = self.window + max(ahead, _decode_block()) - 1
        return max(self.capacity, -(-needed // _RING_STEP) * _RING_STEP)

    def _slot_positions(self, ends: list[int], capacity: int) -> mx.array:
        """[B, C]: the position each slot holds once row r holds positions up to ends[r] (< 0: none)."""
        ends_ = mx.array(ends, dtype=mx.int32)[:, None]
        slots = mx.arange(capacity, dtype=mx.int32)[None]
        return ends_ - 1 - mx.remainder(ends_ - 1 - slots, capacity)

    def _relayout(self, capacity: int) -> None:
        """The rows' rings at ``capacity`` slots (each row's held positions moved to their slots)."""
        old = self.capacity
        held = self._slot_positions(self.lengths, capacity)
        index = mx.remainder(mx.maximum(held, 0), old)[:, None, :, None]
        self.keys, self.values = (_take_slots(a, index) for a in (self.keys, self.values))

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple:
        block_len = keys.shape[2]
        capacity = self._capacity_for(block_len)
        if self.keys is None:
            self.keys = mx.zeros((*keys.shape[:2], capacity, keys.shape[3]), keys.dtype)
            self.values = mx.zeros((*values.shape[:2], capacity, values.shape[3]), values.dtype)
        elif capacity > self.capacity:
            self._relayout(capacity)
        slots = mx.remainder(self.offset[:, None] + mx.arange(block_len)[None], capacity)
        rows = mx.arange(self.batch_size)[:, None]
        for buffer, block in ((self.keys, keys), (self.values, values)):
            if block.size:
                buffer[rows, :, slots] = block.transpose(0, 2, 1, 3)
        self._advance(block_len)
        return self.keys, self.values

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        """bool [B, 1, N, C] over the ring after a write of N positions: row r's query t (at
        position lengths[r] + t) sees the positions q - W < p <= q."""
        window = window_size or self.window
        capacity = self._capacity_for(N)
        held = self._slot_positions([n + N for n in self.lengths], capacity)[:, None, None, :]
        queries = self.offset[:, None, None, None] + mx.arange(N)[None, None, :, None]
        return (held >= 0) & (held <= queries) & (held > queries - window)

    def add_rows(self, caches) -> None:
        if not caches:
            return
        lengths = [int(c.offset) for c in caches]
        filled = [c for c in caches if c.offset]
        if self.keys is None and not filled:
            self.set_lengths(self.lengths + lengths)
            return
        self.set_lengths(self.lengths)  # rows past a commit point: their base is their length
        capacity = max(self._capacity_for(0), self.capacity)
        if self.keys is not None and capacity > self.capacity:
            self._relayout(capacity)
        like = (self.keys, self.values) if self.keys is not None else (filled[0].keys, filled[0].values)
        rows = [_window_ring(c, capacity, like) for c in caches]
        if self.keys is not None:
            rows.insert(0, (self.keys, self.values))
        self.keys = mx.concatenate([r[0] for r in rows], axis=0)
        self.values = mx.concatenate([r[1] for r in rows], axis=0)
        self.set_lengths(self.lengths + lengths)

    def remove_rows(self, keep) -> None:
        self.set_lengths([self.lengths[i] for i in keep])
        if self.keys is None:
            return
        if not keep:
            self.keys = self.values = None
            return
        index = mx.array(list(keep), dtype=mx.int32)
        self.keys, self.values = (mx.take(a, index, axis=0) for a in (self.keys, self.values))

    def extract(self, row: int) -> Any:
        """Row ``row`` as a fresh single-row ``RotatingKVCache`` (the template's class) holding its
        last min(length, W) positions in order."""
        out = self.single_row_type(max_size=self.window, keep=0)
        n = self.lengths[row]
        if n and self.keys is not None:
            held = min(n, self.window)
            slots = mx.array([p % self.capacity for p in range(n - held, n)], dtype=mx.int32)
            out.keys = mx.contiguous(mx.take(self.keys[row : row + 1], slots, axis=2))
            out.values = mx.contiguous(mx.take(self.values[row : row + 1], slots, axis=2))
            out.offset, out._idx = n, held
        return out


def _take_slots(a: mx.array, index: mx.array) -> mx.array:
    """``a`` [B, H, C, D] at slots ``index`` [B, 1, C', 1] (an empty-valued buffer: zeros)."""
    if not a.size:
        return mx.zeros((a.shape[0], a.shape[1], index.shape[2], a.shape[3]), a.dtype)
    return mx.take_along_axis(
        a, mx.broadcast_to(index, (a.shape[0], a.shape[1], index.shape[2], a.shape[3])), 2
    )


def _window_ring(cache: Any, capacity: int, like: tuple) -> tuple:
    """A single-row ``RotatingKVCache`` as a ring of ``capacity`` slots ([1, H, C, D] each): the
    positions it holds (position offset - 1 - j at its slot (_idx - 1 - j) mod its length)."""
    n = int(cache.offset)
    shapes = [(1, a.shape[1], capacity, a.shape[3]) for a in like]
    if not n:
        return tuple(mx.zeros(s, a.dtype) for s, a in zip(shapes, like))
    length = cache.keys.shape[2]
    held = min(n, length, capacity)
    positions = n - 1 - np.mod(n - 1 - np.arange(capacity), capacity)
    source = np.mod(cache._idx - 1 - (n - 1 - positions), length)
    source = np.where(positions >= n - held, source, 0).astype(np.int32)
    index = mx.array(source)[None, None, :, None]
    return _take_slots(cache.keys, index), _take_slots(cache.values, index)


# --------------------------------------------------------------------------- a compressor's pools


def _gather_rows(a: mx.array, index: np.ndarray) -> mx.array:
    """``a`` [B, S, D] at per-row positions ``index`` [B, S'] (host ints)."""
    index = mx.array(index.astype(np.int32))[..., None]
    return mx.take_along_axis(a, mx.broadcast_to(index, (*index.shape[:2], a.shape[-1])), axis=1)


def _dummy_window(ratio: int, width: int, dtype) -> tuple[mx.array, mx.array]:
    """The predecessor of a row's first window, as mlx-vlm's compressor gives it (kv 0, the
    overlapping half's gate -inf); the other half's gate 0 keeps its own dropped pool finite."""
    gate = mx.concatenate(
        [mx.full((1, ratio, width // 2), -mx.inf, dtype), mx.zeros((1, ratio, width - width // 2), dtype)], 2
    )
    return mx.zeros((1, ratio, width), dtype), gate


class RaggedCompressorCache:
    """A DeepSeek-V4 ``PoolingCache`` for B rows (the module docstring): ``lengths`` positions fed
    per row; ``pools`` the completed pools at ``lengths[r] // ratio``; ``window_kv`` /
    ``window_gate`` [B, ratio, D] each row's open window (its first ``lengths[r] % ratio`` slots);
    ``overlap_kv`` / ``overlap_gate`` [B, ratio, D] its last completed window (``has_overlap[r]``:
    a real one, not the first window's predecessor)."""

    def __init__(self, ratio: int):
        self.ratio = ratio
        self.overlaps = ratio == 4  # mlx-vlm's Compressor overlaps windows at ratio 4 only
        self.lengths: list[int] = []
        self.pools = PoolRows()
        self.window_kv = self.window_gate = self.overlap_kv = self.overlap_gate = None
        self.has_overlap: list[bool] = []
        self._speculation: dict | None = None
        self._generation = 0

    @property
    def _remainders(self) -> list[int]:
        return [n % self.ratio for n in self.lengths]

    def _arrays(self) -> tuple:
        return self.window_kv, self.window_gate, self.overlap_kv, self.overlap_gate

    def _set_arrays(self, arrays: tuple) -> None:
        self.window_kv, self.window_gate, self.overlap_kv, self.overlap_gate = arrays

    def _filled(self, width: int, dtype) -> tuple:
        """The four row arrays, zero windows and first-window predecessors where none are held yet."""
        if self.window_kv is not None:
            return self._arrays()
        rows = len(self.lengths)
        zeros = mx.zeros((rows, self.ratio, width), dtype)
        dummy_kv, dummy_gate = _dummy_window(self.ratio, width, dtype)
        repeat = (rows, 1, 1)
        return zeros, zeros, mx.tile(dummy_kv, repeat), mx.tile(dummy_gate, repeat)

    def _sequence(self, before: tuple, remainders: list[int], kv: mx.array, gate: mx.array) -> tuple:
        """Each row's open window then ``kv`` / ``gate`` [B, T, D], as [B, max(rem) + T, D] (past a
        row's own rem + T: repeats, never read)."""
        block_len = kv.shape[1]
        width = max(remainders) + block_len
        i = np.arange(width)[None]
        rem = np.array(remainders)[:, None]
        index = np.minimum(np.where(i < rem, i, i - rem + self.ratio), self.ratio + block_len - 1)
        return tuple(
            _gather_rows(mx.concatenate([held, new], axis=1), index)
            for held, new in ((before[0], kv), (before[1], gate))
        )

    def _settled(self, before: tuple, remainders: list[int], has: list[bool], sequence: tuple, keep) -> tuple:
        """The four row arrays and ``has_overlap`` once row r keeps ``keep[r]`` positions of
        ``sequence`` (`_sequence`'s): its open window and its last completed window then."""
        width = sequence[0].shape[1]
        done = (np.array(remainders) + np.array(keep)) // self.ratio
        slots = np.arange(self.ratio)[None]
        open_at = np.minimum(done[:, None] * self.ratio + slots, width - 1)
        last_at = np.minimum(np.maximum(done - 1, 0)[:, None] * self.ratio + slots, width - 1)
        open_len = mx.array(((np.array(remainders) + np.array(keep)) % self.ratio)[:, None, None])
        completed = mx.array(done > 0)[:, None, None]
        kept = mx.arange(self.ratio)[None, :, None] < open_len
        windows = [mx.where(kept, _gather_rows(s, open_at), 0) for s in sequence]
        overlaps = [mx.where(completed, _gather_rows(s, last_at), b) for s, b in zip(sequence, before[2:])]
        return (*windows, *overlaps), [h or (self.overlaps and bool(d)) for h, d in zip(has, done)]

    def compress_rows(self, compressor: nn.Module, x: mx.array) -> mx.array:
        """mlx-vlm's ``Compressor.__call__`` over ragged rows: the block [B, T, hidden] fed at each
        row's length; returns the pools [B, P, D] (P the longest row's count; a row's own end at
        its count, the mask hides the rest)."""
        from mlx_vlm.models.deepseek_v4.language import _overlap_compress_kv, _simple_compress_kv

        if compressor.overlap != self.overlaps:
            raise ValueError(
                f"a ratio-{self.ratio} pool cache met a compressor with overlap={compressor.overlap}"
            )
        kv, gate = compressor.wkv(x), compressor.wgate(x)
        if self._speculation is not None:
            self._speculation["inputs"].append((kv, gate))
        before, remainders, counts = self._filled(kv.shape[-1], kv.dtype), self._remainders, self._counts()
        sequence = self._sequence(before, remainders, kv, gate)
        done = max((r + kv.shape[1]) // self.ratio for r in remainders)
        if done:
            windows = [mx.unflatten(s[:, : done * self.ratio], 1, (done, self.ratio)) for s in sequence]
            if compressor.overlap:
                windows = [mx.concatenate([b[:, None], w], axis=1) for b, w in zip(before[2:], windows)]
                pooled = _overlap_compress_kv(*windows, compressor.ape, compressor.head_dim)[:, 1:]
            else:
                pooled = _simple_compress_kv(*windows, compressor.ape, compressor.head_dim)
            base = mx.array([c * self.ratio for c in counts], dtype=mx.int32)
            pooled = compressor.rope(compressor.norm(pooled)[:, None], offset=base)
            self.pools.update_and_fetch(pooled, mx.zeros((*pooled.shape[:3], 0), pooled.dtype))
        keep = [kv.shape[1]] * len(counts)
        arrays, self.has_overlap = self._settled(before, remainders, self.has_overlap, sequence, keep)
        self._set_arrays(arrays)
        self.lengths = [n + kv.shape[1] for n in self.lengths]
        self.pools.set_lengths(self._counts())
        return self.held_pools(kv.shape[0], compressor.head_dim, x.dtype)

    def _counts(self) -> list[int]:
        return [n // self.ratio for n in self.lengths]

    def held_pools(self, rows: int, dim: int, dtype) -> mx.array:
        """The rows' pools [B, P, D] up to the longest row's count."""
        width = max(self._counts(), default=0)
        if not width:
            return mx.zeros((rows, 0, dim), dtype)
        return self.pools.keys[:rows, 0, :width]

    def make_mask(self, L: int = 1, offset: Any = 0) -> mx.array:
        """bool [B, L, P]: row r's query t (position lengths[r] - L + t, the block just fed) sees
        pools i < (position + 1) // ratio."""
        ends = mx.array(self.lengths, dtype=mx.int32)[:, None] - L + mx.arange(1, L + 1)[None]
        width = max(self._counts(), default=0)
        return mx.arange(width)[None, None] < (ends // self.ratio)[..., None]

    # ------------------------------------------------------------------ verify blocks
    def start_speculation(self, length: int) -> int:
        self._generation += 1
        self._speculation = {
            "generation": self._generation,
            "lengths": list(self.lengths),
            "arrays": self._arrays(),
            "has_overlap": list(self.has_overlap),
            "inputs": [],
        }
        return self._generation

    def _transaction(self, generation: int | None) -> dict:
        t = self._speculation
        if t is None or (generation is not None and generation != t["generation"]):
            raise RuntimeError("no such DeepSeek-V4 pool transaction is open")
        self._speculation = None
        return t

    def commit_speculation(self, lengths, generation: int | None = None) -> None:
        """Row r keeps the first ``lengths[r]`` positions of the block fed since the start."""
        t = self._transaction(generation)
        self._restore(t)
        keep = [int(n) for n in lengths]
        if not any(keep):
            return
        kv, gate = (mx.concatenate([s[i] for s in t["inputs"]], axis=1) for i in range(2))
        before, remainders = self._filled(kv.shape[-1], kv.dtype), self._remainders
        sequence = self._sequence(before, remainders, kv, gate)
        arrays, self.has_overlap = self._settled(before, remainders, self.has_overlap, sequence, keep)
        self._set_arrays(arrays)
        self.lengths = [n + k for n, k in zip(self.lengths, keep)]
        self.pools.set_lengths(self._counts())

    def abort_speculation(self, generation: int | None = None) -> None:
        self._restore(self._transaction(generation))

    def _restore(self, t: dict) -> None:
        self.lengths, self.has_overlap = list(t["lengths"]), list(t["has_overlap"])
        self._set_arrays(t["arrays"])
        self.pools.set_lengths(self._counts())

    # ------------------------------------------------------------------ rows join and leave
    def add_rows(self, caches) -> None:
        """Append single-row ``PoolingCache`` s (their pools, open windows and overlap windows)."""
        self.pools.add_rows([JoiningPools(c) for c in caches])
        joining = [_pool_row(c) for c in caches]
        lengths = [c.size() * self.ratio + c.remainder for c in caches]
        found = [a for r in joining for a in (r[0], r[2][0] if r[2] else None) if a is not None]
        like = found[0] if found else self.window_kv
        if like is not None:
            width, dtype = like.shape[-1], like.dtype
            held = self._filled(width, dtype) if self.lengths else None
            rows = [_row_arrays(r, self.ratio, width, dtype) for r in joining]
            self._set_arrays(
                tuple(mx.concatenate(([held[i]] if held else []) + [r[i] for r in rows], 0) for i in range(4))
            )
        self.has_overlap += [r[2] is not None for r in joining]
        self.lengths += lengths

    def remove_rows(self, keep) -> None:
        self.pools.remove_rows(keep)
        self.lengths = [self.lengths[i] for i in keep]
        self.has_overlap = [self.has_overlap[i] for i in keep]
        if self.window_kv is not None:
            index = mx.array(list(keep), dtype=mx.int32)
            self._set_arrays(tuple(mx.take(a, index, axis=0) if keep else None for a in self._arrays()))

    def extract(self, row: int) -> Any:
        """Row ``row`` as a fresh mlx-vlm ``PoolingCache`` (pools, open window, overlap window)."""
        from mlx_vlm.models.cache import PoolingCache

        out = PoolingCache(self.ratio)
        n = self.lengths[row]
        count, out.remainder = divmod(n, self.ratio)
        if count:
            out.pooled = mx.contiguous(self.pools.keys[row : row + 1, 0, :count])
        if n and self.window_kv is not None:
            out.buf_kv, out.buf_gate = (mx.contiguous(a[row : row + 1]) for a in self._arrays()[:2])
        if self.has_overlap[row]:  # evaluated: a lazy slice would keep the batch's arrays alive
            window = tuple(mx.contiguous(a[row : row + 1]) for a in self._arrays()[2:])
            mx.eval(window)
            setattr(out, ATTRIBUTE, window)
        return out


def _pool_row(cache: Any) -> tuple:
    """A single-row ``PoolingCache``'s (open window kv, gate, overlap window or None)."""
    return cache.buf_kv, cache.buf_gate, getattr(cache, ATTRIBUTE, None)


def _row_arrays(row: tuple, ratio: int, width: int, dtype) -> tuple:
    """`_pool_row`'s parts as the four [1, ratio, D] row arrays (zeros, or the first window's predecessor)."""
    window_kv, window_gate, overlap = row
    zeros = mx.zeros((1, ratio, width), dtype)
    overlap = overlap if overlap is not None else _dummy_window(ratio, width, dtype)
    return (
        window_kv if window_kv is not None else zeros,
        window_gate if window_gate is not None else zeros,
        *overlap,
    )


# --------------------------------------------------------------------------- the indexer


def _hisa_rows(indexer: nn.Module, counts: list[int], L: int) -> list[int]:
    """The rows whose choice alone is mlx-vlm's HISA path: enough pools to block, more than it keeps."""
    b, keep, top = indexer.index_block, indexer.index_keep, indexer.index_topk
    if b <= 0:
        return []
    return [r for r, n in enumerate(counts) if n > top and n >= b * keep and keep * b >= min(top, n)]


def ragged_indexer(
    indexer: nn.Module, x, q_residual, position_rope, pool_cache: RaggedCompressorCache, offset
):
    """mlx-vlm 0.7.10 ``Indexer.__call__`` over ragged rows: the pools [B, L, k] each query
    attends to (the module docstring), mlx-vlm's scoring under the rows' pool mask, HISA's choice
    (``_hisa_select`` for one position, ``hisa_select`` for more) on its own pools for a row that
    alone would take it."""
    from mlx_vlm.models.deepseek_v4.hisa_kernel import hisa_select

    batch, L, _ = x.shape
    pooled = indexer.compressor(x, pool_cache, offset)
    if pooled.shape[1] == 0:
        return None
    q = indexer.wq_b(q_residual).reshape(batch, L, indexer.n_heads, indexer.head_dim).transpose(0, 2, 1, 3)
    q = position_rope(q, offset)
    k = min(indexer.index_topk, pooled.shape[1])
    pmask = pool_cache.make_mask(L, offset)
    weights = indexer.weights_proj(x).astype(mx.float32) * (indexer.n_heads**-0.5)
    scores = q.astype(mx.float32) @ pooled[:, None].swapaxes(-1, -2).astype(mx.float32)
    scores = (mx.maximum(scores, 0) * indexer.scale * weights.swapaxes(-1, -2)[..., None]).sum(axis=1)
    scores = mx.where(pmask, scores, mx.finfo(scores.dtype).min)
    topk = mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]
    counts = [n // pool_cache.ratio for n in pool_cache.lengths]
    for r in _hisa_rows(indexer, counts, L):
        own = pooled[r : r + 1, : counts[r]]
        if L == 1:
            chosen = indexer._hisa_select(q[r : r + 1], own, x[r : r + 1], k)
        else:
            valid = pmask[r : r + 1, :, : counts[r]].sum(-1)
            chosen = hisa_select(
                q[r : r + 1],
                own,
                weights[r : r + 1],
                indexer.scale,
                k,
                indexer.index_block,
                indexer.index_keep,
                valid,
            )
        topk = mx.where((mx.arange(batch) == r)[:, None, None], chosen.astype(topk.dtype), topk)
    return topk


_ORIGINAL_INDEXER: list = []


def _install_ragged_indexer() -> None:
    """``Indexer.__call__`` -> `ragged_indexer` for a `RaggedCompressorCache`, mlx-vlm's own for
    any other cache (idempotent)."""
    from mlx_vlm.models.deepseek_v4.language import Indexer

    if _ORIGINAL_INDEXER:
        return
    original = Indexer.__call__
    _ORIGINAL_INDEXER.append(original)

    def indexer_call(self, x, q_residual, position_rope, pool_cache, offset):
        if isinstance(pool_cache, RaggedCompressorCache):
            return ragged_indexer(self, x, q_residual, position_rope, pool_cache, offset)
        return original(self, x, q_residual, position_rope, pool_cache, offset)

    Indexer.__call__ = indexer_call


# --------------------------------------------------------------------------- the batch layer

_WINDOWS = ("mlx_vlm.models.cache.RotatingKVCache", "mlx_lm.models.cache.RotatingKVCache")


def _window(template: Any) -> RaggedWindowKV | None:
    if class_key(template) not in _WINDOWS or template.keep != 0:
        return None
    return RaggedWindowKV(template.max_size, type(template))


def deepseek_v4_layer(template: Any) -> Any:
    """The batch layer for a DeepSeek-V4 cache ``template`` (a trunk layer's, or its head's mlx-lm
    window), None for any other cache."""
    if class_key(template) != "mlx_vlm.models.cache.CacheList":
        return _window(template)
    window, *pools = template.caches
    window = _window(window)
    if window is None or not pools or any(type(p).__name__ != "PoolingCache" for p in pools):
        return None
    _install_ragged_indexer()
    layer = CacheList(window, *(RaggedCompressorCache(p.ratio) for p in pools))
    # mlx-vlm's model takes its mask from the first layer's cache (a CacheList's first member only
    # when it is mlx-vlm's own CacheList class): this one answers with its window's
    layer.make_mask = window.make_mask
    return layer
