"""Every benchmark and script imports against the current package layout (their `main` is not run:
each is a long measurement). A moved module breaks the import here, not a week later in a benchmark."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from support.paths import REPO

SCRIPTS = sorted(
    [
        *REPO.glob("benchmarks/*.py"),
        *REPO.glob("benchmarks/experiments/*.py"),
        *REPO.glob("benchmarks/prompts/*.py"),
        *REPO.glob("scripts/*.py"),
    ]
)


def import_script(path: Path):
    spec = importlib.util.spec_from_file_location(f"script_{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    sys.path.insert(0, str(path.parent))  # as `python benchmarks/x.py` runs it: siblings import
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
        sys.path.remove(str(path.parent))
    return module


def test_the_scripts_were_found():
    assert len(SCRIPTS) >= 15 and REPO / "benchmarks" / "old_vs_new.py" in SCRIPTS


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_script_imports_and_has_a_main(path: Path):
    module = import_script(path)
    assert callable(getattr(module, "main", None)), f"{path.name} has no main()"


def test_a_script_importing_a_moved_module_fails(tmp_path: Path):
    """Negative control: a script naming a module that no longer exists is caught."""
    script = tmp_path / "stale.py"
    script.write_text("from mtplx.verify import verify\n\n\ndef main():\n    pass\n")
    with pytest.raises(ModuleNotFoundError):
        import_script(script)
