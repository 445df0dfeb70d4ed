"""GLM-5-Next's MTP head (``mtplx.heads.glm5_next``) beside its mlx-vlm-hosted trunk.

The checkpoints are ``support.vlm_families.glm5_next``'s tiny replicas in the published layout
(the MTP layer at ``model.language_model.layers.4``): one built so the head predicts
(``CONTEXT_STRENGTH``: drafts kept), one all random (the references'). The head against
mlx-vlm's own drafter (``Glm5NextMTPDraftModel``) and a float64 NumPy reference; greedy MTP == AR
(its pool cache dropped back to ``mark_drafts`` after rejections), alone and batched; the split
drafter. The trunk's own checks: ``tests/trunk/test_vlm_glm5_next.py``.
"""

from __future__ import annotations

import json

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.engine.engine import Engine
from mtplx.engine.request import GenerationRequest
from mtplx.heads.glm5_next import Glm5NextMTPHead

import mlx.core as mx
import numpy as np
import pytest
from support.decoding import assert_mtp_equals_ar_with_drafts_kept
from support.numpy_heads import fuse_inputs, mla_attention, read_tensors, rms, silu, zero_position_zero
from support.seeds import SEEDS, resolve
from support.vlm_families import GLM5_NEXT_HIDDEN, GLM5_NEXT_VOCAB
from support.vlm_families import glm5_next as glm5_next_checkpoint
from support.vlm_heads import (
    PROMPTS,
    assert_batched_rows_share_forwards_and_equal_ar,
    assert_split_head_equals_own,
    head_logits_on_trunk,
    replica,
)

REFERENCE_LAYOUTS = ("glm5_next",)
CONTEXT_STRENGTH = 0.1
LENGTH = 4  # the indexer keeps 2 pools of 2 keys: every key at these positions (dense)
MTP = "model.language_model.layers.4."
_req = GenerationRequest.from_kwargs


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm5_next") / "GLM-5-Next-Tiny"
    return replica(path, glm5_next_checkpoint, GLM5_NEXT_VOCAB, context_strength=CONTEXT_STRENGTH)


@pytest.fixture(scope="module")
def engine(checkpoint) -> Engine:
    return Engine.load(str(checkpoint), depth=2)


@pytest.fixture(scope="module")
def random_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm5_next_random") / "r"
    return replica(path, glm5_next_checkpoint, GLM5_NEXT_VOCAB, seed=11)


@pytest.fixture(scope="module")
def random_engine(random_checkpoint) -> Engine:
    return Engine.load(str(random_checkpoint))


def _trunk_hidden(checkpoint, tokens: list[int]) -> mx.array:
    """The state mlx-vlm's language model hands its drafter (``return_hidden``)."""
    from mlx_vlm.utils import load_model

    lm = load_model(checkpoint).language_model
    return lm(mx.array([tokens]), cache=lm.make_cache(), return_hidden=True).hidden_states[0], lm


# --------------------------------------------------------------------------- float64 reference
# From the published math as mlx-vlm 0.7.10 writes it (models/glm5_next/language.py,
# speculative/drafters/glm5_next_mtp), on the published tensor names.


def limited_swiglu(x: np.ndarray, t: dict, p: str, limit: float) -> np.ndarray:
    gate, up = x @ t[p + "gate_proj.weight"].T, x @ t[p + "up_proj.weight"].T
    return (silu(np.minimum(gate, limit)) * np.clip(up, -limit, limit)) @ t[p + "down_proj.weight"].T


def moe(x: np.ndarray, t: dict, p: str, cfg: dict) -> np.ndarray:
    """Sigmoid router scores; the top-k by score + bias, weighted by their scores renormalised,
    times routed_scaling_factor; clamped SwiGLU experts plus the (clamped) shared expert."""
    scores = 1 / (1 + np.exp(-(x @ t[p + "gate.weight"].T)))
    chosen = np.argsort(-(scores + t[p + "gate.e_score_correction_bias"]), axis=-1, kind="stable")
    chosen = chosen[:, : cfg["num_experts_per_tok"]]
    weights = np.take_along_axis(scores, chosen, -1)
    weights = weights / weights.sum(-1, keepdims=True) * cfg["routed_scaling_factor"]
    limit = cfg.get("swiglu_limit", 10.0)
    out = limited_swiglu(x, t, p + "shared_experts.", limit)
    for row in range(x.shape[0]):
        for e, w in zip(chosen[row], weights[row]):
            out[row] += w * limited_swiglu(x[row], t, f"{p}experts.{e}.", limit)
    return out


