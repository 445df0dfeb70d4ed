"""DeepSeek-V4 (``deepseek_v4``) hosted through mlx-vlm's language model with mlx-vlm's own caches
(`mtplx.trunk.vlm_text.NATIVE_CACHE_FAMILIES`), its ``norm(hc_head(streams))`` shown to the trunk
as one final "norm" (`vlm_text.StreamsHead`) and its overlapping compressor made a function of the
tokens (`mtplx.trunk.vlm_deepseek_v4`).

The checkpoint is ``support.vlm_families.deepseek_v4``'s tiny replica in the official inference
layout. The reference is mlx-vlm's own loader and one forward over the whole sequence with
mlx-vlm's own compressor (one call from an empty cache: the published math at every position);
the control shows mlx-vlm's compressor alone makes decode steps differ from it. Cache rollback
for these cache kinds runs in ``tests/trunk/test_cache.py`` (``deepseek_v4_pooled``).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.checkpoints.load import load_mlx_model
from mtplx.trunk import backends, vlm_text
from mtplx.trunk.model import Trunk

import mlx.core as mx
import numpy as np
import pytest
from support.seeds import FRESH, resolve
from support.vlm_families import DEEPSEEK_V4_HIDDEN, DEEPSEEK_V4_VOCAB, deepseek_v4
from support.vlm_heads import lookup_prompt, max_abs_diff

TOL = 1e-4
PROMPT_LEN = 12  # three ratio-4 windows: the indexer keeps 4 pooled keys of them, the window slides
HC_MULT = 2
HOOK = ("mlx_vlm.models.deepseek_v4.language:Compressor", "__call__")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return deepseek_v4(tmp_path_factory.mktemp("deepseek_v4") / "model").path


@contextmanager
def mlx_vlms_compressor():
    """mlx-vlm's own ``Compressor.__call__`` for the duration (the hook put back after)."""
    from mlx_vlm.models.deepseek_v4.language import Compressor

    vlm_text.install_exactness_hooks("deepseek_v4")
    hooked = Compressor.__call__
    Compressor.__call__ = vlm_text.ORIGINALS[HOOK]
    try:
        yield
    finally:
        Compressor.__call__ = hooked


def _scratch(checkpoint, tokens: list[int]):
    """mlx-vlm's own forward over all of ``tokens`` in one call, its own compressor."""
    from mlx_vlm.utils import load_model

    reference = load_model(checkpoint).language_model
    with mlx_vlms_compressor():
        out = reference(mx.array([tokens]), cache=reference.make_cache(), return_hidden=True)
        mx.eval(out.logits, out.hidden_states)
    return out


def test_backend_is_mlx_vlm():
    assert backends.backend_for({"model_type": "deepseek_v4"}) == (backends.MLX_VLM, "deepseek_v4")


