"""Exact rollback of mlx-vlm's own caches (families in `mtplx.trunk.vlm_text.NATIVE_CACHE_FAMILIES`).

Qwen3.8-Flash-Next's caches have no mlx-lm equivalent: a ``QSAKVCache`` (KV plus the QSA
indexer's raw keys, their positions and the pooled block keys), a gated-delta ``ArraysCache``
(conv window, recurrent state) and, on PLE layers, two more ``ArraysCache`` slots (the PLE
short-convolution window and the n-gram token history). mlx-vlm 0.7.10 rolls them back itself
(``mlx_vlm/speculative/cache_state.py``): ``start_speculative_cache(caches, T)`` makes every
``ArraysCache`` record the state after each of the block's T positions (``update_recurrent``
keeps the recurrent states, ``update_window`` views of the windows) and remembers each other
cache's offset; ``commit([num_keep])`` installs the states after position ``num_keep`` and
trims the rest (``QSAKVCache.trim`` drops the indexer's keys too and clears the pooled blocks,
which the next forward pools again from the raw keys); ``abort()`` restores the start.

DeepSeek-V4 (a sliding-window ``RotatingKVCache`` and compressed ``PoolingCache`` s in mlx-vlm's
``CacheList``): mlx-vlm's transaction replays the kept positions into the window and keeps the
kept windows' pooled rows and remainder; the one piece of state mtplx adds (the last completed
window a ratio-4 compressor overlaps with, `mtplx.trunk.vlm_deepseek_v4`) is `OverlapRecord`'s.

mtplx uses exactly that, one transaction per leaf cache (`VlmBlockRecord`), inside its own
`mtplx.trunk.rollback.begin_block` / ``commit_block`` / ``abort_block``; whether the result is
what plain decoding leaves is checked by ``tests/trunk/test_cache.py`` (caches after MTP cycles
== caches after AR, with a control that skips the commit).
"""

from __future__ import annotations

import weakref
from typing import Any

from mtplx.trunk.vlm_deepseek_v4 import OverlapRecord

import mlx.core as mx

__all__ = ["VlmBlockRecord", "batch_size", "begin", "is_vlm_cache", "mark", "refusal", "trim"]


def is_vlm_cache(c: Any) -> bool:
    """A cache of mlx-vlm's own classes (not mlx-lm's)."""
    return type(c).__module__.startswith("mlx_vlm.")


def _members(c: Any) -> list | None:
    """An mlx-vlm ``CacheList``'s caches (DeepSeek-V4: sliding window + pooled), else None."""
    caches = getattr(c, "caches", None)
    return list(caches) if type(c).__name__ == "CacheList" and caches is not None else None


def batch_size(c: Any) -> int | None:
    """Rows an mlx-vlm cache holds (None: nothing written yet)."""
    if (members := _members(c)) is not None:
        return next((b for b in map(batch_size, members) if b is not None), None)
    if type(c).__name__ == "PoolingCache":
        arr = next((a for a in (c.buf_kv, c.pooled) if a is not None), None)
        return None if arr is None else arr.shape[0]
    if hasattr(c, "cache") and isinstance(c.cache, list):  # ArraysCache
        arr = next((a for a in c.cache if a is not None), None)
        return None if arr is None else arr.shape[0]
    keys = getattr(c, "keys", None)
    if isinstance(keys, (tuple, list)):  # a quantized cache: (packed, scales, biases)
        keys = keys[0]
    return None if keys is None else keys.shape[0]


def refusal(c: Any) -> str | None:
    """Why ``c`` (an mlx-vlm cache) cannot be rolled back here, or None."""
    kind = type(c).__name__
    if (members := _members(c)) is not None:  # one transaction over every member
        return next((r for r in map(refusal, members) if r is not None), None)
    if getattr(c, "is_speculating", False):
        return f"{kind}: a previous verify block was neither committed nor aborted"
    if callable(getattr(c, "start_speculation", None)):
        if getattr(c, "left_padding", None) is not None or getattr(c, "lengths", None) is not None:
            return f"{kind} is set up for padded batches"
        return None
    if callable(getattr(c, "trim", None)) and isinstance(getattr(c, "offset", None), int):
        return None
    return f"{kind} cannot be rolled back exactly"


