"""Every contact mtplx has with mlx-lm internals, in one place, checked against the installed mlx-lm.

mlx-lm's public API (``load``, ``make_prompt_cache``, the cache classes and
their ``trim`` / ``prepare`` / ``finalize`` methods, ``create_attention_mask``)
is used where it exists. Three things have no public hook in mlx-lm 0.32 and
are done here, against layouts read from its source
(``mlx_lm/models/cache.py``, ``mlx_lm/models/gated_delta.py``,
``mlx_lm/models/qwen3_5.py``, ``mlx_lm/models/base.py``):

* the final-norm tap: models return logits only, and MTP heads need the hidden
  state before and after the final norm, so the norm instance's class is
  swapped for a subclass that records its input and output (the parameter tree
  stays the same, so loading, quantization and fingerprints are unaffected);
* recurrent-state capture: the gated-delta layers of the modules in
  ``SUPPORTED_RECURRENT_MODULES`` call their module-level name
  ``gated_delta_update``, which ``install_gated_delta_hook`` rebinds to a
  wrapper (``mtplx.trunk.recurrent_capture`` owns the wrapper's logic);
* cache state layouts: ``KVCache.state`` = (keys, values, offset),
  ``RotatingKVCache.state`` = (keys, values, offset, keep, max_size, _idx),
  ``ArraysCache.state`` = (slots, left_padding, lengths), with a gated-delta
  layer's conv state in slot 0 and recurrent state in slot 1. They are read
  and written here by name (``KVState``, ``RotatingState``), nowhere by position.
* cache copies: mlx-lm has no copy for its caches; ``copy_cache`` copies a
  cache's instance attributes (arrays re-wrapped, so in-place slice updates on
  one side never show on the other).

Nemotron-H's contacts (its Mamba2 ``ssm_update`` hook, its ``backbone`` names, a cache list
that skips its MLP / MoE blocks) live in ``compat_nemotron``.

``compat_check.check()`` verifies every one of these assumptions (and compat_nemotron's) on the
installed mlx-lm and raises one clear error naming what changed; the trunk calls it once per
process, and the tests call it with deliberately changed layouts to prove it notices. pyproject
pins the range it was verified on (``compat_check.SUPPORTED_MLX_LM``).
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from mtplx.trunk.compat_nemotron import INNER_PATH, INNER_SPELLINGS, SUPPORTED_SSM_MODULES

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gated_delta as _gated_delta
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
)

__all__ = [
    "SUPPORTED_RECURRENT_MODULES",
    "CONV_SLOT",
    "STATE_SLOT",
    "ArraysCache",
    "BatchKVCache",
    "CacheList",
    "KVCache",
    "KVState",
    "ORIGINAL_GATED_DELTA_UPDATE",
    "NormTap",
    "QuantizedKVCache",
    "RotatingKVCache",
    "RotatingState",
    "arrays_slots",
    "cache_leaves",
    "cache_members",
    "copy_cache",
    "create_attention_mask",
    "find_inner_model",
    "find_lm_head",
    "install_gated_delta_hook",
    "is_supported_recurrent_layer",
    "kv_state",
    "leading_cache",
    "load_prompt_cache",
    "materialize",
    "make_prompt_cache",
    "prompt_cache_file_metadata",
    "rotating_state",
    "save_prompt_cache",
    "set_arrays_slots",
    "set_kv_state",
    "set_rotating_state",
    "tap_final_norm",
    "untapped_norm",
]

# Modules whose gated-delta layers read slot 0 = conv state, slot 1 = recurrent
# state, honour ``cache.lengths`` for the conv state, and pass the recurrent
# state from the cache unchanged into their module-level ``gated_delta_update``.
SUPPORTED_RECURRENT_MODULES = ("mlx_lm.models.qwen3_5", "mlx_lm.models.qwen3_next")
CONV_SLOT = 0
STATE_SLOT = 1
# Recurrent layers whose conv1d input is [conv state, block]: gated delta and Mamba2 (compat_nemotron).
RECURRENT_CONV_MODULES = SUPPORTED_RECURRENT_MODULES + SUPPORTED_SSM_MODULES

# mlx-lm's own function; the hook's wrapper calls it.
ORIGINAL_GATED_DELTA_UPDATE = _gated_delta.gated_delta_update


# --------------------------------------------------------------------------- chat syntax


class ToolCallSyntax(NamedTuple):
    """How a model's chat template writes a tool call (mlx-lm's ``TokenizerWrapper`` infers it)."""

    start: str  # the marker opening a call, e.g. "<tool_call>"
    end: str  # the marker closing it
    parse: Callable[[str, Any], Any]  # mlx_lm.tool_parsers.<family>.parse_tool_call(text, tools)
    family: str  # the parser module's name: "json_tools", "qwen3_coder", "mistral", ...


def tool_call_syntax(tokenizer: Any) -> ToolCallSyntax | None:
    """The tool-call syntax of the template behind ``tokenizer`` (an mlx-lm ``TokenizerWrapper``),
    or None when mlx-lm found none (the template renders no tools)."""
    if not getattr(tokenizer, "has_tool_calling", False) or tokenizer.tool_parser is None:
        return None
    parse = tokenizer.tool_parser
    family = getattr(parse, "__module__", "").rsplit(".", 1)[-1]
    return ToolCallSyntax(tokenizer.tool_call_start, tokenizer.tool_call_end, parse, family)


class ThinkingMarkers(NamedTuple):
    """The markers around a thinking model's reasoning span, as text and as token ids."""

    start: str
    end: str
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]


