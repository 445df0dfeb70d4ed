"""The traffic log of `mtplx serve --learn DIR`: what each finished request asked and what the trunk wrote.

One record per finished request, one file per record under ``DIR/traffic/``: its name is the
time it was written (nanoseconds, so names sort oldest first), its body one JSON object with the
prompt's token ids, each choice's completion ids (``n`` > 1: one entry per choice), how the
output was constrained (a grammar's field: ``response_format``, ``tools``, ...; tools offered),
and the fingerprints of the trunk (`mtplx.model_files.fingerprint`) and of the tokenizer, so a
log is never used for another model. Token ids only: no text, no hidden states.

Written temp-then-rename with permissions 0600 (the directory 0700): a SIGKILL mid-write
leaves a hidden temp file (removed at the next open), never half a record. A byte budget holds
the whole log: after each write the oldest records are removed until it fits. A file that is
not a record, or a record of another trunk or tokenizer, is skipped with one log line.
Imports the standard library only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtplx.errors import MtplxError
from mtplx.io import atomic_path

FORMAT = "mtplx-traffic/1"
TRAFFIC = "traffic"
DEFAULT_LOG_BYTES = 256 * 1024 * 1024

log = logging.getLogger("mtplx.learn")


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 (hex, first 16) over the tokenizer's sorted (token, id) pairs; "" without a vocabulary."""
    vocab = getattr(tokenizer, "get_vocab", None)
    if tokenizer is None or vocab is None:
        return ""
    digest = hashlib.sha256()
    for token, idx in sorted(vocab().items(), key=lambda kv: kv[1]):
        digest.update(f"{idx}\x00{token}\x01".encode("utf-8", "surrogatepass"))
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class Choice:
    """One choice's completion: its token ids (the EOS or stop token that ended it included, as forge
    records it) and why it ended."""

    tokens: tuple[int, ...]
    finish: str | None = None


@dataclass(frozen=True)
class Record:
    """One finished request as the log holds it."""

    prompt: tuple[int, ...]
    choices: tuple[Choice, ...]
    trunk: str
    tokenizer: str = ""
    grammar: str | None = None  # the constrained field (response_format, tools, ...), None: free text
    tools: bool = False  # tools were offered (the completion may hold tool calls)
    time: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "trunk": self.trunk,
            "tokenizer": self.tokenizer,
            "time": self.time,
            "grammar": self.grammar,
            "tools": self.tools,
            "prompt": list(self.prompt),
            "choices": [{"tokens": list(c.tokens), "finish": c.finish} for c in self.choices],
        }

    @classmethod
    def from_json(cls, obj: Any) -> Record:
        """The record ``obj`` holds; ValueError naming what is wrong."""
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise ValueError(f"not a traffic record (format is not {FORMAT!r})")
        try:
            choices = tuple(
                Choice(tuple(int(t) for t in c["tokens"]), c.get("finish")) for c in obj["choices"]
            )
            return cls(
                tuple(int(t) for t in obj["prompt"]),
                choices,
                str(obj["trunk"]),
                str(obj.get("tokenizer", "")),
                obj.get("grammar"),
                bool(obj.get("tools", False)),
                float(obj["time"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a traffic record ({type(e).__name__}: {e})") from None


class TrafficLog:
    """The bounded, append-only log under ``root/traffic`` (module docstring)."""

    def __init__(self, root: str | Path, max_bytes: int = DEFAULT_LOG_BYTES):
        if max_bytes <= 0:
            raise MtplxError(f"--learn-max-bytes: must be > 0, got {max_bytes}")
        self.root = Path(root)
        self.dir = self.root / TRAFFIC
        self.max_bytes = max_bytes
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            os.chmod(self.root, 0o700)
            os.chmod(self.dir, 0o700)
        except OSError as e:
            raise MtplxError(f"--learn: {self.root}: cannot use it ({e.strerror or e})") from None
        for stale in self.dir.glob(".rec-*"):  # temp files of writes a kill interrupted
            stale.unlink(missing_ok=True)
        self._reported: set[str] = set()  # files already skipped with a log line
        self._last_name = ""
        # The record files, oldest first, with their sizes: kept in memory so that a write and its
        # eviction never scan the directory (a full log holds ~10^5 files).
        self._kept: deque[tuple[Path, int]] = deque()
        for path in self.files():
            try:
                self._kept.append((path, path.stat().st_size))
            except FileNotFoundError:
                continue
        self.bytes = sum(size for _, size in self._kept)
        self.written = 0  # records written by this process

    @property
    def records(self) -> int:
        """How many record files the log holds (those there at open, written since, less the evicted)."""
        return len(self._kept)

    def files(self) -> list[Path]:
        """The record files, oldest first."""
        return sorted(self.dir.glob("rec-*.json"))

    def append(self, record: Record) -> Path:
        """Write ``record`` whole (temp, rename, 0600), then evict the oldest records past the budget."""
        name = f"rec-{time.time_ns():020d}.json"
        if name <= self._last_name:  # a coarse clock: keep names increasing
            name = f"rec-{int(self._last_name[4:24]) + 1:020d}.json"
        self._last_name = name
        path = self.dir / name
        data = json.dumps(record.to_json(), separators=(",", ":")).encode()
        with atomic_path(path, permissions=0o600) as tmp:
            _write_bytes(tmp, data)
        self._kept.append((path, len(data)))
        self.bytes += len(data)
        self.written += 1
        self._evict()
        return path

    def _evict(self) -> None:
        while self.bytes > self.max_bytes and self._kept:
            old, size = self._kept.popleft()
            old.unlink(missing_ok=True)
            self.bytes -= size

    def read(self, trunk: str, tokenizer: str = "", newest: int | None = None) -> list[Record]:
        """The records of this trunk and tokenizer, oldest first (the ``newest`` last ones only when
        given); any other file is skipped with one log line (once per file)."""
        paths = self.files()
        if newest is not None:
            paths = paths[-newest:]
        records = []
        for path in paths:
            try:
                record = Record.from_json(_json(path.read_bytes()))
            except FileNotFoundError:
                continue  # evicted meanwhile
            except (OSError, ValueError) as e:
                self._skip(path, str(e).splitlines()[0] if str(e) else type(e).__name__)
                continue
            if record.trunk != trunk:
                self._skip(path, f"recorded for trunk {record.trunk}, not this one ({trunk})")
            elif tokenizer and record.tokenizer and record.tokenizer != tokenizer:
                self._skip(path, f"recorded with tokenizer {record.tokenizer}, not this one ({tokenizer})")
            else:
                records.append(record)
        return records

    def foreign_trunks(self) -> set[str]:
        """Trunk fingerprints of the readable records (to say whose log it is when none is ours)."""
        found = set()
        for path in self.files():
            try:
                found.add(str(json.loads(path.read_bytes())["trunk"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return found

    def _skip(self, path: Path, why: str) -> None:
        if path.name not in self._reported:
            self._reported.add(path.name)
            log.warning("%s: skipped (%s)", path, why)


def _json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"not a traffic record (not JSON: {str(e).splitlines()[0]})") from None


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)


def choices_of(token_lists: Sequence[Sequence[int]], finishes: Sequence[str | None]) -> tuple[Choice, ...]:
    return tuple(Choice(tuple(int(t) for t in toks), f) for toks, f in zip(token_lists, finishes))
