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
  but the last (``decode.PromptPrefix``), and at the chat boundaries ``boundaries``
  names (`mtplx.trunk.prompt_boundaries`: system prompt's end, generation prompt's
  start), so a chat's next turn finds one. A later prompt reuses it only if it
  starts with exactly those tokens; one prefix is held once (``holds``).

In both, ``size`` positions are reused: the trunk's positions 0..size-1 and the
head's (hidden i, token i+1) pairs for i < size. A head pair at i depends on
token i+1, so a prompt must agree with the entry on ``size + 1`` tokens when the
head cache is reused, and at least one prompt token is always forwarded (its
logits start the generation). A block drafter's context (``drafter_cache``: DFlash's
K/V of each position's layer taps, EAGLE-3's (token i + 1, taps of i) pairs, `block_proposer`;
plain KV either way) is kept beside them by the same rule, in both kinds of entry (a snapshot's
holds exactly its ``size`` positions) and on disk too, and served only to a request that asks for
it (``with_drafter``): a block drafter row's context then starts where its trunk does.

Quantized KV (`kv_quant`) is stored as it is (a ``QuantizedKVCache`` is trimmable); an entry
whose caches converted at ``quantized_kv_start`` is never trimmed below that start, where the
same sequence's caches are float. Images (`mtplx.trunk.vision`): a stored copy keeps no prompt
images bound (the request that reuses it binds its own), so no preprocessed pixels sit outside
the byte budget; caches handed over as they are count theirs.
A disk tier (``disk``, `mtplx.trunk.prompt_cache_disk`) keeps entries across restarts.

Reusing never changes outputs beyond float rounding: a cache prefilled in two parts holds the
same positions as one prefilled at once (see tests/trunk/test_prompt_cache.py); not under
``kv_bits``, where rounding to a few bits can make those last-bit differences whole steps
(README "What is exact under --kv-bits"). mlx-lm's
``LRUPromptCache`` (mlx_lm/server.py) was read for the idea of trimming the
longest-prefix entry; the data structure here is our own.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from mtplx.errors import MtplxError
from mtplx.trunk import vision
from mtplx.trunk.compat import KVCache, QuantizedKVCache, cache_leaves, copy_cache
from mtplx.trunk.kv_quant import reusable_from

import numpy as np

__all__ = [
    "DEFAULT_PROMPT_CACHE_BYTES",
    "CacheHit",
    "PromptCache",
    "as_tokens",
    "cache_nbytes",
    "common_prefix",
    "copy_cache",
    "covers",
    "held_positions",
    "is_trimmable",
    "reusable",
]

# What `mtplx serve` and `mtplx chat` keep unless told otherwise.
DEFAULT_PROMPT_CACHE_BYTES = 2 * 1024**3


def is_trimmable(cache: list) -> bool:
    """True if every cache can be moved back by any number of positions (pure KV)."""
    return all(type(c) in (KVCache, QuantizedKVCache) for c in cache_leaves(cache))


def cache_nbytes(cache: list) -> int:
    """Bytes held, counting whole buffers (a KVCache allocates ahead of its offset)."""
    return sum(c.nbytes for c in cache_leaves(cache))


def held_positions(trunk_cache: list, head_cache: list | None, drafter_cache: list | None = None) -> int:
    """Positions every cache holds (the head's pair i needs token i + 1, so it may hold fewer)."""
    caches = list(trunk_cache) + list(head_cache or []) + list(drafter_cache or [])
    return min((c.offset for c in cache_leaves(caches)), default=0)


def _trim_to(cache: list, size: int) -> None:
    for c in cache_leaves(cache):
        c.trim(c.offset - size)  # offset becomes size (KV caches only: is_trimmable)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two token arrays (vectorized: a lookup compares every
    entry's tokens, thousands each, so a Python loop over tokens was its cost)."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def as_tokens(tokens) -> np.ndarray:
    """Token ids as the int64 array entries and lookups compare. A token standing for an image
    patch (`mtplx.trunk.vision.ImageToken`: the image pad id, equal only to the same patch of the
    same pixels) becomes a negative key from its image's digest and patch, so two same-size images
    never share a prefix past the first patch (real ids are >= 0); on disk too."""
    if isinstance(tokens, np.ndarray):
        return tokens.astype(np.int64, copy=False).reshape(-1)
    return np.asarray([_token_key(t) for t in tokens], dtype=np.int64).reshape(-1)


def _token_key(token) -> int:
    image = getattr(token, "image", None)
    if image is None:
        return int(token)
    return -1 - ((int(image.digest[:15], 16) << 12 | token.patch % 4096) % (1 << 62))