def thinking_markers(tokenizer: Any) -> ThinkingMarkers | None:
    """The reasoning span's markers (``<think>`` / ``</think>`` and the other families mlx-lm
    recognises), or None when the model does not think."""
    if not getattr(tokenizer, "has_thinking", False):
        return None
    return ThinkingMarkers(
        tokenizer.think_start,
        tokenizer.think_end,
        tuple(tokenizer.think_start_tokens),
        tuple(tokenizer.think_end_tokens),
    )


# --------------------------------------------------------------------------- model structure


def materialize(module: nn.Module) -> None:
    """Evaluate every array ``module`` holds: its parameters and the private ones ``parameters``
    skips (a RoPE's ``_freqs``). MLX ties a lazy array to the thread that built it, and the server
    decodes on its own thread ("There is no Stream(cpu, 0) in current thread" otherwise)."""
    arrays = [v for m in module.modules() for v in m.values() if isinstance(v, mx.array)]
    mx.eval(module.parameters(), arrays)


def find_inner_model(model: nn.Module) -> nn.Module:
    """The module that owns the embedding, ``layers`` and the final norm (wrapper models nest it;
    ``compat_nemotron.INNER_SPELLINGS``: what they are called)."""
    for path in (("model",), ("language_model", "model"), ("model", "language_model"), INNER_PATH, ()):
        node: Any = model
        try:
            for name in path:
                node = getattr(node, name)
        except AttributeError:
            continue
        if any(all(hasattr(node, a) for a in names) for names in INNER_SPELLINGS):
            return node
    raise ValueError(f"unsupported model class {type(model).__name__}: no embed_tokens/layers/norm found")


def find_lm_head(model: nn.Module) -> nn.Module | None:
    """The untied output layer, or None when the embedding is tied."""
    for owner in (model, getattr(model, "language_model", None)):
        if owner is not None and "lm_head" in owner:
            return owner["lm_head"]
    return None


# --------------------------------------------------------------------------- final-norm tap


class NormTap:
    """Holds the last final-norm input (``pre``) and output (``post``) of one forward pass."""

    def __init__(self) -> None:
        self.pre: mx.array | None = None
        self.post: mx.array | None = None


def tap_final_norm(norm: nn.Module) -> NormTap:
    """Make ``norm`` record its input and output (once: a second trunk over the same model shares it).

    Only this instance's class changes, to a subclass of its own class; the parameters stay put.
    """
    existing = getattr(type(norm), "_mtplx_tap", None)
    if existing is not None:
        return existing
    base = type(norm)
    tap = NormTap()

    def __call__(self, x, *args, **kwargs):
        out = base.__call__(self, x, *args, **kwargs)
        tap.pre, tap.post = x, out
        return out

    norm.__class__ = type(f"Tapped{base.__name__}", (base,), {"__call__": __call__, "_mtplx_tap": tap})
    return tap


def untapped_norm(norm: nn.Module, hidden: mx.array) -> mx.array:
    """``norm(hidden)`` without recording it (a head's own use must not overwrite the trunk's capture)."""
    cls = type(norm)
    base = cls.__mro__[1] if getattr(cls, "_mtplx_tap", None) is not None else cls
    return base.__call__(norm, hidden)


# --------------------------------------------------------------------------- cache layouts


class KVState(NamedTuple):
    """``KVCache.state`` by name."""

    keys: mx.array | None
    values: mx.array | None
    offset: int


class RotatingState(NamedTuple):
    """``RotatingKVCache.state`` by name; ``idx`` is the write position (mlx-lm's ``_idx``)."""

    keys: mx.array | None
    values: mx.array | None
    offset: int
    keep: int
    max_size: int
    idx: int


def kv_state(cache: KVCache) -> KVState:
    return KVState(*cache.state)


def set_kv_state(cache: KVCache, state: KVState) -> None:
    cache.state = tuple(state)


def rotating_state(cache: RotatingKVCache) -> RotatingState:
    return RotatingState(*cache.state)


def set_rotating_state(cache: RotatingKVCache, state: RotatingState) -> None:
    cache.state = tuple(state)


def arrays_slots(cache: ArraysCache) -> list:
    """The slot arrays of an ``ArraysCache`` (the list itself: item assignment goes through ``cache[i]``)."""
    return cache.cache


def set_arrays_slots(cache: ArraysCache, slots: list) -> None:
    cache.cache = list(slots)


def cache_members(cache: CacheList) -> list:
    """The caches inside a ``CacheList`` (one layer with several kinds of state)."""
    return list(cache.caches)


