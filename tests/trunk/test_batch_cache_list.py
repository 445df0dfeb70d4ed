"""A layer whose cache is a ``CacheList`` of K/V caches (an MLA latent and its DSA indexer's keys:
Hunyuan-V4 through mlx-vlm, DeepSeek-V3.2 / GLM-5 through mlx-lm; LongCat-Flash's two attentions) in a batch: every member a
`RaggedKVCache` with the rows' lengths, so ragged rows and per-row rollback work as for plain KV."""

from __future__ import annotations

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.engine.engine import Engine
from mtplx.engine.request import GenerationRequest
from mtplx.spec_decode.rows import check_batch_support
from mtplx.trunk.batch_cache import BatchCache
from mtplx.trunk.compat import CacheList, KVCache, cache_members

import mlx.core as mx
import numpy as np
import pytest
from support import checkpoints
from support.seeds import FRESH, resolve
from support.tokenizer import word_level
from support.vlm_heads import kept_and_rejected

HEADS, DIM, INDEX_DIM = 2, 4, 3
_req = GenerationRequest.from_kwargs


def _block(rng: np.random.Generator, rows: int, positions: int) -> tuple[mx.array, mx.array, mx.array]:
    """Latent keys, latent values and indexer keys of ``positions`` new positions of ``rows`` rows."""

    def draw(*shape: int) -> mx.array:
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    return (
        draw(rows, HEADS, positions, DIM),
        draw(rows, HEADS, positions, DIM),
        draw(rows, 1, positions, INDEX_DIM),
    )


def _write(layer, block) -> None:
    """One layer's forward writes: the latent pair, then the indexer's keys with empty values (as
    mlx-vlm's and mlx-lm's DSA indexers store them)."""
    latent, index = cache_members(layer)
    keys, values, index_keys = block
    latent.update_and_fetch(keys, values)
    index.update_and_fetch(index_keys, mx.zeros((*index_keys.shape[:3], 0)))


def _held(layer) -> list[np.ndarray]:
    """What each member of a single-row ``CacheList`` holds: its K and V up to its offset."""
    out = []
    for member in cache_members(layer):
        n = member.offset
        out += [np.array(member.keys[..., :n, :]), np.array(member.values[..., :n, :])]
    return out


@pytest.mark.parametrize("seed", [0, FRESH])
def test_rows_keep_their_own_count_of_a_block_in_every_member(seed):
    """Three rows of different lengths join, a block of 3 positions is written for all of them and
    row r keeps keep[r]; every row then holds exactly what its own single-row caches hold after
    the kept positions alone, also after the middle row leaves. Control: without the commit the
    rows that dropped positions would hold more (so the comparison sees a missed rollback)."""
    rng = np.random.default_rng(resolve(seed))
    lengths, keep, block_len = [5, 2, 7], [0, 2, 3], 3
    singles = [CacheList(KVCache(), KVCache()) for _ in lengths]
    for layer, n in zip(singles, lengths):
        _write(layer, _block(rng, 1, n))
    batch = BatchCache([CacheList(KVCache(), KVCache())])
    batch.add_rows([[layer] for layer in singles])
    assert batch.lengths == lengths

    block = _block(rng, len(lengths), block_len)
    record = batch.begin_block(block_len)
    _write(batch.layers[0], block)
    uncommitted = [_held(batch.extract(r)[0]) for r in range(len(lengths))]
    batch.commit_block(record, keep)
    for r, (layer, n) in enumerate(zip(singles, keep)):  # the mirror: row r writes its kept positions alone
        _write(layer, tuple(part[r : r + 1, :, :n, :] for part in block))
    assert batch.lengths == [a + n for a, n in zip(lengths, keep)]
    for r, layer in enumerate(singles):
        want = _held(layer)
        assert all(np.array_equal(a, b) for a, b in zip(_held(batch.extract(r)[0]), want, strict=True))
        if keep[r] < block_len:  # control
            assert any(a.shape != b.shape for a, b in zip(uncommitted[r], want))

    batch.remove_rows([0, 2])
    for r, layer in zip(range(2), (singles[0], singles[2])):
        assert all(
            np.array_equal(a, b) for a, b in zip(_held(batch.extract(r)[0]), _held(layer), strict=True)
        )


