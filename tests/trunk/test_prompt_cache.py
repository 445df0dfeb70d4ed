"""Prompt cache across requests (mtplx/trunk/prompt_cache.py) and the decode loop's target logprobs.

Tiny random trunks and heads (tests/support/models.py) with the default model's
real tokenizer (vocabulary 49152), driven through `Engine` with token-id
prompts so turn boundaries are exact. The reference is always the same engine
without a prompt cache, or a teacher-forced forward in NumPy float64.
"""

from __future__ import annotations

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.engine.engine import Engine
from mtplx.sample.params import SamplerConfig
from mtplx.trunk.prompt_cache import PromptCache, cache_nbytes

import mlx.core as mx
import numpy as np
import pytest
from support import decoding as decode
from support.decoding import mtp_decode
from support.models import make_loop_pair
from support.seeds import FRESH, resolve

VOCAB = 49152  # the default tokenizer's
FAMILIES = ["llama", "qwen3_5"]  # plain KV (trimmable) and hybrid (recurrent snapshots)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from mlx_lm.tokenizer_utils import load

    return load(default_model_dir)


@pytest.fixture(scope="module", params=FAMILIES)
def engines(request, tokenizer):
    """(without cache, with cache) engines sharing one trunk and head."""
    trunk, head = make_loop_pair(vocab_size=VOCAB, family=request.param, seed=1, logit_scale=8.0)
    plain = Engine(trunk.model, tokenizer, {}, head=head, depth=3)
    cached = Engine(trunk.model, tokenizer, {}, head=head, depth=3, prompt_cache_bytes=1 << 30)
    return request.param, plain, cached


def _random_tokens(rng: np.random.Generator, n: int) -> list[int]:
    # Ids 3.. avoid the special tokens (EOS is 2).
    return rng.integers(3, VOCAB, size=n).tolist()


@pytest.mark.parametrize("mtp", [True, False])
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=11)])
def test_outputs_identical_with_and_without_the_cache(engines, mtp, sampling):
    family, plain, cached = engines
    cached.prompt_cache.clear()
    seed = resolve(FRESH)  # a fresh conversation every run
    rng = np.random.default_rng(seed)
    first = _random_tokens(rng, 20)
    prompts = [first]
    for turn in range(4):
        kwargs = dict(sampling, max_tokens=7, mtp=mtp)
        expected = plain.generate(prompts[-1], **kwargs)
        got = cached.generate(prompts[-1], **kwargs)
        where = f"{family}, seed {seed}, turn {turn}, prompt {prompts[-1]}"
        assert got.token_ids == expected.token_ids, where
        assert got.text == expected.text, where
        if turn == 0:
            assert got.stats.cached_tokens == 0, where
        # Next: the chat continues; then a repeat; then a prompt sharing only part of the first.
        nxt = [
            prompts[-1] + got.token_ids + _random_tokens(rng, 5),
            list(prompts[-1]),
            first[:12] + _random_tokens(rng, 6),
        ]
        prompts.append(nxt[turn % 3])
    assert len(cached.prompt_cache) > 0, f"seed {seed}"


# Seed 4: the llama pair's first turn keeps every draft (two full cycles), the head's largest lag.
@pytest.mark.parametrize("seed", [None, 4], ids=["fresh", "seed4"])
@pytest.mark.parametrize("mtp", [True, False])
def test_second_turn_prefills_only_the_new_tokens(engines, mtp, seed):
    family, _, cached = engines
    cached.prompt_cache.clear()
    rng = np.random.default_rng(seed)
    turn1 = _random_tokens(rng, 30)
    first = cached.generate(turn1, max_tokens=9, temperature=0.0, mtp=mtp)
    assert (first.stats.cached_tokens, first.stats.prefilled_tokens) == (0, 30)
    new = _random_tokens(rng, 4)
    turn2 = turn1 + first.token_ids + new
    second = cached.generate(turn2, max_tokens=3, temperature=0.0, mtp=mtp)
    stats = second.stats
    assert stats.prompt_tokens == len(turn2)
    assert stats.prefilled_tokens == len(turn2) - stats.cached_tokens
    if family == "qwen3_5":
        # Recurrent state is snapshotted at the prompt's end (all but its last token).
        assert stats.cached_tokens == len(turn1) - 1
    elif not mtp:
        # Plain KV keeps prompt and reply (the AR cycle queued after the last token forwarded it):
        # only the new message is forwarded.
        assert stats.cached_tokens == len(turn1) + len(first.token_ids)
    else:
        # The trunk lags one token (pending), and the head has not yet read the last cycle's
        # trunk states: up to depth + 1 more when that cycle kept every draft.
        lag = cached.depth + 2
        assert (
            len(turn1) + len(first.token_ids) - lag <= stats.cached_tokens < len(turn1) + len(first.token_ids)
        )