class VlmBlockRecord:
    """One mlx-vlm cache's speculative transaction over a verify block of ``block_len`` positions."""

    def __init__(self, cache: Any, block_len: int):
        from mlx_vlm.speculative.cache_state import iter_leaf_caches, start_speculative_cache

        self.cache = cache
        self.block_len = block_len
        # DeepSeek-V4's pool caches carry mtplx's overlap window besides mlx-vlm's state
        pools = [c for c in iter_leaf_caches([cache]) if type(c).__name__ == "PoolingCache"]
        self.overlaps = [OverlapRecord(c) for c in pools]
        self.transaction = start_speculative_cache([cache], block_len)
        for record in self.overlaps:
            record.bind()

    def commit(self, num_keep: int, block_len: int) -> None:
        if block_len != self.block_len:
            raise RuntimeError(
                f"{type(self.cache).__name__} began a block of {self.block_len}, not {block_len}"
            )
        for record in self.overlaps:
            record.commit(num_keep)
        self.transaction.commit([num_keep])

    def abort(self) -> None:
        for record in self.overlaps:
            record.abort()
        self.transaction.abort()


def begin(c: Any, block_len: int | None) -> VlmBlockRecord:
    if block_len is None:
        raise ValueError(f"{type(c).__name__}: an mlx-vlm cache's rollback needs the block length")
    return VlmBlockRecord(c, block_len)


# A head's pool caches as ``mark`` left them: cache -> (positions then, its state then).
_MARKS: weakref.WeakKeyDictionary[Any, tuple[int, tuple]] = weakref.WeakKeyDictionary()


def _pool_state(p: Any) -> tuple:
    copy = [None if a is None else mx.array(a) for a in (p.buf_kv, p.buf_gate)]
    return (p.remainder, *copy, p.pooled)


def mark(c: Any) -> None:
    """Record an mlx-vlm ``CacheList``'s pool caches and ``ArraysCache`` s (Inkling's short
    convolution windows) before a head's draft entries are added (`mtplx.trunk.rollback.mark_drafts`):
    neither is undone by dropping rows, so ``trim`` of exactly those entries restores this record.
    An ArraysCache's slots are replaced by each forward, never written into: references suffice."""
    members = _members(c)
    if not members:
        return
    positions = getattr(members[0], "offset", 0)
    for p in members:
        if type(p).__name__ == "PoolingCache":
            _MARKS[p] = (positions, _pool_state(p))
        elif type(p).__name__ == "ArraysCache":
            _MARKS[p] = (positions, tuple(p.cache))


def trim(c: Any, n: int) -> None:
    """Drop the newest ``n`` entries of an mlx-vlm head cache: a trimmable cache (a QSA KV
    cache), or a ``CacheList`` whose first member counts positions (GLM-5-Next's, Inkling's: its
    KV members cut to that many positions, a pool cache or an ArraysCache back to its ``mark``)."""
    members = _members(c)
    if members is not None:
        _trim_members(c, members, n)
        return
    if not (callable(getattr(c, "is_trimmable", None)) and c.is_trimmable()):
        raise ValueError(f"{type(c).__name__} is not a KV cache")
    if n > c.offset:
        raise ValueError(f"{type(c).__name__} holds {c.offset} entries, cannot drop {n}")
    c.trim(n)


def _trim_members(c: Any, members: list, n: int) -> None:
    if n == 0:
        return
    if n > members[0].offset:
        raise ValueError(f"{type(c).__name__} holds {members[0].offset} entries, cannot drop {n}")
    keep = members[0].offset - n
    for p in members:
        kind = type(p).__name__
        if kind in ("PoolingCache", "ArraysCache"):
            positions, state = _MARKS.pop(p, (None, None))
            if positions != keep:
                raise ValueError(f"{kind}: only the entries added since mark_drafts can be dropped")
            if kind == "ArraysCache":
                p.cache = list(state)
            else:
                p.remainder, p.buf_kv, p.buf_gate, p.pooled = state
        elif getattr(p, "offset", 0) > keep:  # a prefill-only projection cache may hold fewer
            p.trim(p.offset - keep)
