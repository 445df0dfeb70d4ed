"""Cache rollback: after any accept/reject pattern every cache equals a from-scratch run.

Each cycle forwards a block [pending, d1..d(T-1)] through a real tiny mlx-lm
model, keeps a random prefix of it (commit_block), then rebuilds the cache by
running the whole committed sequence from scratch and compares both caches
(KV contents, rotating windows, conv and recurrent states) and the logits of the
next position. Negative controls run the same loop with deliberately wrong
commits and must be caught by the same comparison.

Seeds: the comparisons run on two fixed seeds and one fresh seed per run (``support.seeds``), and
every failure message names the seed and, where the test draws them, the tokens; the negative
controls keep fixed seeds and patterns, so each proves the same catch every run.
"""

from __future__ import annotations

from collections.abc import Callable

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.trunk import rollback as cache_ops
from mtplx.trunk.compat import cache_leaves
from mtplx.trunk.recurrent_capture import RecurrentRecord

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)
from support import models
from support.seeds import FRESH, SEEDS, resolve

QUANTIZED_TOL = 1e-2  # logits and float states of a run with quantized KV: `run_cycles`
TOL = 2e-4  # float32 models; a from-scratch prefill differs only by matmul blocking

Commit = Callable[[list, cache_ops.BlockCapture, int], None]


# --------------------------------------------------------------------------- comparison


def _rotating_window(c: RotatingKVCache) -> list[mx.array]:
    """The entries a next query can attend to, oldest first: the last max_size - 1 positions."""
    keys, values, offset, keep, max_size, idx = c.state
    assert keep == 0, "the test models use keep=0"
    length = keys.shape[2]
    if idx == length:
        order = [keys, values]
    elif idx < offset:  # in-place writes wrapped: oldest entries start at idx
        order = [mx.concatenate([v[..., idx:, :], v[..., :idx, :]], axis=2) for v in (keys, values)]
    else:
        order = [keys[..., :idx, :], values[..., :idx, :]]
    needed = min(offset, max_size - 1)
    return [v[..., v.shape[2] - needed :, :] for v in order]


def _vlm_rotating_window(c) -> list[mx.array]:
    """mlx-vlm's RotatingKVCache's attendable entries, oldest first (as `_rotating_window`)."""
    order = [c._temporal_order(v) for v in (c.keys, c.values)]
    needed = min(c.offset, c.max_size - 1)
    return [v[..., v.shape[2] - needed :, :] for v in order]


def _canonical(c) -> tuple[int, list[mx.array]]:
    """(position count, arrays that determine all future outputs) for one cache."""
    if type(c) is KVCache:
        return c.offset, [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
    if type(c) is QuantizedKVCache:
        return c.offset, [x[..., : c.offset, :] for x in (*c.keys, *c.values)]
    if type(c) is RotatingKVCache:
        return c.offset, _rotating_window(c)
    if type(c) is ArraysCache:
        return -1, list(c.cache)
    if (
        type(c).__name__ == "QSAQuantizedKVCache"
    ):  # mlx-vlm's, under --kv-bits: packed KV + float indexer keys
        packed = [x[..., : c.offset, :] for x in (*c.keys, *c.values)]
        return c.offset, packed + [c.index_keys[:, : c.offset], c.index_position_ids[..., : c.offset]]
    if type(c).__name__ == "QSAKVCache":  # mlx-vlm's (Qwen3.8-Flash-Next): KV + the indexer's raw keys
        kept = [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
        return c.offset, kept + [c.index_keys[:, : c.offset], c.index_position_ids[..., : c.offset]]
    if type(c).__name__ == "ArraysCache":  # mlx-vlm's: gated-delta conv + state, PLE window + n-gram history
        return -1, list(c.cache)
    if type(c).__name__ == "MiniMaxM3KVCache":  # mlx-vlm's: KV + the indexer's keys
        offset, kv = _canonical(c.kv_cache)
        index = [] if c.index_keys is None else [c.index_keys[..., : c.index_offset, :]]
        return offset, kv + index
    if type(c).__name__ == "KVCache":  # mlx-vlm's (GLM-5-Next's MLA latents, indexer keys, pooled keys)
        kept = [] if c.keys is None else [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
        return c.offset, kept
    if type(c).__name__ == "RotatingKVCache":  # mlx-vlm's (DeepSeek-V4's sliding window)
        return c.offset, _vlm_rotating_window(c)
    if type(c).__name__ == "PoolingCache":  # mlx-vlm's (DeepSeek-V4): pooled rows, open window, overlap
        open_window = [] if c.remainder == 0 else [c.buf_kv[:, : c.remainder], c.buf_gate[:, : c.remainder]]
        overlap = list(getattr(c, "overlap_window", ()))
        return 1000 * c.offset + c.remainder, ([] if c.pooled is None else [c.pooled]) + open_window + overlap
    raise AssertionError(f"unexpected cache type {type(c).__name__}")


def _max_diff(a: mx.array, b: mx.array) -> float:
    if a.size == 0 and b.size == 0:  # an indexer cache's values are [B, 1, T, 0]
        return 0.0
    return float(mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))))