def test_cache_is_bounded_by_bytes_with_lru_eviction(engines):
    _, _, cached = engines
    rng = np.random.default_rng(0)
    prompts = [_random_tokens(rng, 40) for _ in range(3)]
    store = PromptCache(1 << 30)
    cached.prompt_cache, saved = store, cached.prompt_cache
    try:
        cached.generate(prompts[0], max_tokens=2, temperature=0.0)
        one_entry = store.nbytes
        assert one_entry > 0 and len(store) == 1
        # Room for two entries: the third request evicts the least recently used one.
        store.max_bytes = int(2.5 * one_entry)
        cached.generate(prompts[1], max_tokens=2, temperature=0.0)
        cached.generate(prompts[0], max_tokens=2, temperature=0.0)  # prompts[0] is now the most recent
        cached.generate(prompts[2], max_tokens=2, temperature=0.0)
        assert len(store) == 2 and store.nbytes <= store.max_bytes
        assert cached.generate(prompts[0], max_tokens=2, temperature=0.0).stats.cached_tokens > 0
        assert cached.generate(prompts[1], max_tokens=2, temperature=0.0).stats.cached_tokens == 0
        # Larger than the whole budget: not stored at all.
        store.clear()
        store.max_bytes = one_entry // 4
        cached.generate(prompts[0], max_tokens=2, temperature=0.0)
        assert len(store) == 0
    finally:
        cached.prompt_cache = saved


def test_cache_nbytes_counts_whole_buffers():
    trunk, _ = make_loop_pair(vocab_size=16, family="llama")
    cache = trunk.make_cache()
    trunk(mx.array([[1, 2, 3]]), cache)
    mx.eval([c.state for c in cache])
    # A KVCache allocates 256 positions ahead; all of them are memory held.
    expected = sum(c.keys.nbytes + c.values.nbytes for c in cache)
    assert cache_nbytes(cache) == expected and expected >= 2 * 256 * 4 * len(cache)


def _kv(positions: int, value: float) -> list:
    """One KVCache holding ``positions`` positions, every entry ``value``."""
    from mtplx.trunk.compat import KVCache

    cache = KVCache()
    cache.update_and_fetch(mx.full((1, 1, positions, 2), value), mx.full((1, 1, positions, 2), value))
    return [cache]


def test_a_block_drafter_context_is_served_only_to_the_rows_that_ask_for_it():
    """An entry with a block drafter's context serves a drafter row (its context trimmed to the
    prefix, the head's token rule: ``size + 1`` tokens agree) and a plain row (trunk only); an
    entry without one never serves a drafter row, and a plain entry of the same tokens does not
    replace a drafter entry (it could not serve its rows)."""
    store = PromptCache(1 << 20)
    tokens = [5, 6, 7, 8, 9, 10]
    store.insert(tokens, 5, _kv(5, 1.0), None, copy=False, drafter_cache=_kv(5, 2.0))
    hit = store.lookup([5, 6, 7, 8, 1, 1], False, with_drafter=True)
    assert hit.start == 3 and hit.drafter_cache[0].offset == 3 and hit.trunk_cache[0].offset == 3
    assert float(hit.drafter_cache[0].keys[0, 0, 0, 0]) == 2.0
    plain = store.lookup([5, 6, 7, 8, 1, 1], False)
    assert plain.start == 4 and plain.drafter_cache is None
    store.insert(tokens, 5, _kv(5, 3.0), None, copy=False)  # a plain row's entry, same tokens
    assert len(store) == 2
    assert store.lookup(tokens + [1], False, with_drafter=True).drafter_cache[0].offset == 5
    store.clear()
    store.insert(tokens, 5, _kv(5, 1.0), None, copy=False)
    assert store.lookup(tokens + [1], False, with_drafter=True) is None


