"""Recurrent-state capture for a verify block: the conv and recurrent state of a gated-delta layer
(Qwen3.5 / Qwen3-Next) or a Mamba2 block (Nemotron-H) after every position of one forward, so that
`mtplx.trunk.rollback.commit_block` (one row) and `mtplx.trunk.batch_cache` (a batch) can keep any
prefix of the block exactly.

How (no second forward, nothing extra for attention-only models):

* Recurrent state: mlx-lm's gated-delta layers call the module-level function
  ``gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, mask, ...)``.
  ``compat.install_gated_delta_hook`` rebinds that name in the supported model
  modules to ``capturing_gated_delta_update``, which passes straight through
  unless ``state`` is the very array object a capturing cache handed out; then
  it runs the same function one position at a time, keeping each state. The
  per-position calls take the path mlx-lm would take (Metal kernel when
  ``use_kernel`` and a GPU, the ops loop otherwise), and both carry the state
  between positions in float32, so the split run equals the one-shot run.
* Conv state: these layers already support per-sequence ``lengths`` (used by
  mlx-lm's batched generation): they store rows ``[len, len + kernel - 1)`` of
  the conv input instead of the last rows. A capturing cache sets ``lengths``
  to ``[0, 1, ..., T]`` (through ``ArraysCache.prepare``); the gather broadcasts over that vector and the layer
  writes the conv state after every prefix length, shape ``[T+1, kernel-1, C]``.
  The capturing cache also hides ``lengths`` from the mask and ``advance``,
  where it would otherwise mean "padding".

Mamba2 (Nemotron-H): its mixer calls the module-level ``ssm_update(..., state, ...)`` the same
way; ``compat_nemotron.install_ssm_hook`` rebinds it to ``capturing_ssm_update`` (the same
records, one call per position), and its conv state honours ``lengths`` as above.

The hooks are Python-level, so the verify forward must run eagerly (not inside ``mx.compile``).
The captured states of a block stay alive until its commit. Every layout this relies on is read
through ``mtplx.trunk.compat`` (and checked by ``compat_check``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mtplx.trunk.compat import (
    CONV_SLOT,
    ORIGINAL_GATED_DELTA_UPDATE,
    STATE_SLOT,
    ArraysCache,
    arrays_slots,
    install_gated_delta_hook,
    set_arrays_slots,
)
from mtplx.trunk.compat_nemotron import ORIGINAL_SSM_UPDATE, install_ssm_hook

import mlx.core as mx

__all__ = [
    "CapturingArraysCache",
    "RecurrentRecord",
    "begin_recurrent",
    "capturing_gated_delta_update",
    "capturing_ssm_update",
    "install_recurrent_hooks",
    "register_recorder",
    "release_recorder",
]


class CapturingArraysCache(ArraysCache):
    """An ArraysCache during a verify block: ``lengths`` = [0..T] selects conv states.

    Only the class is swapped (``begin_block``), the data stays in place, and
    ``commit_block`` / ``abort_block`` swap it back.
    """

    def make_mask(self, N: int):
        # A B=1 verify block has no padding; the base class would turn our
        # prefix-length vector into a padding mask.
        return None

    def advance(self, N: int) -> None:
        # The base class counts ``lengths`` down; ours must stay [0..T].
        return None


@dataclass
class RecurrentRecord:
    cache: ArraysCache
    slots_before: list  # slot arrays before the block (restored on abort / num_keep=0)
    rows: int  # conv states recorded: prefix lengths 0..rows-1
    states: list = field(default_factory=list)  # recurrent state after each position

    @property
    def block_len(self) -> int:
        return len(self.states)

    def commit(self, num_keep: int) -> None:
        c = self.cache
        conv = c[CONV_SLOT]
        if not self.states:
            raise RuntimeError(
                "gated-delta capture saw no recurrent update for this cache: the layer is not a "
                "supported gated-delta layer, or the verify forward did not run"
            )
        if conv is None or conv.shape[0] != self.rows:
            raise RuntimeError("gated-delta layer did not record per-position conv states")
        if num_keep >= self.rows:
            raise ValueError(
                f"num_keep {num_keep} exceeds the {self.rows - 1} positions recorded; pass block_len"
            )
        state = self.slots_before[STATE_SLOT] if num_keep == 0 else self.states[num_keep - 1]
        self._release()
        c[CONV_SLOT] = mx.contiguous(conv[num_keep : num_keep + 1])
        c[STATE_SLOT] = state

    def abort(self) -> None:
        self._release()
        set_arrays_slots(self.cache, self.slots_before)

    def _release(self) -> None:
        release_recorder(self.slots_before[STATE_SLOT])
        self.cache.__class__ = ArraysCache
        self.cache.finalize()  # lengths back to None (left_padding was None: begin_block checks)


# id(state array handed to the layer) -> its record (anything with ``slots_before`` and a
# ``states`` list: this module's RecurrentRecord, or a batch block's). The record holds the
# array, so the id cannot be reused while the entry exists.
_RECORDERS: dict[int, Any] = {}


def register_recorder(record: Any) -> None:
    """Record every per-position state of the next gated-delta update on ``record.slots_before``'s
    state into ``record.states`` (`mtplx.trunk.batch_cache` uses this for batches)."""
    _RECORDERS[id(record.slots_before[STATE_SLOT])] = record


def release_recorder(state: mx.array) -> None:
    _RECORDERS.pop(id(state), None)


def capturing_gated_delta_update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, **kwargs):
    record = _RECORDERS.get(id(state)) if state is not None else None
    if record is None or record.slots_before[STATE_SLOT] is not state:
        return ORIGINAL_GATED_DELTA_UPDATE(q, k, v, a, b, A_log, dt_bias, state, mask, **kwargs)
    if record.states:
        raise RuntimeError("a capturing gated-delta cache was used by two forwards in one block")
    ys = []
    for t in range(q.shape[1]):
        pos = slice(t, t + 1)
        step_mask = None if mask is None else mask[:, pos]
        y, state = ORIGINAL_GATED_DELTA_UPDATE(
            q[:, pos], k[:, pos], v[:, pos], a[:, pos], b[:, pos], A_log, dt_bias, state, step_mask, **kwargs
        )
        ys.append(y)
        record.states.append(state)
    return mx.concatenate(ys, axis=1), state


def capturing_ssm_update(
    hidden_states,
    A_log,
    B,
    C,
    D,
    dt,
    dt_bias,
    state=None,
    time_step_limit=(0.001, 100.0),
    mask=None,
    lengths=None,
):
    """``ssm_update`` (a Mamba2 mixer's, Nemotron-H) as ``capturing_gated_delta_update`` is the
    gated-delta one: a pass-through but for the very state array a capturing record handed out;
    then one call per position (the path an AR step takes: the Metal kernel on a GPU, the SSD ops
    otherwise), each state kept, so the block's state after every prefix is the AR one."""
    record = _RECORDERS.get(id(state)) if state is not None else None
    if record is None or record.slots_before[STATE_SLOT] is not state:
        return ORIGINAL_SSM_UPDATE(
            hidden_states, A_log, B, C, D, dt, dt_bias, state, time_step_limit, mask, lengths
        )
    if record.states:
        raise RuntimeError("a capturing Mamba2 cache was used by two forwards in one block")
    if lengths is not None:
        raise RuntimeError("a capturing Mamba2 update was given per-row lengths (not a verify block)")
    ys = []
    for t in range(hidden_states.shape[1]):
        pos = slice(t, t + 1)
        step_mask = None if mask is None else mask[:, pos]
        y, state = ORIGINAL_SSM_UPDATE(
            hidden_states[:, pos],
            A_log,
            B[:, pos],
            C[:, pos],
            D,
            dt[:, pos],
            dt_bias,
            state,
            time_step_limit,
            step_mask,
        )
        ys.append(y)
        record.states.append(state)
    return mx.concatenate(ys, axis=1), state


def install_recurrent_hooks() -> None:
    """The gated-delta and Mamba2 capture hooks, installed in every supported module (idempotent)."""
    install_gated_delta_hook(capturing_gated_delta_update)
    install_ssm_hook(capturing_ssm_update)


def begin_recurrent(c: ArraysCache, rows: int) -> RecurrentRecord:
    if c[CONV_SLOT] is None or c[STATE_SLOT] is None:
        raise ValueError("begin_block needs a prefilled gated-delta cache (run the prompt first)")
    if c.lengths is not None or c.left_padding is not None:
        raise ValueError("begin_block: gated-delta cache is set up for padded batches")
    state = c[STATE_SLOT]
    if id(state) in _RECORDERS:
        # Two caches sharing one state object would be indistinguishable to the hook.
        state = mx.array(state)
        c[STATE_SLOT] = state
    record = RecurrentRecord(c, list(arrays_slots(c)), rows)
    register_recorder(record)
    c.__class__ = CapturingArraysCache
    c.prepare(lengths=list(range(rows)))
    return record
