"""Quantized KV (`mtplx.trunk.kv_quant`): the flags' plan, the position rule, rollback of a block
that converts, the batch's quantized rows, and the prompt cache's quantized entries.

The reference for "quantized KV" is mlx-lm's own plain decoding: one token per forward and
``maybe_quantize_kv_cache`` between steps (mlx_lm/generate.py), which converts the caches once
they hold ``quantized_kv_start`` positions. (mlx-lm calls it after each step, so its very first
forward is float even with start 0; called before each step, as here, position 0 is quantized
too: the rule mtplx states by position.) Tiny float32 llama with head dimension 32 (the smallest
group size quantization takes).
"""

from __future__ import annotations

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.errors import MtplxError
from mtplx.trunk import kv_quant
from mtplx.trunk.batch_cache import BatchCache, check_batchable
from mtplx.trunk.kv_quant import KVQuantization
from mtplx.trunk.model import Trunk
from mtplx.trunk.prompt_cache import PromptCache
from mtplx.trunk.row_cache import SingleRowCache

import mlx.core as mx
import pytest
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache
from support.models import tiny_llama

TOKENS = [5, 9, 2, 11, 7, 3, 3, 8, 12, 1, 4, 4, 9, 10]
FLOAT_TOL = 2e-5  # float32 rounding between forwards of different shapes
GROUP = 32


@pytest.fixture(scope="module")
def model():
    return tiny_llama(64, seed=3, hidden_size=64, num_heads=2, num_kv_heads=1)


def _trunk(model, plan: KVQuantization | None) -> Trunk:
    trunk = Trunk(model)
    trunk.kv_quantization = plan
    return trunk


def mlx_lm_decoding(model, tokens: list[int], plan: KVQuantization | None) -> tuple[mx.array, list]:
    """Logits [T, V] of every position and the caches after them, as mlx-lm decodes: one token per
    forward, ``maybe_quantize_kv_cache`` between them (the module docstring)."""
    cache = make_prompt_cache(model)
    rows = []
    for t in tokens:
        if plan is not None:
            maybe_quantize_kv_cache(cache, plan.start, plan.group_size, plan.bits)
        rows.append(model(mx.array([[t]]), cache=cache)[0, -1])
    if plan is not None:
        maybe_quantize_kv_cache(cache, plan.start, plan.group_size, plan.bits)
    return mx.stack(rows), cache


def _in_blocks(trunk: Trunk, tokens: list[int], sizes: list[int], cache: list | None = None) -> mx.array:
    cache = cache if cache is not None else trunk.make_cache()
    out, at = [], 0
    for size in sizes:
        out.append(trunk(mx.array([tokens[at : at + size]]), cache).logits[0])
        at += size
    return mx.concatenate(out)


def _max_diff(a: mx.array, b: mx.array) -> float:
    return float(mx.max(mx.abs(a - b)))


def _positions(c) -> list[mx.array]:
    """What a single-row cache holds for its committed positions (each array of K/V)."""
    keys, values = (c.keys, c.values) if type(c) is QuantizedKVCache else ((c.keys,), (c.values,))
    return [x[..., : c.offset, :] for x in (*keys, *values)]


def assert_same_caches(got: list, want: list) -> None:
    for layer, (g, w) in enumerate(zip(got, want)):
        assert type(g) is type(w), (layer, type(g).__name__, type(w).__name__)
        assert g.offset == w.offset, (layer, g.offset, w.offset)
        for x, y in zip(_positions(g), _positions(w)):
            assert _max_diff(x.astype(mx.float32), y.astype(mx.float32)) <= FLOAT_TOL, layer


# --------------------------------------------------------------------------- the plan


def test_plan_defaults_and_bad_values_name_the_flag():
    assert KVQuantization.from_flags(None) is None
    with pytest.raises(MtplxError, match=r"^kv_group_size needs kv_bits"):
        KVQuantization.from_flags(None, 32)  # it would do nothing
    with pytest.raises(MtplxError, match=r"^quantized_kv_start needs kv_bits"):
        KVQuantization.from_flags(None, None, 0)
    assert KVQuantization.from_flags(8) == KVQuantization(8, 64, 5000)  # mlx-lm's defaults
    for args, field in [((7,), "kv_bits"), ((4, 48), "kv_group_size"), ((4, 64, -1), "quantized_kv_start")]:
        with pytest.raises(MtplxError, match=rf"^{field} must be"):
            KVQuantization.from_flags(*args)


