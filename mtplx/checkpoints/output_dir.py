"""Where a converter may write its output directory, and the atomic swap that writes it.

`check_output_dir` runs before anything is read or written: an output that is, contains or lies
inside the input (``--overwrite`` would delete the input with it), one that contains the current
directory, a path through a regular file, an existing non-directory, an existing directory
without ``overwrite`` and a place the process cannot write are refused, each in one line.
`write_dir_atomically` then writes into a hidden sibling temp directory and renames it into
place; a failure, Ctrl-C or SIGTERM (``mtplx convert`` turns it into an interrupt) leaves
nothing behind. Imports the standard library and `mtplx.errors` only.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from mtplx.errors import MtplxError

__all__ = ["check_output_dir", "write_dir_atomically"]


def check_output_dir(out_dir: str | Path, overwrite: bool, inputs: Iterable[str | Path] = ()) -> Path:
    """Refuse an output directory that is unsafe or impossible to write (see the module
    docstring); returns it resolved (so ``.`` has a name and a parent)."""
    if str(out_dir).strip() == "":
        raise MtplxError("output directory: empty path")
    out = Path(out_dir).expanduser().resolve()
    for given in inputs:
        source = Path(given).expanduser()
        if source.exists():
            _refuse_overlap(out_dir, out, source.resolve())
    for parent in out.parents:
        if parent.exists() and not parent.is_dir():
            raise MtplxError(f"{out_dir}: {parent} is a file, not a directory")
    if out.exists():
        if not out.is_dir():
            raise MtplxError(f"{out_dir}: exists and is not a directory (not replaced)")
        if not overwrite:
            raise MtplxError(f"{out_dir}: output already exists (pass --overwrite to replace it)")
        if Path.cwd().resolve().is_relative_to(out):
            raise MtplxError(f"{out_dir}: the output contains the current directory (not replaced)")
    writable = next(p for p in (out.parent, *out.parent.parents) if p.exists())
    if not os.access(writable, os.W_OK | os.X_OK):
        raise MtplxError(f"{out_dir}: cannot write in {writable} (read-only or permission denied)")
    return out


def _refuse_overlap(out_dir: str | Path, out: Path, source: Path) -> None:
    if out == source:
        raise MtplxError(f"{out_dir}: the output is the input (choose another output directory)")
    if source.is_relative_to(out):
        raise MtplxError(
            f"{out_dir}: the output contains the input {source} (choose another output directory)"
        )
    if out.is_relative_to(source):
        raise MtplxError(
            f"{out_dir}: the output lies inside the input {source} (choose another output directory)"
        )


def write_dir_atomically(out_dir: Path, write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp)`` on a fresh sibling temp directory, then rename it to ``out_dir``
    (replacing an existing one); a failure or interruption leaves nothing behind.
    An OS error (disk full, read-only) is one line naming ``out_dir``."""
    out_dir = Path(out_dir).resolve()
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MtplxError(f"{out_dir}: cannot write the output ({e.strerror or e})") from None
    tmp: Path | None = None
    try:
        # Named before it exists, so the cleanup knows it whenever a SIGTERM lands (with mkdtemp, one
        # landing after its mkdir and before it returned left the folder behind).
        tmp = out_dir.parent / f".{out_dir.name}.tmp-{secrets.token_hex(8)}"
        try:
            os.mkdir(tmp, 0o700)
        except OSError as e:
            raise MtplxError(f"{out_dir}: cannot write the output ({e.strerror or e})") from None
        write(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; a model dir is ordinary readable data
        if out_dir.exists():  # overwrite: move the old one aside first so the swap is quick
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.rename(out_dir, old / "x")
            os.rename(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)
    except OSError as e:
        _remove(tmp)
        where = f": {e.filename}" if e.filename else ""
        raise MtplxError(f"{out_dir}: conversion failed ({e.strerror or e}{where})") from None
    except BaseException:
        _remove(tmp)
        raise
    return out_dir


def _remove(tmp: Path | None, attempts: int = 50) -> None:
    """Remove a temp folder, again while a file still being closed in it makes a pass fail."""
    for _ in range(attempts if tmp is not None else 0):
        shutil.rmtree(tmp, ignore_errors=True)
        if not tmp.exists():
            return
        time.sleep(0.1)
