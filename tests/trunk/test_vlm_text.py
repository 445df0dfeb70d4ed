"""The second trunk backend: mlx-vlm's language model of a family mlx-lm lacks (Hunyuan-V4,
``hy_v4``), hosted behind the trunk contract (`mtplx.trunk.backends`, `mtplx.trunk.vlm_text`).

The checkpoint is ``support.vlm_families.hy_v4``'s tiny replica in the published layout; the
reference is mlx-vlm's own loader and forward on its own caches. Cache rollback for its cache
kinds (a CacheList of the MLA KV and the DSA indexer's keys per layer) runs in
``tests/trunk/test_cache.py`` (``hy_v4_dsa``, with the skipped-trim control).
"""

from __future__ import annotations

import json

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.checkpoints.load import load_mlx_model
from mtplx.errors import MtplxError
from mtplx.trunk import backends, vlm_text
from mtplx.trunk.model import Trunk

import mlx.core as mx
import numpy as np
import pytest
from support.seeds import FRESH, resolve
from support.vlm_families import HY_V4_VOCAB, hy_v4
from support.vlm_heads import max_abs_diff

TOL = 1e-4
PROMPT_LEN = 12  # over the indexer's 4 kept keys: it selects


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return hy_v4(tmp_path_factory.mktemp("hy_v4") / "model").path


@pytest.fixture(scope="module")
def trunk(checkpoint):
    model, config = load_mlx_model(checkpoint)
    assert isinstance(model, vlm_text.VlmTextModel) and config["model_type"] == "hy_v4"
    return Trunk(model)


@pytest.fixture(scope="module")
def reference(checkpoint):
    from mlx_vlm.utils import load_model

    return load_model(checkpoint).language_model


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, HY_V4_VOCAB, size=n).tolist()


def test_backend_is_decided_by_the_table():
    assert backends.backend_for({"model_type": "hy_v4"}) == (backends.MLX_VLM, "hy_v4")
    assert backends.backend_for(
        {"model_type": "qwen4_exp", "text_config": {"model_type": "qwen4_exp_text"}}
    ) == (
        backends.MLX_VLM,
        "qwen4_exp",
    )
    assert backends.backend_for({"model_type": "llama"}) == (backends.MLX_LM, "llama")
    # mlx-lm first: a type both have stays on mlx-lm (qwen3_5 is in both packages)
    assert backends.backend_for({"model_type": "qwen3_5"})[0] is backends.MLX_LM


def test_missing_mlx_vlm_names_the_type_and_the_install_command():
    absent = backends.TrunkBackend(
        "mlx-vlm", "mlx-vlm", "no_such_mlx_vlm.models", backends.MLX_VLM.families, backends.MLX_VLM_INSTALL
    )
    with pytest.raises(MtplxError) as e:
        backends.backend_for({"model_type": "hy_v4"}, (backends.MLX_LM, absent))
    message = str(e.value)
    assert "\n" not in message and "hy_v4" in message and backends.MLX_VLM_INSTALL in message


def test_a_type_neither_knows_names_it_and_both_versions():
    from importlib import metadata

    with pytest.raises(MtplxError) as e:
        backends.backend_for({"model_type": "no_such_family", "text_config": {"model_type": "nor_this"}})
    message = str(e.value)
    assert "\n" not in message and "no_such_family" in message and "nor_this" in message
    for package in ("mlx-lm", "mlx-vlm"):
        assert f"{package} {metadata.version(package)}" in message


def test_load_refuses_an_unknown_type_in_one_line(checkpoint, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in checkpoint.iterdir():
        (bad / f.name).symlink_to(f)
    (bad / "config.json").unlink()
    config = json.loads((checkpoint / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "hy_v9"}))
    with pytest.raises(MtplxError) as e:
        load_mlx_model(bad)
    assert "\n" not in str(e.value) and "hy_v9" in str(e.value) and str(bad) in str(e.value)


def test_trunk_logits_equal_mlx_vlm_forward(trunk, reference):
    """Every prompt position, then 5 decode steps, against mlx-vlm's forward on its own caches;
    the post-norm hidden is mlx-vlm's ``return_hidden`` state and feeds the logits."""
    seed = resolve(FRESH)
    tokens = _tokens(seed, PROMPT_LEN + 5)
    cache, ref_cache = trunk.make_cache(), reference.make_cache()
    assert type(ref_cache[0]).__module__.startswith("mlx_vlm") and type(cache[0]).__module__.startswith(
        "mlx_lm"
    )
    prompt = mx.array([tokens[:PROMPT_LEN]])
    out = trunk(prompt, cache)
    ref = reference(prompt, cache=ref_cache, return_hidden=True)
    assert max_abs_diff(out.logits, ref.logits) <= TOL, f"seed {seed}"
    assert max_abs_diff(out.hidden_post_norm, ref.hidden_states[0]) <= TOL, f"seed {seed}"
    # the tap: pre-norm is the hyper-connection head's collapse of the streams, post = norm(pre)
    inner = reference.model
    assert max_abs_diff(out.hidden_post_norm, inner.norm(out.hidden_pre_norm)) <= TOL
    for t in tokens[PROMPT_LEN:]:
        step = trunk(mx.array([[t]]), cache)
        want = reference(mx.array([[t]]), cache=ref_cache).logits
        assert max_abs_diff(step.logits, want) <= TOL, f"seed {seed}, token {t}"


