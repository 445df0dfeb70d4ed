"""What the compat modules' checks share (`compat_check`, `compat_nemotron`, `compat_vision`):
version ranges (`parse_version`, `format_version`), one line per probe that raises (`guarded`), and
one probe: does the installed mlx-lm still have a module-level function mtplx hooks (the gated-delta
and the Mamba2 SSM state updates) with the leading parameters the hook passes, called through the
module attribute the hook replaces? Standard library only."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["check_hooked_function", "format_version", "guarded", "parse_version"]


def parse_version(text: str) -> tuple[int, ...]:
    """``"0.32.2"`` (or ``"0.32.2rc1"``) as ``(0, 32, 2)``: three numbers, missing ones 0."""
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts + [0] * (3 - len(parts)))


def format_version(version: tuple[int, ...]) -> str:
    return ".".join(str(v) for v in version)


def guarded(what: str, check_fn: Callable, *args: Any) -> list[str]:
    """``check_fn(*args)``'s problems; a layout so changed that probing it raises is reported like
    any other change (one line naming ``what``)."""
    try:
        return check_fn(*args)
    except Exception as e:  # the point is to turn any breakage into one clear message
        return [f"{what} failed ({type(e).__name__}: {e})"]


def check_hooked_function(
    name: str, function: Callable, parameters: tuple[str, ...], module_names: Sequence[str]
) -> list[str]:
    """What mlx-lm changed of ``function`` (named ``name`` in each of ``module_names``): empty when
    nothing."""
    problems = []
    leading = tuple(inspect.signature(function).parameters)[: len(parameters)]
    if leading != parameters:
        problems.append(f"{name} takes {leading}, expected {parameters} first")
    for module_name in module_names:
        try:
            module = __import__(module_name, fromlist=["_"])
        except ImportError:
            problems.append(f"{module_name} is gone")
            continue
        if getattr(module, name, None) is None:
            problems.append(f"{module_name} no longer calls a module-level {name}")
    return problems
