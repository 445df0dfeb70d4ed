"""Fail when a test run skipped anything that ``tests/expected_skips.txt`` does not list.

Usage: ``python scripts/check_skips.py build/junit.xml [tests/expected_skips.txt]`` (``.ci/run``
runs it after ``make test``, whose pytest writes the JUnit XML through ``PYTEST_ADDOPTS``).

Each line of the list is ``node id pattern ; marker ; reason``: an ``fnmatch`` pattern over pytest
node ids (``tests/x/test_y.py::test_z[param]``), a PEP 508 environment marker saying where the
skip is expected (empty: everywhere; ``packaging`` evaluates it, a dependency of pytest), and why
the skip is justified. ``#`` starts a comment. A skip is expected when a line's pattern matches
its node id and the line's marker holds here; any other skip is reported with its reason and
fails the check, so a missing install step cannot turn tests into skips on CI. Standard library
and ``packaging`` only: it runs where the tests ran.
"""

from __future__ import annotations

import fnmatch
import re
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import InvalidMarker, Marker

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Expected:
    pattern: str
    marker: str  # "" = everywhere
    reason: str

    def applies_here(self) -> bool:
        return not self.marker or Marker(self.marker).evaluate()


def read_expected(path: Path) -> list[Expected]:
    """The list's entries; a line without a pattern or a reason is an error naming the line."""
    entries = []
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = [part.strip() for part in line.split(";", 2)]
        if len(parts) != 3 or not parts[0] or not parts[2]:
            raise SystemExit(f"{path}:{number}: expected 'node id pattern ; marker ; reason', got {raw!r}")
        try:
            if parts[1]:
                Marker(parts[1])
        except InvalidMarker as err:
            raise SystemExit(f"{path}:{number}: marker: {err}") from None
        entries.append(Expected(*parts))
    return entries


def node_id(classname: str, name: str, root: Path = ROOT) -> str:
    """The pytest node id of a JUnit testcase: ``tests.x.test_y[.Class]`` + name -> path::[Class::]name.
    A skip at collection (a module-level skip) is a testcase with no classname, named by the module."""
    dotted = classname or name
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        path = "/".join(parts[:cut]) + ".py"
        if (root / path).is_file():
            rest = parts[cut:] + ([name] if classname else [])
            return "::".join([path, *rest])
    return f"{dotted}::{name}" if classname else dotted


def skipped_tests(junit: Path, root: Path = ROOT) -> list[tuple[str, str]]:
    """(node id, skip message) of every skipped testcase in a JUnit XML report."""
    tree = ET.parse(junit)
    cases = list(tree.iter("testcase"))
    if not cases:
        raise SystemExit(f"{junit}: no test cases (did the run write this report?)")
    out = []
    for case in cases:
        skip = case.find("skipped")
        if skip is not None and skip.get("type") != "pytest.xfail":
            out.append((node_id(case.get("classname", ""), case.get("name", ""), root), _message(skip)))
    return out


def _message(skip: ET.Element) -> str:
    """The skip's reason; a collection skip's is in its text: "(path, line, 'Skipped: reason')"."""
    message = skip.get("message", "")
    if message != "collection skipped":
        return message
    found = re.search(r"Skipped: (.*)'\)$", (skip.text or "").strip())
    return found.group(1) if found else message


def unexpected(skips: list[tuple[str, str]], expected: list[Expected]) -> list[tuple[str, str]]:
    here = [entry for entry in expected if entry.applies_here()]
    return [(node, why) for node, why in skips if not any(fnmatch.fnmatchcase(node, e.pattern) for e in here)]


def main(argv: list[str], root: Path = ROOT) -> int:
    """``root``: the folder the report's node ids are relative to (the run's rootdir)."""
    if not 1 <= len(argv) <= 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    junit = Path(argv[0])
    listed = Path(argv[1]) if len(argv) == 2 else ROOT / "tests" / "expected_skips.txt"
    skips = skipped_tests(junit, root)
    bad = unexpected(skips, read_expected(listed))
    for node, why in bad:
        print(f"unexpected skip: {node}: {why}", file=sys.stderr)
    if bad:
        print(
            f"{len(bad)} unexpected skip(s); fix the environment, or list each in {listed} with why",
            file=sys.stderr,
        )
        return 1
    print(f"skips: {len(skips)}, all listed in {listed.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