def reusable(
    tokens: np.ndarray,
    size: int,
    has_head: bool,
    trimmable: bool,
    prompt: np.ndarray,
    with_head: bool,
    floor: int = 0,
    has_drafter: bool = False,
    with_drafter: bool = False,
) -> int:
    """Positions of ``prompt`` that caches built from ``tokens`` (holding ``size`` positions) can
    serve (the module docstring), 0 when none. ``floor``: the fewest positions they may be trimmed
    to (KV quantized from a start: float below it, `kv_quant.reusable_from`)."""
    if (with_head and not has_head) or (with_drafter and not has_drafter):
        return 0
    match = common_prefix(tokens, prompt)
    usable = min(size, match - 1 if with_head or with_drafter else match, len(prompt) - 1)
    if not trimmable and usable < size:
        return 0
    if usable < floor:
        return 0
    return max(usable, 0)


def covers(
    new_tokens: np.ndarray, new_size: int, new_head: bool, new_trimmable: bool, old, new_drafter: bool = False
) -> bool:
    """True if an entry (``new_*``) serves every prompt ``old`` serves (``old`` has ``tokens``,
    ``size``, ``has_head``, ``trimmable``): a snapshot serves only prompts through its exact
    boundary, so only an equal one covers it."""
    same_prefix = common_prefix(old.tokens, new_tokens) >= min(len(old.tokens), old.size + 1)
    return (
        same_prefix
        and (not old.has_head or new_head)
        and (not getattr(old, "has_drafter", False) or new_drafter)  # a drafter row's entry
        and (old.size == new_size or (new_trimmable and old.trimmable and old.size < new_size))
    )


@dataclass
class _Entry:
    tokens: np.ndarray  # the sequence the caches were built from (may run past size)
    size: int  # positions reusable (see the module docstring)
    trunk_cache: list
    head_cache: list | None  # None: built without a head (plain AR)
    trimmable: bool
    nbytes: int
    floor: int = 0  # the fewest positions it may be trimmed to (`reusable`)
    drafter_cache: list | None = None  # a block drafter's context (the module docstring)

    @property
    def has_head(self) -> bool:
        return self.head_cache is not None

    @property
    def has_drafter(self) -> bool:
        return self.drafter_cache is not None

    def usable(self, prompt: np.ndarray, with_head: bool, with_drafter: bool = False) -> int:
        """Positions of ``prompt`` this entry serves (`reusable`)."""
        return reusable(
            self.tokens,
            self.size,
            self.has_head,
            self.trimmable,
            prompt,
            with_head,
            self.floor,
            self.has_drafter,
            with_drafter,
        )


@dataclass
class CacheHit:
    """Caches for a new request: they hold ``start`` positions of its prompt."""

    trunk_cache: list
    head_cache: list | None
    start: int
    drafter_cache: list | None = None


