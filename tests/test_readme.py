"""The README's shell examples marked `<!-- runnable -->` run verbatim and succeed.

Each marked ```bash block runs in bash (``set -e -o pipefail``) from the repository root,
with an ``mtplx`` on PATH that runs this checkout (what `make` installs in a fresh clone).
Long examples (a full bench, tune or forge) and anything needing the network stay unmarked.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import REPO

MARKER = "<!-- runnable -->"


def runnable_blocks(markdown: str) -> list[str]:
    """The bodies of the ```bash blocks that directly follow the marker line."""
    pattern = re.compile(re.escape(MARKER) + r"\s*\n```(?:bash|sh|shell)\n(.*?)\n```", re.S)
    return pattern.findall(markdown)


def test_marker_parsing_finds_only_marked_blocks():
    text = f"```bash\nnot marked\n```\n{MARKER}\n```bash\necho one\necho two\n```\n```bash\nalso not\n```\n"
    assert runnable_blocks(text) == ["echo one\necho two"]


BLOCKS = runnable_blocks((REPO / "README.md").read_text(encoding="utf-8"))


def test_the_readme_has_runnable_examples():
    assert BLOCKS, f"README.md has no {MARKER} ```bash block"


@pytest.fixture(scope="module")
def mtplx_on_path(tmp_path_factory) -> Path:
    bin_dir = tmp_path_factory.mktemp("bin")
    shim = bin_dir / "mtplx"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m mtplx "$@"\n')
    shim.chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(block, mtplx_on_path):
    env = dict(os.environ)
    env["PATH"] = f"{mtplx_on_path}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["HF_HUB_OFFLINE"] = "1"  # nothing networked
    out = subprocess.run(
        ["bash", "-c", "set -e -o pipefail\n" + block],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 0, f"{block}\n--- stdout\n{out.stdout[-2000:]}\n--- stderr\n{out.stderr[-2000:]}"
    assert "Traceback" not in out.stderr
