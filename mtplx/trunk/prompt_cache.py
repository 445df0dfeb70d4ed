"""Prompt cache across requests: reuse the trunk and head caches of earlier prompts.

A chat resends its whole history every turn; reusing the caches of the longest
common token prefix means turn N only prefills what is new. Entries hold the
trunk cache (KV and, for hybrid models, recurrent state) and the draft head's
cache, bounded in bytes with least-recently-used eviction.

Two kinds of entry, by what the caches allow:

* Trimmable (every cache is a ``KVCache`` / ``QuantizedKVCache``): the caches a
  request ends with are stored as they are (no copy: the request is done with
  them), covering prompt and generated tokens. A later prompt reuses any prefix
  of them, trimmed to its common prefix with the entry.
* Snapshot (recurrent ``ArraysCache`` or ``RotatingKVCache`` present: state that
  cannot be moved back): a copy taken when the caches hold all prompt positions
  but the last (``decode.PromptPrefix``). A later prompt reuses it only if it
  starts with exactly those tokens.

In both, ``size`` positions are reused: the trunk's positions 0..size-1 and the
head's (hidden i, token i+1) pairs for i < size. A head pair at i depends on
token i+1, so a prompt must agree with the entry on ``size + 1`` tokens when the
head cache is reused, and at least one prompt token is always forwarded (its
logits start the generation).

Quantized KV (`kv_quant`) is stored as it is (a ``QuantizedKVCache`` is trimmable); an entry
whose caches converted at ``quantized_kv_start`` is never trimmed below that start, where the
same sequence's caches are float.

Reusing never changes outputs: a cache prefilled in two parts holds the same
positions as one prefilled at once (see tests/trunk/test_prompt_cache.py). mlx-lm's
``LRUPromptCache`` (mlx_lm/server.py) was read for the idea of trimming the
longest-prefix entry; the data structure here is our own.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from mtplx.errors import MtplxError
from mtplx.trunk.compat import KVCache, QuantizedKVCache, cache_leaves, copy_cache
from mtplx.trunk.kv_quant import reusable_from

__all__ = [
    "DEFAULT_PROMPT_CACHE_BYTES",
    "CacheHit",
    "PromptCache",
    "cache_nbytes",
    "copy_cache",
    "held_positions",
    "is_trimmable",
]

# What `mtplx serve` and `mtplx chat` keep unless told otherwise.
DEFAULT_PROMPT_CACHE_BYTES = 2 * 1024**3


def is_trimmable(cache: list) -> bool:
    """True if every cache can be moved back by any number of positions (pure KV)."""
    return all(type(c) in (KVCache, QuantizedKVCache) for c in cache_leaves(cache))


def cache_nbytes(cache: list) -> int:
    """Bytes held, counting whole buffers (a KVCache allocates ahead of its offset)."""
    return sum(c.nbytes for c in cache_leaves(cache))


def held_positions(trunk_cache: list, head_cache: list | None) -> int:
    """Positions every cache holds (the head's pair i needs token i + 1, so it may hold fewer)."""
    caches = list(trunk_cache) + list(head_cache or [])
    return min((c.offset for c in cache_leaves(caches)), default=0)


def _trim_to(cache: list, size: int) -> None:
    for c in cache_leaves(cache):
        c.trim(c.offset - size)  # offset becomes size (KV caches only: is_trimmable)


def _common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class _Entry:
    tokens: tuple[int, ...]  # the sequence the caches were built from (may run past size)
    size: int  # positions reusable (see the module docstring)
    trunk_cache: list
    head_cache: list | None  # None: built without a head (plain AR)
    trimmable: bool
    nbytes: int


@dataclass
class CacheHit:
    """Caches for a new request: they hold ``start`` positions of its prompt."""

    trunk_cache: list
    head_cache: list | None
    start: int


class PromptCache:
    """Byte-bounded LRU store of caches keyed by the token sequences that built them.

    Not thread-safe: one engine (one generation thread) owns it.
    """

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise MtplxError(f"prompt_cache_bytes: must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._next_id = 0

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()

    def _usable(self, entry: _Entry, prompt: list[int], with_head: bool) -> int:
        if with_head and entry.head_cache is None:
            return 0
        match = _common_prefix(entry.tokens, prompt)
        usable = min(entry.size, match - 1 if with_head else match, len(prompt) - 1)
        if not entry.trimmable and usable < entry.size:
            return 0
        if usable < reusable_from(entry.trunk_cache):  # quantized KV: float below its start
            return 0
        return max(usable, 0)

    def lookup(self, prompt: list[int], with_head: bool, longer_than: int = 0) -> CacheHit | None:
        """Copies of the caches of the longest reusable prefix of ``prompt`` if it holds more than
        ``longer_than`` positions, else None (nothing copied)."""
        best_id, best = None, longer_than
        for entry_id, entry in self._entries.items():
            usable = self._usable(entry, prompt, with_head)
            if usable > best:
                best_id, best = entry_id, usable
        if best_id is None:
            return None
        entry = self._entries[best_id]
        self._entries.move_to_end(best_id)
        trunk_cache = copy_cache(entry.trunk_cache)
        head_cache = copy_cache(entry.head_cache) if with_head else None
        if entry.trimmable:
            _trim_to(trunk_cache, best)
            if head_cache is not None:
                _trim_to(head_cache, best)
        return CacheHit(trunk_cache, head_cache, best)

    def insert(
        self,
        tokens: list[int],
        size: int,
        trunk_cache: list,
        head_cache: list | None,
        *,
        copy: bool,
    ) -> None:
        """Store caches holding ``size`` positions of ``tokens``; ``copy=False`` takes ownership."""
        if self.max_bytes == 0 or size <= 0:
            return
        trimmable = is_trimmable(trunk_cache) and (head_cache is None or is_trimmable(head_cache))
        if copy:
            trunk_cache = copy_cache(trunk_cache)
            head_cache = copy_cache(head_cache) if head_cache is not None else None
        nbytes = cache_nbytes(trunk_cache) + (cache_nbytes(head_cache) if head_cache is not None else 0)
        if nbytes > self.max_bytes:
            return
        entry = _Entry(tuple(tokens), size, trunk_cache, head_cache, trimmable, nbytes)
        # Drop entries the new one makes redundant: every prompt they serve, it serves as well
        # (a snapshot serves only prompts through its exact boundary, so only an equal one).
        for entry_id, old in list(self._entries.items()):
            same_prefix = _common_prefix(old.tokens, tokens) >= min(len(old.tokens), old.size + 1)
            covered = (
                same_prefix
                and (old.head_cache is None or head_cache is not None)
                and (old.size == size or (trimmable and old.trimmable and old.size < size))
            )
            if covered:
                del self._entries[entry_id]
        self._entries[self._next_id] = entry
        self._next_id += 1
        while self.nbytes > self.max_bytes:
            self._entries.popitem(last=False)
