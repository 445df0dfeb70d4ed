"""Qwen3.8-Flash-Next (``qwen4_exp``) hosted through mlx-vlm's language model with mlx-vlm's own
caches (`mtplx.trunk.vlm_text.NATIVE_CACHE_FAMILIES`) and its hyper-connection mixer as the
trunk's final "norm" (`vlm_text.FINAL_MIXERS`).

The checkpoint is ``support.vlm_families.qwen4_exp``'s tiny replica in the published layout; the
reference is mlx-vlm's own loader and forward on its own caches. Cache rollback for its cache
kinds runs in ``tests/trunk/test_cache.py`` (``qwen4_exp_qsa_hybrid``, with the skipped-trim control).
"""

from __future__ import annotations

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.checkpoints.load import load_mlx_model
from mtplx.trunk import vlm_text
from mtplx.trunk.model import Trunk

import mlx.core as mx
import numpy as np
import pytest
from support.seeds import FRESH, resolve
from support.vlm_families import QWEN4_EXP_HIDDEN, QWEN4_EXP_VOCAB, qwen4_exp
from support.vlm_heads import max_abs_diff

TOL = 1e-4
PROMPT_LEN = 12  # over the QSA indexer's 2 kept blocks of 2 keys: it selects
HC_COUNT = 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return qwen4_exp(tmp_path_factory.mktemp("qwen4_exp") / "model").path


def test_trunk_logits_equal_mlx_vlm_forward_and_the_taps_are_the_streams_and_the_mix(checkpoint):
    """Every prompt position, then 5 decode steps, against mlx-vlm's forward on its own caches;
    pre-"norm" = the hc_count streams mlx-vlm's ``return_hidden`` hands its MTP drafter,
    post = the hyper-connection mixer's output, which the LM head reads."""
    from mlx_vlm.utils import load_model

    model, config = load_mlx_model(checkpoint)
    assert isinstance(model, vlm_text.VlmTextModel) and config["model_type"] == "qwen4_exp"
    assert "norm" not in dict(model.language_model.model.children())  # the alias is no parameter
    trunk = Trunk(model)
    reference = load_model(checkpoint).language_model
    seed = resolve(FRESH)
    tokens = np.random.default_rng(seed).integers(0, QWEN4_EXP_VOCAB, size=PROMPT_LEN + 5).tolist()
    cache, ref_cache = trunk.make_cache(), reference.make_cache()
    assert [type(c).__name__ for c in cache] == ["ArraysCache", "QSAKVCache"] * 2
    prompt = mx.array([tokens[:PROMPT_LEN]])
    out = trunk(prompt, cache)
    ref = reference(prompt, cache=ref_cache, return_hidden=True)
    assert max_abs_diff(out.logits, ref.logits) <= TOL, f"seed {seed}"
    assert out.hidden_pre_norm.shape == (1, PROMPT_LEN, HC_COUNT * QWEN4_EXP_HIDDEN)
    assert max_abs_diff(out.hidden_pre_norm, ref.hidden_states[0]) <= TOL, f"seed {seed}"
    assert max_abs_diff(trunk.lm_head(out.hidden_post_norm), out.logits) <= TOL
    for t in tokens[PROMPT_LEN:]:
        step = trunk(mx.array([[t]]), cache)
        want = reference(mx.array([[t]]), cache=ref_cache).logits
        assert max_abs_diff(step.logits, want) <= TOL, f"seed {seed}, token {t}"
    # a block after a chunked prefill (a verify block) equals one forward of the whole sequence
    whole = trunk(mx.array([tokens]), trunk.make_cache()).logits
    chunked = trunk.make_cache()
    trunk(mx.array([tokens[:5]]), chunked)
    trunk(mx.array([tokens[5:PROMPT_LEN]]), chunked)
    block = trunk(mx.array([tokens[PROMPT_LEN:]]), chunked).logits
    assert max_abs_diff(block, whole[:, PROMPT_LEN:]) <= TOL, f"seed {seed}"
