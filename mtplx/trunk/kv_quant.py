"""Quantized KV cache for the trunk: mlx-lm's ``--kv-bits`` / ``--kv-group-size`` /
``--quantized-kv-start``, at positions that do not depend on how tokens are grouped into forwards.

mlx-lm (mlx_lm/generate.py, ``maybe_quantize_kv_cache``) turns every ``KVCache`` into a
``QuantizedKVCache`` (``KVCache.to_quantized``) after the step at which it holds
``quantized_kv_start`` positions or more: in plain decoding, the query of position p attends to
float keys while p < start and to quantized keys (every earlier position quantized too) from
p = start on. A verify block [pending, d1..dk] that crosses ``start`` would see one state for all
its queries, so speculation would differ from plain decoding. Here the rule is stated by position
and holds for every forward (a prefill chunk, a verify block, an AR step):

* a sequence's attention caches are float while they hold fewer than ``start`` positions, and are
  converted right before position ``start`` is written (`convert`);
* a forward over positions that cross ``start`` runs as two forwards split there
  (`conversion_split`, `Trunk.__call__`), so every position's query sees exactly the cache plain
  decoding gives it;
* quantization is per position (groups run along the head dimension), so a position quantized when
  written, or converted later, holds the same values either way.

``start == 0``: the caches are ``QuantizedKVCache`` from the first position (`make_cache`); such
rows batch (`batch_cache.RaggedQuantizedKVCache`). ``start > 0``: the float caches carry their plan
(attribute ``PLAN_ATTR``) and a row decodes on its own caches (`row_cache.SingleRowCache` rolls a
converting block back exactly: `ConversionBlock`); the model must be attention-only (plain
``KVCache`` layers: a sliding-window or recurrent cache cannot take a block in two forwards).
What this does not give: float results differ in their last bits with how positions are grouped
into forwards (a matmul over 54 rows rounds unlike two over 30 and 24), and rounding to a few bits
turns a value near a level boundary into a whole step, which grows through the layers; so a verify
block, a batched row or a reused prompt-cache prefix can give other tokens than plain decoding of
one request on a fresh cache (README "What is exact under --kv-bits"; `Engine.load` prints a note;
tests/engine/test_kv_bits_grouping.py). Invariance would need batch-invariant matmul kernels.

Only plain ``KVCache`` layers are quantized (mlx-lm cannot quantize a ``RotatingKVCache`` either),
and, from position 0, an mlx-vlm cache that quantizes itself keeping its extra state
(`quantizes_itself`: Qwen3.8-Flash-Next's QSA cache); an MTP head's own cache stays float
(`Engine._quantize_kv` says why).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mtplx.errors import MtplxError
from mtplx.trunk.compat import KVCache, QuantizedKVCache

__all__ = [
    "DEFAULT_KV_GROUP_SIZE",
    "DEFAULT_QUANTIZED_KV_START",
    "KV_BITS",
    "PLAN_ATTR",
    "ConversionBlock",
    "KVQuantization",
    "conversion_split",
    "convert",
    "check_fit",
    "kv_bytes_per_token",
    "make_cache",
    "reusable_from",
]

KV_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize takes
KV_GROUP_SIZES = (32, 64, 128)
DEFAULT_KV_GROUP_SIZE = 64  # mlx-lm's default
DEFAULT_QUANTIZED_KV_START = 5000  # mlx-lm's DEFAULT_QUANTIZED_KV_START
PLAN_ATTR = "mtplx_kv_quantization"  # on a cache of a sequence that converts at plan.start


@dataclass(frozen=True)
class KVQuantization:
    """How the trunk's attention caches are quantized (mlx-lm's meaning of the three flags)."""

    bits: int
    group_size: int = DEFAULT_KV_GROUP_SIZE
    start: int = DEFAULT_QUANTIZED_KV_START  # positions held in float before the conversion

    @property
    def label(self) -> str:
        """The plan in one token, for identities that must tell plans apart (the disk tier's, the
        saved batch cost profile's): ``kv8-g64-from5000``."""
        return f"kv{self.bits}-g{self.group_size}-from{self.start}"

    def __post_init__(self) -> None:
        if self.bits not in KV_BITS:
            raise MtplxError(f"kv_bits must be one of {', '.join(map(str, KV_BITS))} (got {self.bits})")
        if self.group_size not in KV_GROUP_SIZES:
            raise MtplxError(
                f"kv_group_size must be one of {', '.join(map(str, KV_GROUP_SIZES))} (got {self.group_size})"
            )
        if self.start < 0:
            raise MtplxError(f"quantized_kv_start must be >= 0 (got {self.start})")

    @classmethod
    def from_flags(
        cls, kv_bits: int | None, kv_group_size: int | None = None, quantized_kv_start: int | None = None
    ) -> KVQuantization | None:
        """None without ``kv_bits`` (float KV, as mlx-lm); the others default as in mlx-lm, and are
        refused without ``kv_bits`` (they would do nothing)."""
        if kv_bits is None:
            for name, value in (("kv_group_size", kv_group_size), ("quantized_kv_start", quantized_kv_start)):
                if value is not None:
                    raise MtplxError(f"{name} needs kv_bits: it does nothing without it (got {value})")
            return None
        group = DEFAULT_KV_GROUP_SIZE if kv_group_size is None else kv_group_size
        start = DEFAULT_QUANTIZED_KV_START if quantized_kv_start is None else quantized_kv_start
        return cls(int(kv_bits), int(group), int(start))

    def quantized_cache(self) -> QuantizedKVCache:
        cache = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        setattr(cache, PLAN_ATTR, self)
        return cache


def _plan(cache: Any) -> KVQuantization | None:
    return getattr(cache, PLAN_ATTR, None)


def quantizes_itself(c: Any) -> bool:
    """An mlx-vlm cache that converts itself to a quantized one keeping its own extra state
    (Qwen3.8-Flash-Next's ``QSAKVCache`` -> ``QSAQuantizedKVCache``, the indexer's keys float)."""
    return (
        type(c).__module__.startswith("mlx_vlm.")
        and getattr(type(c), "preserve_auxiliary_kv_state", False)
        and callable(getattr(c, "to_quantized", None))
    )


def make_cache(cache: list, plan: KVQuantization | None) -> list:
    """A fresh single-row cache list under ``plan``: plain KVCache layers become QuantizedKVCache
    (start 0) or float caches that carry the plan (start > 0); an mlx-vlm cache that
    `quantizes_itself` becomes its own quantized class (start 0 only: `check_fit`); other kinds
    stay as they are."""
    if plan is None:
        return cache
    out = []
    for c in cache:
        if quantizes_itself(c) and plan.start == 0:
            c = c.to_quantized(group_size=plan.group_size, bits=plan.bits)
            setattr(c, PLAN_ATTR, plan)
        elif type(c) is KVCache and plan.start == 0:
            c = plan.quantized_cache()
        elif type(c) is KVCache:
            setattr(c, PLAN_ATTR, plan)
        out.append(c)
    return out


def _pending(cache: Sequence) -> list[Any]:
    """The float caches of ``cache`` (a single-row list) still to be converted."""
    return [c for c in cache if type(c) is KVCache and _plan(c) is not None]


def conversion_split(cache: Sequence, num_positions: int) -> int | None:
    """Where a forward of ``num_positions`` on ``cache`` must convert it: the number of positions
    to forward first (0: convert before the forward), or None when it writes no position >= start."""
    pending = _pending(cache)
    if not pending:
        return None
    offset, start = int(pending[0].offset), _plan(pending[0]).start
    if offset + num_positions <= start:
        return None
    return max(start - offset, 0)


def convert(cache: list) -> None:
    """Replace every float cache that carries a plan with its quantized copy, in place in the list
    (as mlx-lm's ``maybe_quantize_kv_cache`` does); the copy keeps the plan."""
    for i, c in enumerate(cache):
        plan = _plan(c) if type(c) is KVCache else None
        if plan is not None:
            quantized = c.to_quantized(group_size=plan.group_size, bits=plan.bits)
            setattr(quantized, PLAN_ATTR, plan)
            cache[i] = quantized


def reusable_from(cache: Sequence) -> int:
    """The fewest positions ``cache`` may be trimmed to: a cache converted at ``start`` cannot
    stand for a sequence of fewer positions (those are float); 0 otherwise."""
    return max((_plan(c).start for c in cache if type(c) is QuantizedKVCache and _plan(c)), default=0)


class ConversionBlock:
    """A single-row block during which the forward converts the caches (`conversion_split`):
    the float caches before it, to restore when fewer than ``start`` positions are kept or the
    block is undone. Every layer is a plain KVCache carrying the plan (the module docstring)."""

    def __init__(self, layers: list, block_len: int):
        if len(_pending(layers)) != len(layers):
            raise ValueError(
                "quantized_kv_start > 0 needs a model whose every layer is a plain KVCache "
                "(use quantized_kv_start 0)"
            )
        self.float_layers = list(layers)
        self.offset = int(layers[0].offset)
        self.block_len = block_len
        self.start = _plan(layers[0]).start
        self.open = True

    def commit(self, layers: list, num_keep: int) -> None:
        """Leave ``layers`` holding the first ``num_keep`` positions of the block."""
        if not self.open:
            raise ValueError("this block was already committed or aborted")
        if not 0 <= num_keep <= self.block_len:
            self.abort(layers)
            raise ValueError(f"num_keep must be in [0, {self.block_len}], got {num_keep}")
        if any(c.offset != self.offset + self.block_len for c in layers):
            self.abort(layers)
            raise RuntimeError(f"a converting block did not advance every cache by {self.block_len}")
        self.open = False
        kept = self.offset + num_keep
        if kept < self.start:  # back to float: the float caches hold every position before start
            layers[:] = self.float_layers
        for c in layers:
            c.trim(c.offset - kept)

    def abort(self, layers: list) -> None:
        """Back to the float caches as they were before the block; a no-op once closed."""
        if not self.open:
            return
        self.open = False
        layers[:] = self.float_layers
        for c in layers:
            c.trim(c.offset - self.offset)


# --------------------------------------------------------------------------- memory


def _attention_layers(config: dict) -> int:
    """Layers with a KV cache: all, or the full-attention ones of a hybrid config."""
    layers = int(config.get("num_hidden_layers", 0))
    types = config.get("layer_types")
    if isinstance(types, list) and types:
        return sum(1 for t in types if "attention" in str(t))
    interval = config.get("full_attention_interval")
    if interval:
        return layers // int(interval)
    return layers


def kv_bytes_per_token(
    config: dict, bits: int | None, group_size: int = DEFAULT_KV_GROUP_SIZE, float_bytes: int = 2
) -> int:
    """Bytes of the trunk's KV cache per position, from an mlx-lm ``config``: ``float_bytes`` per
    element (the model's activation dtype) when ``bits`` is None, else ``bits`` per element plus a
    scale and a bias per group in that dtype (QuantizedKVCache's layout). Plain K/V attention, GQA
    counted (an estimate for other attention kinds); 0 when the config does not say."""
    config = {**config, **(config.get("text_config") or {})}
    heads = config.get("num_attention_heads")
    kv_heads = int(config.get("num_key_value_heads") or heads or 0)
    head_dim = int(config.get("head_dim") or (config.get("hidden_size", 0) // heads if heads else 0))
    if bits is None:
        per_head = head_dim * float_bytes
    else:
        per_head = head_dim * bits // 8 + 2 * (head_dim // group_size) * float_bytes
    return 2 * kv_heads * per_head * _attention_layers(config)


# --------------------------------------------------------------------------- fit to a model


def cache_kind(c: Any) -> str:
    """A cache's class, with its members' for a list of caches (``CacheList(KVCache, KVCache)``),
    another package's than mlx-lm's named with it (``mlx_vlm KVCache``)."""
    package = type(c).__module__.split(".")[0]
    name = type(c).__name__ if package == "mlx_lm" else f"{package} {type(c).__name__}"
    members = getattr(c, "caches", None)
    if type(c).__name__ == "CacheList" and isinstance(members, (list, tuple)):
        return f"{name}({', '.join(map(cache_kind, members))})"
    return name


def check_fit(trunk: Any, head: Any, plan: KVQuantization) -> None:
    """Raise MtplxError (one line, naming the flag) when ``plan`` cannot run on this trunk and head."""
    layout = getattr(head, "layout", "this")
    if head is not None and getattr(head, "reads_trunk_cache", False):
        raise MtplxError(f"kv_bits: a {layout} head reads the target's KV cache, which must stay float")
    cache = trunk.make_cache()
    if not any(type(c) in (KVCache, QuantizedKVCache) or quantizes_itself(c) for c in cache):
        kinds = ", ".join(dict.fromkeys(map(cache_kind, cache)))
        raise MtplxError(
            f"kv_bits: this model's caches ({kinds}) hold no plain attention KV cache (mlx-lm's KVCache) to quantize"
        )
    if plan.start > 0 and any(type(c) is not KVCache for c in cache):
        kinds = sorted({type(c).__name__ for c in cache if type(c) is not KVCache})
        raise MtplxError(
            f"quantized_kv_start must be 0 for this model (got {plan.start}): its {', '.join(kinds)} layers "
            "cannot take a block in two forwards"
        )
    import mlx.core as mx

    probe = KVQuantization(plan.bits, plan.group_size, 0)
    try:  # builds the graph only (shapes are checked when ops are created): nothing is computed
        trunk(mx.zeros((1, 1), dtype=mx.int32), make_cache(trunk.make_cache(), probe))
    except ValueError as err:
        raise MtplxError(
            f"kv_group_size: {plan.group_size} does not fit this model's attention heads ({str(err).splitlines()[0]})"
        ) from None
