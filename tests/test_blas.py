"""The optimized BLAS really is what MLX's cblas_sgemm resolves to."""

import os
import platform
import subprocess
import sys

import mtplx
from mtplx import blas

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux", reason="BLAS preloading is Linux-only")


def _reference_blas_only() -> bool:
    return not blas.candidate_paths()


def test_import_loads_an_optimized_cblas_or_says_why():
    status = mtplx.BLAS
    if _reference_blas_only():
        assert status.path is None and "no optimized CBLAS" in status.reason
        pytest.skip("no optimized CBLAS installed on this machine")
    assert status.path is not None, status.reason
    resolved = blas.resolved_sgemm_library()
    assert resolved is not None
    # The reference BLAS bundled with the mlx wheel lives in mlx_cpu.libs/libblas-*.so.
    assert "mlx_cpu.libs" not in resolved, resolved
    assert "openblas" in resolved.lower() or "blis" in resolved.lower(), resolved


def test_without_preload_sgemm_resolves_to_the_reference_blas():
    """Negative control: importing mlx first leaves MLX on its bundled reference BLAS."""
    code = (
        "import mlx.core as mx, mtplx.blas as b; mx.eval(mx.ones((2,2)) @ mx.ones((2,2)));"
        "import ctypes; print(b.resolved_sgemm_library())"
    )
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    resolved = out.stdout.strip()
    # mlx binds its own libblas; the process-wide symbol is either absent or the bundled one.
    assert resolved == "None" or "openblas" not in resolved.lower(), resolved


def test_missing_blas_warns_once_in_one_line():
    # Load blas.py on its own: importing the mtplx package would already have loaded a BLAS.
    code = (
        "import warnings, importlib.util; warnings.simplefilter('always');"
        f"spec = importlib.util.spec_from_file_location('blas_alone', {blas.__file__!r});"
        "import sys; b = importlib.util.module_from_spec(spec); sys.modules[spec.name] = b; spec.loader.exec_module(b);"
        "b._CANDIDATE_GLOBS = (); b.ctypes.util.find_library = lambda name: None;"
        "s = b.load_optimized_blas(); s2 = b.load_optimized_blas(); print(s.path, s is s2)"
    )
    env = {k: v for k, v in os.environ.items() if k != blas.BLAS_ENV_VAR}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "None True"
    warning_lines = [line for line in out.stderr.splitlines() if "no optimized CBLAS" in line]
    assert len(warning_lines) == 1, out.stderr
