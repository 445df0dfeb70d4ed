"""Head layouts whose attention needs the trunk's own per-layer cache type, end to end.

Each replica is a tiny random-weight checkpoint in the published Hugging Face layout (config
keys, tensor names, the MTP layers where the checkpoint puts them), loaded through mlx-lm and
``mtplx.heads.load_head`` exactly as a downloaded checkpoint is. Each test checks that the head
loads, that its cache is the one the trunk builds for a layer of the same attention class, and
that greedy decoding with MTP drafts equals greedy AR decoding token for token, with some
drafts accepted (so the rollback really keeps and drops entries).

- DeepSeek-V3.2 (``deepseek_v32``) and GLM-5 (``glm_moe_dsa``): MLA + the DSA indexer. The
  trunk's cache per layer is ``CacheList(KVCache, KVCache)`` (latent KV, indexer keys); the
  MTP layer ``model.layers.{num_hidden_layers}.*`` (enorm, hnorm, eh_proj, shared_head, its
  decoder block; vLLM ``deepseek_mtp.py``) is a decoder layer of the same class and needs the
  same pair. ``index_topk`` is below the context, so the indexer really selects.
- MiMo-V2-Flash (``mimo_v2_flash``): three MTP modules ``model.mtp.layers.{i}.*`` with
  sliding-window attention (vLLM ``mimo_v2_flash_mtp.py``, SGLang ``mimo_v2_flash_nextn.py``);
  the trunk builds a RotatingKVCache of the window for a sliding layer, and so does the head.
  The window (4) is shorter than the context, so it wraps while the head chains drafts.
"""

from __future__ import annotations

from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.heads import load_head
from mtplx.sampling import SamplerConfig
from mtplx.trunk.compat import CacheList, KVCache
from mtplx.trunk.model import Trunk

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model as mlx_load_model
from support import checkpoints, models
from support import decoding as decode
from support.decoding import mtp_decode, take_steps, take_tokens

PROMPT = [3, 17, 42, 5, 60, 9, 11, 2, 33, 8]  # longer than INDEX_TOPK: the indexer selects
GREEDY = SamplerConfig(temperature=0.0)
CONTEXT_STRENGTH = 0.5  # the trunk stays context-dependent, the head agrees with it often enough


def load(path: Path):
    model, config = mlx_load_model(path)
    trunk = Trunk(model)
    return trunk, config, load_head(path, trunk, config)


def cache_kinds(cache) -> object:
    """A cache entry's composition: a class name, or a tuple of them for a CacheList."""
    if type(cache) is CacheList:
        return tuple(cache_kinds(c) for c in cache.caches)
    return type(cache).__name__