# --------------------------------------------------------------------------- the position rule


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("start", [0, 5])
def test_any_block_shape_gives_mlx_lm_decodings_logits(model, bits, start):
    """Blocks that cross the start (3 + 4 + 7 with start 5: the second block holds positions 3..6)
    give, at every position, the logits of mlx-lm's one-token-per-step decoding with the same
    flags; and quantization shows (they are not the float model's)."""
    plan = KVQuantization(bits, GROUP, start)
    want, _ = mlx_lm_decoding(model, TOKENS, plan)
    got = _in_blocks(_trunk(model, plan), TOKENS, [3, 4, 7])
    assert _max_diff(got, want) <= FLOAT_TOL
    float_logits, _ = mlx_lm_decoding(model, TOKENS, None)
    assert _max_diff(float_logits[start + 1 :], want[start + 1 :]) > 100 * FLOAT_TOL


def test_a_block_converted_at_its_first_position_is_caught(model, monkeypatch):
    """Negative control: converting a crossing block as a whole (before its first position, as
    converting at the block boundary would) gives its positions before the start other logits."""
    plan = KVQuantization(4, GROUP, 5)
    want, _ = mlx_lm_decoding(model, TOKENS, plan)
    honest = kv_quant.conversion_split
    monkeypatch.setattr(kv_quant, "conversion_split", lambda c, n: None if honest(c, n) is None else 0)
    got = _in_blocks(_trunk(model, plan), TOKENS, [3, 4, 7])
    assert _max_diff(got[3:5], want[3:5]) > 100 * FLOAT_TOL


# --------------------------------------------------------------------------- rollback


@pytest.mark.parametrize("keep", [0, 1, 2, 3, 4, 5])
def test_a_converting_block_keeps_any_prefix_as_decoding_would(model, keep):
    """A verify block of 5 positions from offset 3 with start 5 converts inside it; keeping
    ``keep`` of them leaves the caches mlx-lm's decoding of those positions leaves (float below
    the start, quantized from it), and undoing it restores the float caches."""
    plan = KVQuantization(8, GROUP, 5)
    trunk = _trunk(model, plan)
    rows = SingleRowCache()
    rows.add_rows([trunk.make_cache()])
    trunk(mx.array([TOKENS[:3]]), rows.layers)
    block = rows.begin_block(5)
    assert isinstance(block, kv_quant.ConversionBlock)
    trunk(mx.array([TOKENS[3:8]]), rows.layers)
    assert all(type(c) is QuantizedKVCache for c in rows.layers)
    rows.commit_block(block, [keep])
    _, want = mlx_lm_decoding(model, TOKENS[: 3 + keep], plan)
    assert_same_caches(rows.layers, want)
    # The next forward continues as decoding does (a float cache converts at the start again).
    logits = trunk(mx.array([TOKENS[3 + keep : 9]]), rows.layers).logits[0]
    want_logits, _ = mlx_lm_decoding(model, TOKENS[:9], plan)
    assert _max_diff(logits, want_logits[3 + keep :]) <= FLOAT_TOL


def test_an_aborted_converting_block_leaves_the_float_caches(model):
    """An AR step at the start converts the caches; undone (a queued step dropped), they are the
    float caches of the positions before it again."""
    plan = KVQuantization(4, GROUP, 4)
    trunk = _trunk(model, plan)
    rows = SingleRowCache()
    rows.add_rows([trunk.make_cache()])
    trunk(mx.array([TOKENS[:4]]), rows.layers)
    assert [type(c) for c in rows.layers] == [KVCache, KVCache]  # 4 held: converts before the 5th
    block = rows.begin_block(1)  # one position, but it converts: undone with the block
    trunk(mx.array([TOKENS[4:5]]), rows.layers)
    assert [type(c) for c in rows.layers] == [QuantizedKVCache, QuantizedKVCache]
    rows.abort_block(block)
    assert [type(c) for c in rows.layers] == [KVCache, KVCache]
    assert_same_caches(rows.layers, mlx_lm_decoding(model, TOKENS[:4], None)[1])