def _decode_vs_scratch(model, tokens: list[int], start: int) -> float:
    """Largest gap between stepping ``model`` (an mlx-vlm language model) one token at a time from
    a prefill of ``tokens[:start]`` and a from-scratch forward of each longer prefix."""
    cache = model.make_cache()
    model(mx.array([tokens[:start]]), cache=cache)
    worst = 0.0
    for n in range(start, len(tokens)):
        step = model(mx.array([[tokens[n]]]), cache=cache).logits[0, -1]
        scratch = model(mx.array([tokens[: n + 1]]), cache=model.make_cache()).logits[0, -1]
        worst = max(worst, max_abs_diff(step, scratch))
    return worst


def test_decode_and_blocks_select_the_keys_a_scratch_forward_does(trunk, reference):
    """The indexer hook: every decode step and a block after a prefill equal a from-scratch
    forward (mlx-vlm's shapeless-compiled top-k does not: the control)."""
    seed = resolve(FRESH)
    tokens = _tokens(seed, PROMPT_LEN + 6)
    assert _decode_vs_scratch(reference, tokens, PROMPT_LEN) <= TOL, f"seed {seed}"
    cache = trunk.make_cache()
    trunk(mx.array([tokens[:PROMPT_LEN]]), cache)
    block = trunk(mx.array([tokens[PROMPT_LEN:]]), cache).logits
    whole = trunk(mx.array([tokens]), trunk.make_cache()).logits
    assert max_abs_diff(block, whole[:, PROMPT_LEN:]) <= TOL, f"seed {seed}"


def test_control_mlx_vlms_compiled_top_k_differs_from_scratch(reference):
    import mlx_vlm.models.hy_v4.indexer as indexer

    vlm_text.install_exactness_hooks("hy_v4")
    original = vlm_text.ORIGINALS[("mlx_vlm.models.hy_v4.indexer", "_partition_scores")]
    original.cache_clear()
    hooked = indexer._partition_scores
    indexer._partition_scores = original
    try:
        gap = _decode_vs_scratch(reference, _tokens(3, PROMPT_LEN + 6), PROMPT_LEN)
    finally:
        indexer._partition_scores = hooked
        original.cache_clear()
    assert gap > 1e-2


def test_chunked_prefill_equals_one_forward(trunk):
    seed = resolve(FRESH)
    tokens = _tokens(seed, PROMPT_LEN)
    whole = trunk(mx.array([tokens]), trunk.make_cache())
    cache, parts = trunk.make_cache(), []
    for lo, hi in ((0, 5), (5, 9), (9, PROMPT_LEN)):
        parts.append(trunk(mx.array([tokens[lo:hi]]), cache))
    for field in ("logits", "hidden_pre_norm", "hidden_post_norm"):
        chunked = mx.concatenate([getattr(p, field) for p in parts], axis=1)
        assert max_abs_diff(chunked, getattr(whole, field)) <= TOL, f"seed {seed}, {field}"


def test_no_vision_module_and_mlx_lm_caches(trunk):
    model = trunk.model
    assert not any("vision" in name for name, _ in model.named_modules())
    assert all(
        type(c).__name__ == "CacheList" and type(c).__module__ == "mlx_lm.models.cache"
        for c in trunk.make_cache()
    )


def test_inspect_shows_the_backend(checkpoint):
    from importlib import metadata

    from mtplx.checkpoints.inspect import inspect_model
    from mtplx.checkpoints.inspect_report import format_inspection

    info = inspect_model(checkpoint)
    assert info["trunk_backend"] == {
        "backend": "mlx-vlm",
        "version": metadata.version("mlx-vlm"),
        "problem": None,
    }
    assert info["verdict"] == "MTP-ready" and info["mtp"]["layout"] == "hy_v4"
    assert f"trunk         mlx-vlm {metadata.version('mlx-vlm')}" in format_inspection(info).splitlines()


def test_families_mlx_vlm_has_but_mtplx_does_not_host_yet_are_one_line_errors(monkeypatch):
    """A family listed in ``NOT_HOSTED_YET`` (none today: Inkling, the last, is hosted) is refused
    in one line naming the type, both versions and what is missing, never loaded."""
    from importlib import metadata

    assert (
        backends.NOT_HOSTED_YET == {}
        and backends.backend_for({"model_type": "inkling"})[0] is backends.MLX_VLM
    )
    model_type, why = "inkling_next", "its caches cannot be rolled back yet"
    monkeypatch.setitem(backends.NOT_HOSTED_YET, model_type, why)
    with pytest.raises(MtplxError) as e:
        backends.backend_for({"model_type": model_type})
    message = str(e.value)
    assert (
        "\n" not in message and model_type in message and f"mlx-vlm {metadata.version('mlx-vlm')}" in message
    )
    assert f"mlx-lm {metadata.version('mlx-lm')}" in message and why in message