def assert_greedy_mtp_equals_ar(trunk, head, prompt: list[int], n: int, depths=(1, 2)) -> None:
    ar = take_tokens(
        decode.ar_decode(trunk, prompt, decode.DecodeSettings(sampler=GREEDY), mx.random.key(0)), n
    )
    for depth in depths:
        settings = decode.DecodeSettings(sampler=GREEDY, depth=depth)
        tokens, steps = take_steps(mtp_decode(trunk, head, prompt, settings, mx.random.key(0)), n)
        assert tokens == ar, depth
        assert sum(s.num_accepted for s in steps if s.num_drafted) > 0, depth  # drafts were kept


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def dsa(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "tiny"
    tiny = checkpoints.deepseek_v3(
        path, model_type=request.param, trunk_layers=2, moe=True, context_strength=CONTEXT_STRENGTH
    )
    return request.param, tiny, load(tiny.path)


def test_dsa_checkpoint_loads_its_head_with_the_trunks_cache_list(dsa):
    model_type, tiny, (trunk, config, head) = dsa
    assert config["model_type"] == model_type and config["index_topk"] < len(PROMPT)
    assert any(k.startswith("model.layers.2.self_attn.indexer.") for k in tiny.tensors)
    assert head is not None and head.layout == "deepseek" and head.num_layers == 1
    assert hasattr(head.modules_[0].block.self_attn, "indexer")
    trunk_kinds = [cache_kinds(c) for c in trunk.make_cache()]
    assert trunk_kinds == [("KVCache", "KVCache")] * 2
    assert [cache_kinds(c) for c in head.make_cache()] == [trunk_kinds[-1]]
    # Fresh objects each time: two head caches never share a member.
    a, b = head.make_cache(), head.make_cache()
    assert a[0].caches[0] is not b[0].caches[0]


def test_dsa_greedy_mtp_equals_greedy_ar(dsa):
    _, _, (trunk, _, head) = dsa
    assert_greedy_mtp_equals_ar(trunk, head, PROMPT, 12)


def test_dsa_head_cache_after_decoding_equals_one_built_from_scratch(dsa):
    """After MTP decoding, both members of the head's cache list (latent KV and indexer keys)
    hold exactly what one pass over the committed (true hidden, next token) pairs builds."""
    _, _, (trunk, _, head) = dsa
    ar = take_tokens(
        decode.ar_decode(trunk, PROMPT, decode.DecodeSettings(sampler=GREEDY), mx.random.key(0)), 8
    )
    head_cache = head.make_cache()
    settings = decode.DecodeSettings(sampler=GREEDY, depth=2)
    take_tokens(mtp_decode(trunk, head, PROMPT, settings, mx.random.key(0), head_cache=head_cache), 8)
    held = head_cache[0].caches[0].offset
    assert all(c.offset == held for c in head_cache[0].caches)
    seq = PROMPT + ar
    hidden = trunk(mx.array([seq[: held + 1]])).hidden_post_norm
    fresh = head.make_cache()
    head(hidden[:, :held], mx.array([seq[1 : held + 1]]), fresh)
    for c, f in zip(head_cache[0].caches, fresh[0].caches):
        assert mx.allclose(c.keys[..., :held, :], f.keys[..., :held, :], atol=1e-4).item()


def test_a_plain_kv_cache_is_what_broke_the_dsa_head(dsa):
    """Negative control: the head's attention indexes its cache as a pair; the plain KVCache
    it used to get does not support that (the crash at the first draft)."""
    _, _, (trunk, _, head) = dsa
    hidden = trunk(mx.array([PROMPT])).hidden_post_norm
    with pytest.raises((TypeError, AttributeError)):
        mx.eval(head(hidden, mx.array([PROMPT[1:] + [1]]), [KVCache()]))


def test_deepseek_v3_head_cache_stays_a_plain_kv_cache(tmp_path):
    """The trunk of DeepSeek-V3 builds plain KV caches; so does its head (nothing changes there)."""
    trunk, _, head = load(checkpoints.deepseek_v3(tmp_path / "v3", trunk_layers=2, sidecar=True).path)
    assert [cache_kinds(c) for c in head.make_cache()] == ["KVCache"]
    assert models.HIDDEN == head.modules_[0].eh_proj.weight.shape[0]


def _fill(leaves: list, start: int, n: int) -> None:
    """Append positions start..start+n-1 to each leaf: keys and values carry their position."""
    pos = mx.arange(start, start + n, dtype=mx.float32).reshape(1, 1, n, 1)
    for c in leaves:
        c.update_and_fetch(mx.broadcast_to(pos, (1, 1, n, 2)), mx.broadcast_to(pos + 0.5, (1, 1, n, 2)))


def test_rollback_walks_nested_cache_lists():
    """begin_block / commit_block / abort_block / trim_kv reach every member of a cache list
    nested in a cache list: each ends as if only the kept positions had been forwarded."""
    from mtplx.trunk import rollback
    from mtplx.trunk.compat import RotatingKVCache, cache_leaves

    def nested():
        return [CacheList(KVCache(), CacheList(KVCache(), RotatingKVCache(max_size=16)))]

    cache, expected = nested(), nested()
    assert rollback.check_rollback_support(cache) is None
    _fill(cache_leaves(cache), 0, 6)
    capture = rollback.begin_block(cache, 3)
    _fill(cache_leaves(cache), 6, 3)
    rollback.commit_block(cache, capture, 1)
    _fill(cache_leaves(expected), 0, 7)
    for got, want in zip(cache_leaves(cache), cache_leaves(expected)):
        assert got.offset == want.offset == 7
        assert mx.array_equal(got.keys[..., :7, :], want.keys[..., :7, :]).item()
        assert mx.array_equal(got.values[..., :7, :], want.values[..., :7, :]).item()
    capture = rollback.begin_block(cache, 2)
    _fill(cache_leaves(cache), 7, 2)
    rollback.abort_block(cache, capture)
    assert [c.offset for c in cache_leaves(cache)] == [7, 7, 7]
    _fill(cache_leaves(cache), 7, 2)
    rollback.trim_kv(cache, 2)
    assert [c.offset for c in cache_leaves(cache)] == [7, 7, 7]


@pytest.fixture(scope="module")
def mimo_v2(tmp_path_factory):
    tiny = checkpoints.mimo_v2_flash(
        tmp_path_factory.mktemp("mimo_v2") / "tiny", context_strength=CONTEXT_STRENGTH
    )
    return tiny, load(tiny.path)


def test_mimo_v2_flash_loads_its_three_sliding_window_modules(mimo_v2):
    from mtplx.trunk.compat import RotatingKVCache

    tiny, (trunk, config, head) = mimo_v2
    assert not any(k.startswith("model.mtp") for k, _ in tree_flatten(trunk.model.parameters()))
    assert head is not None and head.layout == "mimo_v2_flash" and head.num_layers == 3
    assert head.hidden_source == "post_norm" and head.chain_source == "post_norm"
    caches = head.make_cache()
    assert [cache_kinds(c) for c in caches] == ["RotatingKVCache"] * 3
    assert all(c.max_size == config["sliding_window_size"] for c in caches if isinstance(c, RotatingKVCache))
    assert [cache_kinds(c) for c in trunk.make_cache()] == ["KVCache", "RotatingKVCache"]
    block = head.modules_[0].block
    assert block.is_sliding_window and block.self_attn.attention_sink_bias is not None
    # pre_mlp_layernorm (the checkpoint's name) is the block's post_attention_layernorm.
    w = tiny.tensors["model.mtp.layers.1.pre_mlp_layernorm.weight"]
    assert mx.array_equal(head.modules_[1].block.post_attention_layernorm.weight, mx.array(w)).item()


def test_mimo_v2_flash_greedy_mtp_equals_greedy_ar_at_depths_1_to_4(mimo_v2):
    _, (trunk, _, head) = mimo_v2
    assert_greedy_mtp_equals_ar(trunk, head, PROMPT, 16, depths=(1, 2, 3, 4))


def test_mimo_v2_flash_head_caches_after_chained_drafts_equal_ones_built_from_scratch(mimo_v2):
    """The chain writes draft entries one token at a time into windows that have wrapped; after
    each commit every module's window holds exactly the newest committed positions."""
    _, (trunk, _, head) = mimo_v2
    settings = decode.DecodeSettings(sampler=GREEDY, depth=3)
    ar = take_tokens(
        decode.ar_decode(trunk, PROMPT, decode.DecodeSettings(sampler=GREEDY), mx.random.key(0)), 12
    )
    head_cache = head.make_cache()
    take_tokens(mtp_decode(trunk, head, PROMPT, settings, mx.random.key(0), head_cache=head_cache), 12)
    held = head_cache[0].offset
    assert held > head_cache[0].max_size  # the window wrapped
    seq = PROMPT + ar
    hidden = trunk(mx.array([seq[: held + 1]])).hidden_post_norm
    fresh = head.make_cache()
    head(hidden[:, :held], mx.array([seq[1 : held + 1]]), fresh)
    for c, f in zip(head_cache, fresh):
        assert c.offset == f.offset == held
        got, want = _window(c), _window(f)
        assert got.shape == want.shape and mx.allclose(got, want, atol=1e-4).item()


def _window(c) -> mx.array:
    """The newest ``max_size`` keys of a RotatingKVCache in temporal order."""
    from mtplx.trunk.compat import rotating_state

    st = rotating_state(c)
    keys = st.keys
    if st.idx < keys.shape[2] and st.offset > st.max_size:  # wrapped in place: oldest entry at idx
        keys = mx.concatenate([keys[..., st.idx :, :], keys[..., : st.idx, :]], axis=2)
    return keys[..., -st.max_size :, :]


def test_mimo_v2_flash_inspects_and_converts_with_its_head(mimo_v2, tmp_path):
    from mtplx.checkpoints.convert_hf import convert_hf
    from mtplx.checkpoints.inspect import inspect_model

    tiny, _ = mimo_v2
    info = inspect_model(tiny.path)
    assert info["verdict"] == "MTP-ready" and info["mtp"]["layout"] == "mimo_v2_flash"
    assert info["mtp"]["declared_layers"] == 3
    out = convert_hf(tiny.path, tmp_path / "converted", q_bits=4, q_group_size=32)
    trunk, _, head = load(out)
    assert head is not None and head.layout == "mimo_v2_flash" and head.num_layers == 3
    ar = take_tokens(
        decode.ar_decode(trunk, PROMPT, decode.DecodeSettings(sampler=GREEDY), mx.random.key(0)), 8
    )
    settings = decode.DecodeSettings(sampler=GREEDY, depth=2)
    assert take_tokens(mtp_decode(trunk, head, PROMPT, settings, mx.random.key(0)), 8) == ar
