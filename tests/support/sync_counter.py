"""Count host syncs: calls that make Python wait for MLX to compute something.

A pass-through wrapper (not a mock: every call still runs) around ``mx.eval``,
``array.item``, ``array.tolist`` and the scalar conversions. Reading an array
that an earlier ``mx.eval`` already computed is not a sync and is not counted.
Used by tests/spec_decode/test_hot_path.py, tests/spec_decode/test_drafters.py and benchmarks/count_syncs.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterator

import mlx.core as mx

_READS = ("item", "tolist", "__bool__", "__int__", "__float__")


def _arrays(tree) -> Iterator[mx.array]:
    if isinstance(tree, mx.array):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _arrays(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _arrays(item)


class SyncCounter:
    def __init__(self) -> None:
        self.syncs = 0
        self._evaluated: dict[int, mx.array] = {}  # id -> array (held, so ids stay unique)

    def reset(self) -> None:
        self.syncs = 0
        self._evaluated.clear()


@contextlib.contextmanager
def counting_syncs() -> Iterator[SyncCounter]:
    counter = SyncCounter()
    real_eval = mx.eval
    real_reads = {name: getattr(mx.array, name) for name in _READS}

    def eval_(*args):
        counter.syncs += 1
        for array in _arrays(args):
            counter._evaluated[id(array)] = array
        return real_eval(*args)

    def reader(name):
        real = real_reads[name]

        def read(self, *args, **kwargs):
            if id(self) not in counter._evaluated:
                counter.syncs += 1
                counter._evaluated[id(self)] = self
            return real(self, *args, **kwargs)

        return read

    mx.eval = eval_
    for name in _READS:
        setattr(mx.array, name, reader(name))
    try:
        yield counter
    finally:
        mx.eval = real_eval
        for name, real in real_reads.items():
            setattr(mx.array, name, real)


def syncs_after_prefill(steps: Generator, cycles: int) -> int:
    """Host syncs of a decode generator's next ``cycles`` steps after its first (the prefill and
    the first token); closes ``steps``."""
    next(steps)
    with counting_syncs() as counter:
        for _ in range(cycles):
            next(steps)
    steps.close()
    return counter.syncs
