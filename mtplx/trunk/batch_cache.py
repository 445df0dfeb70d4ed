"""Caches for a batch of sequences of different lengths, with per-row rollback.

mlx-lm's batch caches keep every row aligned at one write position (left padding), so
`BatchKVCache.trim` moves all rows by the same amount. A speculative batch keeps a different
number of positions per row each cycle, so here every row has its own length:

* `RaggedKVCache` (one per attention layer): buffers [B, H, S, D]; row r holds positions
  0..lengths[r]-1. A forward of T positions writes row r's block at lengths[r].. (one scatter),
  RoPE reads the per-row ``offset`` array, and `make_mask` gives each row its own causal mask
  (key j is visible to query t of row r iff j <= lengths[r] + t), so entries past a row's
  length (a shorter row's stale tail, or the right padding of a block) are never read.
  Keeping n of the T positions is setting lengths[r] = before[r] + n: no copy of the context.
* Gated-delta layers (Qwen3.5 / Qwen3-Next): an mlx-lm ``ArraysCache`` holding B rows. A verify
  block records the recurrent state after every position (the same hook as single-row
  rollback, `mtplx.trunk.recurrent_capture`) and the conv layer's input (`compat.ConvInputTap`), so a
  row keeping n positions takes the state recorded after its position n and the conv rows
  [n, n + kernel - 1) of that input. Nemotron-H's Mamba2 blocks the same (their SSM-state hook,
  `compat_nemotron`); its cache list skips the MLP / MoE blocks (`compat_nemotron.cache_layers`).

* Quantized KV (`RaggedQuantizedKVCache`, `kv_quant` with start 0): the same rows, lengths and
  masks over mlx-lm's QuantizedKVCache layout (each of K and V a triple: packed uint32 values, a
  scale and a bias per group along the head dimension); a block is quantized when written, per
  position, as a single-row QuantizedKVCache does, so rollback is again setting lengths.

* A ``CacheList`` of K/V caches (one layer's MLA latent and its DSA indexer's keys: Hunyuan-V4
  through mlx-vlm, DeepSeek-V3.2 / GLM-5 / LongCat-Flash through mlx-lm): a ``CacheList`` of
  `RaggedKVCache` s, every member at the rows' lengths (the model's attention and indexer read
  ``cache[0]`` / ``cache[1]`` as for a single row). An indexer's keys cache stores empty values
  (head dim 0); no write touches an empty buffer. An indexer that keeps ``top_k`` keys selects
  over the padded keys with the row's mask applied (masked keys score -inf), so a row shorter
  than ``top_k`` still attends to all of its keys, as alone.

* A backend's own cache classes (mlx-vlm's): the model names the batch's layer for each
  (``own_layer(cache)``: ``model.batch_layer``, `mtplx.trunk.vlm_text.VlmTextModel`, per family:
  MiniMax-M3's KV + indexer keys, `mtplx.trunk.vlm_minimax_m3`; Qwen3.8-Flash-Next's QSA KV as
  ragged rows and its and GLM-5-Next's mlx-vlm ``ArraysCache`` s of B rows whose operators record
  every block position themselves, `mtplx.trunk.batch_vlm`; GLM-5-Next's sparse layers'
  ``CacheList`` s, `mtplx.trunk.batch_glm5_next`; Inkling's ``CacheList(KVCache, ArraysCache(4))``,
  `mtplx.trunk.batch_inkling`; DeepSeek-V4's sliding windows as per-row rings and its
  compressors' pool caches, `mtplx.trunk.batch_deepseek_v4`). A batch layer, or a ``CacheList``
  member, with ``start_speculation`` is rolled back per row by its own ``commit_speculation``.

Rows join from single-row caches (`add_rows`, after their own prefill or from the prompt
cache) and leave (`remove_rows`); both copy only the rows that move, never per cycle. Sliding-window
(rotating) caches of mlx-lm models, float caches that convert to quantized KV at a later
position, and mlx-vlm's own cache classes without a batch layer are not batched:
`check_batchable` says so in one line naming the cache class.

Invariant between cycles: every layer's row r holds exactly the committed positions of
sequence r, as the same sequence's single-row cache would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mtplx.trunk import kv_quant, recurrent_capture
from mtplx.trunk.compat import (
    CONV_SLOT,
    STATE_SLOT,
    ArraysCache,
    CacheList,
    ConvInputTap,
    KVCache,
    QuantizedKVCache,
    arrays_slots,
    cache_leaves,
    cache_members,
    is_supported_recurrent_layer,
    kv_state,
)
from mtplx.trunk.compat_nemotron import cache_layers

import mlx.core as mx
import mlx.nn as nn

__all__ = ["BatchCache", "RaggedKVCache", "RaggedQuantizedKVCache", "check_batchable"]

# A backend's batch layer for one of its own cache classes (None: not one it batches).
OwnLayer = Callable[[Any], Any]

_STEP = 256  # buffer growth, in positions (mlx-lm's KVCache grows by the same step)


def class_key(c: Any) -> str:
    """``module.Class`` of a cache (the batch forms match mlx-vlm's classes by name: imported lazily)."""
    return f"{type(c).__module__}.{type(c).__qualname__}"


class RaggedKVCache:
    """K/V of B rows with per-row lengths (the module docstring). Quacks like mlx-lm's KVCache
    where models touch it: ``offset`` (per-row array), ``update_and_fetch``, ``make_mask``, ``state``.

    The buffers hold ``slots >= B`` rows; rows 0..B-1 are the batch (a leading-axis slice, no
    copy). A joining row is written into the next free slot and a leaving row's slot is filled
    by the last row, so a join or a leave copies the rows that move, not the whole batch (at 16
    rows of ~700 positions a whole copy is ~0.5 GB of float32 K/V per join and per leave). The
    buffers grow by doubling; they shrink (one copy) when the batch uses a quarter of the slots
    or half the positions, and are freed when the last row leaves.
    """

    def __init__(self, keys: mx.array | None = None, values: mx.array | None = None, lengths=()):
        self.keys = keys  # [slots, H, capacity, D] or None while empty; rows 0..B-1 in use
        self.values = values
        self.lengths: list[int] = list(lengths)
        self.offset = mx.array(self.lengths, dtype=mx.int32)  # [B]: where the next block is written

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def state(self) -> tuple:
        if self.keys is None:
            return ()
        rows = self.batch_size
        return _map(lambda a: a[:rows], self.keys), _map(lambda a: a[:rows], self.values)

    @property
    def _buffers(self) -> list[mx.array]:
        """Every buffer, keys' before values' (one each; three each when quantized)."""
        return _leaves((self.keys, self.values))

    @property
    def _written(self) -> list[mx.array]:
        """The buffers that hold anything: an indexer's key cache stores empty values (head dim 0),
        and MLX's scatter into an empty array stops the process (SIGFPE), so no write touches them."""
        return [b for b in self._buffers if b.size]

    def _shape(self) -> tuple[int, int]:
        """(slots, capacity) of the buffers; (0, 0) while empty."""
        if self.keys is None:
            return 0, 0
        first = self._buffers[0]
        return first.shape[0], first.shape[2]

    def _encode(self, keys: mx.array, values: mx.array) -> tuple:
        """What a block of keys/values [B, H, T, D] is stored as (float: itself)."""
        return keys, values

    def _row_state(self, cache: Any) -> tuple:
        """(keys, values) of a joining single-row cache, [1, H, capacity, D] each."""
        state = kv_state(cache)
        return state.keys, state.values

    def set_lengths(self, lengths: Sequence[int]) -> None:
        self.lengths = [int(n) for n in lengths]
        self.offset = mx.array(self.lengths, dtype=mx.int32)

    def _reallocate(self, slots: int, capacity: int, like_keys: Any, like_values: Any) -> None:
        """New zero buffers [slots, H, capacity, D] holding the current rows (one copy of them)."""

        def zeros(like: mx.array) -> mx.array:
            return mx.zeros((slots, like.shape[1], capacity, like.shape[3]), like.dtype)

        keys, values = _map(zeros, like_keys), _map(zeros, like_values)
        if self.keys is not None and self.batch_size:
            rows, have = min(self.batch_size, slots), min(self._shape()[1], capacity)
            for new, old in zip(_leaves((keys, values)), self._buffers):
                if new.size:
                    new[:rows, :, :have, :] = old[:rows, :, :have, :]
        self.keys, self.values = keys, values

    def _reserve(self, end: int, like_keys: Any, like_values: Any) -> None:
        slots, capacity = self._shape()
        if end <= capacity:
            return
        self._reallocate(
            slots if self.keys is not None else self.batch_size, _round_up(end), like_keys, like_values
        )

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple:
        """Write keys/values [B, H, T, D] at each row's length; return the rows' buffers up to the longest end."""
        block_len = keys.shape[2]
        stored = self._encode(keys, values)
        end = max(self.lengths) + block_len
        self._reserve(end, *stored)
        positions = self.offset[:, None] + mx.arange(block_len)[None]  # [B, T]
        rows = mx.arange(self.batch_size)[:, None]
        for buffer, block in zip(self._buffers, _leaves(stored)):
            if block.size:
                buffer[rows, :, positions] = block.transpose(0, 2, 1, 3)
        self.set_lengths([n + block_len for n in self.lengths])
        batch = self.batch_size

        def used(a: mx.array) -> mx.array:
            return a[:batch, :, :end, :]

        return _map(used, self.keys), _map(used, self.values)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        """bool [B, 1, N, max(lengths) + N]: query t of row r sees keys 0..lengths[r] + t."""
        if window_size is not None:
            raise ValueError("RaggedKVCache has no sliding window (check_batchable refuses such models)")
        end = max(self.lengths) + N
        query_positions = self.offset[:, None, None, None] + mx.arange(N)[None, None, :, None]
        return mx.arange(end)[None, None, None, :] <= query_positions

    # ------------------------------------------------------------------ rows join and leave
    def add_rows(self, caches: Sequence[Any]) -> None:
        """Append single-row caches (copied into free slots; the originals stay usable)."""
        if not caches:
            return
        lengths = [int(c.offset) for c in caches]
        filled = [c for c in caches if c.offset > 0]
        if not filled and self.keys is None:
            self.set_lengths(self.lengths + lengths)
            return
        like = (self.keys, self.values) if self.keys is not None else self._row_state(filled[0])
        first, rows = self.batch_size, self.batch_size + len(caches)
        slots, capacity = self._shape()
        needed = _round_up(max(max(self.lengths, default=0), max(lengths)) + 1)
        if rows > slots or needed > capacity:
            self._reallocate(max(rows, 2 * slots), max(needed, capacity), *like)
        for r, (c, n) in enumerate(zip(caches, lengths), start=first):
            # A slot's stale tail past its length is never read (make_mask); only n is written.
            if n:
                for buffer, held in zip(self._buffers, _leaves(self._row_state(c))):
                    if buffer.size:
                        buffer[r : r + 1, :, :n, :] = held[..., :n, :]
        self.set_lengths(self.lengths + lengths)

    def remove_rows(self, keep: Sequence[int]) -> None:
        """Keep only the rows ``keep`` (indices, in their new order): row j becomes old row
        keep[j]. Only rows whose index changes are copied (`BatchDecoder.leave` moves the last
        rows into the holes, so that is one row per leaver)."""
        self.set_lengths([self.lengths[i] for i in keep])
        if self.keys is None:
            return
        if not keep:
            self.keys = self.values = None
            return
        moves = [(j, i) for j, i in enumerate(keep) if i != j]
        if moves:
            dst = [j for j, _ in moves]
            src = mx.array([i for _, i in moves], dtype=mx.int32)
            moved = [mx.take(buffer, src, axis=0) for buffer in self._written]
            # Evaluated first, so the buffers have no other reader and the slice writes below
            # happen in place (MLX donates a buffer only to its last user; else a write copies it).
            mx.eval(moved)
            for buffer, rows in zip(self._written, moved):
                for k, j in enumerate(dst):
                    buffer[j : j + 1] = rows[k : k + 1]
        slots, capacity = self._shape()
        needed = _round_up(max(self.lengths))
        if 4 * len(keep) <= slots or 2 * needed <= capacity:  # free what the batch no longer uses
            self._reallocate(max(len(keep), slots // 2), min(needed, capacity), self.keys, self.values)

    def extract(self, row: int) -> KVCache:
        """Row ``row`` as a fresh single-row mlx-lm KVCache (its own copy)."""
        out = KVCache()
        n = self.lengths[row]
        if n and self.keys is not None:
            out.update_and_fetch(
                mx.contiguous(self.keys[row : row + 1, :, :n, :]),
                mx.contiguous(self.values[row : row + 1, :, :n, :]),
            )
        return out


class RaggedQuantizedKVCache(RaggedKVCache):
    """`RaggedKVCache` over mlx-lm's QuantizedKVCache layout: keys and values are each a triple
    (packed values, scales, biases) [slots, H, capacity, *]; ``bits`` and ``group_size`` make the
    model's attention take mlx-lm's quantized path, as for a single-row QuantizedKVCache. A block
    is quantized per position when written (`_encode`), so row r holds exactly what its own
    QuantizedKVCache would, and keeping n positions is again setting its length."""

    def __init__(self, group_size: int, bits: int):
        super().__init__()
        self.group_size = group_size
        self.bits = bits

    def _encode(self, keys: mx.array, values: mx.array) -> tuple:
        def quantize(x: mx.array) -> tuple:
            return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

        return quantize(keys), quantize(values)

    def _row_state(self, cache: Any) -> tuple:
        if type(cache) is not QuantizedKVCache or (cache.group_size, cache.bits) != (
            self.group_size,
            self.bits,
        ):
            raise ValueError(
                f"a row joining a {self.bits}-bit KV batch (groups of {self.group_size}) must hold the same "
                f"quantized KV (got {type(cache).__name__})"
            )
        keys, values, *_ = cache.state
        return keys, values

    def extract(self, row: int) -> QuantizedKVCache:
        """Row ``row`` as a fresh single-row QuantizedKVCache (its own copy)."""
        out = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        n = self.lengths[row]
        if n and self.keys is not None:

            def row_copy(a: mx.array) -> mx.array:
                return mx.contiguous(a[row : row + 1, :, :n, :])

            keys, values = _map(row_copy, self.keys), _map(row_copy, self.values)
            out.state = (keys, values, n, self.group_size, self.bits)
        return out


def _leaves(pair: tuple) -> list[mx.array]:
    """The arrays of a (keys, values) pair, keys' first: each part an array, or a tuple of arrays
    (quantized: packed values, scales, biases)."""
    return [a for part in pair for a in (part if isinstance(part, tuple) else (part,))]


def _map(fn, part: Any) -> Any:
    """``fn`` over one part of a (keys, values) pair, keeping its shape (array or tuple)."""
    return tuple(fn(a) for a in part) if isinstance(part, tuple) else fn(part)


def _round_up(positions: int) -> int:
    return max(_STEP, ((positions + _STEP - 1) // _STEP) * _STEP)


# --------------------------------------------------------------------------- which models batch


def check_batchable(
    single_row_cache: list, model: nn.Module | None = None, own_layer: OwnLayer | None = None
) -> str | None:
    """None if a model whose single-row cache looks like this can decode in a batch, else why not
    (``own_layer``: the backend's batch layer for its own cache classes, default ``model.batch_layer``)."""
    own_layer = own_layer or getattr(model, "batch_layer", None)
    layers = cache_layers(model) if model is not None else None
    for i, c in enumerate(single_row_cache):
        if own_layer is not None and own_layer(c) is not None:
            continue
        if type(c) is CacheList:
            reason = next(filter(None, (_kv_refusal(m) for m in cache_leaves(cache_members(c)))), None)
            if reason is not None:
                return f"cache of layer {i}: a CacheList member's {reason}"
            continue
        if type(c) is ArraysCache and len(arrays_slots(c)) == 2:
            if layers is not None and not is_supported_recurrent_layer(layers[i]):
                return f"cache of layer {i}: ArraysCache of a layer that is not a supported recurrent layer"
            continue
        reason = _kv_refusal(c)
        if reason is not None:
            return f"cache of layer {i}: {reason}"
    return None


def _kv_refusal(c: Any) -> str | None:
    """None for a KV cache a `RaggedKVCache` batches (float, or quantized from position 0), else why not."""
    if type(c) is KVCache and getattr(c, kv_quant.PLAN_ATTR, None) is not None:
        start = getattr(c, kv_quant.PLAN_ATTR).start
        return (
            f"KV quantized from position {start} is decoded one request at a "
            "time (each row converts at its own position; quantized_kv_start 0 batches)"
        )
    if type(c) in (KVCache, QuantizedKVCache):
        return None
    if type(c).__name__ == "RotatingKVCache" and type(c).__module__.startswith("mlx_lm."):
        return "sliding-window attention (RotatingKVCache) is decoded one request at a time"
    return f"{kv_quant.cache_kind(c)} is not batched (decoded one request at a time)"


# --------------------------------------------------------------------------- the batch's caches


def _stack_rows(arrays: list[mx.array | None]) -> mx.array | None:
    present = [a for a in arrays if a is not None]
    if not present:
        return None
    if len(present) != len(arrays):
        raise ValueError("a gated-delta cache row without state joined the batch (prefill it first)")
    return mx.concatenate(arrays, axis=0)


@dataclass
class _RecurrentBlock:
    cache: ArraysCache
    tap: ConvInputTap
    slots_before: list
    states: list = field(default_factory=list)  # recurrent state [B, ...] after each position

    def commit(self, num_keep: Sequence[int], kernel_rows: int) -> None:
        conv_input = self.tap.take()
        if conv_input is None or not self.states:
            raise RuntimeError("gated-delta layer did not record its verify block (was the forward run?)")
        stacked = mx.stack([self.slots_before[STATE_SLOT], *self.states], axis=0)  # [T+1, B, ...]
        rows = mx.arange(len(num_keep))
        keep = mx.array(list(num_keep), dtype=mx.int32)
        self.cache[STATE_SLOT] = stacked[keep, rows]
        # conv_input is [B, kernel - 1 + T, C]: the conv state after n positions is its rows [n, n + kernel - 1).
        positions = keep[:, None] + mx.arange(kernel_rows)[None]
        self.cache[CONV_SLOT] = mx.take_along_axis(conv_input, positions[..., None], axis=1)
        recurrent_capture.release_recorder(self.slots_before[STATE_SLOT])

    def abort(self) -> None:
        self.tap.take()
        recurrent_capture.release_recorder(self.slots_before[STATE_SLOT])
        self.cache.cache = list(self.slots_before)


@dataclass
class _SpeculationBlock:
    """A batch layer that records a block itself (mlx-vlm's ``ArraysCache``: ``start_speculation``)."""

    cache: Any
    generation: int

    def commit(self, num_keep: Sequence[int]) -> None:
        self.cache.commit_speculation([int(n) for n in num_keep], self.generation)

    def abort(self) -> None:
        self.cache.abort_speculation(self.generation)


@dataclass
class BatchBlock:
    """What `BatchCache.begin_block` recorded; consumed by one commit or abort."""

    lengths_before: list[int]
    block_len: int
    recurrent: list[_RecurrentBlock | _SpeculationBlock]
    open: bool = True


class BatchCache:
    """One cache per layer for the rows of a batch (attention: RaggedKVCache; gated delta: ArraysCache).

    ``layers`` is what the model's forward takes as its cache list. Rows are indexed 0..B-1 in
    join order; `remove_rows` renumbers them (`BatchDecoder.leave` moves the last rows into holes).
    """

    def __init__(self, template: list, model: nn.Module | None = None, own_layer: OwnLayer | None = None):
        """``template``: a fresh single-row cache of the model (its layer kinds); ``own_layer``:
        the backend's batch layer for its own cache classes (default ``model.batch_layer``; a
        head's cache passes its trunk model's)."""
        own_layer = own_layer or getattr(model, "batch_layer", None)
        reason = check_batchable(template, model, own_layer)
        if reason is not None:
            raise ValueError(reason)
        self.layers: list[Any] = [_batch_layer(c, own_layer) for c in template]
        self._list_types = [type(c) for c in template]  # a CacheList row leaves as its template's class
        self._conv_taps: dict[int, ConvInputTap] = {}
        if model is not None:
            owners = cache_layers(model)  # cache i's layer (Nemotron-H's MLP / MoE blocks have none)
            for i, c in enumerate(self.layers):
                if type(c) is ArraysCache:
                    self._conv_taps[i] = ConvInputTap.on(owners[i])
        self._attention = next(iter(self._ragged()), None)
        if self._attention is None:
            raise ValueError("a batch needs at least one attention layer (its rows' lengths)")

    def _ragged(self) -> list[RaggedKVCache]:
        """Every layer's K/V caches, a `CacheList` layer's members included (they share the rows' lengths)."""
        return [c for c in cache_leaves(self.layers) if isinstance(c, RaggedKVCache)]

    @property
    def lengths(self) -> list[int]:
        """Positions each row holds (every attention layer agrees between forwards)."""
        return list(self._attention.lengths)

    def add_rows(self, rows: Sequence[list]) -> None:
        """Append sequences given as single-row caches (same layer kinds as the template)."""
        for i, layer in enumerate(self.layers):
            members = [row[i] for row in rows]
            if isinstance(layer, RaggedKVCache):
                layer.add_rows(members)
            elif type(layer) is CacheList:
                for j, member in enumerate(cache_members(layer)):
                    member.add_rows([cache_members(m)[j] for m in members])
            else:
                joined = [arrays_slots(m) for m in members]
                for slot in range(len(layer.cache)):
                    new = _stack_rows([j[slot] for j in joined])
                    old = layer.cache[slot]
                    layer.cache[slot] = new if old is None else mx.concatenate([old, new], axis=0)

    def remove_rows(self, keep: Sequence[int]) -> None:
        index = mx.array(list(keep), dtype=mx.int32)
        for layer in self.layers:
            if isinstance(layer, (RaggedKVCache, CacheList)):
                for member in cache_leaves([layer]):
                    member.remove_rows(keep)
            else:
                layer.cache = [
                    None if a is None or not keep else mx.contiguous(mx.take(a, index, axis=0))
                    for a in layer.cache
                ]

    def extract(self, row: int) -> list:
        """Row ``row`` as a single-row mlx-lm cache list (for the prompt cache)."""
        out: list = []
        for layer, list_type in zip(self.layers, self._list_types):
            if isinstance(layer, RaggedKVCache):
                out.append(layer.extract(row))
            elif type(layer) is CacheList:
                out.append(list_type(*(member.extract(row) for member in cache_members(layer))))
            else:
                single = type(layer)(len(layer.cache))  # mlx-lm's ArraysCache, or mlx-vlm's
                single.cache = [None if a is None else mx.contiguous(a[row : row + 1]) for a in layer.cache]
                out.append(single)
        return out

    def set_lengths(self, lengths: Sequence[int]) -> None:
        """Attention-only: move every row to its length (a head's catch-up keeps only true pairs)."""
        if len(self._ragged()) != len(cache_leaves(self.layers)):
            raise ValueError("set_lengths: a recurrent cache cannot be moved back")
        for layer in self._ragged():
            layer.set_lengths(lengths)

    # ------------------------------------------------------------------ verify blocks
    def begin_block(self, block_len: int) -> BatchBlock:
        """Call right before a forward of ``block_len`` positions for every row."""
        recurrent: list[_RecurrentBlock] = []
        for i, layer in enumerate(self.layers):
            if type(layer) is ArraysCache:
                recurrent_capture.install_recurrent_hooks()
                tap = self._conv_taps.get(i)
                if tap is None:
                    raise ValueError("BatchCache of a hybrid model needs the model (pass model=)")
                record = _RecurrentBlock(layer, tap, list(layer.cache))
                recurrent_capture.register_recorder(record)
                tap.arm()
                recurrent.append(record)
            else:  # a batch layer, or a CacheList member, that records a block itself (mlx-vlm's)
                for own in cache_leaves([layer]):
                    if callable(getattr(own, "start_speculation", None)):
                        recurrent.append(_SpeculationBlock(own, own.start_speculation(block_len)))
        return BatchBlock(list(self.lengths), block_len, recurrent)

    def commit_block(self, block: BatchBlock, num_keep: Sequence[int]) -> None:
        """Row r keeps the first num_keep[r] positions of the block (0 <= num_keep[r] <= block_len)."""
        if not block.open:
            raise ValueError("this block was already committed or aborted")
        block.open = False
        if len(num_keep) != len(block.lengths_before) or not all(0 <= n <= block.block_len for n in num_keep):
            self._restore(block)
            raise ValueError(
                f"num_keep must hold {len(block.lengths_before)} values in [0, {block.block_len}]"
            )
        try:
            for record in block.recurrent:
                if isinstance(record, _SpeculationBlock):
                    record.commit(num_keep)
                else:
                    record.commit(num_keep, _kernel_rows(record))
        except BaseException:
            self._restore(block)
            raise
        lengths = [before + n for before, n in zip(block.lengths_before, num_keep)]
        for layer in self._ragged():
            layer.set_lengths(lengths)

    def abort_block(self, block: BatchBlock) -> None:
        """Back to the state at `begin_block` (a failed or interrupted forward). A no-op once closed."""
        if block.open:
            block.open = False
            self._restore(block)

    def _restore(self, block: BatchBlock) -> None:
        for record in block.recurrent:
            record.abort()
        for layer in self._ragged():
            layer.set_lengths(block.lengths_before)


def _batch_layer(template: Any, own_layer: OwnLayer | None = None) -> Any:
    """The batch's cache for a layer whose single-row cache is ``template``."""
    own = own_layer(template) if own_layer is not None else None
    if own is not None:
        return own
    if type(template) is KVCache:
        return RaggedKVCache()
    if type(template) is QuantizedKVCache:
        return RaggedQuantizedKVCache(template.group_size, template.bits)
    if type(template) is CacheList:  # one layer's several K/V caches (an MLA latent and its indexer's keys)
        return CacheList(*(_batch_layer(m) for m in cache_members(template)))
    return ArraysCache(len(arrays_slots(template)))


def _kernel_rows(record: _RecurrentBlock) -> int:
    return int(record.slots_before[CONV_SLOT].shape[1])
