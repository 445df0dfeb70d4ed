"""SIGTERM as an orderly exit: the one handler commands that must clean up install.

Python's default for SIGTERM kills the process where it stands: no ``finally`` block runs, so
`mtplx convert` left its hidden temp directories and `mtplx serve` lost the prompt-cache writes
still queued (uvicorn catches SIGTERM, shuts down, then raises it again under the handler it found,
the default one). Under `terminate_as_exit` the signal raises ``SystemExit(128 + SIGTERM)`` in the
main thread instead, so the command unwinds as after Ctrl-C and exits with the status a shell
expects of a terminated process.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator


def _exit(signum: int, frame: object) -> None:
    print("mtplx: terminated", file=sys.stderr)
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def terminate_as_exit() -> Iterator[None]:
    """SIGTERM raises SystemExit in the main thread while inside; the previous handler after."""
    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
