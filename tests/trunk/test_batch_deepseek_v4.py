"""DeepSeek-V4's sliding-window ring (`mtplx.trunk.batch_deepseek_v4.RaggedWindowKV`) against a
NumPy window: after every write, each row's query at position q sees exactly the keys of its
positions q - W < p <= q, through verify blocks kept in part, a head's chain rolled back whole
(longer than the ring at first: it grows), joins from single-row caches of both write modes, an
extract and a leave. The model-level checks (rows' logits alone, every cache kind) are
``tests/trunk/test_batch_vlm_caches.py``'s."""

from __future__ import annotations

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.trunk.batch_deepseek_v4 import RaggedWindowKV

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import RotatingKVCache
from support.seeds import FRESH, resolve

WINDOW = 5
DIM = 4
CHAIN = 20  # a head's chain of single positions, rolled back: past the ring's first size


class _Rows:
    """The ring under test and, per row, every key it was given (the NumPy mirror)."""

    def __init__(self, rng, keys: list[np.ndarray], singles: list):
        self.rng, self.keys = rng, keys
        self.written = np.zeros((len(keys), 0, DIM), np.float32)  # since the lengths were last set
        self.ring = RaggedWindowKV(WINDOW, RotatingKVCache)
        self.ring.add_rows(singles)

    @classmethod
    def fresh(cls, rng, lengths: tuple[int, ...]) -> _Rows:
        """Rows of random keys joining from single-row caches (mlx-lm's, as a head's window)."""
        keys = [rng.standard_normal((n, DIM)).astype(np.float32) for n in lengths]
        singles = []
        for r, row in enumerate(keys):
            single = RotatingKVCache(max_size=WINDOW)
            if r % 2:  # one write of every position (its concatenating mode)
                single.update_and_fetch(*_kv(row))
            else:  # one position at a time (its rotating mode)
                for p in range(len(row)):
                    single.update_and_fetch(*_kv(row[p : p + 1]))
            singles.append(single)
        return cls(rng, keys, singles)

    def write(self, block_len: int) -> None:
        """A block of new keys for every row, written after the mask is taken; each row's visible
        keys checked against its NumPy window."""
        block = self.rng.standard_normal((len(self.keys), block_len, DIM)).astype(np.float32)
        mask = np.array(self.ring.make_mask(block_len, return_array=True, window_size=WINDOW))
        held = np.array(self.ring.update_and_fetch(*_kv(block))[0])
        assert mask.shape == (len(self.keys), 1, block_len, held.shape[2])
        self.written = np.concatenate([self.written, block], axis=1)
        for r, keys in enumerate(self.keys):
            everything = np.concatenate([keys, self.written[r]])
            for t in range(block_len):
                q = len(everything) - block_len + t
                want = everything[max(0, q - WINDOW + 1) : q + 1]
                assert _same_rows(held[r, 0][mask[r, 0, t]], want), (r, t, q)

    def keep(self, counts: list[int]) -> None:
        """Row r keeps the first counts[r] positions written since the lengths were last set."""
        self.keys = [
            np.concatenate([k, self.written[r, :n]]) for r, (k, n) in enumerate(zip(self.keys, counts))
        ]
        self.written = self.written[:, :0]
        self.ring.set_lengths([len(k) for k in self.keys])


def _kv(keys: np.ndarray) -> tuple[mx.array, mx.array]:
    """DeepSeek-V4's layout: one K=V head [B, 1, T, D] and empty values."""
    k = mx.array(keys if keys.ndim == 3 else keys[None])[:, None]
    return k, mx.zeros((*k.shape[:3], 0))


def _same_rows(a: np.ndarray, b: np.ndarray) -> bool:
    """The same keys, in any order (a ring holds them by slot)."""
    return a.shape == b.shape and np.array_equal(a[np.lexsort(a.T)], b[np.lexsort(b.T)])


@pytest.mark.parametrize("seed", [0, FRESH])
def test_each_rows_queries_see_exactly_its_window_through_blocks_a_rolled_back_chain_joins_and_leaves(seed):
    rows = _Rows.fresh(np.random.default_rng(resolve(seed)), (1, 9))
    rows.write(3)
    rows.keep([1, 3])
    for _ in range(CHAIN):  # a head's chain: one position at a time, then none of it kept
        rows.write(1)
    rows.keep([0, 0])
    rows.write(3)
    rows.keep([3, 0])

    extracted = rows.ring.extract(0)
    held = min(len(rows.keys[0]), WINDOW)
    assert type(extracted) is RotatingKVCache and extracted.offset == len(rows.keys[0])
    assert np.array_equal(np.array(extracted.keys[0, 0]), rows.keys[0][-held:])  # in order
    joined = _Rows(rows.rng, rows.keys[:1], [extracted])  # it joins another batch as it left
    joined.write(2)

    rows.ring.remove_rows([1])
    rows.keys, rows.written = rows.keys[1:], rows.written[1:]
    rows.write(2)
    rows.keep([1])
    rows.write(1)


def test_control_a_ring_sized_for_one_block_loses_what_a_rolled_back_chain_overwrote(monkeypatch):
    """A ring that does not grow with the positions written since the lengths were set (a chain
    longer than its slots) no longer holds the window the rows are moved back to."""
    monkeypatch.setattr(
        RaggedWindowKV, "_capacity_for", lambda self, n: max(self.capacity, WINDOW + max(n, 8) - 1)
    )
    rows = _Rows.fresh(np.random.default_rng(0), (1, 9))
    for _ in range(CHAIN):
        rows.write(1)
    rows.keep([0, 0])
    with pytest.raises(AssertionError):
        rows.write(1)
