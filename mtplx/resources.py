"""Where mtplx's files live, in a source checkout and in an installed wheel alike.

The wheel force-includes the checkout's top-level folders under the package (pyproject:
``kernels`` -> ``mtplx/_kernels``, ``models`` -> ``mtplx/_models``, ``benchmarks/prompts`` ->
``mtplx/_prompts``); a checkout has them beside the package. Every lookup of shipped data goes
through this module, so both layouts are found the same way. Standard library only.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
PROMPT_SUITE = "suite.jsonl"
# Read once: the cache root is a process-wide setting, not something to re-resolve per call.
_ENV_CACHE_DIR = os.environ.get("MTPLX_CACHE")


def _shipped(wheel_name: str, checkout_path: str) -> list[Path]:
    """The two places a shipped folder can be: inside the installed package, or in the checkout."""
    return [PACKAGE_DIR / wheel_name, PACKAGE_DIR.parent / checkout_path]


def kernel_dir() -> Path:
    """The folder of the kernel sources (``verify.body`` and its preludes)."""
    for candidate in _shipped("_kernels", "kernels"):
        if (candidate / "verify.body").is_file():
            return candidate
    raise FileNotFoundError(f"mtplx kernel sources not found next to {PACKAGE_DIR}")


def shipped_head_dir(model_name: str) -> Path | None:
    """The forged head mtplx ships for ``model_name`` (``models/<name>/``), or None."""
    for root in _shipped("_models", "models"):
        candidate = root / model_name
        if (candidate / "manifest.json").is_file():
            return candidate
    return None


def prompt_suite() -> Path | None:
    """The benchmark prompt suite (``benchmarks/prompts/suite.jsonl``), or None when not shipped."""
    for root in _shipped("_prompts", "benchmarks/prompts"):
        if (root / PROMPT_SUITE).is_file():
            return root / PROMPT_SUITE
    return None


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """Where mtplx keeps converted models and builds: ``cache_dir``, else $MTPLX_CACHE, else ~/.cache/mtplx."""
    if cache_dir is not None:
        return Path(cache_dir)
    if _ENV_CACHE_DIR:
        return Path(_ENV_CACHE_DIR)
    return Path.home() / ".cache" / "mtplx"