@pytest.mark.parametrize(
    ("family", "kinds"),
    [  # hy_v4: the MLA latent KV with the DSA indexer's keys, or a shared indexer's alone
        ("hy_v4", "CacheList(KVCache, KVCache), CacheList(KVCache)"),
        (
            "deepseek_v4",
            "mlx_vlm RotatingKVCache, mlx_vlm CacheList(mlx_vlm RotatingKVCache, mlx_vlm PoolingCache, "
            "mlx_vlm PoolingCache)",
        ),
        (
            "glm5_next",
            "mlx_vlm ArraysCache, mlx_vlm CacheList(mlx_vlm KVCache, mlx_vlm KVCache, mlx_vlm PoolingCache, "
            "mlx_vlm KVCache)",
        ),
        ("minimax_m3", "mlx_vlm KVCache, mlx_vlm MiniMaxM3KVCache"),
    ],
)
def test_kv_bits_is_refused_in_one_line_naming_the_cache_kinds(family, kinds):
    """These families hold no plain mlx-lm KVCache to quantize (mlx-vlm's own classes, or the MLA
    latent cache inside a CacheList with its indexer's), nor a cache that quantizes itself
    (Qwen3.8-Flash-Next's does: `test_qwen4_exp_takes_kv_bits_from_position_0_only`)."""
    from mtplx.trunk.kv_quant import KVQuantization, check_fit

    import support.vlm_families as families

    trunk = Trunk(getattr(families, f"tiny_{family}")())
    with pytest.raises(MtplxError) as e:
        check_fit(trunk, None, KVQuantization(4, 64, 0))
    message = str(e.value)
    assert "\n" not in message and message.startswith("kv_bits: ") and f"({kinds})" in message


@pytest.mark.parametrize(
    "family",
    [
        "hy_v4",  # mlx-lm caches: CacheList(KVCache, KVCache) per layer, batched
        "qwen4_exp",  # mlx-vlm's own caches with batch forms (mtplx.trunk.batch_vlm)
        "deepseek_v4",  # its window and pool caches as ragged rows (mtplx.trunk.batch_deepseek_v4)
        "glm5_next",  # mlx-vlm's own caches with batch forms (mtplx.trunk.batch_glm5_next)
        "minimax_m3",  # mlx-vlm's own KVCache / MiniMaxM3KVCache as ragged rows, batched
        "inkling",  # mlx-vlm's CacheList(KVCache, ArraysCache(4)), batched (batch_inkling)
    ],
)
def test_families_on_mlx_vlms_own_caches_batch(family):
    """Every family hosted through mlx-vlm batches (`tests/heads/test_{hy_v4,qwen4_exp,deepseek_v4,
    glm5_next,inkling}.py`: rows share one forward; `tests/trunk/test_vlm_minimax_m3.py`)."""
    from mtplx.spec_decode.rows import check_batch_support

    import support.vlm_families as families
    import support.vlm_inkling

    source = support.vlm_inkling if family == "inkling" else families
    assert check_batch_support(Trunk(getattr(source, f"tiny_{family}")())) is None


def test_an_mlx_vlm_cache_without_a_batch_form_decodes_alone_with_a_one_line_reason():
    """A cache of mlx-vlm's own classes its family's batch layer does not take (a sliding window
    that keeps its first positions: DeepSeek-V4's batch ring has no such prefix) makes the rows
    decode one request at a time: the reason is one line naming the cache."""
    from mtplx.trunk.batch_cache import check_batchable

    from mlx_vlm.models.cache import RotatingKVCache
    from support.vlm_families import tiny_deepseek_v4

    trunk = Trunk(tiny_deepseek_v4())
    cache = trunk.make_cache()
    cache[0] = RotatingKVCache(max_size=8, keep=4)
    assert check_batchable(cache, trunk.model) == (
        "cache of layer 0: mlx_vlm RotatingKVCache is not batched (decoded one request at a time)"
    )


def test_qwen4_exp_takes_kv_bits_from_position_0_only():
    """Its QSAKVCache quantizes itself (mlx-vlm's QSAQuantizedKVCache); a later start would convert
    it mid-sequence, which its gated-delta caches cannot take in two forwards: one line."""
    from mtplx.trunk.kv_quant import KVQuantization, check_fit, make_cache

    from support.vlm_families import tiny_qwen4_exp

    trunk = Trunk(tiny_qwen4_exp())
    check_fit(trunk, None, KVQuantization(8, 32, 0))
    kinds = [type(c).__name__ for c in make_cache(trunk.make_cache(), KVQuantization(8, 32, 0))]
    assert kinds == ["ArraysCache", "QSAQuantizedKVCache"] * 2
    with pytest.raises(MtplxError) as e:
        check_fit(trunk, None, KVQuantization(8, 32, 16))
    assert "\n" not in str(e.value) and "quantized_kv_start must be 0" in str(e.value)
