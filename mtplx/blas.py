"""Load an optimized CBLAS before MLX on Linux.

MLX's Linux CPU wheel links the reference netlib BLAS (about 6 GFLOP/s for a
1024x1024 float32 matmul on a 2-core x86 machine). MLX resolves only
``cblas_sgemm``/``cblas_dgemm``/``cblas_cgemm`` dynamically, so a CBLAS loaded
with ``RTLD_GLOBAL`` before ``mlx.core`` is first imported takes precedence
(about 330 GFLOP/s with Debian's OpenBLAS). This must run before anything
imports ``mlx``: ``mtplx/__init__.py`` calls it first thing.

Exit: OpenBLAS's pthread build shuts its worker pool down in a library destructor
(``gotoblas_quit -> blas_thread_shutdown_``): it marks each worker's queue "exit" (-1) and
joins it. A worker that is running a job at that moment stores "idle" (0) over that mark when the
job ends (``blas_server.c``, 0.3.21 and later alike), then sleeps on its condition variable, and
the join never returns: the process hangs after its work, at 0% CPU. MLX's stream thread runs BLAS
jobs asynchronously, so work still in flight when the interpreter exits (an ``mx.async_eval``
nobody waited for) triggers it. `quiesce_at_exit` (an ``atexit`` handler, so every process that
imports mtplx has it) stops the pool while the interpreter is healthy: one thread from then on (no
job goes to a worker), MLX's queued work finished, then the pool shut down with every worker idle;
the destructor then has nothing to join.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import glob
import os
import platform
import sys
import warnings
from dataclasses import dataclass

BLAS_ENV_VAR = "MTPLX_BLAS"

_CANDIDATE_GLOBS = (
    "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/*-linux-gnu/openblas-openmp/libopenblas.so.0",
    "/usr/lib/*-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas*.so.0",
    "/usr/lib/libopenblas.so.0",
    "/usr/local/lib/libopenblas.so.0",
    "/usr/lib/*-linux-gnu/blis-pthread/libblis.so.4",
)


@dataclass(frozen=True)
class BlasStatus:
    path: str | None  # the optimized library loaded, or None
    reason: str  # one line: what happened


_status: BlasStatus | None = None


def candidate_paths() -> list[str]:
    """Libraries to try, in order: the override, then the usual distro paths."""
    paths = []
    override = os.environ.get(BLAS_ENV_VAR)
    if override:
        paths.append(override)
    for pattern in _CANDIDATE_GLOBS:
        paths.extend(sorted(glob.glob(pattern)))
    found = ctypes.util.find_library("openblas")
    if found:
        paths.append(found)
    return paths


def _exports_sgemm(lib: ctypes.CDLL) -> bool:
    return hasattr(lib, "cblas_sgemm")


def load_optimized_blas() -> BlasStatus:
    """Load an optimized CBLAS globally (Linux only); idempotent; warns once if none."""
    global _status
    if _status is not None:
        return _status
    if platform.system() != "Linux":
        _status = BlasStatus(None, "not Linux: MLX uses the platform's BLAS")
        return _status
    if "mlx.core" in sys.modules:
        _status = BlasStatus(None, "mlx.core was imported before mtplx; import mtplx first for fast BLAS")
        warnings.warn(f"mtplx: {_status.reason}", RuntimeWarning, stacklevel=3)
        return _status
    for path in candidate_paths():
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        if _exports_sgemm(lib):
            _status = BlasStatus(path, f"loaded {path}")
            atexit.register(quiesce_at_exit, lib)
            return _status
    _status = BlasStatus(
        None,
        "no optimized CBLAS found, MLX runs on reference BLAS (slow); install one "
        f"('apt-get install libopenblas0-pthread') or set {BLAS_ENV_VAR}=/path/to/libopenblas.so",
    )
    warnings.warn(f"mtplx: {_status.reason}", RuntimeWarning, stacklevel=3)
    return _status


def quiesce_at_exit(lib: ctypes.CDLL) -> None:
    """Stop an OpenBLAS worker pool with no job running (the module docstring); a no-op for a
    library without one (BLIS, an OpenMP build's pool is not joined at exit)."""
    set_threads = getattr(lib, "openblas_set_num_threads", None)
    shutdown = getattr(lib, "blas_thread_shutdown_", None)
    if set_threads is None or shutdown is None:
        return
    set_threads(1)  # from here on every BLAS call runs in its caller's thread: no new worker job
    mlx = sys.modules.get("mlx.core")
    if mlx is not None:
        try:
            mlx.synchronize()  # the work MLX queued (its BLAS calls with it) ends
        except Exception:  # noqa: BLE001 - exiting anyway: never turn an exit into a traceback
            pass
    shutdown()


def resolved_sgemm_library() -> str | None:
    """The file that the process-wide ``cblas_sgemm`` symbol resolves to (Linux, via dladdr)."""

    class DlInfo(ctypes.Structure):
        _fields_ = [
            ("dli_fname", ctypes.c_char_p),
            ("dli_fbase", ctypes.c_void_p),
            ("dli_sname", ctypes.c_char_p),
            ("dli_saddr", ctypes.c_void_p),
        ]

    libdl = ctypes.CDLL(None)
    try:
        address = ctypes.cast(libdl.cblas_sgemm, ctypes.c_void_p).value
    except AttributeError:
        return None
    info = DlInfo()
    if not libdl.dladdr(ctypes.c_void_p(address), ctypes.byref(info)):
        return None
    return os.path.realpath(info.dli_fname.decode())
