"""Where a request can fail inside the engine (`FailedStage`), and the test hook that plants a
failure there (`reach`, read from ``MTPLX_TEST_FAULT``).

A failure that is not the request's own mistake (not an `MtplxError`) ends the requests it
concerns: one request where the failure is its own (its start, its prompt's prefill, its first
token's draw, its output's detokenization, its prompt-cache store, its rows' invalid values in a
cycle), every request in flight where the batch's shared state failed (a step that raised
anywhere else; the server's worker then builds a fresh scheduler), and the requests waiting
for a scheduler that could not be built (its setup: the draft policy's cost profile). The
server answers each with a 500 naming the stage (`FailedStage.doing`) and counts it in
/metrics by the stage's label (`FailedStage.label`). One stage fails no request: `serve --learn`'s
learner (``learn``: its call to record a finished request or to train while idle raised), which
the worker then sets aside and serves on without.

Test hook: ``MTPLX_TEST_FAULT="prefill@2,setup:2"`` makes `reach` raise `InjectedFault` at the
named stages: ``label@k`` the k-th time that stage is reached, ``label:n`` the first n times
(a bare ``label``: the first time). Read once, when this module is imported; unset (always,
outside tests) it costs one dict lookup per call. tests/server/test_worker_failures.py plants
failures through it in a real server process.
"""

from __future__ import annotations

import os
from enum import Enum

__all__ = ["FAULT_ENV", "FailedStage", "InjectedFault", "reach"]

FAULT_ENV = "MTPLX_TEST_FAULT"


class FailedStage(Enum):
    """Where a request failed; the value says it in a 500's one line."""

    SETUP = "while setting up the batch scheduler"  # every request waiting for it
    SUBMIT = "while starting the request"
    PREFILL = "while prefilling the prompt"
    ADMIT = "while drawing the first token"
    CYCLE = "in a decode cycle"  # the rows the model produced invalid values for
    OUTPUT = "while detokenizing the output"
    STORE = "while storing the prompt cache"
    STEP = "in a batch step"  # the batch's shared state: every request in flight
    LEARN = "while learning from traffic"  # `serve --learn`'s learner, between steps: no request fails

    @property
    def label(self) -> str:
        """Its name in /metrics and in ``MTPLX_TEST_FAULT``."""
        return self.name.lower()

    @property
    def doing(self) -> str:
        return self.value


class InjectedFault(RuntimeError):
    """The failure ``MTPLX_TEST_FAULT`` planted (a test hook)."""


def _parse(spec: str) -> dict[str, set[int]]:
    """``MTPLX_TEST_FAULT``'s value as {stage label: the reach counts (1-based) that fail}."""
    planned: dict[str, set[int]] = {}
    labels = {stage.label for stage in FailedStage}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        label, sep, count = item.partition("@")
        if sep:
            counts = {int(count)}
        else:
            label, _, times = item.partition(":")
            counts = set(range(1, int(times or 1) + 1))
        if label not in labels:
            raise ValueError(f"{FAULT_ENV}: {label!r} is not a stage ({', '.join(sorted(labels))})")
        planned.setdefault(label, set()).update(counts)
    return planned


_planned = _parse(os.environ.get(FAULT_ENV, ""))
_reached: dict[str, int] = {}


def reach(stage: FailedStage) -> None:
    """The engine reached ``stage``: raise `InjectedFault` when ``MTPLX_TEST_FAULT`` planted one
    for this reach (module docstring); otherwise nothing."""
    if not _planned:
        return
    label = stage.label
    count = _reached[label] = _reached.get(label, 0) + 1
    if count in _planned.get(label, ()):
        raise InjectedFault(f"{FAULT_ENV}: planted failure at {label} (reach {count})")
