"""Inkling (``inkling``) hosted through mlx-vlm's language model with mlx-vlm's own caches
(`mtplx.trunk.vlm_text.NATIVE_CACHE_FAMILIES`), its final norm shown with the width multiplier's
division (`mtplx.trunk.vlm_inkling.WidthScaledNorm`).

The checkpoint is ``support.vlm_inkling.inkling``'s tiny replica in the published layout; the
reference is mlx-vlm's own loader and forward on its own caches. Cache rollback of its short
convolutions' windows runs in ``tests/trunk/test_cache.py`` (``inkling_sconv``, with the controls).
"""

from __future__ import annotations

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.checkpoints.load import load_mlx_model
from mtplx.errors import MtplxError
from mtplx.trunk import backends, vlm_text
from mtplx.trunk.model import Trunk

import mlx.core as mx
import numpy as np
import pytest
from support.seeds import FRESH, resolve
from support.vlm_heads import max_abs_diff
from support.vlm_inkling import INKLING_VOCAB, MUP_WIDTH, inkling

TOL = 1e-4
PROMPT_LEN = 12  # past the global layer's band of 8 and the sliding layers' window of 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return inkling(tmp_path_factory.mktemp("inkling") / "model").path


def test_backend_hosts_it_and_a_missing_mlx_audio_is_one_line(monkeypatch):
    assert backends.backend_for({"model_type": "inkling"}) == (backends.MLX_VLM, "inkling")
    module, why, install = backends.MLX_VLM_FAMILY_IMPORTS["inkling"]
    monkeypatch.setitem(backends.MLX_VLM_FAMILY_IMPORTS, "inkling", ("no_such_mlx_audio", why, install))
    with pytest.raises(MtplxError) as e:
        backends.backend_for({"model_type": "inkling"})
    message = str(e.value)
    assert (
        "\n" not in message and "inkling" in message and 'pip install --no-deps "mlx-audio==0.6.2"' in message
    )


def test_trunk_logits_equal_mlx_vlm_forward_and_the_taps_are_the_lm_heads_input(checkpoint):
    """Every prompt position, then 5 decode steps, against mlx-vlm's forward on its own caches;
    pre-norm = mlx-vlm's ``return_hidden`` (what its drafter reads), post = the final norm divided
    by the width multiplier, which the LM head reads."""
    from mlx_vlm.utils import load_model

    model, config = load_mlx_model(checkpoint)
    assert isinstance(model, vlm_text.VlmTextModel) and config["model_type"] == "inkling"
    trunk = Trunk(model)
    reference = load_model(checkpoint).language_model
    seed = resolve(FRESH)
    tokens = np.random.default_rng(seed).integers(0, INKLING_VOCAB, size=PROMPT_LEN + 5).tolist()
    cache, ref_cache = trunk.make_cache(), reference.make_cache()
    assert [type(m).__name__ for m in cache[0].caches] == ["KVCache", "ArraysCache"]
    prompt = mx.array([tokens[:PROMPT_LEN]])
    out = trunk(prompt, cache)
    ref = reference(prompt, cache=ref_cache, return_hidden=True)
    assert max_abs_diff(out.logits, ref.logits) <= TOL, f"seed {seed}"
    assert max_abs_diff(out.hidden_pre_norm, ref.hidden_states[0]) <= TOL, f"seed {seed}"
    norm = reference.model.norm(ref.hidden_states[0]) / MUP_WIDTH
    assert max_abs_diff(out.hidden_post_norm, norm) <= TOL, f"seed {seed}"
    assert max_abs_diff(trunk.lm_head(out.hidden_post_norm), out.logits) <= TOL
    for t in tokens[PROMPT_LEN:]:
        step = trunk(mx.array([[t]]), cache)
        want = reference(mx.array([[t]]), cache=ref_cache).logits
        assert max_abs_diff(step.logits, want) <= TOL, f"seed {seed}, token {t}"


def test_chunked_prefill_and_a_block_equal_one_forward(checkpoint):
    trunk = Trunk(load_mlx_model(checkpoint)[0])
    seed = resolve(FRESH)
    tokens = np.random.default_rng(seed).integers(0, INKLING_VOCAB, size=PROMPT_LEN + 5).tolist()
    whole = trunk(mx.array([tokens]), trunk.make_cache())
    cache, parts = trunk.make_cache(), []
    for lo, hi in ((0, 5), (5, PROMPT_LEN), (PROMPT_LEN, len(tokens))):
        parts.append(trunk(mx.array([tokens[lo:hi]]), cache))
    for field in ("logits", "hidden_pre_norm", "hidden_post_norm"):
        chunked = mx.concatenate([getattr(p, field) for p in parts], axis=1)
        assert max_abs_diff(chunked, getattr(whole, field)) <= TOL, f"seed {seed}, {field}"


def test_a_padded_vocabulary_is_refused_in_one_line():
    from mtplx.trunk.vlm_inkling import host

    from mlx_vlm.models.inkling.config import ModelConfig
    from mlx_vlm.models.inkling.language import LanguageModel
    from support.vlm_inkling import inkling_config

    config = inkling_config()
    config["text_config"]["unpadded_vocab_size"] = INKLING_VOCAB - 6
    with pytest.raises(MtplxError) as e:
        host(LanguageModel(ModelConfig.from_dict(config).text_config))
    assert "\n" not in str(e.value) and "unpadded_vocab_size 90" in str(e.value)


def test_a_copied_cache_keeps_its_own_conv_windows(checkpoint):
    """`compat.copy_cache` (a prompt-cache entry, an n > 1 choice's fork) copies the ArraysCache
    inside each mlx-vlm CacheList too: decoding on the copy leaves the original's windows, and
    both then give the same logits for the same token."""
    from mtplx.trunk.compat import copy_cache

    trunk = Trunk(load_mlx_model(checkpoint)[0])
    cache = trunk.make_cache()
    trunk(mx.array([[3, 17, 42, 5, 60, 9]]), cache)
    windows = [list(c.caches[1].cache) for c in cache]
    copy = copy_cache(cache)
    assert all(a.caches[1] is not b.caches[1] for a, b in zip(cache, copy))
    after_copy = trunk(mx.array([[11, 2]]), copy).logits
    assert all(all(x is y for x, y in zip(w, c.caches[1].cache)) for w, c in zip(windows, cache))
    after_original = trunk(mx.array([[11, 2]]), cache).logits
    assert max_abs_diff(after_copy, after_original) == 0.0
