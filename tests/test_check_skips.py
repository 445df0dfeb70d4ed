"""scripts/check_skips.py, CI's guard against skips (`.ci/run`), on a real pytest run's JUnit XML.

A throwaway test folder skips one test in a listed way, one in an unlisted way and a whole module
at collection; the script must pass exactly the listed skips, honour each line's environment
marker, and fail (naming the test and its skip message) on the rest. The shipped list must parse,
and each of its patterns must name a test file and function that exist.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import REPO

sys.path.insert(0, str(REPO / "scripts"))
import check_skips  # noqa: E402

TESTS = {
    "test_a.py": (
        "import pytest\n"
        "def test_runs():\n    assert True\n"
        "def test_listed():\n    pytest.skip('no NVRTC here')\n"
        "@pytest.mark.parametrize('x', [1, 2])\n"
        "def test_unlisted(x):\n    pytest.skip('matplotlib is not installed')\n"
    ),
    "sub/test_b.py": "import pytest\npytest.skip('whole module', allow_module_level=True)\n",
}


@pytest.fixture(scope="module")
def junit(tmp_path_factory) -> tuple[Path, Path]:
    """(the folder the run's node ids are relative to, its JUnit XML)."""
    root = tmp_path_factory.mktemp("run")
    for name, text in TESTS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # CI's --junitxml too
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:xdist",
            "-p",
            "no:cacheprovider",
            "--junitxml=r.xml",
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return root, root / "r.xml"


def _listed(tmp_path: Path, text: str) -> list[check_skips.Expected]:
    (tmp_path / "expected.txt").write_text(text)
    return check_skips.read_expected(tmp_path / "expected.txt")


def test_skips_are_read_with_their_node_ids_and_messages(junit):
    root, xml = junit
    assert sorted(check_skips.skipped_tests(xml, root)) == [
        ("sub/test_b.py", "whole module"),
        ("test_a.py::test_listed", "no NVRTC here"),
        ("test_a.py::test_unlisted[1]", "matplotlib is not installed"),
        ("test_a.py::test_unlisted[2]", "matplotlib is not installed"),
    ]


def test_only_listed_skips_pass_and_markers_decide_where(junit, tmp_path):
    root, xml = junit
    skips = check_skips.skipped_tests(xml, root)
    listed = _listed(
        tmp_path,
        "# comment\n"
        "test_a.py::test_listed ; ; NVRTC's wheel is Linux x86_64 only\n"
        "sub/test_b.py ; python_version >= '3' ; a module skipped on every Python 3\n"
        "test_a.py::test_unlisted[*] ; sys_platform == 'no-such-platform' ; expected elsewhere only\n",
    )
    assert check_skips.unexpected(skips, listed) == [
        ("test_a.py::test_unlisted[1]", "matplotlib is not installed"),
        ("test_a.py::test_unlisted[2]", "matplotlib is not installed"),
    ]
    everywhere = _listed(tmp_path, "test_a.py::test_* ; ; any\nsub/* ; ; any\n")
    assert check_skips.unexpected(skips, everywhere) == []


def test_the_command_fails_naming_each_unexpected_skip(junit, tmp_path, capsys):
    root, xml = junit
    (tmp_path / "expected.txt").write_text("test_a.py::test_listed ; ; NVRTC\n")
    code = check_skips.main([str(xml), str(tmp_path / "expected.txt")], root=root)
    err = capsys.readouterr().err
    assert code == 1
    assert "unexpected skip: test_a.py::test_unlisted[1]: matplotlib is not installed" in err
    assert "unexpected skip: sub/test_b.py: whole module" in err and "test_listed" not in err


@pytest.mark.parametrize(
    "line, message",
    [
        ("test_a.py::test_x ; ;", "expected 'node id pattern ; marker ; reason'"),
        ("test_a.py::test_x", "expected 'node id pattern ; marker ; reason'"),
        ("test_a.py::test_x ; os_name =! 'x' ; why", "marker: "),
    ],
)
def test_a_malformed_line_is_refused_naming_it(tmp_path, line, message):
    with pytest.raises(SystemExit, match=re.escape(f"expected.txt:2: {message}")):
        _listed(tmp_path, f"# header\n{line}\n")


def test_the_shipped_list_names_tests_that_exist():
    entries = check_skips.read_expected(REPO / "tests" / "expected_skips.txt")
    assert entries, "the list parses"
    for entry in entries:
        path, _, test = entry.pattern.partition("::")
        assert (REPO / path).is_file(), entry.pattern
        function = re.sub(r"\[.*$", "", test)
        if function and function != "*":
            assert re.search(rf"^def {re.escape(function)}\(", (REPO / path).read_text(), re.M), entry.pattern
