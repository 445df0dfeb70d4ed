"""Rows of the families on mlx-vlm's own caches that batch, at their own lengths in one batch:
Qwen3.8-Flash-Next (``qwen4_exp``, `mtplx.trunk.batch_vlm`: its QSA KV as ragged rows, the
indexer's selection per row) and GLM-5-Next (``glm5_next``, `mtplx.trunk.batch_glm5_next`: its
sparse layers' CacheList as ragged rows, the pools per row, the indexer's choice per row); both
families' gated-delta / PLE / linear-attention ``ArraysCache`` s as mlx-vlm's own, rolled back per
row by mlx-vlm's ``commit_speculation``; Inkling (`mtplx.trunk.batch_inkling`); DeepSeek-V4
(``deepseek_v4``, `mtplx.trunk.batch_deepseek_v4`: its windows as per-row rings, each compressor's
pools / open window / overlap window per row, the indexer's choice per row, HISA's on a row's own
pools). The engine-level batches (rows share one forward, AR with rejections) are
``tests/heads/test_{qwen4_exp,glm5_next,inkling,deepseek_v4}.py``'s."""

from __future__ import annotations

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.spec_decode.rows import check_batch_support
from mtplx.trunk import vlm_text
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


def _tiny(family: str, **changes):
    """The family's tiny in-memory trunk model (``support.vlm_families``, Inkling's
    ``support.vlm_inkling``; ``changes``: DeepSeek-V4's config keys replaced)."""
    from support import vlm_inkling

    return getattr(vlm_inkling if family == "inkling" else families, f"tiny_{family}")(**changes)


def _inputs(rng, lengths) -> tuple:
    """Prompts of ``lengths`` tokens, three blocks of 3 and one of 1 for both rows, the counts kept."""
    prompts = [rng.integers(2, 90, size=n).tolist() for n in lengths]
    blocks = [rng.integers(2, 90, size=(2, BLOCK)) for _ in KEEPS] + [rng.integers(2, 90, size=(2, 1))]
    return prompts, blocks, [*KEEPS, [1, 1]]


def _ragged_rows_alone(trunk: Trunk, rng, lengths) -> tuple:
    """Two rows (``lengths`` committed tokens) forward verify blocks of 3 positions together, each
    keeping its own count (``KEEPS``), then one position: every kept position's logits and the
    last step's are each row's own forward's alone on its single-row caches (the mirror forwards
    only the kept tokens). Returns the prompts, blocks, keeps, the batch's logits and the batch."""
    prompts, blocks, keeps = _inputs(rng, lengths)
    singles, batch = _rows(trunk, prompts)
    together = _run(trunk, batch, blocks, keeps)
    for tokens, keep, logits in zip(blocks, keeps, together):
        for r, cache in enumerate(singles):
            if keep[r]:
                alone = trunk(mx.array(tokens[r : r + 1, : keep[r]]), cache).logits
                assert max_abs_diff(logits[r : r + 1, : keep[r]], alone) < TOL, (keep, r)
    assert batch.lengths == [n + sum(k[r] for k in keeps) for r, n in enumerate(lengths)]
    return prompts, blocks, keeps, together, singles, batch


@pytest.mark.parametrize("family", ["qwen4_exp", "glm5_next", "inkling", "deepseek_v4"])
@pytest.mark.parametrize("seed", [0, FRESH])
def test_ragged_rows_keep_their_own_count_and_give_each_rows_logits_alone(family, seed):
    """`_ragged_rows_alone` for rows of 1 and 13 committed tokens (DeepSeek-V4's long row past its
    window of 8 and, at 17 positions, past the 4 pools its indexer keeps). A row extracted from the
    batch decodes on as the mirror; after the short row leaves, the long one goes on alone in the
    batch. Control: a batch that keeps the whole first block of the short row (a missed rollback
    of every cache kind) gives other logits."""
    rng = np.random.default_rng(resolve(seed))
    trunk = Trunk(_tiny(family))
    prompts, blocks, keeps, together, singles, batch = _ragged_rows_alone(trunk, rng, LENGTHS)

    nxt = rng.integers(2, 90, size=(2, 1))
    extracted = batch.extract(0)
    want = [trunk(mx.array(nxt[r : r + 1]), singles[r]).logits for r in range(2)]
    assert max_abs_diff(trunk(mx.array(nxt[:1]), extracted).logits, want[0]) < TOL
    batch.remove_rows([1])
    assert max_abs_diff(trunk(mx.array(nxt[1:]), batch.layers).logits, want[1]) < TOL

    _, control = _rows(trunk, prompts)
    wrong = _run(trunk, control, blocks, [[BLOCK, 3], *keeps[1:]])
    assert max_abs_diff(wrong[-1][:1], together[-1][:1]) > 1e-2


def _no_hisa_rows(monkeypatch) -> None:
    """Control: every row's indexer choice is the plain scoring, never HISA's."""
    from mtplx.trunk import batch_deepseek_v4

    monkeypatch.setattr(batch_deepseek_v4, "_hisa_rows", lambda *args: [])


def _no_list_mask(monkeypatch) -> None:
    """Control: a layer's CacheList does not answer mlx-vlm's mask question with its window's."""
    from mtplx.trunk import batch_deepseek_v4

    layer = batch_deepseek_v4.deepseek_v4_layer

    def without_mask(template):
        out = layer(template)
        out.__dict__.pop("make_mask", None)
        return out

    monkeypatch.setitem(vlm_text.BATCH_LAYERS, "deepseek_v4", without_mask)


@pytest.mark.parametrize(
    ("changes", "long_row", "control"),
    [  # the long row's indexer takes mlx-vlm's HISA path alone (blocks of 2 pools, 2 kept)
        pytest.param({"index_block": 2, "index_keep": 2}, 21, _no_hisa_rows, id="hisa"),
        # layer 0 a CacheList (ratio 4), layer 1 a ratio-128 compressor whose window the long row completes
        pytest.param({"compress_ratios": [4, 128, 0]}, 126, _no_list_mask, id="ratio_128"),
    ],
)
def test_deepseek_v4_rows_give_their_logits_alone_under_hisa_and_a_ratio_128_compressor(
    changes, long_row, control, monkeypatch
):
    """`_ragged_rows_alone` for DeepSeek-V4 configurations the default replica does not reach: a
    long row whose indexer alone chooses by HISA (mlx-vlm's block-then-position choice, redone on
    that row's own pools), and a first layer with pool caches beside a ratio-128 compressor
    (mlx-vlm's plain pooling, no overlap). Control: without the row's own HISA choice, or with
    the first layer's CacheList giving mlx-vlm no mask, the long row's logits differ."""
    trunk = Trunk(_tiny("deepseek_v4", **changes))
    rng = np.random.default_rng(resolve(FRESH))
    prompts, blocks, keeps, together, _, _ = _ragged_rows_alone(trunk, rng, (1, long_row))
    control(monkeypatch)
    _, batch = _rows(trunk, prompts)
    wrong = _run(trunk, batch, blocks, keeps)
    assert max(max_abs_diff(w[1:], t[1:]) for w, t in zip(wrong, together)) > 1e-2


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