def test_only_quantized_from_zero_batches(model):
    assert check_batchable(_trunk(model, KVQuantization(4, GROUP, 0)).make_cache(), model) is None
    reason = check_batchable(_trunk(model, KVQuantization(4, GROUP, 100)).make_cache(), model)
    assert reason is not None and "position 100" in reason


# --------------------------------------------------------------------------- the batch's rows


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_batch_rows_hold_what_their_own_caches_would(model, bits):
    """Rows of different lengths join a quantized batch, take one block [3, 4] with per-row keeps,
    and each holds (`extract`) and computes what its own QuantizedKVCache would: logits of every
    real block position, then the caches of the kept positions."""
    plan = KVQuantization(bits, GROUP, 0)
    trunk = _trunk(model, plan)
    prompts = [TOKENS[:3], TOKENS[2:9], TOKENS[5:6]]
    blocks = [[4, 4, 9, 10], [1, 2], [7, 7, 7]]
    keeps = [2, 0, 3]
    batch = BatchCache(trunk.make_cache(), model)
    singles = []
    for p in prompts:
        cache = trunk.make_cache()
        trunk(mx.array([p]), cache)
        singles.append(cache)
    batch.add_rows(singles)
    width = max(map(len, blocks))
    block = batch.begin_block(width)
    padded = mx.array([b + [0] * (width - len(b)) for b in blocks])
    logits = trunk(padded, batch.layers).logits
    batch.commit_block(block, keeps)
    for r, (p, b, keep) in enumerate(zip(prompts, blocks, keeps)):
        want_logits, _ = mlx_lm_decoding(model, p + b, plan)
        assert _max_diff(logits[r, : len(b)], want_logits[len(p) :]) <= FLOAT_TOL, r
        assert_same_caches(batch.extract(r), mlx_lm_decoding(model, p + b[:keep], plan)[1])
    assert batch.lengths == [len(p) + k for p, k in zip(prompts, keeps)]


# --------------------------------------------------------------------------- the prompt cache


def test_prompt_cache_stores_quantized_entries_and_never_trims_below_the_start(model):
    """A quantized entry is stored as it is and reused trimmed; an entry converted at the start
    serves prefixes of at least the start only (below it the sequence's caches are float)."""
    store = PromptCache(1 << 30)
    zero = _trunk(model, KVQuantization(4, GROUP, 0))
    cache = zero.make_cache()
    zero(mx.array([TOKENS]), cache)
    store.insert(TOKENS, len(TOKENS), cache, None, copy=True)
    hit = store.lookup(TOKENS[:6] + [0, 0], with_head=False)
    assert hit is not None and hit.start == 6
    assert_same_caches(hit.trunk_cache, mlx_lm_decoding(model, TOKENS[:6], zero.kv_quantization)[1])

    store.clear()
    later = _trunk(model, KVQuantization(4, GROUP, 8))
    cache = later.make_cache()
    later(mx.array([TOKENS]), cache)
    assert all(type(c) is QuantizedKVCache for c in cache)
    store.insert(TOKENS, len(TOKENS), cache, None, copy=True)
    assert store.lookup(TOKENS[:7] + [0, 0], with_head=False) is None
    hit = store.lookup(TOKENS[:9] + [0], with_head=False)
    assert hit is not None and hit.start == 9
    assert_same_caches(hit.trunk_cache, mlx_lm_decoding(model, TOKENS[:9], later.kv_quantization)[1])


# --------------------------------------------------------------------------- memory


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_kv_bytes_per_token_is_what_real_caches_hold(model, bits):
    """`kv_bytes_per_token` (what `inspect` and `doctor` print) from the config alone equals the
    bytes mlx-lm's caches hold per position (256 positions: one allocation step, no slack)."""
    plan = None if bits is None else KVQuantization(bits, GROUP, 0)
    cache = _trunk(model, plan).make_cache()
    model(mx.zeros((1, 256), dtype=mx.int32), cache=cache)
    config = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1}
    held = sum(c.nbytes for c in cache)
    assert kv_quant.kv_bytes_per_token(config, bits, GROUP, float_bytes=4) * 256 == held
