"""`mtplx chat --prompt-cache-dir DIR`: a conversation picked up again in a new process reuses
the caches the last one left on disk (the default model); the disk flags are checked as serve's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TURN = "What is the capital of France?\n"


def _chat(*args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(
        [sys.executable, "-m", "mtplx", "chat", "-m", "6", "--verbose", "True", *args],
        capture_output=True,
        text=True,
        input=TURN,
        timeout=300,
        env=env,
    )


def _cached(stderr: str) -> int:
    match = re.search(r"^Prompt: \d+ tokens(?: \((\d+) cached, \d+ prefilled\))?,", stderr, re.M)
    assert match is not None, stderr
    return int(match.group(1) or 0)


def test_chat_reuses_the_prompt_cache_a_previous_process_left_on_disk(tmp_path):
    first = _chat("--prompt-cache-dir", str(tmp_path))
    assert first.returncode == 0 and _cached(first.stderr) == 0, first.stderr
    assert list(tmp_path.glob("*.safetensors")), "the first turn's entry reached the disk before exit"
    again = _chat("--prompt-cache-dir", str(tmp_path))
    assert again.returncode == 0 and _cached(again.stderr) > 0, again.stderr
    assert again.stdout == first.stdout  # greedy: the same reply from the loaded caches


def test_chat_checks_the_disk_flags_before_loading(tmp_path):
    out = _chat("--prompt-cache-disk-bytes", "100")
    assert (
        out.returncode != 0
        and out.stderr.strip() == "mtplx: error: --prompt-cache-disk-bytes: needs --prompt-cache-dir"
    )
    out = _chat("--prompt-cache-dir", str(tmp_path), "--prompt-cache-bytes", "0")
    assert out.returncode != 0 and "--prompt-cache-dir: needs a prompt cache in RAM" in out.stderr
