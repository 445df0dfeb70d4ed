"""Saved `mtplx tune` results: the fastest depth per model fingerprint and machine, and the cost
profile of a batched cycle that the batched loop's draft policy reads.

`Engine.load` reads this store (`saved_depth`) on every load without a depth;
`mtplx tune` (`mtplx.bench.tune`, which runs the benchmark) writes it. Kept apart from
both so loading a model never imports the benchmark. The file is JSON at
$XDG_CONFIG_HOME/mtplx/tune.json (default ~/.config/mtplx/tune.json).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from mtplx.errors import MtplxError
from mtplx.io import atomic_write
from mtplx.spec_decode.draft_policy import CostProfile
from mtplx.spec_decode.settings import MAX_DEPTH

__all__ = [
    "config_file",
    "machine_info",
    "machine_key",
    "entry_key",
    "read_config",
    "saved_entry",
    "saved_depth",
    "saved_threshold",
    "saved_batch_cost",
    "save_entry",
]

SCHEMA = 1
_warned_corrupt: set[str] = set()


def config_file(config_path: str | Path | None = None) -> Path:
    if config_path is not None:
        return Path(config_path).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "mtplx" / "tune.json"


def machine_key(info: dict[str, Any] | None = None) -> str:
    """The parts of `machine_info` that change which depth is fastest."""
    info = info or machine_info()
    return f"{info['system']} {info['arch']} | {info['cpu']} | {info['cores']} cores | {info['device']}"


def entry_key(fingerprint: str, machine: str) -> str:
    return f"{fingerprint} @ {machine}"


def read_config(config_path: str | Path | None = None) -> dict[str, Any]:
    """The saved entries ({} when there is no file); one-line error when the file is damaged."""
    path = config_file(config_path)
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MtplxError(
            f"{path}: unreadable tune config ({type(e).__name__}); delete it or run `mtplx tune --retune`"
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
        raise MtplxError(
            f"{path}: not an mtplx tune config (no 'entries'); delete it or run `mtplx tune --retune`"
        )
    return data["entries"]


def saved_entry(
    fingerprint: str, config_path: str | Path | None = None, machine: str | None = None
) -> dict | None:
    entry = read_config(config_path).get(entry_key(fingerprint, machine or machine_key()))
    return entry if isinstance(entry, dict) else None


def saved_depth(fingerprint: str, config_path: str | Path | None = None) -> int | None:
    """The tuned depth for this model on this machine: None = never tuned, 0 = AR is fastest.

    Called on every `Engine.load` without a depth, so a damaged config must not stop
    generation: it warns once on stderr and counts as "not tuned".
    """
    try:
        entry = saved_entry(fingerprint, config_path)
    except MtplxError as e:
        if str(e) not in _warned_corrupt:
            _warned_corrupt.add(str(e))
            print(f"mtplx: warning: {e}", file=sys.stderr)
        return None
    if entry is None:
        return None
    depth = entry.get("depth")
    return depth if isinstance(depth, int) and 0 <= depth <= MAX_DEPTH else None


def _saved_field(fingerprint: str, name: str, config_path: str | Path | None) -> Any:
    """One field of this model's entry here; None when untuned or the config is damaged
    (saved_depth, read on every load, already warned about that)."""
    try:
        entry = saved_entry(fingerprint, config_path)
    except MtplxError:
        return None
    return entry.get(name) if entry is not None else None


def saved_threshold(fingerprint: str, config_path: str | Path | None = None) -> float | None:
    """The adaptive-length threshold tuned with the depth (None = not measured here)."""
    value = _saved_field(fingerprint, "adaptive_threshold", config_path)
    return float(value) if isinstance(value, (int, float)) and 0.0 < value < 1.0 else None


def saved_batch_cost(fingerprint: str, config_path: str | Path | None = None) -> CostProfile | None:
    """The batched cycle's cost profile `mtplx tune` measured here (None = not measured)."""
    value = _saved_field(fingerprint, "batch_cost", config_path)
    return CostProfile.from_dict(value) if isinstance(value, dict) else None


def save_entry(
    fingerprint: str, entry: dict[str, Any], config_path: str | Path | None = None, machine: str | None = None
) -> Path:
    """Add or replace one entry, keeping the others; a damaged file is replaced (a retune's job)."""
    path = config_file(config_path)
    try:
        entries = read_config(path)
    except MtplxError:
        entries = {}
    entries[entry_key(fingerprint, machine or machine_key())] = entry
    text = json.dumps({"schema": SCHEMA, "entries": entries}, indent=1, sort_keys=True)
    with atomic_write(path) as handle:
        handle.write(text + "\n")
    return path


def machine_info() -> dict[str, Any]:
    """What the numbers depend on: OS, CPU, cores, MLX device and BLAS."""
    from mtplx.blas import load_optimized_blas

    import mlx.core as mx

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    if sys.platform == "darwin":
        with contextlib.suppress(Exception):
            cpu = (
                subprocess.run(
                    ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=5
                ).stdout.strip()
                or cpu
            )
    blas = load_optimized_blas()  # idempotent: the status `import mtplx` recorded
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 0
    return {
        "system": platform.system(),
        "arch": platform.machine(),
        "cpu": cpu,
        "cores": cores,
        "device": str(mx.default_device()),
        "blas": os.path.basename(str(getattr(blas, "path", "") or "")) or "default",
        "python": platform.python_version(),
    }