def _all_leaves(cache: list) -> list:
    """mtplx's leaves, an mlx-vlm CacheList (DeepSeek-V4's window + pool caches) opened too."""
    out = []
    for c in cache_leaves(cache):
        if type(c).__name__ != "CacheList":
            out.append(c)
        elif len(c.caches) == 4 and type(c.caches[2]).__name__ == "PoolingCache":
            # GLM-5-Next's (latent KV, indexer KV, pooled keys, projected K/V): the last is a prefill
            # accelerator (filled only by forwards longer than mlx-vlm's DECODE_BLOCK_SIZE, read only
            # when it covers every earlier position; its entries are the latents' projections)
            out.extend(_all_leaves(c.caches[:3]))
        else:
            out.extend(_all_leaves(c.caches))
    return out


def cache_mismatch(got: list, want: list, float_tol: float = TOL) -> str | None:
    """None if both caches hold the same content, else the first difference: packed entries within
    one quantization level, float entries within ``float_tol`` (relative past magnitude 1)."""
    # A CacheList (DeepSeek-V3.2's MLA + indexer, Hunyuan-V4's) is compared member by member.
    got, want = _all_leaves(got), _all_leaves(want)
    if len(got) != len(want):
        return f"{len(got)} leaf caches vs {len(want)}"
    for layer, (g, w) in enumerate(zip(got, want)):
        if type(g) is not type(w):
            return f"layer {layer}: {type(g).__name__} vs {type(w).__name__}"
        (g_len, g_arrays), (w_len, w_arrays) = _canonical(g), _canonical(w)
        if g_len != w_len:
            return f"layer {layer}: {g_len} positions vs {w_len}"
        if type(g) is QuantizedKVCache or type(g).__name__ == "QSAQuantizedKVCache":
            # Packed levels are compared as values: a K or V entry computed in a block of another
            # shape may differ in its last float bit and land one level over (a packed uint32 then
            # differs by up to 2**32). The dequantized entries must agree within one level.
            g_arrays, w_arrays = _dequantized(g) + g_arrays[6:], _dequantized(w) + w_arrays[6:]  # + indexer
            scales = [part[1][..., : c.offset, :] for c in (g, w) for part in (c.keys, c.values)]
            tol, relative = TOL + 1.01 * max(float(mx.max(mx.abs(x))) for x in scales), False
        else:
            tol, relative = float_tol, True
        for slot, (x, y) in enumerate(zip(g_arrays, w_arrays)):
            if x.shape != y.shape:
                return f"layer {layer} slot {slot}: shape {x.shape} vs {y.shape}"
            # Relative past magnitude 1: a block of another shape moves float32 entries by their last
            # bits (seen: 2.8e-4 on Qwen3.8-Flash-Next's QSA keys of magnitude 6, with a fresh seed).
            scale = max(1.0, float(mx.max(mx.abs(y)))) if relative and y.size else 1.0
            if (d := _max_diff(x, y)) > tol * scale:
                return f"layer {layer} slot {slot}: max diff {d:.3g}"
    return None


def _dequantized(c: QuantizedKVCache) -> list[mx.array]:
    """The keys and values a QuantizedKVCache holds for its positions, dequantized."""
    return [
        mx.dequantize(*(x[..., : c.offset, :] for x in part), group_size=c.group_size, bits=c.bits)
        for part in (c.keys, c.values)
    ]


