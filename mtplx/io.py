"""Atomic file writes: the one way mtplx writes a file that someone may read concurrently or later.

A write goes to a hidden temp file beside the target and is renamed onto it
only on success, so an error or Ctrl-C mid-write leaves the old file or
nothing, never half a file. (Directories, as in `mtplx.checkpoints.convert_gguf`, are swapped
with their own rename dance.) Imports the standard library only.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_path", "atomic_write"]


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


@contextlib.contextmanager
def atomic_path(path: str | Path, permissions: int = 0o666) -> Iterator[Path]:
    """Yield a temp path beside ``path`` (same suffix, for writers such as
    ``mx.save_safetensors`` that insist on one); rename it onto ``path`` on success.

    ``permissions`` (less the umask) replace mkstemp's 0600: 0o777 for a program."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix or ".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, permissions & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_write(path: str | Path, mode: str = "w") -> Iterator[IO[Any]]:
    """Open a temp file beside ``path`` for writing (``"w"`` UTF-8 text or ``"wb"``); rename on success."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write mode must be 'w' or 'wb', got {mode!r}")
    with atomic_path(path) as tmp:
        with open(tmp, mode, **({"encoding": "utf-8"} if mode == "w" else {})) as handle:
            yield handle