def test_a_snapshot_keeps_a_drafter_context_of_exactly_its_size():
    """Caches that cannot be trimmed (a gated-delta layer's state) are stored as snapshots of
    exactly ``size`` positions: a block drafter's context beside one must hold exactly those (one
    holding a position more is not kept: the entry then serves plain rows only); a snapshot with
    the context replaces a plain one of the same prefix, which never counts as holding it for a
    drafter row (`holds`); it serves only prompts through its exact prefix."""
    from mtplx.trunk.compat import ArraysCache

    def recurrent() -> list:
        cache = ArraysCache(1)
        cache[0] = mx.ones((1, 2))
        return [cache]

    store = PromptCache(1 << 20)
    tokens = [5, 6, 7, 8, 9]
    store.insert(tokens, 4, recurrent(), None, copy=False)
    assert store.holds(tokens, 4, False) and not store.holds(tokens, 4, False, with_drafter=True)
    store.insert(tokens, 4, recurrent(), None, copy=False, drafter_cache=_kv(5, 2.0))
    assert store.lookup(tokens + [1], False, with_drafter=True) is None
    store.insert(tokens, 4, recurrent(), None, copy=False, drafter_cache=_kv(4, 2.0))
    assert len(store) == 1 and store.holds(tokens, 4, False, with_drafter=True)
    hit = store.lookup(tokens + [1], False, with_drafter=True)
    assert hit.start == 4 and hit.drafter_cache[0].offset == 4
    assert float(hit.drafter_cache[0].keys[0, 0, 0, 0]) == 2.0
    assert store.lookup(tokens[:4] + [1, 1], False, with_drafter=True) is None


# ------------------------------------------------------------------ logprobs


def _reference_logprobs(trunk, tokens: list[int]) -> np.ndarray:
    """log_softmax (float64) of a one-shot teacher-forced forward: row i predicts tokens[i + 1]."""
    logits = trunk(mx.array(tokens)[None], trunk.make_cache()).logits[0]
    x = np.array(logits.astype(mx.float32), dtype=np.float64)
    return x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mtp", [True, False])
def test_logprobs_are_the_targets_own_whether_drafted_or_not(family, mtp):
    trunk, head = make_loop_pair(vocab_size=16, family=family, seed=3)
    seed = resolve(FRESH)
    prompt = np.random.default_rng(seed).integers(0, 16, size=9).tolist()
    where = f"seed {seed}: prompt {prompt}"
    # Penalties and filters change sampling but not the reported (raw) log-probabilities.
    sampler = SamplerConfig(temperature=0.8, top_k=5, repetition_penalty=1.3)
    settings = decode.DecodeSettings(sampler=sampler, depth=3, logprobs=4)
    key = mx.random.key(5)
    steps = (
        mtp_decode(trunk, head, prompt, settings, key)
        if mtp
        else decode.ar_decode(trunk, prompt, settings, key)
    )
    tokens, reported, drafted_hits = [], [], 0
    for step in steps:
        assert step.logprobs is not None and len(step.logprobs) == len(step.tokens), where
        tokens += step.tokens
        reported += step.logprobs
        drafted_hits += step.num_accepted
        if len(tokens) >= 40 and (drafted_hits >= 5 or not mtp):
            break
    steps.close()
    reference = _reference_logprobs(trunk, prompt + tokens[:-1])[len(prompt) - 1 :]
    for i, (token, lp) in enumerate(zip(tokens, reported)):
        at = f"{where}, position {i}"
        np.testing.assert_allclose(lp.logprob, reference[i, token], atol=2e-4, err_msg=at)
        order = np.argsort(-reference[i], kind="stable")[:4]
        assert len(lp.top) == 4, at
        np.testing.assert_allclose([v for _, v in lp.top], reference[i, order], atol=2e-4, err_msg=at)
        assert [t for t, _ in lp.top] == order.tolist() or np.allclose(
            reference[i, [t for t, _ in lp.top]], reference[i, order], atol=2e-4
        ), at


def test_logprobs_reference_catches_an_off_by_one():
    """Negative control: logprobs read from the next row would not pass the comparison above."""
    trunk, _ = make_loop_pair(vocab_size=16, family="llama", seed=3)
    tokens = np.random.default_rng(0).integers(0, 16, size=20).tolist()
    reference = _reference_logprobs(trunk, tokens)
    right = reference[np.arange(9, 19), tokens[10:20]]
    shifted = reference[np.arange(10, 20), tokens[10:20]]
    assert np.abs(right - shifted).max() > 1e-2
