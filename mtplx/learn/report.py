"""What `mtplx inspect --learn DIR` reports of a `serve --learn DIR` directory, from its files alone
(no MLX): the learned head in use and its acceptance over time (``heads/current.json``,
`mtplx.learn.store`), the traffic log's size, and the trainer's share of the server's time as the
server last wrote it (``learn-state.json``, after each round)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from mtplx.errors import MtplxError
from mtplx.io import atomic_write

STATE = "learn-state.json"


def write_state(root: str | Path, snapshot: dict[str, Any]) -> None:
    """The server's `Learner.snapshot`, written whole, with the time it was taken."""
    with atomic_write(Path(root) / STATE) as handle:
        handle.write(json.dumps({**snapshot, "time": time.time()}, indent=1) + "\n")


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        return {"unreadable": f"{path}: {e}"}
    return value if isinstance(value, dict) else {"unreadable": f"{path}: not a JSON object"}


def learn_report(root: str | Path) -> dict[str, Any]:
    """{"dir", "head_version", "acceptance", "history", "records", "log_bytes", "trainer"} of ``root``."""
    root = Path(root)
    if not (root / "traffic").is_dir():
        raise MtplxError(f"--learn: {root}: not a `serve --learn` directory (no traffic/ in it)")
    current = _json(root / "heads" / "current.json")
    files = list((root / "traffic").glob("rec-*.json"))
    return {
        "dir": str(root),
        "head_version": current.get("version", 0),
        "acceptance": current.get("acceptance"),
        "history": [
            {
                "version": h.get("version"),
                "time": h.get("time"),
                "first_draft": h.get("acceptance", {}).get("first_draft"),
            }
            for h in current.get("history", [])
        ],
        "records": len(files),
        "log_bytes": sum(p.stat().st_size for p in files),
        "trainer": _json(root / STATE),
    }


def format_learn_report(report: dict[str, Any]) -> str:
    lines = [f"learning from traffic ({report['dir']}):"]
    version = report["head_version"]
    if version:
        acc = report["acceptance"] or {}
        lines.append(
            f"  head: learned v{version}, first-draft acceptance {acc.get('first_draft', float('nan')):.3f} "
            f"on held-out traffic (the head before it: {acc.get('before', float('nan')):.3f})"
        )
        for h in report["history"]:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(h["time"])) if h.get("time") else "?"
            lines.append(f"    v{h['version']} {when}: {h['first_draft']:.3f}")
    else:
        lines.append("  head: the served one (no learned head accepted yet)")
    lines.append(f"  traffic log: {report['records']} requests, {report['log_bytes']} bytes")
    trainer = report["trainer"]
    if trainer.get("trainer_share") is not None:
        lines.append(
            f"  trainer: {100 * trainer['trainer_share']:.1f}% of the worker's time "
            f"({trainer.get('trainer_seconds', 0):.0f}s, {trainer.get('rounds', 0)} rounds, "
            f"{trainer.get('accepted', 0)} accepted, longest piece {trainer.get('max_piece_seconds', 0):.2f}s)"
        )
    return "\n".join(lines)
