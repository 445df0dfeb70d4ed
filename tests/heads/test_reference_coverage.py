"""Every head family has an independent float64 reference test: a new registry row cannot land without one.

A test module under ``tests/heads/`` that holds a family's reference (its math in NumPy from
the checkpoint's tensors, compared with the loaded head's output at every position) declares
the layouts it covers in a module-level ``REFERENCE_LAYOUTS`` tuple of string literals. The
required set is every row of ``mtplx.heads.registry.FAMILIES`` plus the heads loaded outside
the registry (``heads/discovery.py``): forged heads and Gemma 4 assistants. The declarations are
read with ``ast`` (nothing is imported), so a module that fails to import still counts against
nothing it does not declare. ``scripts/mutate_heads.py`` proves each reference can fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

from mtplx.heads.gemma4_assistant import LAYOUT as GEMMA4_ASSISTANT
from mtplx.heads.registry import FAMILIES

HEADS_TESTS = Path(__file__).parent
OUTSIDE_REGISTRY = ("forged", GEMMA4_ASSISTANT)  # found by heads/discovery.py, not by a registry row


def declared_references(folder: Path) -> dict[str, list[str]]:
    """``{layout: [test modules declaring it]}`` from each module's ``REFERENCE_LAYOUTS`` literal."""
    found: dict[str, list[str]] = {}
    for path in sorted(folder.glob("test_*.py")):
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else []
            if any(isinstance(t, ast.Name) and t.id == "REFERENCE_LAYOUTS" for t in targets):
                for layout in ast.literal_eval(node.value):
                    found.setdefault(layout, []).append(path.name)
    return found


def uncovered(required: set[str], folder: Path = HEADS_TESTS) -> set[str]:
    return required - set(declared_references(folder))


def test_every_registry_row_and_every_outside_head_kind_has_a_reference_test():
    required = set(FAMILIES) | set(OUTSIDE_REGISTRY)
    assert not uncovered(required), f"head families without a reference test: {sorted(uncovered(required))}"


def test_declared_layouts_are_known_ones():
    """A typo in a declaration would cover nothing: every declared name is a row or an outside kind."""
    unknown = set(declared_references(HEADS_TESTS)) - set(FAMILIES) - set(OUTSIDE_REGISTRY)
    assert not unknown, unknown


def test_a_row_without_a_reference_is_reported(tmp_path):
    """Negative control: a new row nobody declared is named; a module that declares it clears it."""
    assert uncovered(set(FAMILIES) | {"inkling_mtp_demo"}) == {"inkling_mtp_demo"}
    (tmp_path / "test_new.py").write_text('REFERENCE_LAYOUTS = ("inkling_mtp_demo",)\n')
    assert uncovered({"inkling_mtp_demo", "qwen3_next"}, tmp_path) == {"qwen3_next"}