def leading_cache(cache: Any) -> Any:
    """The first leaf of one layer's cache (a ``CacheList``'s first member, recursively): the one
    whose offset and mask the layer's attention follows (mlx-lm's deepseek_v32 reads ``cache[0][0]``)."""
    while type(cache) is CacheList:
        cache = cache_members(cache)[0]
    return cache


def cache_leaves(cache: Sequence) -> list:
    """Every leaf cache of a cache list, a ``CacheList`` contributing its members."""
    out = []
    for c in cache:
        out.extend(cache_leaves(cache_members(c)) if type(c) is CacheList else [c])
    return out


def _is_cache(x: Any) -> bool:
    """A KV-like cache (``update_and_fetch``) or an ArraysCache (its ``cache`` list of slots)."""
    return callable(getattr(x, "update_and_fetch", None)) or isinstance(getattr(x, "cache", None), list)


def _detached(x: Any) -> Any:
    # mx.array(a) is a new array object with a's value: in-place updates (slice
    # assignment) on one of them never show in the other.
    if isinstance(x, mx.array):
        return mx.array(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_detached(v) for v in x)
    if not isinstance(x, type) and hasattr(x, "__dict__") and _is_cache(x):
        # a cache held inside a cache (mlx-vlm's MiniMaxM3KVCache.kv_cache, its CacheList's members,
        # Inkling's conv-window ArraysCache among them)
        return copy_cache([x])[0]
    return x


def copy_cache(cache: Sequence) -> list:
    """An independent copy of an mlx-lm cache list (shares memory until one side writes)."""
    out = []
    for c in cache:
        new = copy.copy(c)
        if type(c) is CacheList:
            new.caches = tuple(copy_cache(cache_members(c)))
        else:  # caches inside (mlx-vlm's CacheList members, MiniMax-M3's KV) are copied too: _detached
            new.__dict__.update({k: _detached(v) for k, v in vars(c).items()})
        out.append(new)
    return out


def prompt_cache_file_metadata(header_metadata: dict[str, str]) -> dict[str, str]:
    """The caller's metadata in a file ``save_prompt_cache`` wrote, from the safetensors header's
    ``__metadata__``: mlx-lm flattens [metadata, classes, scalars], so the caller's keys (no dots)
    are stored as ``0.<key>`` (mlx_lm/models/cache.py, ``save_prompt_cache``)."""
    return {k[2:]: v for k, v in header_metadata.items() if k.startswith("0.") and "." not in k[2:]}


# --------------------------------------------------------------------------- gated-delta hook


def install_gated_delta_hook(wrapper: Callable) -> None:
    """Rebind ``gated_delta_update`` in the supported, already-imported model modules to ``wrapper``.

    Idempotent; the wrapper must pass every call it does not capture straight through.
    """
    for name in SUPPORTED_RECURRENT_MODULES:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "gated_delta_update", None) is ORIGINAL_GATED_DELTA_UPDATE:
            module.gated_delta_update = wrapper


class ConvInputTap:
    """Records the input of a gated-delta layer's ``conv1d`` during one armed forward.

    That input is [B, kernel - 1 + T, C]: the conv state before the block followed by the
    block's projections, so the conv state after any prefix n of the block is its rows
    [n, n + kernel - 1), for every row of a batch (`mtplx.trunk.batch_cache`). Only this
    module instance's class changes (a recording subclass of its own class); unarmed it
    passes straight through and holds nothing.
    """

    def __init__(self) -> None:
        self.armed = False
        self.recorded: mx.array | None = None

    @classmethod
    def on(cls, layer: nn.Module) -> ConvInputTap:
        """The tap of the gated-delta ``conv1d`` inside ``layer`` (installed once per instance)."""
        conv = next(
            (
                m.conv1d
                for _, m in layer.named_modules()
                if type(m).__module__ in RECURRENT_CONV_MODULES and hasattr(m, "conv1d")
            ),
            None,
        )
        if conv is None:
            raise ValueError("layer has no supported recurrent (gated-delta or Mamba2) conv1d")
        existing = getattr(type(conv), "_mtplx_conv_tap", None)
        if existing is not None:
            return existing
        base = type(conv)
        tap = cls()

        def __call__(self, x, *args, **kwargs):
            if tap.armed:
                tap.recorded = x
            return base.__call__(self, x, *args, **kwargs)

        conv.__class__ = type(
            f"Tapped{base.__name__}", (base,), {"__call__": __call__, "_mtplx_conv_tap": tap}
        )
        return tap

    def arm(self) -> None:
        self.armed, self.recorded = True, None

    def take(self) -> mx.array | None:
        """The recorded input (None if the layer did not run), disarming the tap."""
        recorded, self.recorded, self.armed = self.recorded, None, False
        return recorded


def is_supported_recurrent_layer(layer: nn.Module) -> bool:
    """A gated-delta layer or a Nemotron-H Mamba2 block: one whose ArraysCache rollback captures."""
    return any(
        type(m).__module__ in RECURRENT_CONV_MODULES and hasattr(m, "conv1d")
        for _, m in layer.named_modules()
    )
