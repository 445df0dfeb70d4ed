"""Optional test dependencies: skip only when the dependency is really absent.

``pytest.importorskip`` (and ``except ImportError: skip``) also turns an installed but broken
package, or a bug in our own import, into a skip. Here absence is decided by the import system's
finder alone (``importlib.util.find_spec``: no module of that name, or of a parent package); an
installed module is then imported normally, so any error it raises fails the test. CI's
``scripts/check_skips.py`` then fails on any skip not listed in ``tests/expected_skips.txt``.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

import pytest


def installed(module: str) -> bool:
    """Whether ``module`` can be found (parents imported as needed; their own errors propagate)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError as err:  # a parent package is absent
        if err.name and (module == err.name or module.startswith(err.name + ".")):
            return False
        raise


def import_or_skip(module: str, install: str) -> ModuleType:
    """``module`` imported; a skip naming ``install`` (how to get it) only when it is not installed."""
    if not installed(module):
        pytest.skip(f"{module} is not installed ({install})")
    return importlib.import_module(module)