# --------------------------------------------------------------------------- the cycle loop


def _scratch(model, make_cache: Callable[[], list], tokens: list[int]) -> list:
    cache = make_cache()
    mx.eval(model(mx.array(tokens)[None], cache=cache))
    return cache


def run_cycles(
    model,
    make_cache: Callable[[], list],
    seed: int,
    *,
    cycles: int = 8,
    prompt_len: int = 6,
    pattern: list[tuple[int, int]] | None = None,
    commit: Commit = cache_ops.commit_block,
) -> str | None:
    """Random (or given) (block length, num_keep) cycles; the first mismatch with a scratch run, or None."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, models.ROLLBACK_VOCAB, size=prompt_len).tolist()
    cache = make_cache()
    mx.eval(model(mx.array(tokens)[None], cache=cache))
    pending = int(rng.integers(models.ROLLBACK_VOCAB))
    want_next = None  # logits for `pending` computed through a scratch cache
    steps = pattern or [(0, 0)] * cycles
    # Quantized KV: an entry one level over (`cache_mismatch`) moves later logits by ~1e-4..1e-3;
    # a rollback that keeps a wrong position moves them by far more.
    # (mlx-lm's QuantizedKVCache and mlx-vlm's QSAQuantizedKVCache alike: seen 2.4e-4 with a fresh seed.)
    # The float states of later layers (conv windows, recurrent states) read that entry too, so they
    # are held to the same tolerance: `test_qwen4_exp_under_kv_bits_rolls_back_as_plain_decoding`.
    quantized = any(
        isinstance(c, QuantizedKVCache) or "Quantized" in type(c).__name__ for c in cache_leaves(cache)
    )
    tol = QUANTIZED_TOL if quantized else TOL
    for cycle, (block_len, num_keep) in enumerate(steps):
        block_len = block_len or int(rng.integers(1, 10))
        num_keep = num_keep or int(rng.integers(1, block_len + 1))
        block = [pending] + rng.integers(0, models.ROLLBACK_VOCAB, size=block_len - 1).tolist()
        told = block_len if rng.random() < 0.5 else None  # the decode loop may or may not pass it
        if any(type(c).__module__.startswith("mlx_vlm.") for c in cache_leaves(cache)):
            told = block_len  # mlx-vlm's transactions need it (the decode loop always passes it)
        capture = cache_ops.begin_block(cache, told)
        logits = model(mx.array(block)[None], cache=cache)
        mx.eval(logits)
        if want_next is not None and (d := _max_diff(logits[0, 0], want_next)) > tol:
            return f"cycle {cycle}: next-step logits differ by {d:.3g}"
        commit(cache, capture, num_keep)
        tokens += block[:num_keep]
        pending = int(rng.integers(models.ROLLBACK_VOCAB))
        scratch = _scratch(model, make_cache, tokens)
        if (why := cache_mismatch(cache, scratch, tol)) is not None:
            return f"cycle {cycle} (T={block_len}, keep={num_keep}): {why}"
        want_next = model(mx.array([[pending]]), cache=scratch)[0, -1]
    final = model(mx.array([[pending]]), cache=cache)[0, -1]
    if (d := _max_diff(final, want_next)) > tol:
        return f"final next-step logits differ by {d:.3g}"
    return None


MODELS = {
    "llama": ("llama", None),
    "llama_quantized_kv": ("llama", models.quantized_kv_cache),
    "qwen3_5_hybrid": ("qwen3_5", None),
    "qwen3_next_hybrid": ("qwen3_next", None),
    "gemma3_rotating": ("gemma3", None),
    "nemotron_h_hybrid": ("nemotron_h", None),
    "hy_v4_dsa": ("hy_v4", None),  # mlx-vlm's language model: CacheList(MLA KV, indexer KV) per layer
    # mlx-vlm's own caches: QSAKVCache (KV + QSA indexer keys), gated-delta and PLE ArraysCaches
    "qwen4_exp_qsa_hybrid": ("qwen4_exp", None),
    # mlx-vlm's own caches: sliding-window RotatingKVCache, CacheList(window, PoolingCache x2)
    "deepseek_v4_pooled": ("deepseek_v4", None),
    # mlx-vlm's own caches: linear-attention ArraysCaches, CacheList(KV, indexer KV, PoolingCache, KV)
    "glm5_next_hybrid": ("glm5_next", None),
    # mlx-vlm's own caches: MiniMaxM3KVCache (KV + the block-sparse indexer's keys), KVCache
    "minimax_m3_sparse": ("minimax_m3", None),
    # mlx-vlm's own caches: CacheList(KVCache, ArraysCache(4): the short convolutions' windows)
    "inkling_sconv": ("inkling", None),
}


def _model_and_cache(name: str):
    family, cache_fn = MODELS[name]
    model = models.rollback_model(family)
    make_cache = (lambda: cache_fn(model)) if cache_fn else model.make_cache
    return model, make_cache


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_case(request):
    return (request.param, *_model_and_cache(request.param))


@pytest.mark.parametrize("seed", SEEDS)
def test_random_accept_patterns_match_scratch(model_case, seed):
    name, model, make_cache = model_case
    seed = resolve(seed)
    assert cache_ops.check_rollback_support(make_cache(), model) is None
    why = run_cycles(model, make_cache, seed)
    assert why is None, f"{name}, seed {seed}: {why}"


def test_full_accept_and_single_token_blocks(model_case):
    # Edge patterns: accept everything, keep only the pending token, T=1 blocks
    # (the in-place path of a rotating cache once its window has wrapped); fresh tokens every run.
    name, model, make_cache = model_case
    seed = resolve(FRESH)
    pattern = [(9, 9), (9, 1), (1, 1), (1, 1), (5, 5), (2, 1), (1, 1), (9, 3)]
    why = run_cycles(model, make_cache, seed, pattern=pattern)
    assert why is None, f"{name}, seed {seed}: {why}"


# --------------------------------------------------------------------------- negative controls


def _commit_recurrent_off_by_one(cache: list, capture: cache_ops.BlockCapture, num_keep: int) -> None:
    block_len = cache_ops._block_len(capture)
    wrong = num_keep - 1 if num_keep == block_len else num_keep + 1
    for r in capture.records:
        if isinstance(r, RecurrentRecord):
            r.commit(wrong)
        else:
            r.commit(num_keep, block_len)
    capture.status = "committed"


def _commit_without_trim(cache: list, capture: cache_ops.BlockCapture, num_keep: int) -> None:
    block_len = cache_ops._block_len(capture)
    for r in capture.records:
        if isinstance(r, RecurrentRecord):
            r.commit(num_keep)
        else:
            r.commit(block_len, block_len)
    capture.status = "committed"


REJECTING = [(6, 2), (4, 4), (7, 3)]


def test_negative_control_recurrent_off_by_one_is_caught():
    model, make_cache = _model_and_cache("qwen3_5_hybrid")
    assert run_cycles(model, make_cache, 5, pattern=REJECTING) is None
    why = run_cycles(model, make_cache, 5, pattern=REJECTING, commit=_commit_recurrent_off_by_one)
    assert why is not None and "layer 0" in why


def _commit_without_ssm_rollback(cache: list, capture: cache_ops.BlockCapture, num_keep: int) -> None:
    """The conv state rolled back, the recurrent (SSM) state left as the whole block made it."""
    block_len = cache_ops._block_len(capture)
    for r in capture.records:
        if isinstance(r, RecurrentRecord):
            final = r.states[-1]
            r.commit(num_keep)
            r.cache[1] = final
        else:
            r.commit(num_keep, block_len)
    capture.status = "committed"


def test_negative_control_skipped_ssm_rollback_is_caught():
    """Nemotron-H's Mamba2 state: a commit that rolls back the conv state but not the SSM state
    (the state-update hook skipped) differs from the scratch run at the first Mamba2 layer."""
    model, make_cache = _model_and_cache("nemotron_h_hybrid")
    assert run_cycles(model, make_cache, 5, pattern=REJECTING) is None
    why = run_cycles(model, make_cache, 5, pattern=REJECTING, commit=_commit_without_ssm_rollback)
    assert why is not None and "layer 0 slot 1" in why, why


@pytest.mark.parametrize(
    "name",
    [
        "llama",
        "qwen3_5_hybrid",
        "gemma3_rotating",
        "hy_v4_dsa",
        "qwen4_exp_qsa_hybrid",
        "deepseek_v4_pooled",
        "glm5_next_hybrid",
        "minimax_m3_sparse",
        "inkling_sconv",
    ],
)
def test_negative_control_skipped_trim_is_caught(name):
    model, make_cache = _model_and_cache(name)
    assert run_cycles(model, make_cache, 6, pattern=REJECTING, commit=_commit_without_trim) is not None


def test_qwen4_exp_under_kv_bits_rolls_back_as_plain_decoding():
    """Qwen3.8-Flash-Next with ``--kv-bits 8`` (mlx-vlm's QSAQuantizedKVCache: packed KV, float
    indexer keys; `kv_quant.make_cache`): random accept patterns leave the caches a scratch run
    leaves (controls: the trim skipped; the gated-delta states left as the whole block made them).

    Seeds 5 and 50 are the ones (of 120) where a block and a scratch prefill computed one value of
    layer 1 a last bit apart across a rounding boundary: the packed entry sits one level over
    (0.02 here) and layer 2's conv window and state, which read it, moved by up to 5.5e-4 of their
    magnitude. It is not the rollback: forwarding only the kept prefix (no rejected token ever
    written) gives the same entry. So the float states of a quantized run are held to
    QUANTIZED_TOL (1e-2) as its logits are; a skipped recurrent rollback moves them by more
    than 1x their magnitude (seeds 0..7), caught here at layer 0."""
    model = models.rollback_model("qwen4_exp")

    def make_cache():
        return models.quantized_kv_cache_of_its_own(model)

    assert "QSAQuantizedKVCache" in {type(c).__name__ for c in make_cache()}
    for seed in (5, 50, resolve(FRESH)):
        why = run_cycles(model, make_cache, seed)
        assert why is None, f"seed {seed}: {why}"
    assert run_cycles(model, make_cache, 6, pattern=REJECTING, commit=_commit_without_trim) is not None
    why = run_cycles(model, make_cache, 6, pattern=REJECTING, commit=_commit_without_recurrent_rollback)
    assert why is not None and "layer 0 slot" in why, why


def _commit_without_recurrent_rollback(cache: list, capture: cache_ops.BlockCapture, num_keep: int) -> None:
    """mlx-vlm's own caches: the QSA KV trimmed, every ArraysCache (gated-delta state and conv,
    PLE window, n-gram history) left as the whole block made it."""
    block_len = cache_ops._block_len(capture)
    for r in capture.records:
        if type(r.cache).__name__ == "ArraysCache":
            r.cache._speculation = None  # end mlx-vlm's transaction without selecting a state
        else:
            r.commit(num_keep, block_len)
    capture.status = "committed"


@pytest.mark.parametrize("name", ["qwen4_exp_qsa_hybrid", "glm5_next_hybrid"])
def test_negative_control_skipped_recurrent_rollback_of_mlx_vlms_caches_is_caught(name):
    model, make_cache = _model_and_cache(name)
    why = run_cycles(model, make_cache, 6, pattern=REJECTING, commit=_commit_without_recurrent_rollback)
    assert why is not None and "slot" in why, why


def test_negative_control_inklings_conv_windows_left_as_the_block_made_them_are_caught(monkeypatch):
    """Inkling: the K/V trimmed, each short convolution's window the one after the whole block
    (mlx-vlm's transaction selecting the last window, not the kept prefix's): caught at a conv slot.
    Without the recording hook mlx-vlm's commit refuses outright (no temporal record of the slots)."""
    from mlx_vlm.models.cache import ArraysCache as VlmArraysCache

    model, make_cache = _model_and_cache("inkling_sconv")
    assert run_cycles(model, make_cache, 6, pattern=REJECTING) is None
    monkeypatch.setattr(
        VlmArraysCache,
        "_select_speculative_window",
        staticmethod(lambda record, lengths: mx.contiguous(record[1][:, record[1].shape[1] - record[2] :])),
    )
    why = run_cycles(model, make_cache, 6, pattern=REJECTING)
    assert why is not None and "slot" in why, why


