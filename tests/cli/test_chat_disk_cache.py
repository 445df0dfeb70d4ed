"""`mtplx chat --prompt-cache-dir DIR`: a conversation picked up again by a new engine (a new
session) reuses the caches the last one left on disk (the default model); the disk flags are
checked as serve's. In this process, through the command's entry point (each run loads its own
engine and indexes the directory afresh, as a new process would)."""

from __future__ import annotations

import contextlib
import io
import re

import pytest

TURN = "What is the capital of France?\n"


def _chat(monkeypatch, *args: str) -> tuple[int, str, str]:
    from mtplx.cli.main import main

    monkeypatch.setattr("sys.stdin", io.StringIO(TURN))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["chat", "-m", "6", "--verbose", "True", *args])
        except SystemExit as exit_:
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


def _cached(stderr: str) -> int:
    match = re.search(r"^Prompt: \d+ tokens(?: \((\d+) cached, \d+ prefilled\))?,", stderr, re.M)
    assert match is not None, stderr
    return int(match.group(1) or 0)


def test_chat_reuses_the_prompt_cache_a_previous_session_left_on_disk(tmp_path, monkeypatch):
    code, first, err = _chat(monkeypatch, "--prompt-cache-dir", str(tmp_path))
    assert code == 0 and _cached(err) == 0, err  # the control: an empty directory serves nothing
    assert list(tmp_path.glob("*.safetensors")), (
        "the turn's entry reached the disk before the command returned"
    )
    code, again, err = _chat(monkeypatch, "--prompt-cache-dir", str(tmp_path))
    assert code == 0 and _cached(err) > 0, err
    assert again == first  # greedy: the same reply from the loaded caches


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--prompt-cache-disk-bytes", "100"], "--prompt-cache-disk-bytes: needs --prompt-cache-dir"),
        (
            ["--prompt-cache-dir", "DIR", "--prompt-cache-bytes", "0"],
            "--prompt-cache-dir: needs a prompt cache in RAM",
        ),
    ],
)
def test_chat_checks_the_disk_flags_before_loading(tmp_path, monkeypatch, flags, message):
    code, _, err = _chat(monkeypatch, *[str(tmp_path) if f == "DIR" else f for f in flags])
    assert code != 0 and err.startswith(f"mtplx: error: {message}") and len(err.splitlines()) == 1, err
