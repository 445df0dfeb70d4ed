"""Rows of the families on mlx-vlm's own caches that batch, at their own lengths in one batch:
Qwen3.8-Flash-Next (``qwen4_exp``, `mtplx.trunk.batch_vlm`: its QSA KV as ragged rows, the
indexer's selection per row) and GLM-5-Next (``glm5_next``, `mtplx.trunk.batch_glm5_next`: its
sparse layers' CacheList as ragged rows, the pools per row, the indexer's choice per row); both
families' gated-delta / PLE / linear-attention ``ArraysCache`` s as mlx-vlm's own, rolled back per
row by mlx-vlm's ``commit_speculation``. The engine-level batches (rows share one forward, AR with
rejections) are ``tests/heads/test_{qwen4_exp,glm5_next}.py``'s."""

from __future__ import annotations

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.spec_decode.rows import check_batch_support
from mtplx.trunk.batch_cache import BatchCache, check_batchable
from mtplx.trunk.model import Trunk

import mlx.core as mx
import numpy as np
import pytest
import support.vlm_families as families
from support.seeds import FRESH, resolve
from support.vlm_families import tiny_qwen4_exp
from support.vlm_heads import max_abs_diff

TOL = 1e-4
BLOCK = 3
# Row 0 starts with 1 committed token (its indexer keeps every key: dense), row 1 with 13 (6
# complete blocks / pools of 2, over the 2 the indexer keeps: it selects). Per verify block,
# each row's count kept.
LENGTHS = (1, 13)
KEEPS = ([1, 3], [0, 2], [3, 1])


def _rows(trunk: Trunk, prompts: list[list[int]]) -> tuple[list, BatchCache]:
    """Each prompt prefilled alone on its own single-row caches, and a batch holding copies of them."""
    singles = []
    for prompt in prompts:
        cache = trunk.make_cache()
        trunk(mx.array([prompt]), cache)
        singles.append(cache)
    batch = BatchCache(trunk.make_cache(), trunk.model)
    batch.add_rows(singles)
    return singles, batch


def _run(trunk: Trunk, batch: BatchCache, blocks: list[np.ndarray], keeps) -> list[mx.array]:
    """Verify blocks of every row in one forward each, row r keeping keeps[i][r] of block i; then
    one position for every row. Returns each forward's logits [B, T, V]."""
    out = []
    for tokens, keep in zip(blocks, keeps):
        record = batch.begin_block(tokens.shape[1])
        out.append(trunk(mx.array(tokens), batch.layers).logits)
        batch.commit_block(record, keep)
    return out


def _tiny(family: str):
    """The family's tiny in-memory trunk model (``support.vlm_families``, Inkling's ``support.vlm_inkling``)."""
    from support import vlm_inkling

    return getattr(vlm_inkling if family == "inkling" else families, f"tiny_{family}")()


@pytest.mark.parametrize("family", ["qwen4_exp", "glm5_next", "inkling"])
@pytest.mark.parametrize("seed", [0, FRESH])
def test_ragged_rows_keep_their_own_count_and_give_each_rows_logits_alone(family, seed):
    """Two rows (1 and 13 committed tokens) forward verify blocks of 3 positions together, each
    keeping its own count (0 to 3), then one position: every kept position's logits and the last
    step's are each row's own forward's alone on its single-row caches (the mirror forwards only
    the kept tokens). A row extracted from the batch decodes on as the mirror; after the short row
    leaves, the long one goes on alone in the batch. Control: a batch that keeps the whole first
    block of the short row (a missed rollback of every cache kind) gives other logits."""
    rng = np.random.default_rng(resolve(seed))
    trunk = Trunk(_tiny(family))
    prompts = [rng.integers(2, 90, size=n).tolist() for n in LENGTHS]
    blocks = [rng.integers(2, 90, size=(2, BLOCK)) for _ in KEEPS] + [rng.integers(2, 90, size=(2, 1))]
    keeps = [*KEEPS, [1, 1]]
    singles, batch = _rows(trunk, prompts)
    together = _run(trunk, batch, blocks, keeps)
    for tokens, keep, logits in zip(blocks, keeps, together):
        for r, cache in enumerate(singles):
            if keep[r]:
                alone = trunk(mx.array(tokens[r : r + 1, : keep[r]]), cache).logits
                assert max_abs_diff(logits[r : r + 1, : keep[r]], alone) < TOL, (seed, keep, r)
    assert batch.lengths == [n + sum(k[r] for k in keeps) for r, n in enumerate(LENGTHS)]

    nxt = rng.integers(2, 90, size=(2, 1))
    extracted = batch.extract(0)
    want = [trunk(mx.array(nxt[r : r + 1]), singles[r]).logits for r in range(2)]
    assert max_abs_diff(trunk(mx.array(nxt[:1]), extracted).logits, want[0]) < TOL
    batch.remove_rows([1])
    assert max_abs_diff(trunk(mx.array(nxt[1:]), batch.layers).logits, want[1]) < TOL

    _, control = _rows(trunk, prompts)
    wrong = _run(trunk, control, blocks, [[BLOCK, 3], *keeps[1:]])
    assert max_abs_diff(wrong[-1][:1], together[-1][:1]) > 1e-2


def test_kv_bits_rows_decode_alone_with_a_one_line_reason():
    """Under ``--kv-bits`` its QSA cache is mlx-vlm's QSAQuantizedKVCache, which has no ragged form:
    one line naming it; the float caches batch."""
    from mtplx.trunk.kv_quant import KVQuantization, make_cache

    trunk = Trunk(tiny_qwen4_exp())
    assert check_batch_support(trunk) is None
    quantized = make_cache(trunk.make_cache(), KVQuantization(8, 32, 0))
    reason = check_batchable(quantized, trunk.model)
    assert (
        reason
        == "cache of layer 1: mlx_vlm QSAQuantizedKVCache is not batched (decoded one request at a time)"
    )