def test_inklings_commit_without_the_recording_hook_is_refused(monkeypatch):
    from mtplx.trunk import vlm_text

    import mlx_vlm.models.inkling.language as inkling_language

    model, make_cache = _model_and_cache("inkling_sconv")
    original = vlm_text.ORIGINALS[("mlx_vlm.models.inkling.language:InklingShortConvolution", "__call__")]
    monkeypatch.setattr(inkling_language.InklingShortConvolution, "__call__", original)
    with pytest.raises(RuntimeError, match="without temporal records"):
        run_cycles(model, make_cache, 6, pattern=REJECTING)


def test_negative_control_skipped_overlap_window_rollback_is_caught(monkeypatch):
    """DeepSeek-V4: mlx-vlm's transaction alone, the compressor's overlap window (mtplx's) left as
    the whole block made it: the next window pools with a rejected predecessor."""
    from mtplx.trunk import vlm_deepseek_v4

    monkeypatch.setattr(vlm_deepseek_v4.OverlapRecord, "commit", lambda self, num_keep: None)
    model, make_cache = _model_and_cache("deepseek_v4_pooled")
    assert run_cycles(model, make_cache, 6, pattern=REJECTING) is not None


# --------------------------------------------------------------------------- interruption


@pytest.mark.parametrize("name", ["qwen3_5_hybrid", "gemma3_rotating"])
@pytest.mark.parametrize("block_len", [1, 7])
def test_abort_after_full_forward_restores_pre_block_state(name, block_len):
    model, make_cache = _model_and_cache(name)
    seed = resolve(FRESH)
    # 10 prompt tokens (longer than the rotating window), the aborted block, the committed one.
    drawn = np.random.default_rng(seed).integers(0, models.ROLLBACK_VOCAB, size=10 + block_len + 3).tolist()
    tokens, aborted, committed = drawn[:10], drawn[10 : 10 + block_len], drawn[10 + block_len :]
    where = f"seed {seed}: prompt {tokens}, aborted {aborted}, committed {committed}"
    cache = _scratch(model, make_cache, tokens[:-1])
    # One single-token step shrinks a rotating buffer to its window; from then on
    # a T=1 block overwrites the oldest entry in place.
    mx.eval(model(mx.array([tokens[-1:]]), cache=cache))
    before = [[mx.array(x) for x in _raw_arrays(c)] for c in cache]
    capture = cache_ops.begin_block(cache, block_len)
    mx.eval(model(mx.array([aborted]), cache=cache))
    cache_ops.abort_block(cache, capture)
    why = cache_mismatch(cache, _scratch(model, make_cache, tokens))
    assert why is None, f"{where}: {why}"
    # Stronger than the window comparison: the buffers are bit-identical to before.
    for c, old in zip(cache, before):
        assert all(_max_diff(x, y) == 0 for x, y in zip(_raw_arrays(c), old)), where
    # and it keeps working: another block commits normally
    capture = cache_ops.begin_block(cache)
    mx.eval(model(mx.array([committed]), cache=cache))
    cache_ops.commit_block(cache, capture, 2)
    why = cache_mismatch(cache, _scratch(model, make_cache, tokens + committed[:2]))
    assert why is None, f"{where}: {why}"


