"""Host syncs of a Qwen3.8-Flash-Next batch forward (`mtplx.trunk.batch_vlm.RaggedQSAKVCache`):
rows at their own lengths forward together with the syncs of one row's forward alone. mlx-vlm
0.7.10's attention would read each QSA layer's ``offset.max()`` to the host (and its model one
more) on a cache whose offsets are an array; the ragged cache names its longest end as a Python
int (``_idx``) and ``left_padding = None``, so those reads do not happen."""

from __future__ import annotations

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.trunk.batch_cache import BatchCache
from mtplx.trunk.batch_vlm import RaggedQSAKVCache
from mtplx.trunk.model import Trunk

import mlx.core as mx
import numpy as np
import pytest
from support.sync_counter import counting_syncs
from support.vlm_families import tiny_qwen4_exp

LENGTHS = (1, 13)  # a row whose indexer keeps every key beside one whose indexer selects


@pytest.fixture(scope="module")
def trunk() -> Trunk:
    return Trunk(tiny_qwen4_exp())


def _forward_syncs(trunk: Trunk, tokens: mx.array, cache) -> int:
    """Host syncs of one forward and the eval of its logits (the inputs evaluated before)."""
    mx.eval(tokens)
    with counting_syncs() as counter:
        mx.eval(trunk(tokens, cache).logits)
    return counter.syncs


def _batch_syncs(trunk: Trunk) -> list[int]:
    """Syncs of a 2-row batch's verify block of 3 (rows keeping 1 and 3) and its next position."""
    rng = np.random.default_rng(0)
    singles = []
    for n in LENGTHS:
        cache = trunk.make_cache()
        trunk(mx.array([rng.integers(2, 90, size=n).tolist()]), cache)
        singles.append(cache)
    batch = BatchCache(trunk.make_cache(), trunk.model)
    batch.add_rows(singles)
    syncs = []
    for width, keep in ((3, [1, 3]), (1, [1, 1])):
        record = batch.begin_block(width)
        syncs.append(_forward_syncs(trunk, mx.array(rng.integers(2, 90, size=(2, width))), batch.layers))
        batch.commit_block(record, keep)
    return syncs


def test_a_batch_forward_syncs_the_host_as_one_rows_forward_does(trunk: Trunk) -> None:
    assert (
        sum(isinstance(c, RaggedQSAKVCache) for c in BatchCache(trunk.make_cache(), trunk.model).layers) == 2
    )
    cache = trunk.make_cache()
    trunk(mx.array([[5, 6, 7]]), cache)
    alone = _forward_syncs(trunk, mx.array([[8]]), cache)
    # One row alone: the logits' eval and mlx-vlm's PLE embedding reading the token ids (its own).
    assert alone == 2
    assert _batch_syncs(trunk) == [alone, alone]


def test_without_its_host_end_the_qsa_layers_read_one_value_each(trunk: Trunk, monkeypatch) -> None:
    """Negative control: the counter sees the reads the ragged cache avoids. Without
    ``left_padding`` each QSA layer's attention reads ``offset.max()`` (two layers: two more
    syncs); without ``_idx`` the model's ``cache_position_offset`` reads it too (one more)."""
    monkeypatch.delattr(RaggedQSAKVCache, "left_padding")
    assert _batch_syncs(trunk) == [2 + 2, 2 + 2]
    monkeypatch.undo()
    monkeypatch.delattr(RaggedQSAKVCache, "_idx")
    assert _batch_syncs(trunk) == [2 + 2 + 1, 2 + 2 + 1]
