"""``check()``: every assumption `mtplx.trunk.compat` (and `compat_nemotron`) makes about mlx-lm
internals, verified on the installed mlx-lm, failing with one error that names every change.

Each ``_check_*`` probes one contact of ``compat`` on a tiny live object (a cache updated with
zeros, a norm called once) through the same accessors the engine uses (``KVState``,
``RotatingState``, ``copy_cache``, ``tap_final_norm``); a probe that raises is reported like any
other change (``compat_probe.guarded``). The trunk calls ``check_once()`` when it wraps a model;
the tests call ``check()`` with deliberately changed classes and functions to prove each
assumption is really checked. ``check()`` leaves MLX's global random state as it found it (the
Nemotron-H probe builds a model, whose init draws from it): a model loaded after ``mx.random.seed``
takes nothing from the caller's sequence. pyproject pins the range it was verified on (``SUPPORTED_MLX_LM``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from importlib import metadata

from mtplx.errors import MtplxError
from mtplx.trunk.compat import (
    ORIGINAL_GATED_DELTA_UPDATE,
    SUPPORTED_RECURRENT_MODULES,
    ArraysCache,
    CacheList,
    KVCache,
    KVState,
    QuantizedKVCache,
    RotatingKVCache,
    RotatingState,
    copy_cache,
    create_attention_mask,
    kv_state,
    tap_final_norm,
)
from mtplx.trunk.compat_nemotron import check_ssm
from mtplx.trunk.compat_probe import check_hooked_function, format_version, guarded, parse_version

import mlx.core as mx
import mlx.nn as nn

__all__ = ["SUPPORTED_MLX_LM", "check", "check_once"]

# [low, high): the mlx-lm releases whose internals compat was verified on (pyproject pins the same).
SUPPORTED_MLX_LM = ((0, 32, 2), (0, 33, 0))

_GATED_DELTA_PARAMETERS = ("q", "k", "v", "a", "b", "A_log", "dt_bias", "state", "mask")


def _is_int(value: object, expected: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value == expected


def _check_version(version: str) -> list[str]:
    low, high = SUPPORTED_MLX_LM
    if not low <= parse_version(version) < high:
        return [
            f"version {version} is outside the supported range >={format_version(low)},<{format_version(high)}"
        ]
    return []


def _check_kv(kv_cls: type) -> list[str]:
    cache = kv_cls()
    cache.update_and_fetch(mx.zeros((1, 1, 3, 2)), mx.zeros((1, 1, 3, 2)))
    state = tuple(cache.state)
    if len(state) != len(KVState._fields):
        return [f"{kv_cls.__name__}.state has {len(state)} fields, expected {KVState._fields}"]
    named = KVState(*state)
    if not _is_int(named.offset, 3) or not _is_int(cache.offset, 3) or named.keys is not cache.keys:
        return [f"{kv_cls.__name__}.state is no longer (keys, values, offset)"]
    return []


def _check_trim(kv_cls: type) -> list[str]:
    """Offset-addressed caches: ``.offset`` counts entries and ``trim(n)`` moves it back by n."""
    cache = kv_cls()
    head_dim = 64  # a multiple of every quantization group size
    cache.update_and_fetch(mx.zeros((1, 1, 3, head_dim)), mx.zeros((1, 1, 3, head_dim)))
    if not _is_int(getattr(cache, "offset", None), 3):
        return [f"{kv_cls.__name__}.offset no longer counts the entries"]
    if (
        not callable(getattr(cache, "trim", None))
        or not _is_int(cache.trim(1), 1)
        or not _is_int(cache.offset, 2)
    ):
        return [f"{kv_cls.__name__}.trim(n) no longer moves the offset back by n"]
    return []


def _check_rotating(rotating_cls: type) -> list[str]:
    cache = rotating_cls(max_size=8, keep=1)
    cache.update_and_fetch(mx.zeros((1, 1, 3, 2)), mx.zeros((1, 1, 3, 2)))
    state = tuple(cache.state)
    if len(state) != len(RotatingState._fields):
        return [f"{rotating_cls.__name__}.state has {len(state)} fields, expected {RotatingState._fields}"]
    named = RotatingState(*state)
    counters = (named.offset, named.keep, named.max_size, named.idx)
    if (
        not all(_is_int(got, want) for got, want in zip(counters, (3, 1, 8, 3)))
        or named.keys is not cache.keys
    ):
        return [f"{rotating_cls.__name__}.state is no longer (keys, values, offset, keep, max_size, _idx)"]
    if named.keys.shape[2] != named.idx:
        return [
            f"{rotating_cls.__name__}: a multi-token update no longer leaves the buffer in temporal order"
        ]
    return []


def _check_arrays(arrays_cls: type) -> list[str]:
    cache = arrays_cls(2)
    state = tuple(cache.state)
    if len(state) != 3 or state[0] is not cache.cache or len(state[0]) != 2:
        return [f"{arrays_cls.__name__}.state is no longer (slots, left_padding, lengths)"]
    missing = [
        m for m in ("prepare", "finalize", "make_mask", "advance") if not callable(getattr(cache, m, None))
    ]
    if missing:
        return [f"{arrays_cls.__name__} lacks {', '.join(missing)}"]
    cache.prepare(lengths=[0, 1, 2])
    if cache.lengths is None or cache.lengths.tolist() != [0, 1, 2]:
        return [f"{arrays_cls.__name__}.prepare(lengths=...) no longer sets .lengths"]
    cache.finalize()
    if cache.lengths is not None:
        return [f"{arrays_cls.__name__}.finalize() no longer clears .lengths"]
    return []


def _check_gated_delta(update: Callable, module_names: Sequence[str]) -> list[str]:
    return check_hooked_function("gated_delta_update", update, _GATED_DELTA_PARAMETERS, module_names)


def _check_cache_list(cache_list_cls: type) -> list[str]:
    member = KVCache()
    if list(getattr(cache_list_cls(member), "caches", ())) != [member]:
        return [f"{cache_list_cls.__name__} no longer keeps its members in .caches"]
    return []


def _check_copy(kv_cls: type, arrays_cls: type) -> list[str]:
    kv, arrays = kv_cls(), arrays_cls(2)
    kv.update_and_fetch(mx.zeros((1, 1, 2, 2)), mx.zeros((1, 1, 2, 2)))
    arrays[0] = mx.zeros((1, 2))
    kv_copy, arrays_copy = copy_cache([kv, arrays])
    kv.update_and_fetch(mx.ones((1, 1, 1, 2)), mx.ones((1, 1, 1, 2)))  # writes into kv's buffer in place
    arrays[0] = mx.ones((1, 2))
    problems = []
    if kv_copy.offset != 2 or float(mx.abs(kv_state(kv_copy).keys).sum()) != 0.0:
        problems.append(f"a copied {kv_cls.__name__} changes when the original is updated")
    if float(mx.abs(arrays_copy[0]).sum()) != 0.0:
        problems.append(f"a copied {arrays_cls.__name__} changes when the original is updated")
    return problems


def _check_mask(mask_fn: Callable) -> list[str]:
    names = tuple(inspect.signature(mask_fn).parameters)
    expected = ("h", "cache", "window_size", "return_array")
    return [] if names[:4] == expected else [f"create_attention_mask takes {names}, expected {expected}"]


def _check_norm_tap() -> list[str]:
    norm = nn.RMSNorm(2)
    tap = tap_final_norm(norm)
    x = mx.ones((1, 1, 2))
    out = norm(x)
    if tap.pre is not x or tap.post is not out or "weight" not in dict(norm.parameters()):
        return ["the final-norm tap no longer records the norm's input/output"]
    return []


@contextlib.contextmanager
def _caller_random_state_kept() -> Iterator[None]:
    """MLX's global random key as it was on entry, set again on exit: ``mx.random.seed(s)`` sets
    the key to (s >> 32, s & 0xFFFFFFFF), so the saved pair read as one 64-bit number restores it."""
    high, low = (int(word) for word in mx.random.state[0].tolist())
    try:
        yield
    finally:
        mx.random.seed((high << 32) | low)


@_caller_random_state_kept()
def check(
    *,
    version: str | None = None,
    kv_cls: type = KVCache,
    trimmable_classes: Sequence[type] = (KVCache, QuantizedKVCache),
    rotating_cls: type = RotatingKVCache,
    arrays_cls: type = ArraysCache,
    cache_list_cls: type = CacheList,
    gated_delta_update: Callable = ORIGINAL_GATED_DELTA_UPDATE,
    recurrent_modules: Sequence[str] = SUPPORTED_RECURRENT_MODULES,
    mask_fn: Callable = create_attention_mask,
) -> None:
    """Raise one MtplxError naming every layout assumption the installed mlx-lm breaks.

    The keyword arguments default to the installed mlx-lm; the tests pass changed
    classes and functions to prove each assumption is really checked.
    """
    problems = _check_version(metadata.version("mlx-lm") if version is None else version)
    problems += guarded(f"probing {kv_cls.__name__}", _check_kv, kv_cls)
    for trimmable in trimmable_classes:
        problems += guarded(f"probing {trimmable.__name__}", _check_trim, trimmable)
    problems += guarded(f"probing {rotating_cls.__name__}", _check_rotating, rotating_cls)
    problems += guarded(f"probing {arrays_cls.__name__}", _check_arrays, arrays_cls)
    problems += guarded(f"probing {cache_list_cls.__name__}", _check_cache_list, cache_list_cls)
    problems += guarded(
        "probing gated_delta_update", _check_gated_delta, gated_delta_update, recurrent_modules
    )
    problems += guarded("probing ssm_update", check_ssm)
    problems += guarded("probing cache copies", _check_copy, kv_cls, arrays_cls)
    problems += guarded("probing create_attention_mask", _check_mask, mask_fn)
    problems += guarded("probing the final-norm tap", _check_norm_tap)
    if problems:
        raise MtplxError(
            "the installed mlx-lm changed internals mtplx relies on (mtplx/trunk/compat.py): "
            + "; ".join(problems)
            + f". Install mlx-lm>={format_version(SUPPORTED_MLX_LM[0])},<{format_version(SUPPORTED_MLX_LM[1])}"
        )


@functools.cache
def check_once() -> None:
    """``check()`` once per process (the trunk calls this when it wraps a model)."""
    check()