def _raw_arrays(c) -> list[mx.array]:
    if type(c) is ArraysCache:
        return list(c.cache)
    if type(c) is RotatingKVCache:
        return [c.keys, c.values]
    return [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]


def test_abort_after_interrupted_forward():
    model, make_cache = _model_and_cache("qwen3_5_hybrid")
    tokens = list(range(5, 14))
    cache = _scratch(model, make_cache, tokens)
    layer = model.layers[2]  # layers 0 (gated-delta) and 1 (attention) run, then Ctrl-C
    original = type(layer)

    def interrupt(self, *args, **kwargs):
        raise KeyboardInterrupt

    layer.__class__ = type("Interrupted", (original,), {"__call__": interrupt})
    capture = cache_ops.begin_block(cache, 5)
    try:
        with pytest.raises(KeyboardInterrupt):
            model(mx.array([[1, 2, 3, 4, 5]]), cache=cache)
    finally:
        layer.__class__ = original
    cache_ops.abort_block(cache, capture)
    assert cache_mismatch(cache, _scratch(model, make_cache, tokens)) is None
    assert cache_ops.check_rollback_support(cache, model) is None


def test_failed_commit_leaves_pre_block_state():
    model, make_cache = _model_and_cache("qwen3_5_hybrid")
    tokens = [7, 8, 9, 10]
    cache = _scratch(model, make_cache, tokens)
    capture = cache_ops.begin_block(cache, 3)
    mx.eval(model(mx.array([[1, 2, 3]]), cache=cache))
    with pytest.raises(ValueError):
        cache_ops.commit_block(cache, capture, 4)
    assert cache_mismatch(cache, _scratch(model, make_cache, tokens)) is None
    with pytest.raises(ValueError):
        cache_ops.commit_block(cache, capture, 1)  # a capture is used once


