"""Exact rollback of mlx-lm prompt caches after a speculative verify block.

A verify forward appends T = k+1 positions [pending, d1..dk] to every cache;
the decode loop then keeps the first ``num_keep`` of them. Every cache must end
up exactly as if only those positions had been forwarded:

* ``KVCache`` / ``QuantizedKVCache``: entries are addressed by ``offset``, so
  moving ``offset`` back is exact (the stale tail is overwritten later).
* ``RotatingKVCache``: a multi-token update (mlx-lm's concatenating path)
  keeps ``max_size - 1`` old entries plus the whole block in temporal order,
  so the rejected suffix is the tail of the buffer and is sliced off, even when
  the window has wrapped. A single-token update writes in place over the
  oldest entry; that entry is only needed if the whole block is rejected, and
  for that case the pre-block state is kept (see ``_RotatingRecord``).
* ``ArraysCache`` of a gated-delta layer (Qwen3.5 / Qwen3-Next) or of a Mamba2 block
  (Nemotron-H, the same two slots: conv, SSM state): slot 0 holds
  the last ``kernel_size - 1`` conv inputs, slot 1 the recurrent state. Neither
  can be "trimmed", so ``begin_block`` arranges that the verify forward itself
  records both after every position and ``commit_block`` installs the ones of
  position ``num_keep``: the hybrid capture of ``mtplx.trunk.recurrent_capture`` (no
  second forward, nothing extra for attention-only models; its hooks are Python-level,
  so the verify forward runs eagerly, not inside ``mx.compile``).

Every layout this relies on is read through ``mtplx.trunk.compat`` (checked by ``compat_check``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from mtplx.trunk import rollback_vlm
from mtplx.trunk.compat import (
    ArraysCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    RotatingState,
    arrays_slots,
    cache_leaves,
    is_supported_recurrent_layer,
    rotating_state,
    set_rotating_state,
)
from mtplx.trunk.compat_nemotron import cache_layers
from mtplx.trunk.recurrent_capture import (
    CapturingArraysCache,
    RecurrentRecord,
    begin_recurrent,
    install_recurrent_hooks,
)

import mlx.core as mx
import mlx.nn as nn

# Conv rows recorded when begin_block is not told the block length.
DEFAULT_MAX_BLOCK = 16

__all__ = [
    "BlockCapture",
    "abort_block",
    "begin_block",
    "check_rollback_support",
    "checkpoint",
    "commit_block",
    "mark_drafts",
    "trim_kv",
]


# --------------------------------------------------------------------------- support


def _leaves(cache: list) -> list[tuple[int, Any]]:
    """(layer index, leaf cache) pairs; a CacheList contributes all its members, and a CacheList
    among them its own (DeepSeek-V3.2 / GLM-5 pair the latent KV with the indexer's keys)."""
    out: list[tuple[int, Any]] = []
    for i, c in enumerate(cache):
        out.extend((i, leaf) for leaf in cache_leaves([c]))
    return out


def _batch_size(c: Any) -> int | None:
    if rollback_vlm.is_vlm_cache(c):
        return rollback_vlm.batch_size(c)
    if type(c) is ArraysCache or isinstance(c, CapturingArraysCache):
        arr = next((a for a in arrays_slots(c) if a is not None), None)
    else:
        arr = c.keys[0] if type(c) is QuantizedKVCache and c.keys is not None else c.keys
    return None if arr is None else arr.shape[0]


def _leaf_refusal(c: Any) -> str | None:
    kind = type(c).__name__
    if isinstance(c, CapturingArraysCache):
        return "a previous verify block was neither committed nor aborted"
    if rollback_vlm.is_vlm_cache(c):  # mlx-vlm's own caches (`mtplx.trunk.rollback_vlm`)
        return rollback_vlm.refusal(c)
    if type(c) in (KVCache, QuantizedKVCache, RotatingKVCache):
        return None
    if type(c) is ArraysCache:
        if len(arrays_slots(c)) != 2:
            return f"{kind} with {len(arrays_slots(c))} slots is not a gated-delta cache"
        if c.left_padding is not None or c.lengths is not None:
            return f"{kind} is set up for padded batches"
        return None
    return f"{kind} cannot be rolled back exactly"


def check_rollback_support(cache: list, model: nn.Module | None = None) -> str | None:
    """None if ``begin_block``/``commit_block`` can roll every cache back exactly, else why not.

    Supported: KVCache, QuantizedKVCache, RotatingKVCache (any window, wrapped
    or not), CacheLists of those (nested too), and the ArraysCache of a gated-delta layer of
    a module in ``SUPPORTED_RECURRENT_MODULES``; batch size 1 only. Pass the
    model to check that every ArraysCache belongs to such a layer; without it
    an ArraysCache is assumed to, and a layer that is not one makes
    ``commit_block`` raise instead of committing a wrong state.
    """
    layers = cache_layers(model) if model is not None else None
    for i, c in _leaves(cache):
        reason = _leaf_refusal(c)
        if reason is None and _batch_size(c) not in (None, 1):
            reason = f"batch size {_batch_size(c)} (only 1 is supported)"
        if reason is None and type(c) is ArraysCache and layers is not None:
            if i >= len(layers) or not is_supported_recurrent_layer(layers[i]):
                reason = "ArraysCache of a layer that is not a supported gated-delta or Mamba2 layer"
        if reason is not None:
            return f"cache of layer {i}: {reason}"
    return None


# --------------------------------------------------------------------------- KV kinds


@dataclass
class _KVRecord:
    cache: Any  # KVCache or QuantizedKVCache
    offset_before: int

    def commit(self, num_keep: int, block_len: int) -> None:
        if self.cache.offset != self.offset_before + block_len:
            raise RuntimeError(
                f"{type(self.cache).__name__} advanced by {self.cache.offset - self.offset_before}, "
                f"expected the block length {block_len}"
            )
        # Entries past offset are never read and are overwritten by the next update.
        self.cache.trim(block_len - num_keep)

    def abort(self) -> None:
        self.cache.trim(self.cache.offset - self.offset_before)


def _rotating_slice(c: RotatingKVCache, n: int) -> None:
    """Drop the newest ``n`` entries of a rotating cache left by a multi-token update.

    Valid when the buffer is in temporal order (``_idx`` == buffer length), which
    the concatenating path guarantees, and when what remains still holds every
    entry a future query may need: either nothing was ever evicted
    (length == offset) or at least ``max_size`` entries remain.
    """
    state = rotating_state(c)
    if n == 0:
        return
    if state.keys is None or state.idx != state.keys.shape[2]:
        raise ValueError("RotatingKVCache was last updated in place; its rejected entries overwrote history")
    length = state.idx - n
    if length < 0 or (length != state.offset - n and length < state.max_size):
        raise ValueError(f"cannot drop {n} entries from this RotatingKVCache without losing window history")
    set_rotating_state(
        c,
        state._replace(
            keys=state.keys[..., :length, :],
            values=state.values[..., :length, :],
            offset=state.offset - n,
            idx=length,
        ),
    )


@dataclass
class _RotatingRecord:
    cache: RotatingKVCache
    state_before: RotatingState

    def commit(self, num_keep: int, block_len: int) -> None:
        c = self.cache
        offset_before = self.state_before.offset
        if c.offset != offset_before + block_len:
            raise RuntimeError(
                f"RotatingKVCache advanced by {c.offset - offset_before}, expected the block length {block_len}"
            )
        if num_keep == 0:
            self.abort()
        else:
            # 0 < num_keep < block_len implies block_len > 1: the concatenating path ran.
            _rotating_slice(c, block_len - num_keep)

    def abort(self) -> None:
        set_rotating_state(self.cache, self.state_before)


def _begin_rotating(c: RotatingKVCache, block_len: int | None) -> _RotatingRecord:
    state = rotating_state(c)
    if state.keys is not None and block_len in (None, 1):
        # A one-token update writes into the buffer in place; independent aliases
        # keep the overwritten entry for a full rejection. A longer block builds
        # new arrays, so plain references suffice there.
        state = state._replace(keys=mx.array(state.keys), values=mx.array(state.values))
    return _RotatingRecord(c, state)


# --------------------------------------------------------------------------- public API


@dataclass
class BlockCapture:
    """What ``begin_block`` recorded; consumed by exactly one commit_block or abort_block."""

    block_len: int | None
    records: list  # _KVRecord | _RotatingRecord | RecurrentRecord, in cache order
    status: str = "open"  # -> "committed" | "aborted"


def begin_block(cache: list, block_len: int | None = None) -> BlockCapture:
    """Call right before the verify forward of ``block_len`` positions on ``cache``.

    KV caches only remember their offset (free). Gated-delta caches switch to
    capture mode for the next forward (see the module docstring). ``block_len``
    is optional; giving it sizes the conv capture exactly and lets the commit
    check the forward advanced by that much. Raises ValueError for caches that
    ``check_rollback_support`` refuses.
    """
    reason = check_rollback_support(cache)
    if reason is not None:
        raise ValueError(f"cannot roll back this cache: {reason}")
    records: list = []
    for _, c in _leaves(cache):
        if rollback_vlm.is_vlm_cache(c):
            records.append(rollback_vlm.begin(c, block_len))
        elif type(c) is ArraysCache:
            install_recurrent_hooks()
            records.append(begin_recurrent(c, (block_len or DEFAULT_MAX_BLOCK) + 1))
        elif type(c) is RotatingKVCache:
            records.append(_begin_rotating(c, block_len))
        else:
            records.append(_KVRecord(c, c.offset))
    return BlockCapture(block_len, records)


@dataclass
class _SlotsRecord:
    cache: ArraysCache
    slots_before: list

    def abort(self) -> None:
        # Layers assign new arrays into the slots (never write into them), so the old references are exact.
        self.cache.cache = list(self.slots_before)


def checkpoint(cache: list) -> BlockCapture:
    """Record ``cache`` so that ``abort_block`` restores it after any number of forwards.

    For autoregressive drafting (a draft model's own cache): several one-token
    forwards follow, and all of them are undone at once. Unlike ``begin_block``
    nothing switches to capture mode, so the forwards may be many; a partial
    keep is not possible (the caller re-forwards the kept tokens instead).
    Any ArraysCache is restorable here: its slots are replaced, not written into.
    """
    records: list = []
    for i, c in _leaves(cache):
        reason = _leaf_refusal(c)
        if reason is None and _batch_size(c) not in (None, 1):
            reason = f"batch size {_batch_size(c)} (only 1 is supported)"
        if reason is not None:
            raise ValueError(f"cannot checkpoint this cache: cache of layer {i}: {reason}")
        if rollback_vlm.is_vlm_cache(c):
            raise ValueError(
                f"cannot checkpoint this cache: cache of layer {i}: mlx-vlm's {type(c).__name__}"
            )
        if type(c) is ArraysCache:
            records.append(_SlotsRecord(c, list(c.cache)))
        elif type(c) is RotatingKVCache:
            records.append(_begin_rotating(c, None))
        else:
            records.append(_KVRecord(c, c.offset))
    return BlockCapture(None, records)


def _block_len(capture: BlockCapture) -> int:
    if capture.block_len is not None:
        return capture.block_len
    for r in capture.records:
        if isinstance(r, RecurrentRecord):
            return r.block_len
        if isinstance(r, _KVRecord):
            return r.cache.offset - r.offset_before
        if isinstance(r, _RotatingRecord):
            return r.cache.offset - r.state_before.offset
    return 0


def commit_block(cache: list, capture: BlockCapture, num_keep: int) -> None:
    """Leave every cache as if only the first ``num_keep`` block positions had been forwarded.

    KV caches drop the last T - num_keep entries; gated-delta caches take the
    conv and recurrent state recorded after position ``num_keep`` (0 = the state
    before the block). 0 <= num_keep <= T.
    """
    if capture.status != "open":
        raise ValueError(f"this BlockCapture was already {capture.status}")
    block_len = _block_len(capture)
    try:
        if not 0 <= num_keep <= block_len:
            raise ValueError(f"num_keep must be in [0, {block_len}], got {num_keep}")
        for r in capture.records:
            if isinstance(r, RecurrentRecord):
                if r.block_len != block_len:
                    raise RuntimeError(
                        f"gated-delta capture saw {r.block_len} positions, expected {block_len}"
                    )
                r.commit(num_keep)
            else:
                r.commit(num_keep, block_len)
    except BaseException:
        # Never leave capture mode or a half-committed cache behind: back to the pre-block state.
        abort_block(cache, capture)
        raise
    capture.status = "committed"
    # Drop the per-position states and pre-block buffers now, not when the caller
    # lets go of the capture; a committed capture is never used again.
    capture.records = []


def abort_block(cache: list, capture: BlockCapture) -> None:
    """Restore every cache to its state at ``begin_block``.

    For a verify forward that raised or was interrupted (KeyboardInterrupt),
    possibly after only some layers ran: offsets and recurrent slots are reset
    to their recorded values, and capture mode is switched off. A no-op once
    the capture is committed (a commit is final) or already aborted, so it is
    safe in an ``except``/``finally`` around the whole cycle.
    """
    if capture.status != "open":
        return
    capture.status = "aborted"
    for r in capture.records:
        r.abort()


# RotatingKVCache -> its state before entries that ``trim_kv`` will drop were written one at a
# time (``mark_drafts``). Weak keys: a cache that is let go takes its mark with it.
_DRAFT_MARKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def mark_drafts(cache: list) -> None:
    """Record every RotatingKVCache in ``cache`` before draft entries are added one token at a
    time (an MTP head's chained steps), so that ``trim_kv`` dropping exactly those entries is
    exact even where the single-token updates wrote in place over the window's oldest entries.
    KV caches need no record (their offset is enough); the latest mark of a cache replaces any
    earlier one."""
    for _, c in _leaves(cache):
        if type(c) is RotatingKVCache:
            _DRAFT_MARKS[c] = _begin_rotating(c, None).state_before
        elif rollback_vlm.is_vlm_cache(c):
            rollback_vlm.mark(c)  # an mlx-vlm CacheList's pool caches (GLM-5-Next's head)


def _trim_rotating(c: RotatingKVCache, n: int) -> None:
    mark = _DRAFT_MARKS.pop(c, None)
    if mark is not None and mark.offset == c.offset - n:
        set_rotating_state(c, mark)  # exactly the entries added since the mark
        return
    _rotating_slice(c, n)


def trim_kv(cache: list, n: int) -> None:
    """Drop the newest ``n`` entries of every KV cache in ``cache`` (e.g. an MTP head's).

    Raises ValueError for recurrent caches (use begin_block/commit_block), for
    n larger than a cache holds, and for a RotatingKVCache whose last update
    was a single in-place token (the evicted entry is gone) unless ``mark_drafts``
    recorded it right before the ``n`` entries were added.
    """
    if n < 0:
        raise ValueError(f"trim_kv: n must be >= 0, got {n}")
    for i, c in _leaves(cache):
        if rollback_vlm.is_vlm_cache(c):
            rollback_vlm.trim(c, n)
        elif type(c) in (KVCache, QuantizedKVCache):
            if n > c.offset:
                raise ValueError(f"trim_kv: layer {i} holds {c.offset} entries, cannot drop {n}")
            c.trim(n)
        elif type(c) is RotatingKVCache:
            if n > c.offset:
                raise ValueError(f"trim_kv: layer {i} holds {c.offset} entries, cannot drop {n}")
            _trim_rotating(c, n)
        else:
            raise ValueError(f"trim_kv: layer {i}: {type(c).__name__} is not a KV cache")
