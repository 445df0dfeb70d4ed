"""One probe the compat modules share: does the installed mlx-lm still have a module-level function
mtplx hooks (the gated-delta and the Mamba2 SSM state updates) with the leading parameters the hook
passes, called through the module attribute the hook replaces? Standard library only."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

__all__ = ["check_hooked_function"]


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