# --------------------------------------------------------------------------- trim_kv (head caches)


def test_trim_kv_after_chained_single_token_steps():
    model, make_cache = _model_and_cache("llama")
    seed = resolve(FRESH)
    drawn = np.random.default_rng(seed).integers(0, models.ROLLBACK_VOCAB, size=7).tolist()
    tokens, drafted = drawn[:4], drawn[4:]
    cache = _scratch(model, make_cache, tokens)
    for t in drafted:  # a head drafting one token at a time
        mx.eval(model(mx.array([[t]]), cache=cache))
    cache_ops.trim_kv(cache, 2)
    why = cache_mismatch(cache, _scratch(model, make_cache, tokens + drafted[:1]))
    assert why is None, f"seed {seed}: prompt {tokens}, drafted {drafted}: {why}"
    with pytest.raises(ValueError):
        cache_ops.trim_kv(cache, 6)


def test_trim_kv_refuses_what_it_cannot_trim():
    model, make_cache = _model_and_cache("gemma3_rotating")
    cache = _scratch(model, make_cache, list(range(10)))
    mx.eval(model(mx.array([[50]]), cache=cache))  # in place over the oldest window entry
    with pytest.raises(ValueError):
        cache_ops.trim_kv(cache, 1)
    hybrid, hybrid_cache = _model_and_cache("qwen3_5_hybrid")
    with pytest.raises(ValueError):
        cache_ops.trim_kv(_scratch(hybrid, hybrid_cache, [1, 2]), 1)


