"""`mtplx ARGS` in the test process: what a subprocess would print and return, without a Python start
and the imports for each call. Tests of the process boundary itself (exit codes from `python -m mtplx`,
signals, environment read at import) start a real process; one such test per behaviour is enough."""

from __future__ import annotations

import contextlib
import io
import subprocess


def run_main(*args: str) -> subprocess.CompletedProcess:
    """``mtplx.cli.main.main(args)`` with stdout and stderr captured. Any exception other than
    argparse's exit escapes and fails the test (a real process would print a traceback)."""
    from mtplx.cli.main import main

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main(list(args))
        except SystemExit as exit_:  # argparse usage errors
            code = exit_.code
    return subprocess.CompletedProcess(["mtplx", *args], code, stdout.getvalue(), stderr.getvalue())


def one_line_error(out: subprocess.CompletedProcess) -> str:
    """The single stderr line of a failed command (asserting it failed, in one line, with no traceback)."""
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    return lines[0]
