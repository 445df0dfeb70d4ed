"""DeepSeek-V4's overlapping KV compressor made a function of the tokens (an mlx-vlm exactness hook).

A ratio-4 ``Compressor`` (``models/deepseek_v4/language.py``) pools every window of 4 positions
with the first half of its channels taken from the *previous* window (``_overlap_compress_kv``:
``kv_a`` shifted by one window), as DeepSeek-V4's published inference code does, which keeps the
previous window's raw ``kv`` / ``gate`` in its ``kv_state`` between decode steps. mlx-vlm 0.7.10
compresses only the windows completed inside one forward call and gives the first of them a zero
predecessor with a ``-inf`` gate: a window completed in a decode step, or first in a verify block
or a prefill chunk, pools without its overlap, so a block after a prefill, every decode step and a
from-scratch forward attend to different pooled keys (logits differ by ~0.3 on the tiny replica;
``tests/trunk/test_vlm_deepseek_v4.py`` keeps mlx-vlm's compressor as the control).

`exact_compressor_call` is the same math with the predecessor carried across calls: the last
completed window's raw ``(kv, gate)`` lives on the ``PoolingCache`` as ``overlap_window`` and is
prepended to the next call's first window (its own pooled row dropped again). Rollback of that one
extra piece of state is `OverlapRecord`'s (the rest of the PoolingCache is mlx-vlm's transaction);
a prompt-cache file holds it beside the caches (`overlap_windows` / `restore_overlap_windows`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

__all__ = [
    "ATTRIBUTE",
    "OverlapRecord",
    "exact_compressor_call",
    "leaf_caches",
    "overlap_windows",
    "restore_overlap_windows",
]

ATTRIBUTE = "overlap_window"  # on a PoolingCache: (kv [B, ratio, D], gate [B, ratio, D]) raw, or absent


def exact_compressor_call(original: Any):
    """``Compressor.__call__`` with the overlap predecessor kept on the pool cache; a compressor
    without overlap (ratio 128) or without a cache runs ``original`` unchanged, a batch's pool
    cache its own ``compress_rows`` (the same math per row)."""
    from mlx_vlm.models.deepseek_v4.language import _overlap_compress_kv

    def __call__(self, x: mx.array, pool_cache: Any, offset: Any) -> mx.array:
        compress_rows = getattr(pool_cache, "compress_rows", None)
        if compress_rows is not None:  # a batch's rows (`mtplx.trunk.batch_deepseek_v4`)
            return compress_rows(self, x)
        if not self.overlap or pool_cache is None:
            return original(self, x, pool_cache, offset)
        kv, gate = self.wkv(x), self.wgate(x)
        ready_kv, ready_gate, pool_base = pool_cache.accumulate_windows(kv, gate, offset)
        if ready_kv.size == 0:
            return pool_cache.update_and_fetch(mx.zeros((x.shape[0], 0, self.head_dim), dtype=x.dtype))
        windows = mx.unflatten(ready_kv, 1, (-1, self.compress_ratio))
        gates = mx.unflatten(ready_gate, 1, (-1, self.compress_ratio))
        previous = getattr(pool_cache, ATTRIBUTE, None)
        if previous is not None:
            windows = mx.concatenate([previous[0][:, None], windows], axis=1)
            gates = mx.concatenate([previous[1][:, None], gates], axis=1)
        pooled = _overlap_compress_kv(windows, gates, self.ape, self.head_dim)
        if previous is not None:
            pooled = pooled[:, 1:]
        setattr(pool_cache, ATTRIBUTE, (windows[:, -1], gates[:, -1]))
        pooled = self.rope(self.norm(pooled)[:, None], offset=pool_base).squeeze(1)
        return pool_cache.update_and_fetch(pooled)

    return __call__


class OverlapRecord:
    """A PoolingCache's ``overlap_window`` over one verify block: at commit, the last window
    completed within the kept positions (from mlx-vlm's transaction's recorded inputs), or the
    one before the block; at abort, the one before the block. Made before mlx-vlm's transaction
    starts; ``bind`` after it started (it reads the transaction's record)."""

    def __init__(self, cache: Any):
        self.cache = cache
        self.before = getattr(cache, ATTRIBUTE, None)
        self.transaction: dict | None = None

    def bind(self) -> None:
        self.transaction = self.cache._speculation

    def commit(self, num_keep: int) -> None:
        """Before mlx-vlm's commit (it clears the transaction): set the kept window."""
        t, ratio = self.transaction, self.cache.ratio
        done = (t["remainder"] + num_keep) // ratio  # windows completed within the kept positions
        if done == 0 or not t["inputs"]:
            self._set(self.before)
            return
        kv = mx.concatenate([segment[0] for segment in t["inputs"]], axis=1)
        gate = mx.concatenate([segment[1] for segment in t["inputs"]], axis=1)
        if t["remainder"]:
            kv = mx.concatenate([t["buf_kv"][:, : t["remainder"]], kv], axis=1)
            gate = mx.concatenate([t["buf_gate"][:, : t["remainder"]], gate], axis=1)
        end = done * ratio
        self._set((kv[:, end - ratio : end], gate[:, end - ratio : end]))

    def abort(self) -> None:
        self._set(self.before)

    def _set(self, window: tuple | None) -> None:
        if window is None:
            self.cache.__dict__.pop(ATTRIBUTE, None)
        else:
            setattr(self.cache, ATTRIBUTE, window)


def leaf_caches(caches: list) -> list:
    """Every leaf cache of ``caches`` in order, mlx-vlm's CacheLists opened."""
    out = []
    for c in caches:
        members = getattr(c, "caches", None)
        if type(c).__name__ == "CacheList" and isinstance(members, (list, tuple)):
            out.extend(leaf_caches(list(members)))
        else:
            out.append(c)
    return out


def overlap_windows(caches: list) -> tuple[list[int], list[tuple]]:
    """The ``overlap_window`` s ``caches`` carry (state a cache's ``state`` / ``meta_state`` does
    not hold): each one's leaf index (CacheLists opened, in order) and its (kv, gate), for a
    prompt-cache file to hold beside the caches (`restore_overlap_windows` puts them back)."""
    found = [(i, getattr(c, ATTRIBUTE, None)) for i, c in enumerate(leaf_caches(caches))]
    found = [(i, w) for i, w in found if w is not None]
    return [i for i, _ in found], [w for _, w in found]


def restore_overlap_windows(caches: list, leaves: list[int], windows: list) -> None:
    """Put back what `overlap_windows` took (ValueError when a leaf is no pool cache)."""
    all_leaves = leaf_caches(caches)
    for i, window in zip(leaves, windows, strict=True):
        if not 0 <= i < len(all_leaves) or type(all_leaves[i]).__name__ != "PoolingCache":
            raise ValueError(f"an overlap window names leaf cache {i}, which is no PoolingCache")
        setattr(all_leaves[i], ATTRIBUTE, tuple(window))
