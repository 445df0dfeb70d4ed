"""One disk prompt-cache entry as a file (the format `mtplx.trunk.prompt_cache_disk`'s tier keeps):
what `save_entry` writes, what `entry_from` indexes from its header and what `read_entry` loads back.

A file is in mlx-lm's prompt-cache format (``mlx_lm.models.cache.save_prompt_cache``: a safetensors
file of the caches' states, their class names and string metadata), so
``load_prompt_cache(path)[:trunk_layers]`` is the trunk's cache as mlx-lm builds it; the draft
head's caches follow it, then a block drafter's context (`mtplx.trunk.prompt_cache`'s
``drafter_cache``: DFlash's K/V, EAGLE-3's pairs) where the entry has one. The metadata
(`entry_metadata`) holds the key, ``FORMAT_VERSION``, the tokens, the reusable size, the layout
(trunk / head / drafter layer counts) and the digest of every byte (`mtplx.trunk.prompt_cache_file`,
checked by `read_entry` before anything is loaded).

A trunk hosted with mlx-vlm's own caches (`mtplx.trunk.vlm_text.NATIVE_CACHE_FAMILIES`) writes
each cache's module beside its class name (``mtplx_cache_modules``): `load_caches` rebuilds those
as mlx-vlm's classes (mlx-lm's loader knows only its own, and mlx-vlm's ``ArraysCache`` shares a
name with mlx-lm's); only ``mlx_lm.models.cache`` and ``mlx_vlm.models.*`` modules are imported.
A class without ``from_state`` (MiniMax-M3's ``MiniMaxM3KVCache``) is rebuilt as a fresh instance
given its ``state`` and ``meta_state`` (`_rebuild`; written only when `rebuildable`: its
constructor takes no argument and its ``state`` can be set). DeepSeek-V4's compressor overlap
windows, state a cache's ``state`` does not hold (`mtplx.trunk.vlm_deepseek_v4`), are written after
the caches, with the leaf cache each belongs to (``mtplx_overlap_leaves``), and put back on load.
"""

from __future__ import annotations

import importlib
import inspect
import json
from dataclasses import dataclass
from pathlib import Path

from mtplx.trunk.compat import load_prompt_cache, save_prompt_cache
from mtplx.trunk.prompt_cache import as_tokens
from mtplx.trunk.prompt_cache_file import DIGEST_FIELD, PLACEHOLDER, verify
from mtplx.trunk.vlm_deepseek_v4 import overlap_windows, restore_overlap_windows

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

FORMAT_VERSION = "3"  # 2: every file carries its digest; 3: a block drafter's context after the head's
CACHE_MODULES_FIELD = "mtplx_cache_modules"
CACHE_META_FIELD = "mtplx_cache_meta_states"  # mlx-vlm's from_state(state, meta_state) takes both
OVERLAP_FIELD = "mtplx_overlap_leaves"  # DeepSeek-V4's overlap windows: the leaf cache of each
LM_CACHE_MODULE = "mlx_lm.models.cache"


@dataclass
class DiskEntry:
    """An entry file as the index knows it, from its header alone (`entry_from`)."""

    name: str  # file name in the directory
    tokens: np.ndarray
    size: int
    has_head: bool
    trimmable: bool
    trunk_layers: int
    head_layers: int
    drafter_layers: int  # 0: no block drafter's context
    nbytes: int  # the file's size
    last_use: float

    @property
    def has_drafter(self) -> bool:
        return self.drafter_layers > 0

    @property
    def layers(self) -> int:
        """How many caches the file holds before any overlap window."""
        return self.trunk_layers + self.head_layers + self.drafter_layers

    def parts(self, caches: list) -> tuple[list, list | None, list | None]:
        """(trunk cache, head cache, drafter context) of the file's ``caches``, in the order written."""
        head_end = self.trunk_layers + self.head_layers
        head = caches[self.trunk_layers : head_end] if self.has_head else None
        drafter = caches[head_end : self.layers] if self.has_drafter else None
        return caches[: self.trunk_layers], head, drafter


def entry_from(path: Path, meta: dict[str, str]) -> DiskEntry:
    """An index entry from a file's metadata (KeyError / ValueError when it lacks a field)."""
    if meta["mtplx_format"] != FORMAT_VERSION:
        raise ValueError(f"format {meta['mtplx_format']}, expected {FORMAT_VERSION}")
    if len(meta[DIGEST_FIELD]) != len(PLACEHOLDER) or meta[DIGEST_FIELD] == PLACEHOLDER:
        raise ValueError("it has no digest")
    stat = path.stat()
    return DiskEntry(
        name=path.name,
        tokens=as_tokens(json.loads(meta["mtplx_tokens"])),
        size=int(meta["mtplx_size"]),
        has_head=meta["mtplx_head"] == "1",
        trimmable=meta["mtplx_trimmable"] == "1",
        trunk_layers=int(meta["mtplx_trunk_layers"]),
        head_layers=int(meta["mtplx_head_layers"]),
        drafter_layers=int(meta["mtplx_drafter_layers"]),
        nbytes=stat.st_size,
        last_use=stat.st_mtime,
    )


# ---------------------------------------------------------------------- writing


