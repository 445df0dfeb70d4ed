"""The prompt cache's disk tier: entries that outlive the process (`mtplx serve --prompt-cache-dir`).

Files: one per entry, in mlx-lm's prompt-cache format (``mlx_lm.models.cache.save_prompt_cache``:
a safetensors file of the caches' states, their class names and string metadata), so
``load_prompt_cache(path)[:trunk_layers]`` is the trunk's cache as mlx-lm builds it; the draft
head's caches follow it, then a block drafter's context (`mtplx.trunk.prompt_cache`'s
``drafter_cache``: DFlash's K/V, EAGLE-3's pairs) where the entry has one. The metadata holds the
key, the format version, the tokens, the reusable size and the layout (`_write_now`).

Key: sha256 over the identity (`cache_identity`: model fingerprint, adapter identity, dtype, head
identity, block drafter identity, KV-cache quantization, mlx-lm minor version) and
``FORMAT_VERSION``: caches of another model, adapter, dtype, head, drafter or KV quantization
would give wrong output, so a file with another key is never loaded (a model fingerprint ignores
adapters: the adapter files are hashed).

Invariants:
- a file is written atomically: a hidden temporary name in the same directory, then a rename;
  the decode thread only queues the write (``mx.async_eval`` of the states: no host sync), the
  writer thread saves it;
- the entries of this key on disk hold at most ``max_bytes``; the least recently used (a hit
  touches the file) go first; an entry covered by a newer one is deleted (`prompt_cache.covers`);
- every file carries a digest of all its bytes (`mtplx.trunk.prompt_cache_file`: the tensors and
  the key, the tokens, the size), computed by the writer thread and checked before the file is
  loaded; a damaged file (unreadable header, shorter than its header says, a digest that does not
  match, failing to load) is deleted with one log line and counted, never served (so never
  written back either); a file of another key is skipped (left for its own configuration);
- one process writes a directory: `DiskTier` holds an exclusive lock on ``.lock`` in it for
  the process's life (released by the kernel when the process dies); a second process is refused
  with one line (two writers would evict each other's files under budgets neither sees). Holding
  the lock, start-up removes the hidden temporary files a killed writer left;
- `close` (shutdown) waits a bounded time for the queued writes and logs how many entries were
  written and dropped.

A trunk hosted with mlx-vlm's own caches (`mtplx.trunk.vlm_text.NATIVE_CACHE_FAMILIES`) writes
each cache's module beside its class name (``mtplx_cache_modules``): `load_caches` rebuilds those
as mlx-vlm's classes (mlx-lm's loader knows only its own, and mlx-vlm's ``ArraysCache`` shares a
name with mlx-lm's); only ``mlx_lm.models.cache`` and ``mlx_vlm.models.*`` modules are imported.
A class without ``from_state`` (MiniMax-M3's ``MiniMaxM3KVCache``) is rebuilt as a fresh instance
given its ``state`` and ``meta_state`` (`_rebuild`; written only when its constructor takes no
argument and its ``state`` can be set). DeepSeek-V4's compressor overlap windows, state a cache's
``state`` does not hold (`mtplx.trunk.vlm_deepseek_v4`), are written after the caches, with the
leaf cache each belongs to (``mtplx_overlap_leaves``), and put back on load.

The index reads each file's safetensors header alone (`mtplx.model_files.headers`, which also
notices a file shorter than its header says), never its tensors.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import inspect
import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from importlib import metadata as package_metadata
from pathlib import Path

from mtplx.errors import MtplxError, first_line
from mtplx.model_files.headers import read_safetensors_metadata
from mtplx.trunk.compat import (
    QuantizedKVCache,
    cache_leaves,
    load_prompt_cache,
    prompt_cache_file_metadata,
    save_prompt_cache,
)
from mtplx.trunk.prompt_cache import as_tokens, covers, reusable
from mtplx.trunk.prompt_cache_file import DIGEST_FIELD, PLACEHOLDER, stamp, verify
from mtplx.trunk.vlm_deepseek_v4 import overlap_windows, restore_overlap_windows

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

__all__ = ["DEFAULT_DISK_BYTES", "FORMAT_VERSION", "DiskStats", "DiskTier", "cache_identity"]

FORMAT_VERSION = "3"  # 2: every file carries its digest; 3: a block drafter's context after the head's
DEFAULT_DISK_BYTES = 16 * 1024**3  # what `mtplx serve --prompt-cache-dir` keeps unless told otherwise
MAX_QUEUED_WRITES = 8  # writes waiting beyond this are dropped (the entry stays in RAM)
LOCK_FILE = ".lock"
TEMP_SUFFIX = ".tmp.safetensors"
log = logging.getLogger("mtplx.prompt_cache")
# This process's lock on each directory it writes: (resolved directory) -> the open lock file.
# DiskTiers of one process share it (an engine restarted in-process, as the tests do).
_held_locks: dict[Path, int] = {}
_held_locks_guard = threading.Lock()


def lock_directory(directory: Path) -> None:
    """Take the directory's writer lock for this process (kept until it exits); `MtplxError`
    naming the other process when one holds it."""
    where = directory.resolve()
    with _held_locks_guard:
        if where in _held_locks:
            return
        fd = os.open(where / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise MtplxError(
                f"{directory}: the prompt cache directory is in use by another process (pid {holder}); "
                "give each server its own directory"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        _held_locks[where] = fd


CACHE_MODULES_FIELD = "mtplx_cache_modules"
CACHE_META_FIELD = "mtplx_cache_meta_states"  # mlx-vlm's from_state(state, meta_state) takes both
OVERLAP_FIELD = "mtplx_overlap_leaves"  # DeepSeek-V4's overlap windows: the leaf cache of each
LM_CACHE_MODULE = "mlx_lm.models.cache"


class _HeldState:
    """A piece of state written after the caches (an overlap window), as ``save_prompt_cache``
    writes a cache: its ``state``."""

    def __init__(self, state: tuple):
        self.state = state


def _rebuildable(klass: type) -> bool:
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


def _file_digest(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def kv_quantization(trunk) -> str:
    """The KV-cache kinds a fresh trunk cache holds, quantization settings included."""
    kinds = []
    for c in cache_leaves(trunk.make_cache()):
        name = type(c).__name__
        if isinstance(c, QuantizedKVCache):
            name += f"(bits={c.bits},group={c.group_size})"
        kinds.append(name)
    return ",".join(sorted(set(kinds)))


def cache_identity(
    *, fingerprint: str, trunk, head, adapter_path: str | Path | None = None, kv: str = "", drafter=None
) -> dict[str, str]:
    """What caches on disk must agree on to be reused (the module docstring). ``kv`` names a KV
    quantization applied while decoding (beside what the trunk's fresh caches show); ``drafter``
    the engine's block drafter (a `BlockDrafter`: its layout and weights), whose context an entry
    may hold."""
    from mtplx.model_files.fingerprint import model_fingerprint

    adapter = "none"
    if adapter_path is not None:
        adapter = _file_digest(sorted(p for p in Path(adapter_path).iterdir() if p.is_file()))
    dtypes = sorted({str(v.dtype) for _, v in tree_flatten(trunk.model.parameters())})
    major, minor = package_metadata.version("mlx-lm").split(".")[:2]
    return {
        "model": fingerprint or model_fingerprint(trunk.model),
        "adapter": adapter,
        "dtype": ",".join(dtypes),
        "head": "none" if head is None else f"{type(head).__name__}:{model_fingerprint(head)}",
        "drafter": "none"
        if drafter is None
        else f"{drafter.source.value}:{model_fingerprint(drafter.drafter)}",
        "kv": kv_quantization(trunk) + (f"+{kv}" if kv else ""),
        "mlx_lm": f"{major}.{minor}",
    }


@dataclass
class DiskStats:
    """What the disk tier did since the process started (`/metrics`)."""

    hits: int = 0  # lookups served from disk
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    writes: int = 0  # entries written
    dropped_writes: int = 0  # queue full, larger than the budget, the write failed, or unfinished at close
    skipped_files: int = 0  # damaged or of another key
    removed_files: int = 0  # damaged files and a killed writer's temporary files, deleted


@dataclass
class _DiskEntry:
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


@dataclass
class _Write:
    tokens: np.ndarray
    size: int
    trunk_cache: list
    head_cache: list | None
    trimmable: bool
    drafter_cache: list | None


class DiskTier:
    """Entries on disk for one model configuration (the module docstring). The index and the
    files are shared by the decode thread (lookups, queued writes) and the writer thread."""

    def __init__(self, directory: str | Path, max_bytes: int, identity: dict[str, str]):
        if max_bytes <= 0:
            raise MtplxError(f"prompt cache disk budget: must be > 0 bytes, got {max_bytes}")
        if not str(directory).strip():
            raise MtplxError("prompt cache directory: empty path")
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise MtplxError(
                f"{self.directory}: cannot create the prompt cache directory ({err.strerror})"
            ) from None
        if not os.access(self.directory, os.W_OK):
            raise MtplxError(f"{self.directory}: the prompt cache directory is not writable")
        lock_directory(self.directory)
        self.max_bytes = max_bytes
        self.key = self.key_of(identity)
        self.stats = DiskStats()
        self._entries: dict[str, _DiskEntry] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue[_Write] = queue.Queue(maxsize=MAX_QUEUED_WRITES)
        self._writer: threading.Thread | None = None
        self._closed = False
        self._warned_budget = False
        self._remove_temp_files()
        self.index()

    @staticmethod
    def key_of(identity: dict[str, str]) -> str:
        """The key of the files an ``identity`` (`cache_identity`) reads and writes."""
        text = json.dumps({**identity, "format": FORMAT_VERSION}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    # ------------------------------------------------------------------ the index
    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def _remove_temp_files(self) -> None:
        """Temporary files a killed writer left (this process holds the lock: no other writes)."""
        ours = f".{os.getpid()}{TEMP_SUFFIX}"
        left = [p for p in self.directory.glob(f".*{TEMP_SUFFIX}") if not p.name.endswith(ours)]
        for path in left:
            path.unlink(missing_ok=True)
        if left:
            self.stats.removed_files += len(left)
            log.warning(
                "prompt cache: removed %d unfinished files a stopped writer left in %s",
                len(left),
                self.directory,
            )

    def _remove_damaged(self, path: Path, err: BaseException) -> None:
        path.unlink(missing_ok=True)
        self.stats.skipped_files += 1
        self.stats.removed_files += 1
        log.warning("prompt cache: skipped %s: damaged, removed (%s)", path.name, first_line(err))

    def index(self) -> None:
        """Read every entry file's header (not its tensors); remove damaged ones, skip foreign ones."""
        foreign = 0
        for path in sorted(self.directory.glob("*.safetensors")):
            if path.name.startswith("."):
                continue  # a write in progress
            try:
                meta = prompt_cache_file_metadata(read_safetensors_metadata(path))
                if meta.get("mtplx_key") != self.key:
                    foreign += 1
                    continue
                entry = _entry_from(path, meta)
            except (MtplxError, OSError, ValueError, KeyError, TypeError) as err:
                self._remove_damaged(path, err)
                continue
            self._entries[entry.name] = entry
        if foreign:
            self.stats.skipped_files += foreign
            log.info(
                "prompt cache: skipped %d files in %s of another model or configuration",
                foreign,
                self.directory,
            )
        with self._lock:
            self._evict()
        log.info(
            "prompt cache: %d entries (%d bytes) on disk in %s",
            len(self._entries),
            self.nbytes,
            self.directory,
        )

    def _evict(self) -> None:
        """Least recently used entries out until the budget holds (the lock held)."""
        while sum(e.nbytes for e in self._entries.values()) > self.max_bytes:
            oldest = min(self._entries.values(), key=lambda e: e.last_use)
            self._delete(oldest)

    def _delete(self, entry: _DiskEntry) -> None:
        self._entries.pop(entry.name, None)
        try:
            (self.directory / entry.name).unlink()
        except FileNotFoundError:
            pass

    # ------------------------------------------------------------------ reading
    def load_best(
        self, prompt: np.ndarray, with_head: bool, longer_than: int = 0, with_drafter: bool = False
    ) -> tuple[np.ndarray, int, list, list | None, list | None] | None:
        """(tokens, size, trunk cache, head cache, drafter context) of the entry serving the
        longest prefix of ``prompt`` (``with_drafter``: one holding a block drafter's context), if
        longer than ``longer_than``; None when none does or it fails to load."""
        with self._lock:
            best, best_size = None, longer_than
            for entry in self._entries.values():
                usable = reusable(
                    entry.tokens,
                    entry.size,
                    entry.has_head,
                    entry.trimmable,
                    prompt,
                    with_head,
                    has_drafter=entry.has_drafter,
                    with_drafter=with_drafter,
                )
                if usable > best_size:
                    best, best_size = entry, usable
            if best is None:
                return None
            best.last_use = time.time()
        return self._load(best)

    def _load(self, entry: _DiskEntry) -> tuple[np.ndarray, int, list, list | None, list | None] | None:
        path = self.directory / entry.name
        started = time.perf_counter()
        try:
            verify(path)  # every byte as written: the tensors and the key, tokens and size indexed
            caches, meta = load_caches(path)
            layers = entry.trunk_layers + entry.head_layers + entry.drafter_layers
            if meta.get("mtplx_key") != self.key or len(caches) < layers:
                raise ValueError("its metadata changed since it was indexed")
            if as_tokens(json.loads(meta["mtplx_tokens"])).tolist() != entry.tokens.tolist():
                raise ValueError("its tokens changed since it was indexed")
            mx.eval([a for _, a in tree_flatten([c.state for c in caches]) if isinstance(a, mx.array)])
            os.utime(path)
        except Exception as err:  # any failure to read a file is a damaged file: remove it, serve on
            with self._lock:
                self._entries.pop(entry.name, None)
            self._remove_damaged(path, err)
            return None
        self.stats.hits += 1
        self.stats.bytes_loaded += entry.nbytes
        self.stats.load_seconds += time.perf_counter() - started
        trunk_cache = caches[: entry.trunk_layers]
        head_end = entry.trunk_layers + entry.head_layers
        head_cache = caches[entry.trunk_layers : head_end] if entry.has_head else None
        drafter_cache = caches[head_end:layers] if entry.has_drafter else None
        return entry.tokens, entry.size, trunk_cache, head_cache, drafter_cache

    # ------------------------------------------------------------------ writing
    def write(self, entry) -> None:
        """Queue ``entry`` (a prompt-cache entry: tokens, size, caches) for the writer thread. Its
        states are queued for evaluation here (no wait); the caches are never written to after."""
        if self._closed:
            self.stats.dropped_writes += 1
            return
        head = list(entry.head_cache) if entry.head_cache is not None else None
        drafter = list(entry.drafter_cache) if entry.drafter_cache is not None else None
        caches = list(entry.trunk_cache) + (head or []) + (drafter or [])
        if not all(_rebuildable(type(c)) for c in caches):  # a class no file can rebuild
            self.stats.dropped_writes += 1
            return
        states = [c.state for c in caches] + overlap_windows(caches)[1]
        mx.async_eval([a for _, a in tree_flatten(states) if isinstance(a, mx.array)])
        job = _Write(entry.tokens, entry.size, list(entry.trunk_cache), head, entry.trimmable, drafter)
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self.stats.dropped_writes += 1
            return
        if self._writer is None:
            self._writer = threading.Thread(
                target=self._write_loop, name="mtplx-prompt-cache-writer", daemon=True
            )
            self._writer.start()

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every queued write is on disk (tests, benchmarks, shutdown); False on timeout."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._queue.unfinished_tasks

    def close(self, timeout: float = 30.0) -> None:
        """Shutdown: take no more writes, wait up to ``timeout`` s for the queued ones, and log how
        many entries were written and dropped since start (the unfinished ones count as dropped)."""
        self._closed = True
        started = time.monotonic()
        unfinished = 0 if self.flush(timeout) else self._queue.unfinished_tasks
        self.stats.dropped_writes += unfinished
        log.info(
            "prompt cache: shutdown: %d entries written to %s, %d dropped%s (%.1f s)",
            self.stats.writes,
            self.directory,
            self.stats.dropped_writes,
            f" ({unfinished} still queued after {timeout:g} s)" if unfinished else "",
            time.monotonic() - started,
        )

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                self._write_now(job)
            except Exception as err:  # a full disk, a removed directory: the entry stays in RAM only
                self.stats.dropped_writes += 1
                log.warning(
                    "prompt cache: could not write an entry to %s (%s)", self.directory, first_line(err)
                )
            finally:
                self._queue.task_done()

    def _write_now(self, job: _Write) -> None:
        tokens = job.tokens.tolist()
        kinds = [job.head_cache is not None, job.drafter_cache is not None]
        digest = hashlib.sha256(json.dumps([tokens[: job.size + 1], *kinds]).encode())
        name = f"{self.key[:12]}-{digest.hexdigest()[:20]}-{job.size}.safetensors"
        temp = self.directory / f".{name}.{os.getpid()}{TEMP_SUFFIX}"
        caches = job.trunk_cache + (job.head_cache or []) + (job.drafter_cache or [])
        meta = {
            "mtplx_key": self.key,
            "mtplx_format": FORMAT_VERSION,
            "mtplx_tokens": json.dumps(tokens),
            "mtplx_size": str(job.size),
            "mtplx_head": "1" if job.head_cache is not None else "0",
            "mtplx_trimmable": "1" if job.trimmable else "0",
            "mtplx_trunk_layers": str(len(job.trunk_cache)),
            "mtplx_head_layers": str(len(job.head_cache or [])),
            "mtplx_drafter_layers": str(len(job.drafter_cache or [])),
            DIGEST_FIELD: PLACEHOLDER,
        }
        modules = [type(c).__module__ for c in caches]
        if any(m != LM_CACHE_MODULE for m in modules):
            meta[CACHE_MODULES_FIELD] = json.dumps(modules)
            meta[CACHE_META_FIELD] = json.dumps(
                [c.meta_state if m != LM_CACHE_MODULE else "" for c, m in zip(caches, modules)]
            )
        leaves, windows = overlap_windows(caches)
        if leaves:
            meta[OVERLAP_FIELD] = json.dumps(leaves)
        try:
            save_prompt_cache(str(temp), caches + [_HeldState(w) for w in windows], meta)
            if temp.stat().st_size > self.max_bytes:
                self._over_budget(temp.stat().st_size)
                return
            meta[DIGEST_FIELD] = stamp(temp)
            os.replace(temp, self.directory / name)
        finally:
            temp.unlink(missing_ok=True)
        entry = _entry_from(self.directory / name, meta)
        with self._lock:
            for old in list(self._entries.values()):
                if old.name != name and covers(
                    entry.tokens, entry.size, entry.has_head, entry.trimmable, old, entry.has_drafter
                ):
                    self._delete(old)
            self._entries[name] = entry
            self._evict()
        self.stats.writes += 1

    def _over_budget(self, nbytes: int) -> None:
        """An entry larger than the whole budget is not kept: counted, and said once."""
        self.stats.dropped_writes += 1
        if not self._warned_budget:
            self._warned_budget = True
            log.warning(
                "prompt cache: an entry of %d bytes is larger than the disk budget of %d bytes: "
                "such entries are not written (raise the disk budget)",
                nbytes,
                self.max_bytes,
            )


def _entry_from(path: Path, meta: dict[str, str]) -> _DiskEntry:
    """An index entry from a file's metadata (KeyError / ValueError when it lacks a field)."""
    if meta["mtplx_format"] != FORMAT_VERSION:
        raise ValueError(f"format {meta['mtplx_format']}, expected {FORMAT_VERSION}")
    if len(meta[DIGEST_FIELD]) != len(PLACEHOLDER) or meta[DIGEST_FIELD] == PLACEHOLDER:
        raise ValueError("it has no digest")
    stat = path.stat()
    return _DiskEntry(
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
