"""`mtplx serve` as a real process on a free port, for the server tests (tests/server)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from support.paths import REPO

KEY = "test-key-0123"


def wait_for(condition, timeout: float = 30.0) -> None:
    """Poll ``condition`` until true or ``timeout`` s (server log lines are written as requests
    end, which may be just after the client saw the response); the caller asserts after."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_health(proc: subprocess.Popen, base: str, log_path: Path) -> None:
    """Until ``base``/health answers 200; the test fails with the server's log if it exits or takes 180 s."""
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text()}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"server did not come up:\n{log_path.read_text()}")
        time.sleep(0.1)  # the test waits on this poll; a finer one takes CPU from the start itself


@contextlib.contextmanager
def running_server(
    model_dir: Path, log_path: Path, *flags: str, api_key: str | None = KEY, env: dict[str, str] | None = None
):
    """`mtplx serve` on ``model_dir`` and a free port; yields (base URL, log path) once /health answers.
    ``env``: variables set for the server process only (e.g. the test hook ``MTPLX_TEST_FAULT``)."""
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    env.pop("MTPLX_API_KEY", None)
    if api_key is not None:
        env["MTPLX_API_KEY"] = api_key
    args = [sys.executable, "-m", "mtplx", "serve", "--model", str(model_dir), "--port", str(port)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen([*args, *flags], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(proc, base, log_path)
        yield base, log_path
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