class _HeldState:
    """A piece of state written after the caches (an overlap window), as ``save_prompt_cache``
    writes a cache: its ``state``."""

    def __init__(self, state: tuple):
        self.state = state


def rebuildable(klass: type) -> bool:
    """Whether a file can rebuild a cache of ``klass``: ``from_state``, or a settable ``state``
    and a constructor that takes no argument (`_rebuild`)."""
    if callable(getattr(klass, "from_state", None)):
        return True
    prop = getattr(klass, "state", None)
    if not isinstance(prop, property) or prop.fset is None:
        return False
    try:
        inspect.signature(klass).bind()
    except (TypeError, ValueError):
        return False
    return True


def entry_metadata(
    key: str,
    tokens: list[int],
    size: int,
    trimmable: bool,
    trunk_cache: list,
    head_cache: list | None,
    drafter_cache: list | None,
) -> dict[str, str]:
    """The metadata of the file of these caches (the digest a placeholder until `stamp`)."""
    caches = trunk_cache + (head_cache or []) + (drafter_cache or [])
    meta = {
        "mtplx_key": key,
        "mtplx_format": FORMAT_VERSION,
        "mtplx_tokens": json.dumps(tokens),
        "mtplx_size": str(size),
        "mtplx_head": "1" if head_cache is not None else "0",
        "mtplx_trimmable": "1" if trimmable else "0",
        "mtplx_trunk_layers": str(len(trunk_cache)),
        "mtplx_head_layers": str(len(head_cache or [])),
        "mtplx_drafter_layers": str(len(drafter_cache or [])),
        DIGEST_FIELD: PLACEHOLDER,
    }
    modules = [type(c).__module__ for c in caches]
    if any(m != LM_CACHE_MODULE for m in modules):
        meta[CACHE_MODULES_FIELD] = json.dumps(modules)
        meta[CACHE_META_FIELD] = json.dumps(
            [c.meta_state if m != LM_CACHE_MODULE else "" for c, m in zip(caches, modules)]
        )
    leaves, _ = overlap_windows(caches)
    if leaves:
        meta[OVERLAP_FIELD] = json.dumps(leaves)
    return meta


def save_entry(path: Path, caches: list, meta: dict[str, str]) -> None:
    """``caches`` (trunk, head, drafter: the order `entry_metadata` counted) and their overlap
    windows into ``path`` with ``meta``."""
    _, windows = overlap_windows(caches)
    save_prompt_cache(str(path), caches + [_HeldState(w) for w in windows], meta)


# ---------------------------------------------------------------------- reading


def _rebuild(klass: type, state, meta_state):
    """A cache of mlx-vlm's ``klass`` holding ``state`` / ``meta_state``."""
    if callable(getattr(klass, "from_state", None)):
        return klass.from_state(state, meta_state)
    cache = klass()
    cache.state = state
    cache.meta_state = meta_state
    return cache


def _cache_class(module: str, name: str) -> type:
    if module != LM_CACHE_MODULE and not module.startswith("mlx_vlm.models."):
        raise ValueError(f"cache class {module}.{name} is not an mlx-lm or mlx-vlm cache")
    return getattr(importlib.import_module(module), name)


def load_caches(path: Path) -> tuple[list, dict[str, str]]:
    """mlx-lm's ``load_prompt_cache(path, return_metadata=True)``, each cache rebuilt as the class
    of the module the file names for it (``CACHE_MODULES_FIELD``; mlx-lm's when it names none)."""
    arrays, header = mx.load(str(path), return_metadata=True)
    meta, classes, scalars = tree_unflatten(list(header.items()))
    if CACHE_MODULES_FIELD not in meta:
        return load_prompt_cache(str(path), return_metadata=True)
    for pos, kind in scalars[1:]:
        arrays[pos] = {"scalar": lambda a: a.item(), "none": lambda a: None}.get(
            kind, lambda a: "".join(chr(i) for i in a.tolist())
        )(arrays[pos])
    states = tree_unflatten(list(arrays.items()))
    modules, meta_states = json.loads(meta[CACHE_MODULES_FIELD]), json.loads(meta[CACHE_META_FIELD])
    caches = []
    for module, name, state, meta_state in zip(modules, classes, states, meta_states):
        klass = _cache_class(module, name)
        vlm = module != LM_CACHE_MODULE
        caches.append(_rebuild(klass, state, meta_state) if vlm else klass.from_state(state))
    if OVERLAP_FIELD in meta:
        restore_overlap_windows(caches, json.loads(meta[OVERLAP_FIELD]), states[len(modules) :])
    return caches, meta


def read_entry(path: Path, entry: DiskEntry, key: str) -> list:
    """The caches of ``entry``'s file at ``path``, evaluated: its digest checked over every byte
    first, then its key, layer count and tokens against the index's. Any failure raises (a
    damaged file)."""
    verify(path)  # every byte as written: the tensors and the key, tokens and size indexed
    caches, meta = load_caches(path)
    if meta.get("mtplx_key") != key or len(caches) < entry.layers:
        raise ValueError("its metadata changed since it was indexed")
    if as_tokens(json.loads(meta["mtplx_tokens"])).tolist() != entry.tokens.tolist():
        raise ValueError("its tokens changed since it was indexed")
    mx.eval([a for _, a in tree_flatten([c.state for c in caches]) if isinstance(a, mx.array)])
    return caches
