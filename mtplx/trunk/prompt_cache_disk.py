"""The prompt cache's disk tier: entries that outlive the process (`mtplx serve --prompt-cache-dir`).
Its policy: which files this configuration reads, the index, eviction, the writer thread, the
directory's lock. An entry's file, how it is written, indexed and read back, is
`mtplx.trunk.prompt_cache_format`'s (mlx-lm's prompt-cache format; a block drafter's context after
the head's caches; mlx-vlm's cache classes and DeepSeek-V4's overlap windows).

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

The index reads each file's safetensors header alone (`mtplx.model_files.headers`, which also
notices a file shorter than its header says), never its tensors.
"""

from __future__ import annotations

import fcntl
import hashlib
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
from mtplx.trunk.compat import QuantizedKVCache, cache_leaves, prompt_cache_file_metadata
from mtplx.trunk.prompt_cache import covers, reusable
from mtplx.trunk.prompt_cache_file import DIGEST_FIELD, stamp
from mtplx.trunk.prompt_cache_format import (
    FORMAT_VERSION,
    DiskEntry,
    entry_from,
    entry_metadata,
    read_entry,
    rebuildable,
    save_entry,
)
from mtplx.trunk.vlm_deepseek_v4 import overlap_windows

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

__all__ = ["DEFAULT_DISK_BYTES", "FORMAT_VERSION", "DiskStats", "DiskTier", "cache_identity"]

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
class _Write:
    tokens: np.ndarray
    size: int
    trunk_cache: list
    head_cache: list | None
    trimmable: bool
    drafter_cache: list | None

    @property
    def caches(self) -> list:
        """Trunk, head and drafter caches in the order a file holds them."""
        return self.trunk_cache + (self.head_cache or []) + (self.drafter_cache or [])


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
        self._entries: dict[str, DiskEntry] = {}
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
                entry = entry_from(path, meta)
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

    def _delete(self, entry: DiskEntry) -> None:
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

    def _load(self, entry: DiskEntry) -> tuple[np.ndarray, int, list, list | None, list | None] | None:
        path = self.directory / entry.name
        started = time.perf_counter()
        try:
            caches = read_entry(path, entry, self.key)
            os.utime(path)
        except Exception as err:  # any failure to read a file is a damaged file: remove it, serve on
            with self._lock:
                self._entries.pop(entry.name, None)
            self._remove_damaged(path, err)
            return None
        self.stats.hits += 1
        self.stats.bytes_loaded += entry.nbytes
        self.stats.load_seconds += time.perf_counter() - started
        return entry.tokens, entry.size, *entry.parts(caches)

    # ------------------------------------------------------------------ writing
    def write(self, entry) -> None:
        """Queue ``entry`` (a prompt-cache entry: tokens, size, caches) for the writer thread. Its
        states are queued for evaluation here (no wait); the caches are never written to after."""
        if self._closed:
            self.stats.dropped_writes += 1
            return
        head = list(entry.head_cache) if entry.head_cache is not None else None
        drafter = list(entry.drafter_cache) if entry.drafter_cache is not None else None
        job = _Write(entry.tokens, entry.size, list(entry.trunk_cache), head, entry.trimmable, drafter)
        caches = job.caches
        if not all(rebuildable(type(c)) for c in caches):  # a class no file can rebuild
            self.stats.dropped_writes += 1
            return
        states = [c.state for c in caches] + overlap_windows(caches)[1]
        mx.async_eval([a for _, a in tree_flatten(states) if isinstance(a, mx.array)])
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
        meta = entry_metadata(
            self.key, tokens, job.size, job.trimmable, job.trunk_cache, job.head_cache, job.drafter_cache
        )
        try:
            save_entry(temp, job.caches, meta)
            if temp.stat().st_size > self.max_bytes:
                self._over_budget(temp.stat().st_size)
                return
            meta[DIGEST_FIELD] = stamp(temp)
            os.replace(temp, self.directory / name)
        finally:
            temp.unlink(missing_ok=True)
        entry = entry_from(self.directory / name, meta)
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
