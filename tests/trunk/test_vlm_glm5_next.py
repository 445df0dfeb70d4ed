"""GLM-5-Next (``glm5_next``) hosted through mlx-vlm's language model with mlx-vlm's own caches
(`mtplx.trunk.vlm_text.NATIVE_CACHE_FAMILIES`: linear-attention ``ArraysCache`` s and, per sparse
layer, ``CacheList(KV, indexer KV, PoolingCache, projected KV)``).

The checkpoint is ``support.vlm_families.glm5_next``'s tiny replica in the published layout; the
reference is mlx-vlm's own loader and forward. Cache rollback for these cache kinds runs in
``tests/trunk/test_cache.py`` (``glm5_next_hybrid``, with the skipped-trim and skipped-recurrent
controls).
"""

from __future__ import annotations

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.checkpoints.load import load_mlx_model
from mtplx.trunk import backends, vlm_text
from mtplx.trunk.model import Trunk

import mlx.core as mx
import numpy as np
import pytest
from support.seeds import FRESH, resolve
from support.vlm_families import GLM5_NEXT_HIDDEN, GLM5_NEXT_VOCAB, glm5_next
from support.vlm_heads import lookup_prompt, max_abs_diff

TOL = 1e-4
PROMPT_LEN = 12  # six pools of 2 keys: the indexer keeps 2 of them


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return glm5_next(tmp_path_factory.mktemp("glm5_next") / "model").path


def test_backend_is_mlx_vlm():
    config = {"model_type": "glm5_next", "text_config": {"model_type": "glm5_next_text"}}
    assert backends.backend_for(config) == (backends.MLX_VLM, "glm5_next")


def test_trunk_logits_equal_mlx_vlm_forward_and_the_taps(checkpoint):
    """Every prompt position, then 5 decode steps, against mlx-vlm's forward on its own caches and
    its one forward over the whole sequence; pre-norm = the streams' mean, post = the state
    mlx-vlm's ``return_hidden`` hands its MTP drafter; a block after a chunked prefill."""
    from mlx_vlm.utils import load_model

    model, config = load_mlx_model(checkpoint)
    assert isinstance(model, vlm_text.VlmTextModel) and config["model_type"] == "glm5_next"
    trunk = Trunk(model)
    reference = load_model(checkpoint).language_model
    seed = resolve(FRESH)
    tokens = np.random.default_rng(seed).integers(0, GLM5_NEXT_VOCAB, size=PROMPT_LEN + 5).tolist()
    whole = reference(mx.array([tokens]), cache=reference.make_cache()).logits
    cache, ref_cache = trunk.make_cache(), reference.make_cache()
    assert [type(c).__name__ for c in cache] == ["ArraysCache"] * 3 + ["CacheList"]
    prompt = mx.array([tokens[:PROMPT_LEN]])
    out = trunk(prompt, cache)
    ref = reference(prompt, cache=ref_cache, return_hidden=True)
    assert max_abs_diff(out.logits, ref.logits) <= TOL, f"seed {seed}"
    assert out.hidden_post_norm.shape == (1, PROMPT_LEN, GLM5_NEXT_HIDDEN)
    assert max_abs_diff(out.hidden_post_norm, ref.hidden_states[0]) <= TOL, f"seed {seed}"
    for i, t in enumerate(tokens[PROMPT_LEN:]):
        step = trunk(mx.array([[t]]), cache).logits
        assert max_abs_diff(step, reference(mx.array([[t]]), cache=ref_cache).logits) <= TOL, f"seed {seed}"
        assert max_abs_diff(step[:, 0], whole[:, PROMPT_LEN + i]) <= TOL, f"seed {seed}, step {i}"
    chunked = trunk.make_cache()
    trunk(mx.array([tokens[:5]]), chunked)
    trunk(mx.array([tokens[5:PROMPT_LEN]]), chunked)
    block = trunk(mx.array([tokens[PROMPT_LEN:]]), chunked).logits
    assert max_abs_diff(block, whole[:, PROMPT_LEN:]) <= TOL, f"seed {seed}"


def test_engine_decodes_as_one_forward_with_lookup_drafts_and_both_prompt_cache_tiers(checkpoint, tmp_path):
    """Through the Engine: greedy tokens = the argmax chain of mlx-vlm's one forward; the decode
    loop with prompt-lookup drafts (verify blocks, rejections) gives them too; a prompt-cache hit
    in RAM, then from disk in a new engine (rebuilt as mlx-vlm's classes), gives them too."""
    from mtplx.engine.engine import Engine
    from mtplx.engine.request import GenerationRequest

    from mlx_vlm.utils import load_model
    from support.decoding import lookup_decode_steps
    from support.tokenizer import word_level

    word_level(checkpoint, GLM5_NEXT_VOCAB)
    engine = Engine.load(str(checkpoint), prompt_cache_bytes=1 << 26)
    engine.use_disk_cache(tmp_path, 1 << 26)
    prompt = lookup_prompt(GLM5_NEXT_VOCAB)

    def run(e, tokens):
        return e.generate(tokens, GenerationRequest.from_kwargs(max_tokens=6, temperature=0.0, draft="none"))

    ar = run(engine, prompt).token_ids
    lm = load_model(checkpoint).language_model
    ref = lm(mx.array([prompt + ar[:-1]]), cache=lm.make_cache()).logits[0, len(prompt) - 1 :]
    assert ar == np.argmax(np.array(ref), axis=-1).tolist()[: len(ar)]
    drafted = lookup_decode_steps(engine.trunk, prompt, len(ar))
    assert [t for s in drafted for t in s.tokens][: len(ar)] == ar
    assert any(s.num_drafted > s.num_accepted for s in drafted), "no rejected draft"
    again = run(engine, prompt + ar[:2])
    assert again.stats.cached_tokens > 0 and again.token_ids[:4] == ar[2:]
    assert engine.prompt_cache.disk.flush()
    second = Engine.load(str(checkpoint), prompt_cache_bytes=1 << 26)
    second.use_disk_cache(tmp_path, 1 << 26)
    from_disk = run(second, prompt + ar[:2])
    assert from_disk.stats.cached_tokens > 0 and from_disk.token_ids[:4] == ar[2:]
    assert second.prompt_cache.disk.stats.hits == 1