def test_trunk_logits_equal_mlx_vlms_forward_and_the_taps_are_the_streams_and_the_head(checkpoint):
    """The prompt, then 5 decode steps, then a block after a chunked prefill, each position against
    mlx-vlm's one forward over the whole sequence; pre-"norm" = the hc_mult streams mlx-vlm's
    ``return_hidden`` hands its MTP drafter (flattened), post = ``norm(hc_head(streams))``."""
    model, config = load_mlx_model(checkpoint)
    assert isinstance(model, vlm_text.VlmTextModel) and config["model_type"] == "deepseek_v4"
    assert "norm" in dict(model.language_model.model.children())  # the alias is no parameter
    trunk = Trunk(model)
    seed = resolve(FRESH)
    tokens = np.random.default_rng(seed).integers(0, DEEPSEEK_V4_VOCAB, size=PROMPT_LEN + 5).tolist()
    ref = _scratch(checkpoint, tokens)
    cache = trunk.make_cache()
    assert [type(c).__name__ for c in cache] == ["RotatingKVCache", "CacheList", "RotatingKVCache"]
    out = trunk(mx.array([tokens[:PROMPT_LEN]]), cache)
    assert max_abs_diff(out.logits, ref.logits[:, :PROMPT_LEN]) <= TOL, f"seed {seed}"
    streams = ref.hidden_states[0].reshape(1, len(tokens), HC_MULT * DEEPSEEK_V4_HIDDEN)
    assert out.hidden_pre_norm.shape == (1, PROMPT_LEN, HC_MULT * DEEPSEEK_V4_HIDDEN)
    assert max_abs_diff(out.hidden_pre_norm, streams[:, :PROMPT_LEN]) <= TOL, f"seed {seed}"
    assert max_abs_diff(trunk.lm_head(out.hidden_post_norm), out.logits) <= TOL
    for i, t in enumerate(tokens[PROMPT_LEN:]):
        step = trunk(mx.array([[t]]), cache)
        assert max_abs_diff(step.logits[:, 0], ref.logits[:, PROMPT_LEN + i]) <= TOL, f"seed {seed}, step {i}"
    chunked = trunk.make_cache()
    trunk(mx.array([tokens[:5]]), chunked)
    trunk(mx.array([tokens[5:PROMPT_LEN]]), chunked)
    block = trunk(mx.array([tokens[PROMPT_LEN:]]), chunked).logits
    assert max_abs_diff(block, ref.logits[:, PROMPT_LEN:]) <= TOL, f"seed {seed}"


def test_control_mlx_vlms_compressor_makes_decode_steps_differ_from_one_forward(checkpoint):
    """Without the hook a window completed in a decode step pools without its predecessor."""
    from mlx_vlm.utils import load_model

    tokens = np.random.default_rng(5).integers(0, DEEPSEEK_V4_VOCAB, size=PROMPT_LEN + 5).tolist()
    ref = _scratch(checkpoint, tokens)
    model = load_model(checkpoint).language_model
    with mlx_vlms_compressor():
        cache = model.make_cache()
        model(mx.array([tokens[:PROMPT_LEN]]), cache=cache)
        steps = [model(mx.array([[t]]), cache=cache).logits for t in tokens[PROMPT_LEN:]]
    assert max_abs_diff(mx.concatenate(steps, axis=1), ref.logits[:, PROMPT_LEN:]) > 1e-2


def test_a_copied_cache_shares_no_member_with_its_source():
    """The prompt cache keeps copies (`compat.copy_cache`): mlx-vlm's CacheList's members too."""
    from mtplx.trunk.compat import copy_cache

    from support.vlm_families import tiny_deepseek_v4

    trunk = Trunk(tiny_deepseek_v4())
    cache = trunk.make_cache()
    trunk(mx.array([list(range(3, 3 + PROMPT_LEN))]), cache)
    copy = copy_cache(cache)
    before = [np.array(a) for a in copy[1].caches[1].state if a is not None]
    trunk(mx.array([[5, 6, 7, 8]]), cache)  # a window completes in the source only
    after = [np.array(a) for a in copy[1].caches[1].state if a is not None]
    assert copy[1].caches[1] is not cache[1].caches[1]
    assert [a.shape for a in after] == [b.shape for b in before]
    assert all(np.array_equal(a, b) for a, b in zip(after, before))