# --------------------------------------------------------------------------- refusals


def _kv_with_batch(batch: int) -> KVCache:
    c = KVCache()
    c.update_and_fetch(mx.zeros((batch, 1, 3, 8)), mx.zeros((batch, 1, 3, 8)))
    return c


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda: [BatchKVCache(left_padding=[0])], "BatchKVCache"),
        (lambda: [KVCache(), ChunkedKVCache(8)], "layer 1: ChunkedKVCache"),
        (lambda: [ConcatenateKVCache()], "ConcatenateKVCache"),
        (lambda: [ArraysCache(2, left_padding=[1])], "padded"),
        (lambda: [ArraysCache(3)], "3 slots"),
        (lambda: [_kv_with_batch(2)], "batch size 2"),
    ],
)
def test_check_rollback_support_refuses(make, needle):
    reason = cache_ops.check_rollback_support(make())
    assert reason is not None and needle in reason and "\n" not in reason
    with pytest.raises(ValueError, match="cannot roll back"):
        cache_ops.begin_block(make())


def test_check_rollback_support_with_model():
    llama, _ = _model_and_cache("llama")
    hybrid, hybrid_cache = _model_and_cache("qwen3_5_hybrid")
    assert cache_ops.check_rollback_support(hybrid_cache(), hybrid) is None
    # An ArraysCache on a layer that is not a supported gated-delta layer.
    reason = cache_ops.check_rollback_support([ArraysCache(2), KVCache()], llama)
    assert reason is not None and "gated-delta" in reason
    assert cache_ops.check_rollback_support([RotatingKVCache(4), QuantizedKVCache()]) is None


def test_begin_block_needs_prefilled_recurrent_cache():
    _, hybrid_cache = _model_and_cache("qwen3_5_hybrid")
    with pytest.raises(ValueError, match="prefilled"):
        cache_ops.begin_block(hybrid_cache())
