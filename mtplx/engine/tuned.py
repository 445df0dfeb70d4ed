"""Saved `mtplx tune` results: the fastest depth per model fingerprint and machine, and the cost
profile of a batched cycle that the batched loop's draft policy reads.

`Engine.load` reads this store (`saved_depth`) on every load without a depth;
`mtplx tune` (`mtplx.bench.tune`, which runs the benchmark) writes it. Kept apart from
both so loading a model never imports the benchmark. The file is JSON at
$XDG_CONFIG_HOME/mtplx/tune.json (default ~/.config/mtplx/tune.json).

The batched cycle's cost profile (`engine_batch_cost`) is measured once and kept in the same
entry (``batch_cost``), with what it was measured for (``batch_cost_for``: the model's weights,
dtype and adapters, the head, the block drafter, the KV quantization, mlx / mlx-lm / mtplx and
the BLAS): the next start on this machine reuses it, `mtplx tune` measures it again, and a
profile measured for anything else, or damaged, is measured again (one line on stderr).

Every save is a read-modify-write of the whole file under an exclusive lock (`fcntl.flock` on
``tune.json.lock`` beside it), written temp-then-rename: two processes saving at once (two servers
starting, pytest-xdist workers, a start beside `mtplx tune`) each keep the other's entry, and a
start adds its profile to the entry as it is then, not as it was before the measurement.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

from mtplx.errors import MtplxError
from mtplx.io import atomic_write
from mtplx.spec_decode.draft_policy import CostProfile
from mtplx.spec_decode.settings import MAX_DEPTH

__all__ = [
    "config_file",
    "machine_info",
    "versions",
    "machine_key",
    "entry_key",
    "read_config",
    "saved_entry",
    "saved_depth",
    "saved_threshold",
    "saved_batch_cost",
    "batch_cost_identity",
    "engine_batch_cost",
    "save_entry",
    "update_entry",
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


def saved_batch_cost(
    fingerprint: str, config_path: str | Path | None = None, identity: dict[str, str] | None = None
) -> CostProfile | None:
    """The batched cycle's cost profile measured here (None = not measured); with ``identity``
    (`batch_cost_identity`), only one measured for it. A damaged file or entry, or one measured
    for another identity, is None with one line on stderr."""
    where = f"mtplx: batch cost profile in {config_file(config_path)}"
    try:
        entry = saved_entry(fingerprint, config_path) or {}
    except MtplxError:
        print(f"{where}: the file is damaged; measuring again", file=sys.stderr)
        return None
    if "batch_cost" not in entry:
        return None
    profile = CostProfile.from_dict(entry["batch_cost"]) if isinstance(entry["batch_cost"], dict) else None
    saved_for = entry.get("batch_cost_for")
    if profile is None:
        print(f"{where}: damaged; measuring again", file=sys.stderr)
    elif identity is not None and saved_for != identity:
        saved_for = saved_for if isinstance(saved_for, dict) else {}
        changed = ", ".join(sorted(k for k in identity if saved_for.get(k) != identity[k])) or "identity"
        print(f"{where}: measured for another {changed}; measuring again", file=sys.stderr)
        return None
    return profile


def batch_cost_identity(engine) -> dict[str, str]:
    """What a batched cycle's cost depends on beyond the model's fingerprint and the machine (the
    entry's key): `Engine.cache_identity` (dtype, adapters, head, block drafter, KV quantization,
    mlx-lm), and the versions and BLAS that run it."""
    identity = engine.cache_identity()
    installed = versions()
    return {**identity, "blas": machine_info()["blas"], "mlx": installed["mlx"], "mtplx": installed["mtplx"]}


def engine_batch_cost(
    engine, remeasure: bool = False, should_stop: Callable[[], bool] | None = None
) -> CostProfile:
    """``engine``'s batched cycle cost: the one saved for it here, else measured (seconds) and
    saved; ``remeasure`` (`mtplx tune`) measures it anyway. A store that cannot be written costs
    a line on stderr, not the measurement. ``should_stop`` (a server stopping) ends the
    measurement between two forwards: `MeasurementStopped`, and nothing is saved."""
    from mtplx.spec_decode.draft_policy import measure_cost_profile

    identity = batch_cost_identity(engine)
    saved = None if remeasure else saved_batch_cost(engine.fingerprint, identity=identity)
    if saved is not None:
        print(f"mtplx: batch cost profile: the one measured here before ({config_file()})", file=sys.stderr)
        return saved
    print("mtplx: batch cost profile: measuring (once for this model here)", file=sys.stderr)
    profile = measure_cost_profile(
        engine.trunk, engine.head, blocks=engine.block_drafter, should_stop=should_stop
    )
    try:  # into the entry as it is now: another process may have saved it while this one measured
        path = update_entry(engine.fingerprint, {"batch_cost": profile.as_dict(), "batch_cost_for": identity})
    except OSError as e:
        print(f"mtplx: batch cost profile: measured, not saved ({type(e).__name__}: {e})", file=sys.stderr)
    else:
        print(f"mtplx: batch cost profile: measured, saved to {path}", file=sys.stderr)
    return profile


def save_entry(
    fingerprint: str, entry: dict[str, Any], config_path: str | Path | None = None, machine: str | None = None
) -> Path:
    """Add or replace one entry, keeping the others; a damaged file is replaced (a retune's job)."""
    key = entry_key(fingerprint, machine or machine_key())
    return _update_store(config_file(config_path), lambda entries: entries.__setitem__(key, entry))


def update_entry(
    fingerprint: str,
    fields: dict[str, Any],
    config_path: str | Path | None = None,
    machine: str | None = None,
) -> Path:
    """Set ``fields`` in one entry as the file holds it now (a new entry when there is none), keeping
    its other fields and the other entries."""
    key = entry_key(fingerprint, machine or machine_key())

    def change(entries: dict[str, Any]) -> None:
        entry = entries.get(key)
        entries[key] = {**(entry if isinstance(entry, dict) else {}), **fields}

    return _update_store(config_file(config_path), change)


def _update_store(path: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    """``change`` applied to the saved entries, read and written back under the store's lock (module
    docstring); a damaged file counts as empty and is replaced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.with_name(path.name + ".lock")):
        try:
            entries = read_config(path)
        except MtplxError:
            entries = {}
        change(entries)
        text = json.dumps({"schema": SCHEMA, "entries": entries}, indent=1, sort_keys=True)
        with atomic_write(path) as handle:
            handle.write(text + "\n")
    return path


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """An exclusive `fcntl.flock` on ``lock_path`` (made if missing, never removed: a removed lock
    file would let a third process lock another file), held for the block; released on close."""
    import fcntl

    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


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


def versions() -> dict[str, str]:
    """The installed mlx, mlx-lm and mtplx versions ("unknown" where one is not installed)."""
    out = {}
    for name in ("mlx", "mlx-lm", "mtplx"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "unknown"
    return out