def test_engine_decodes_as_one_forward_with_lookup_drafts_and_the_prompt_cache(checkpoint, tmp_path):
    """Through the Engine: greedy tokens = the argmax chain of mlx-vlm's one forward; the decode
    loop with prompt-lookup drafts (verify blocks, rejections) and a prompt-cache hit in RAM give
    the same tokens; so does a new engine starting from the disk tier's entry (the compressor's
    overlap windows written beside the caches: `test_the_disk_tier_keeps_the_overlap_windows`)."""
    from mtplx.engine.engine import Engine
    from mtplx.engine.request import GenerationRequest

    from support.decoding import lookup_decode_steps
    from support.tokenizer import word_level

    word_level(checkpoint, DEEPSEEK_V4_VOCAB)
    engine = Engine.load(str(checkpoint), prompt_cache_bytes=1 << 26)
    engine.use_disk_cache(tmp_path, 1 << 26)
    prompt = lookup_prompt(DEEPSEEK_V4_VOCAB)

    def run(tokens, draft):
        request = GenerationRequest.from_kwargs(max_tokens=6, temperature=0.0, draft=draft)
        return engine.generate(tokens, request)

    ar = run(prompt, "none").token_ids
    ref = _scratch(checkpoint, prompt + ar[:-1]).logits[0, len(prompt) - 1 :]
    assert ar == np.argmax(np.array(ref), axis=-1).tolist()[: len(ar)]
    drafted = lookup_decode_steps(engine.trunk, prompt, len(ar))
    assert [t for s in drafted for t in s.tokens][: len(ar)] == ar
    assert any(s.num_drafted > s.num_accepted for s in drafted), "no rejected draft"
    again = run(prompt + ar[:2], "none")
    assert again.stats.cached_tokens > 0 and again.token_ids == ar[2:] + again.token_ids[len(ar) - 2 :]
    assert engine.prompt_cache.disk.flush() and list(tmp_path.glob("*.safetensors"))
    fresh = Engine.load(str(checkpoint), prompt_cache_bytes=1 << 26)
    fresh.use_disk_cache(tmp_path, 1 << 26)
    longer = replace(GenerationRequest.from_kwargs(max_tokens=4, draft="none"), ignore_eos=True)
    from_disk = fresh.generate(prompt + ar[:2], longer)
    assert from_disk.stats.cached_tokens > 0 and fresh.prompt_cache.disk.stats.hits == 1
    assert from_disk.token_ids == engine.generate(prompt + ar[:2], longer).token_ids


def test_the_disk_tier_keeps_the_overlap_windows(checkpoint, tmp_path):
    """A prompt-cache file holds each pool cache's overlap window beside the caches: the caches
    loaded from it continue as one forward over the whole sequence does (control: without the
    windows, the next window completed pools without its predecessor and the logits differ)."""
    from mtplx.engine.engine import Engine
    from mtplx.engine.request import GenerationRequest
    from mtplx.trunk import vlm_deepseek_v4
    from mtplx.trunk.prompt_cache_format import load_caches

    from support.tokenizer import word_level

    word_level(checkpoint, DEEPSEEK_V4_VOCAB)
    engine = Engine.load(str(checkpoint), prompt_cache_bytes=1 << 26)
    engine.use_disk_cache(tmp_path, 1 << 26)
    tokens = (
        np.random.default_rng(resolve(FRESH)).integers(2, DEEPSEEK_V4_VOCAB, size=PROMPT_LEN + 6).tolist()
    )
    engine.generate(tokens[:PROMPT_LEN], GenerationRequest.from_kwargs(max_tokens=1, temperature=0.0))
    assert engine.prompt_cache.disk.flush()
    (path,) = tmp_path.glob("*.safetensors")
    trunk = engine.trunk

    def continued(drop_windows: bool) -> float:
        caches, meta = load_caches(path)
        cache = caches[: int(meta["mtplx_trunk_layers"])]
        leaves, _ = vlm_deepseek_v4.overlap_windows(cache)
        assert leaves, "no overlap window was written"
        if drop_windows:
            for c in vlm_deepseek_v4.leaf_caches(cache):
                c.__dict__.pop(vlm_deepseek_v4.ATTRIBUTE, None)
        n = vlm_deepseek_v4.leaf_caches(cache)[0].offset
        out = trunk(mx.array([tokens[n:]]), cache).logits
        return max_abs_diff(out, _scratch(checkpoint, tokens).logits[:, n:])

    assert continued(drop_windows=False) <= TOL
    assert continued(drop_windows=True) > 1e-2