def mtp_logits(t: dict, cfg: dict, hidden: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """The MTP layer at ``MTP`` on (trunk post-norm hidden, next token) rows: logits [T, V]:
    NoPE MLA (dense at these positions), a plain residual block, ``shared_head.norm``."""
    eps = cfg["rms_norm_eps"]
    e = zero_position_zero(t["model.language_model.embed_tokens.weight"][tokens])
    x = fuse_inputs(
        e, hidden, t[MTP + "enorm.weight"], t[MTP + "hnorm.weight"], t[MTP + "eh_proj.weight"], eps
    )
    attn_cfg = {**cfg, "rope_theta": 1.0}  # qk_rope_head_dim 0: no rotation
    x = x + mla_attention(
        rms(x, t[MTP + "input_layernorm.weight"], eps), t, MTP + "self_attn.", attn_cfg, latent_eps=eps
    )
    x = x + moe(rms(x, t[MTP + "post_attention_layernorm.weight"], eps), t, MTP + "mlp.", cfg)
    return rms(x, t[MTP + "shared_head.norm.weight"], eps) @ t["lm_head.weight"].T


@pytest.mark.parametrize("seed", SEEDS)
def test_head_logits_match_the_float64_reference_at_every_position(random_engine, random_checkpoint, seed):
    seed = resolve(seed)
    tokens = np.random.default_rng(seed).integers(0, GLM5_NEXT_VOCAB, size=LENGTH + 1).tolist()
    t = read_tensors(random_checkpoint)
    cfg = json.loads((random_checkpoint / "config.json").read_text())["text_config"]
    hidden, _ = _trunk_hidden(random_checkpoint, tokens[:-1])
    want = mtp_logits(t, cfg, np.asarray(hidden[0], dtype=np.float64), np.array(tokens[1:]))
    got = head_logits_on_trunk(random_engine, tokens)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max(), f"seed {seed}"


def test_head_equals_mlx_vlms_drafter_at_every_position(random_checkpoint, random_engine):
    """Same tensors (mlx-vlm's splitter's rename, then its drafter's ``sanitize``), the same trunk
    hidden, the same next tokens, over 11 positions (the indexer selecting): mlx-vlm's
    ``_forward_hidden``."""
    from mlx_vlm.speculative.drafters.glm5_next_mtp import Model, ModelConfig
    from mlx_vlm.speculative.drafters.glm5_next_mtp.split import Glm5NextMTPSplitter

    config = json.loads((random_checkpoint / "config.json").read_text())
    tokens = np.random.default_rng(3).integers(0, GLM5_NEXT_VOCAB, size=12).tolist()
    drafter = Model(ModelConfig.from_dict({"text_config": config["text_config"]}))
    tensors = mx.load(str(random_checkpoint / "model.safetensors"))
    renamed = Glm5NextMTPSplitter().rename(
        {k: v for k, v in tensors.items() if k.startswith(MTP)}, config["text_config"]
    )
    drafter.load_weights(list(drafter.sanitize(renamed).items()))
    hidden, lm = _trunk_hidden(random_checkpoint, tokens[:-1])
    drafter.bind(lm)
    drafter.reset(lm)
    nxt = mx.array([tokens[1:]])
    out, _ = drafter._forward_hidden(lm.model.embed_tokens(nxt), hidden, nxt, drafter.make_cache())
    want = np.asarray(lm.lm_head(out)[0], dtype=np.float64)
    got = head_logits_on_trunk(random_engine, tokens)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()


def test_the_head_reads_the_post_norm_state_and_chains_on_its_output(random_engine):
    head = random_engine.head
    assert (head.hidden_source, head.chain_source) == ("post_norm", "post_norm")
    hidden = mx.array(np.random.default_rng(2).standard_normal((1, 1, GLM5_NEXT_HIDDEN)).astype(np.float32))
    out = head(hidden, mx.array([[5]]), head.make_cache())
    assert out.shape == (1, 1, GLM5_NEXT_HIDDEN) and mx.array_equal(head.chain_input(out), out).item()


# --------------------------------------------------------------------------- decoding


def test_the_engine_finds_the_head_beside_the_mlx_vlm_trunk(engine):
    assert isinstance(engine.head, Glm5NextMTPHead) and type(engine.trunk.model).__name__ == "VlmTextModel"


def test_greedy_mtp_equals_ar_with_drafts_kept_at_depths_1_and_2(engine):
    assert_mtp_equals_ar_with_drafts_kept(engine.trunk, engine.head, PROMPTS[:1], 8)


def test_rows_in_a_batch_share_one_forward_and_equal_ar_with_rejections(engine, monkeypatch):
    """Its caches batch (`mtplx.trunk.batch_glm5_next`: the sparse layers' CacheLists as ragged
    rows, the linear-attention ArraysCaches rolled back per row by mlx-vlm), the head's too: the
    three rows decode in shared trunk forwards, each giving its AR tokens alone with drafts kept
    and rejected."""
    assert_batched_rows_share_forwards_and_equal_ar(engine, monkeypatch, max_tokens=8)


def test_the_split_drafter_is_found_beside_the_trunk_and_equals_the_checkpoints_head(
    checkpoint, engine, tmp_path
):
    """mlx-vlm's splitter's ``glm5_next_mtp`` drafter of the replica, beside the same trunk
    without its MTP tensors."""
    from mlx_vlm.split_mtp import split_mtp

    trunk_dir = tmp_path / "GLM-5-Next-Tiny-4bit"
    replica(
        trunk_dir, glm5_next_checkpoint, GLM5_NEXT_VOCAB, context_strength=CONTEXT_STRENGTH, ship_mtp=False
    )
    drafter = split_mtp(str(checkpoint), str(tmp_path / "GLM-5-Next-Tiny-MTP"))
    assert json.loads((tmp_path / drafter / "config.json").read_text())["model_type"] == "glm5_next_mtp"
    split = Engine.load(str(trunk_dir), depth=2)
    head = split.head
    assert isinstance(head, Glm5NextMTPHead) and head.hidden_source == "post_norm"
    assert_split_head_equals_own(split, engine, PROMPTS[0])
    assert_mtp_equals_ar_with_drafts_kept(split.trunk, head, PROMPTS[:1], 10, depths=(2,))


# --------------------------------------------------------------------------- conversion


def test_mtplx_convert_keeps_the_head_at_safe_precision_and_mlx_vlm_opens_the_output(checkpoint, tmp_path):
    from mtplx.checkpoints.convert_hf import convert_hf

    from mlx_vlm.utils import load_model

    out = convert_hf(checkpoint, tmp_path / "GLM-5-Next-Tiny-4bit", q_bits=4, q_group_size=32)
    assert type(load_model(out)).__module__ == "mlx_vlm.models.glm5_next.glm5_next"  # opens in mlx-vlm
    converted = Engine.load(str(out), depth=2)
    assert isinstance(converted.head, Glm5NextMTPHead)
    bits = {path: m.bits for path, m in converted.head.named_modules() if hasattr(m, "scales")}
    block = "modules_.0.block."
    assert (
        bits["modules_.0.eh_proj"]
        == bits[block + "self_attn.qkv_a_proj"]
        == bits[block + "self_attn.embed_q"]
        == 8
    )
    assert bits[block + "mlp.switch_mlp.gate_proj"] == 4  # routed experts at the trunk's bits
    assert_mtp_equals_ar_with_drafts_kept(converted.trunk, converted.head, PROMPTS[:1], 10, depths=(2,))


def test_dropping_draft_entries_leaves_the_head_cache_as_the_kept_positions_made_it(random_engine):
    """Two chained draft steps complete a pool of 2 keys; ``trim_kv`` of those 2 entries puts the
    pool cache back to ``mark_drafts``' record and cuts the KV members: equal to a cache that
    never saw them. Without a record the trim refuses (never a silently wrong pool)."""
    from mtplx.trunk import rollback_vlm
    from mtplx.trunk.rollback import trim_kv

    head = random_engine.head
    rng = np.random.default_rng(4)
    hidden = mx.array(rng.standard_normal((1, 7, GLM5_NEXT_HIDDEN)).astype(np.float32))
    tokens = mx.array([rng.integers(0, GLM5_NEXT_VOCAB, size=7).tolist()])
    drafted, kept = head.make_cache(), head.make_cache()
    for cache in (drafted, kept):
        head(hidden[:, :5], tokens[:, :5], cache)
    head(hidden[:, 5:6], tokens[:, 5:6], drafted, step=1)  # marks, then a draft entry
    head(hidden[:, 6:7], tokens[:, 6:7], drafted, step=2)  # the pool of positions 4-5 completes
    pool = drafted[0].caches[2]
    assert pool.pooled.shape[1] == 3
    trim_kv(drafted, 2)
    for got, want in zip(drafted[0].caches, kept[0].caches):
        assert got.offset == want.offset
        for a, b in zip(got.state, want.state):
            assert (a is None) == (b is None) and (a is None or mx.array_equal(a, b).item())
    head(hidden[:, 5:6], tokens[:, 5:6], drafted, step=1)
    rollback_vlm._MARKS.clear()
    with pytest.raises(ValueError, match="mark_drafts"):
        trim_kv(drafted, 1)