# LongCat-Flash (~2 s) runs in make test; the DSA families (~10-25 s each) under make test-slow, beside
# Hunyuan-V4's batch test (tests/heads/test_hy_v4.py), which runs an indexer CacheList every make test.
@pytest.mark.parametrize(
    "family",
    [
        pytest.param("deepseek_v32", marks=pytest.mark.slow),
        pytest.param("glm_moe_dsa", marks=pytest.mark.slow),
        "longcat_flash",
    ],
)
def test_mlx_lm_cache_list_rows_batch_and_equal_ar_with_rejections(family, tmp_path):
    """DeepSeek-V3.2 and GLM-5 (MLA + DSA indexer in one CacheList per layer; 4 kept keys) and
    LongCat-Flash (two attentions' KV in one CacheList) through mlx-lm: their rows batch, and
    greedy head rows at depth 2 give each prompt's AR tokens alone with drafts kept and rejected."""
    path = tmp_path / family
    if family == "longcat_flash":
        checkpoints.longcat_flash(path, context_strength=0.3)
    else:
        checkpoints.deepseek_v3(path, model_type=family, context_strength=0.3, moe=family == "glm_moe_dsa")
    word_level(path)
    engine = Engine.load(str(path), depth=2)
    assert check_batch_support(engine.trunk, engine.head) is None
    prompts = ([3, 17, 22, 5, 30, 9, 11, 2, 13, 8], [20, 10, 5, 7, 2, 9], [7, 7, 12, 9, 4, 4, 11])
    want = [engine.generate(list(p), _req(max_tokens=12, draft="none")).token_ids for p in prompts]
    requests = [_req(max_tokens=12, draft="head", depth=2) for _ in prompts]
    batched = engine.generate_batch([list(p) for p in prompts], requests, max_rows=3, draft_policy="fixed")
    assert [b.token_ids for b in batched] == want
    kept, rejected = map(sum, zip(*(kept_and_rejected(b.stats) for b in batched)))
    assert kept > 0 and rejected > 0, (kept, rejected)


@pytest.mark.parametrize("seed", [0, FRESH])
def test_hunyuan_v4_ragged_rows_give_each_rows_logits_alone(seed):
    """A Hunyuan-V4 trunk (mlx-vlm; DSA indexer keeping 4 keys) forwards a 2-position block, then
    one position, for two rows of 1 and 9 committed tokens in one batch: each row's logits are
    its own forward's alone. The short row holds at most 4 keys (alone its indexer selects
    nothing) while the padded batch holds more, so its keys are chosen under its row's mask."""
    from mtplx.trunk.model import Trunk

    from support.vlm_families import tiny_hy_v4
    from support.vlm_heads import max_abs_diff

    rng = np.random.default_rng(resolve(seed))
    trunk = Trunk(tiny_hy_v4())
    prompts = [rng.integers(2, 40, size=n).tolist() for n in (1, 9)]
    singles = []
    for prompt in prompts:
        cache = trunk.make_cache()
        trunk(mx.array([prompt]), cache)
        singles.append(cache)
    batch = BatchCache(trunk.make_cache(), trunk.model)
    batch.add_rows(singles)
    for block_len in (2, 1):
        tokens = rng.integers(2, 40, size=(len(prompts), block_len))
        together = trunk(mx.array(tokens), batch.layers).logits
        for r, cache in enumerate(singles):
            alone = trunk(mx.array(tokens[r : r + 1]), cache).logits
            assert max_abs_diff(together[r : r + 1], alone) < 1e-4
    assert batch.lengths == [len(p) + 3 for p in prompts]