class PromptCache:
    """Byte-bounded LRU store of caches keyed by the token sequences that built them.

    ``disk`` (a `mtplx.trunk.prompt_cache_disk.DiskTier`, None: RAM only) keeps entries across
    restarts: a lookup whose longest prefix is on disk loads it, and entries inserted with
    ``persist`` are written there (off this thread). ``boundaries`` (prompt -> positions; None:
    none) names where a request whose caches cannot be trimmed keeps snapshots besides its
    prompt's end (`mtplx.trunk.prompt_boundaries`).

    Not thread-safe: one engine (one generation thread) owns it.
    """

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise MtplxError(f"prompt_cache_bytes: must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._next_id = 0
        self.disk = None
        self.boundaries: Callable[[list[int]], list[int]] | None = None

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()

    def holds(self, tokens: list[int], size: int, with_head: bool, with_drafter: bool = False) -> bool:
        """True if an entry already serves exactly ``tokens[:size]`` (a snapshot there is held once;
        ``with_drafter``: with a block drafter's context); that entry counts as used now."""
        prompt = as_tokens(tokens[: size + 1])
        for entry_id, e in self._entries.items():
            if e.size == size and e.usable(prompt, with_head, with_drafter) == size:
                self._entries.move_to_end(entry_id)
                return True
        return False

    def _best_in_ram(
        self, prompt: np.ndarray, with_head: bool, longer_than: int, with_drafter: bool
    ) -> tuple[int | None, int]:
        best_id, best = None, longer_than
        for entry_id, entry in self._entries.items():
            usable = entry.usable(prompt, with_head, with_drafter)
            if usable > best:
                best_id, best = entry_id, usable
        return best_id, best

    def lookup(
        self, prompt: list[int], with_head: bool, longer_than: int = 0, with_drafter: bool = False
    ) -> CacheHit | None:
        """Copies of the caches of the longest reusable prefix of ``prompt`` if it holds more than
        ``longer_than`` positions, else None (nothing copied). An entry on disk that serves more
        than any in RAM is loaded (and kept in RAM). ``with_drafter``: a block drafter's context
        too."""
        ids = as_tokens(prompt)
        best_id, best = self._best_in_ram(ids, with_head, longer_than, with_drafter)
        if self.disk is not None:
            loaded = self.disk.load_best(ids, with_head, longer_than=best, with_drafter=with_drafter)
            if loaded is not None:
                entry = _entry(*loaded)
                usable = entry.usable(ids, with_head, with_drafter)
                if usable > best:  # else (its quantized part starts later) the RAM entry serves
                    best = usable
                    best_id = self._add(entry)
                    if best_id is None:  # larger than the RAM budget: served from the loaded caches once
                        return _hit(entry, best, with_head, with_drafter)
        if best_id is None:
            return None
        self._entries.move_to_end(best_id)
        return _hit(self._entries[best_id], best, with_head, with_drafter)

    def insert(
        self,
        tokens: list[int],
        size: int,
        trunk_cache: list,
        head_cache: list | None,
        *,
        copy: bool,
        persist: bool = False,
        drafter_cache: list | None = None,
    ) -> None:
        """Store caches holding ``size`` positions of ``tokens``; ``copy=False`` takes ownership.
        ``persist``: also write them to the disk tier, if there is one (a request's final caches
        and its snapshots; not the prompt's caches `CacheSession.store_prompt` lends meanwhile),
        a block drafter's context ``drafter_cache`` beside them (copied too with ``copy``)."""
        if self.max_bytes == 0 or size <= 0:
            return
        if copy:
            trunk_cache = copy_cache(trunk_cache)
            head_cache = copy_cache(head_cache) if head_cache is not None else None
            drafter_cache = copy_cache(drafter_cache) if drafter_cache is not None else None
            vision.unbind(trunk_cache)  # the copy keeps no pixels: a request reusing it binds its own
        entry = _entry(tokens, size, trunk_cache, head_cache, drafter_cache)
        if self._add(entry) is not None and persist and self.disk is not None:
            self.disk.write(entry)

    def _add(self, entry: _Entry) -> int | None:
        """Keep ``entry`` (its id), dropping the entries it covers and then the least recently
        used ones over the budget; None (nothing kept) when it alone is over the budget."""
        if entry.nbytes > self.max_bytes:
            return None
        for entry_id, old in list(self._entries.items()):
            if covers(entry.tokens, entry.size, entry.has_head, entry.trimmable, old, entry.has_drafter):
                del self._entries[entry_id]
        entry_id = self._next_id
        self._entries[entry_id] = entry
        self._next_id += 1
        while self.nbytes > self.max_bytes:
            self._entries.popitem(last=False)
        return entry_id


def _entry(
    tokens, size: int, trunk_cache: list, head_cache: list | None, drafter_cache: list | None = None
) -> _Entry:
    trimmable = is_trimmable(trunk_cache) and (head_cache is None or is_trimmable(head_cache))
    if drafter_cache is not None and not _context_fits(drafter_cache, size, trimmable):
        drafter_cache = None
    nbytes = sum(cache_nbytes(c) for c in (trunk_cache, head_cache, drafter_cache) if c is not None)
    nbytes += vision.bound_nbytes(trunk_cache)  # caches handed over as they are keep their images' pixels
    floor = reusable_from(trunk_cache)  # quantized KV: float below its start
    return _Entry(as_tokens(tokens), size, trunk_cache, head_cache, trimmable, nbytes, floor, drafter_cache)


def _context_fits(drafter_cache: list, size: int, trimmable: bool) -> bool:
    """Whether a block drafter's context can go beside caches holding ``size`` positions: plain
    KV, and (beside caches that cannot be trimmed: a snapshot) holding exactly ``size``."""
    offsets = {c.offset for c in cache_leaves(drafter_cache)}
    return is_trimmable(drafter_cache) and (trimmable or offsets == {size})


def _hit(entry, size: int, with_head: bool, with_drafter: bool = False) -> CacheHit:
    """Copies of ``entry``'s caches holding ``size`` positions."""
    trunk_cache = copy_cache(entry.trunk_cache)
    head_cache = copy_cache(entry.head_cache) if with_head else None
    drafter_cache = copy_cache(entry.drafter_cache) if with_drafter else None
    if entry.trimmable:
        for cache in (trunk_cache, head_cache, drafter_cache):
            if cache is not None:
                _trim_to(cache, size)
    return CacheHit(trunk_cache, head_cache, size, drafter_cache)
