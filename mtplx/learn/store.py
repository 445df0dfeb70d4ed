"""The heads `mtplx serve --learn DIR` accepted, under ``DIR/heads``, so a restart resumes with the last one.

Each accepted head is a forged-head sidecar (`mtplx.heads.forged`) in ``DIR/heads/vNNNN``,
written into a hidden temp directory and renamed into place; then ``DIR/heads/current.json``
(written whole) names it, with its measured acceptance and the history of every accepted head.
A kill at any point leaves the last good head: a half-written version is a temp directory (removed
at the next start), and ``current.json`` only ever names a complete one (it is rewritten after the
rename). Only the newest ``keep`` versions stay on disk.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from mtplx.errors import MtplxError
from mtplx.heads.forged import ForgedMTPHead, load_forged_head, save_forged_head
from mtplx.io import atomic_write

HEADS = "heads"
CURRENT = "current.json"

log = logging.getLogger("mtplx.learn")


class HeadStore:
    """Accepted heads under ``root/heads`` (module docstring)."""

    def __init__(self, root: str | Path, keep: int = 3):
        self.dir = Path(root) / HEADS
        self.keep = keep
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        for stale in self.dir.glob(".v*"):  # a save a kill interrupted
            shutil.rmtree(stale, ignore_errors=True)

    def state(self) -> dict[str, Any]:
        """``current.json``: {"version", "dir", "acceptance", "history": [...]}; {} when none (or unreadable)."""
        path = self.dir / CURRENT
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.warning("%s: unreadable, starting from the served head (%s)", path, e)
            return {}
        return state if isinstance(state, dict) and "version" in state else {}

    @property
    def version(self) -> int:
        return int(self.state().get("version", 0))

    def save(self, head: ForgedMTPHead, manifest: dict[str, Any], acceptance: dict[str, Any]) -> int:
        """Write ``head`` as the next version and make it current; returns the version."""
        state = self.state()
        version = int(state.get("version", 0)) + 1
        name = f"v{version:04d}"
        tmp = self.dir / f".{name}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        save_forged_head(tmp, head, manifest)
        final = self.dir / name
        if final.exists():  # a version left by a run whose current.json never named it
            shutil.rmtree(final)
        os.replace(tmp, final)
        entry = {"version": version, "dir": name, "time": time.time(), "acceptance": acceptance}
        history = [*state.get("history", []), entry]
        with atomic_write(self.dir / CURRENT) as handle:
            handle.write(json.dumps({**entry, "history": history}, indent=1) + "\n")
        older = sorted(p for p in self.dir.glob("v[0-9]*") if p.name != name)
        for old in older[: max(len(older) - (self.keep - 1), 0)]:
            shutil.rmtree(old, ignore_errors=True)
        return version

    def load_current(self, trunk: Any, fingerprint: str) -> tuple[ForgedMTPHead, dict] | None:
        """(the current head, its state) or None when there is none; a damaged one is refused with one
        log line (the served head stays)."""
        state = self.state()
        if not state:
            return None
        try:
            return load_forged_head(self.dir / str(state["dir"]), trunk, fingerprint), state
        except MtplxError as e:
            log.warning("learned head v%s not used: %s", state.get("version"), e)
            return None
