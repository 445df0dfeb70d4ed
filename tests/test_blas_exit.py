"""Issue 49 item 6: a process that imports mtplx exits when its work is done, under CPU load.

OpenBLAS (the pthread build `mtplx.blas` preloads) joins its workers in a library destructor;
a worker still running a job then sleeps forever and the process hangs at 0% CPU after its work
(`mtplx.blas.quiesce_at_exit` is the fix). The trigger is BLAS work in flight at exit, which
MLX's asynchronous evaluation makes ordinary. Real processes: Python processes that import
mtplx, compute, print ``done`` and exit with matmuls still queued; and `mtplx generate` on the
default model. Several run at once beside busy-loop processes (a loaded machine). A process that
outlives its last output by more than ``GRACE_S`` is a hang (killed, reported with its stack when
gdb is there). Negative control: the same probe with the fix unregistered hangs (so the stress
can see the bug). ``make test`` runs 12 probes and one generate; ``slow`` 200 probes and 40
generates.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
import sys
import threading
import time

import mtplx
from mtplx import blas

import pytest
from support.paths import REPO

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or mtplx.BLAS.path is None or "openblas" not in mtplx.BLAS.path.lower(),
    reason="the exit hang is OpenBLAS's (Linux, preloaded)",
)

GRACE_S = 10.0  # a finished process must be gone this long after its last output
PROBE = """
import atexit, sys
import mtplx
import mlx.core as mx
if sys.argv[1] == "unfixed":
    atexit.unregister(mtplx.blas.quiesce_at_exit)
a = mx.random.normal((384, 384))
for _ in range(3):
    mx.eval(a @ a)
print("done", flush=True)
b = a
for _ in range(8):
    b = b @ a
mx.async_eval(b)  # BLAS work in flight while the interpreter exits
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}


@contextlib.contextmanager
def _cpu_load(processes: int = 2):
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


class _Run:
    """A started process and the time of its last output (stdout and stderr, read by threads);
    its work is done once ``done_marker`` was printed."""

    def __init__(self, argv: list[str], done_marker: bytes):
        self.done_marker = done_marker
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env()
        )
        self.last_output = time.monotonic()
        self.output = bytearray()
        self._readers = [
            threading.Thread(target=self._read, args=(s,), daemon=True)
            for s in (self.proc.stdout, self.proc.stderr)
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, stream) -> None:
        while chunk := stream.read1(4096):
            self.output += chunk
            self.last_output = time.monotonic()

    def finish(self, limit_s: float) -> str | None:
        """None when it exited; else what it was doing when its output stopped ``GRACE_S`` ago."""
        deadline = time.monotonic() + limit_s
        while self.proc.poll() is None:
            done = self.done_marker in self.output
            idle = time.monotonic() - self.last_output
            if (done and idle > GRACE_S) or time.monotonic() > deadline:
                if not done:
                    self.proc.kill()
                    self.proc.wait()
                    return f"pid {self.proc.pid} did not finish its work in {limit_s:.0f} s"
                stack = _stack(self.proc.pid)
                self.proc.kill()
                self.proc.wait()
                return f"pid {self.proc.pid} alive {idle:.0f} s after its last output\n{stack}"
            time.sleep(0.1)
        for reader in self._readers:
            reader.join(5)
        return None


def _stack(pid: int) -> str:
    if shutil.which("gdb") is None:
        return "(no gdb for a stack)"
    out = subprocess.run(
        ["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 10"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return "\n".join(
        line for line in out.splitlines() if line.startswith("#") and ("blas" in line or "join" in line)
    )


def _probes(count: int, at_once: int, variant: str = "fixed") -> list[str]:
    hangs = []
    for start in range(0, count, at_once):
        runs = [
            _Run([sys.executable, "-c", PROBE, variant], b"done") for _ in range(min(at_once, count - start))
        ]
        for run in runs:
            problem = run.finish(limit_s=240)
            if problem is None:
                assert run.proc.returncode == 0 and b"done" in run.output, run.output.decode(errors="replace")
            else:
                hangs.append(problem)
    return hangs


def _generates(count: int, at_once: int) -> list[str]:
    argv = [sys.executable, "-m", "mtplx", "generate", "--no-mtp", "--temp", "0", "--max-tokens", "24"]
    argv += ["--verbose", "True"]  # its last line (the drafter) marks the end of its work
    hangs = []
    for start in range(0, count, at_once):
        runs = [
            _Run([*argv, f"Say something about the number {start + i}."], b"Drafter:")
            for i in range(min(at_once, count - start))
        ]
        for run in runs:
            problem = run.finish(limit_s=600)  # its work: ~10 s alone on 2 cores, far more when shared
            if problem is None:
                assert run.proc.returncode == 0, run.output.decode(errors="replace")
            else:
                hangs.append(problem)
    return hangs


def test_processes_with_blas_work_in_flight_exit_under_load():
    with _cpu_load():
        assert _probes(count=12, at_once=6) == []


@pytest.mark.slow
def test_without_the_fix_the_stress_sees_the_hang():
    """Negative control: the probe with `quiesce_at_exit` unregistered hangs at least once in 6
    (13 of 16 did on a 2-core machine at load average ~27 before the fix). Under `slow`: in a full
    `make test` on a quieter machine 0 of 6 hung, so in the default suite it failed by chance."""
    with _cpu_load():
        hangs = _probes(count=6, at_once=6, variant="unfixed")
    assert hangs, "no hang without the fix: the stress cannot see the bug"
    assert any("blas_thread_shutdown_" in h for h in hangs) or shutil.which("gdb") is None, hangs


def test_mtplx_generate_exits_after_its_reply_under_load():
    with _cpu_load(1):
        assert _generates(count=1, at_once=1) == []


@pytest.mark.slow
def test_many_processes_exit_under_load():
    with _cpu_load():
        assert _probes(count=200, at_once=8) == []
        assert _generates(count=40, at_once=4) == []


def test_quiesce_is_a_no_op_for_a_library_without_a_pool():
    class NoPool:  # BLIS, or a library that exports neither function
        pass

    blas.quiesce_at_exit(NoPool())  # must not raise
