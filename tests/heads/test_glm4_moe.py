"""GLM-4.5 / 4.6 / 4.7 (``glm4_moe``) checkpoints load their MTP layer and decode greedily as AR.

The replica (``support.checkpoints.glm4_moe``) is a tiny random-weight checkpoint in the
published Hugging Face layout, loaded through mlx-lm and ``mtplx.heads.load_head`` exactly as a
downloaded one is. What it follows:

- the config keys and the trunk's tensors: mlx-lm 0.32's ``mlx_lm/models/glm4_moe.py``
  (``ModelArgs``; ``sanitize`` stacks ``mlp.experts.{e}.*`` and drops the MTP layer
  ``model.layers.{num_hidden_layers}.*``) and zai-org/GLM-4.5's published config (GQA with
  q/k/v biases, ``use_qk_norm``, ``partial_rotary_factor`` 0.5, first layer(s) dense, sigmoid
  routing with ``e_score_correction_bias``, one shared expert, bfloat16);
- the MTP layer: vLLM's ``glm4_moe_mtp.py`` (``Glm4MoeMultiTokenPredictorLayer``: ``enorm``,
  ``hnorm``, ``eh_proj`` over [embedding, hidden], the embedding zeroed at position 0, a
  ``Glm4MoeDecoderLayer`` whose tensors sit at the layer prefix itself, ``shared_head.norm``
  and ``shared_head.head``, an ``embed_tokens`` copy at the prefix), the layout mtplx reads
  through the DeepSeek row (``mtplx/heads/deepseek.py``).

GLM's MTP block is the trunk's GQA + MoE decoder layer, not DeepSeek's MLA: the head builds a
layer of the trunk's class, so nothing GLM-specific is needed in the loader. The CPU backend's
``GatherMM`` (unquantized experts) is float32-only, so the bfloat16 replica is decoded cast to
float32; the ``convert --q-bits 4`` output (quantized experts) decodes in its own dtype.
"""

from __future__ import annotations

from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx import cli
from mtplx.checkpoints.inspect import inspect_model
from mtplx.checkpoints.inspect_report import format_inspection
from mtplx.heads import load_head
from mtplx.sampling import SamplerConfig
from mtplx.trunk.compat import KVCache
from mtplx.trunk.model import Trunk

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import glm4_moe
from mlx_lm.utils import load_model as mlx_load_model
from support import checkpoints
from support import decoding as decode
from support.decoding import mtp_decode, take_steps, take_tokens
from support.numpy_heads import (
    causal_mask,
    fuse_inputs,
    gqa_attention,
    read_tensors,
    rms,
    rope,
    routing_margin,
    sigmoid_moe,
    zero_position_zero,
)
from support.seeds import SEEDS, resolve

PROMPT = [3, 17, 42, 5, 60, 9, 11, 2, 33, 8]
GREEDY = SamplerConfig(temperature=0.0)
CONTEXT_STRENGTH = 0.2  # the trunk stays context-dependent, the head agrees with it often enough
MTP = "model.layers.2."  # num_hidden_layers 2: the MTP layer's prefix


def load(path: Path, dtype=None):
    model, config = mlx_load_model(path)
    if dtype is not None:
        model.set_dtype(dtype)
    trunk = Trunk(model)
    head = load_head(path, trunk, config)
    if dtype is not None and head is not None:
        head.set_dtype(dtype)
    return trunk, config, head


@pytest.fixture(scope="module", params=[True, False], ids=["GLM-4.5", "GLM-4.5-Air"])
def glm(request, tmp_path_factory):
    """With QK norm (GLM-4.5, 4.6, 4.7) and without (GLM-4.5-Air); two shards, as the published
    checkpoints are split (the MTP layer's tensors land in both)."""
    path = tmp_path_factory.mktemp("glm4_moe") / "tiny"
    return checkpoints.glm4_moe(path, shards=2, qk_norm=request.param, context_strength=CONTEXT_STRENGTH)


def assert_greedy_mtp_equals_ar(trunk, head, n: int, depths, rollbacks: bool = True) -> None:
    ar = take_tokens(
        decode.ar_decode(trunk, PROMPT, decode.DecodeSettings(sampler=GREEDY), mx.random.key(0)), n
    )
    rolled_back = False
    for depth in depths:
        settings = decode.DecodeSettings(sampler=GREEDY, depth=depth)
        tokens, steps = take_steps(mtp_decode(trunk, head, PROMPT, settings, mx.random.key(0)), n)
        assert tokens == ar, depth
        assert sum(s.num_accepted for s in steps if s.num_drafted) > 0, depth  # drafts were kept
        rolled_back |= any(s.num_drafted and s.num_accepted < depth for s in steps)
    assert rolled_back or not rollbacks  # and some were dropped: the rollback ran


def test_the_replica_is_in_the_published_layout(glm):
    files = {}
    for shard in sorted(glm.path.glob("model-*.safetensors")):
        part = mx.load(str(shard))
        assert any(k.startswith(MTP) for k in part)  # the MTP layer spans the shards
        files.update(part)
    assert glm.config["model_type"] == "glm4_moe" and glm.config["num_nextn_predict_layers"] == 1
    qk_norm = glm.config["use_qk_norm"]
    assert (MTP + "self_attn.k_norm.weight" in files) == qk_norm
    for name in (
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "shared_head.head.weight",
        "embed_tokens.weight",
        "self_attn.q_proj.bias",
        "self_attn.v_proj.bias",
        "mlp.experts.3.down_proj.weight",
        "mlp.shared_experts.gate_proj.weight",
        "mlp.gate.weight",
        "mlp.gate.e_score_correction_bias",
    ):
        assert MTP + name in files, name
    assert not any(k.startswith(MTP + "self_attn.kv_") for k in files)  # GQA, not MLA
    assert files[MTP + "eh_proj.weight"].dtype == mx.bfloat16
    assert files[MTP + "mlp.gate.e_score_correction_bias"].dtype == mx.float32
    # mlx-lm's sanitize leaves the MTP layer out of the trunk.
    trunk, _, _ = load(glm.path)
    assert len(trunk.layers) == 2
    assert not any(k.startswith("model.layers.2.") for k, _ in tree_flatten(trunk.model.parameters()))


def test_the_head_is_the_trunks_gqa_moe_layer_with_the_checkpoints_weights(glm):
    trunk, config, head = load(glm.path)
    assert head is not None and head.layout == "deepseek" and head.num_layers == 1
    assert head.module_prefix(0) == MTP
    block = head.modules_[0].block
    assert type(block) is glm4_moe.DecoderLayer and type(block.mlp) is glm4_moe.MoE
    attn = block.self_attn
    assert (attn.n_heads, attn.n_kv_heads) == (4, 2) and attn.use_qk_norm == config["use_qk_norm"]
    assert [type(c).__name__ for c in head.make_cache()] == [KVCache.__name__]
    # The head's tensors are the file's, bfloat16 as stored (the router bias float32); the
    # module's copies of the embedding and of an identical LM head are not kept.
    loaded = dict(tree_flatten(head.modules_[0].parameters()))
    for ours, theirs in (
        ("block.self_attn.q_proj.bias", "self_attn.q_proj.bias"),
        ("block.self_attn.k_proj.weight", "self_attn.k_proj.weight"),
        ("block.mlp.gate.e_score_correction_bias", "mlp.gate.e_score_correction_bias"),
        ("block.mlp.shared_experts.up_proj.weight", "mlp.shared_experts.up_proj.weight"),
        ("eh_proj.weight", "eh_proj.weight"),
        ("final_layernorm.weight", "shared_head.norm.weight"),
    ):
        assert np.array_equal(np.array(loaded[ours].astype(mx.float32)), glm.tensors[MTP + theirs]), ours
    experts = np.array(loaded["block.mlp.switch_mlp.down_proj.weight"].astype(mx.float32))
    for e in range(config["n_routed_experts"]):
        assert np.array_equal(experts[e], glm.tensors[f"{MTP}mlp.experts.{e}.down_proj.weight"])
    if config["use_qk_norm"]:
        want = glm.tensors[MTP + "self_attn.q_norm.weight"]
        assert np.array_equal(np.array(loaded["block.self_attn.q_norm.weight"].astype(mx.float32)), want)
    assert loaded["eh_proj.weight"].dtype == mx.bfloat16
    assert loaded["block.mlp.gate.e_score_correction_bias"].dtype == mx.float32
    assert not head.has_own_lm_head(0) and not any("embed_tokens" in k for k in loaded)


def test_greedy_mtp_equals_greedy_ar_at_depths_1_to_3(glm):
    trunk, _, head = load(glm.path, dtype=mx.float32)
    assert_greedy_mtp_equals_ar(trunk, head, 16, depths=(1, 2, 3))


def test_inspect_names_the_head_and_convert_q4_keeps_it(glm, tmp_path, capsys):
    info = inspect_model(glm.path)
    assert info["model_type"] == "glm4_moe" and info["verdict"] == "MTP-ready"
    assert info["mtp"]["layout"] == "deepseek" and info["mtp"]["declared_layers"] == 1
    assert cli.main(["inspect", str(glm.path)]) == 0
    assert "model_type glm4_moe" in capsys.readouterr().out
    out = tmp_path / "q4"
    assert cli.main(["convert", str(glm.path), str(out), "--q-bits", "4", "--q-group-size", "32"]) == 0
    converted = inspect_model(out)
    assert converted["verdict"] == "MTP-ready" and converted["mtp"]["layout"] == "deepseek"
    assert converted["mtp"]["precision"]["groups"] == {
        "projection": 8,
        "attention": 8,
        "dense": 8,
        "routed_experts": 4,
    }
    assert "head bits" in format_inspection(converted)
    trunk, _, head = load(out)
    assert head is not None and head.num_layers == 1
    bits = {p: m.bits for p, m in head.named_modules() if hasattr(m, "scales")}
    assert bits and all(b == (4 if "switch_mlp" in p else 8) for p, b in bits.items()), bits
    assert_greedy_mtp_equals_ar(trunk, head, 12, depths=(1, 2), rollbacks=False)


# ---------------------------------------------------------------- float64 reference of the MTP layer

# The DeepSeek row's GQA + MoE variant (its MLA variant's reference is in test_heads.py).
REFERENCE_LAYOUTS = ("deepseek",)


def glm_mtp_logits(t, cfg, hidden, tokens, *, mask_first=True, embedding_first=True, head_norm=True):
    """GLM-4.5's MTP layer in float64 (vLLM ``glm4_moe_mtp.py``; HF ``modeling_glm4_moe.py``'s
    decoder layer: GQA with q/k/v biases, per-head q/k norms with ``use_qk_norm``, rope on the
    first ``partial_rotary_factor`` of each head (halves), the sigmoid-routed MoE with a shared
    expert) -> (logits [T, vocab], the MoE's input, for the routing margin)."""
    p, eps, T = f"model.layers.{cfg['num_hidden_layers']}.", cfg["rms_norm_eps"], len(tokens)
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    e = t["model.embed_tokens.weight"][tokens]
    e = zero_position_zero(e) if mask_first else e
    x = fuse_inputs(
        e, hidden, t[p + "enorm.weight"], t[p + "hnorm.weight"], t[p + "eh_proj.weight"], eps,
        hidden_first=not embedding_first,
    )  # fmt: skip
    a = rms(x, t[p + "input_layernorm.weight"], eps)
    qkv = {n: a @ t[f"{p}self_attn.{n}_proj.weight"].T + t[f"{p}self_attn.{n}_proj.bias"] for n in "qkv"}
    q, k = qkv["q"].reshape(T, nh, hd), qkv["k"].reshape(T, nkv, hd)
    if cfg["use_qk_norm"]:
        q, k = rms(q, t[p + "self_attn.q_norm.weight"], eps), rms(k, t[p + "self_attn.k_norm.weight"], eps)
    dims = int(hd * cfg["partial_rotary_factor"])
    q, k = rope(q, dims, cfg["rope_theta"], False), rope(k, dims, cfg["rope_theta"], False)
    o = gqa_attention(q, k, qkv["v"].reshape(T, nkv, hd), hd**-0.5, causal_mask(T))
    x = x + o @ t[p + "self_attn.o_proj.weight"].T
    moe_in = rms(x, t[p + "post_attention_layernorm.weight"], eps)
    x = x + sigmoid_moe(moe_in, t, p + "mlp.", cfg)
    out = rms(x, t[p + "shared_head.norm.weight"], eps) if head_norm else x
    return out @ t[p + "shared_head.head.weight"].T, moe_in


@pytest.fixture(scope="module", params=[True, False], ids=["GLM-4.5", "GLM-4.5-Air"])
def glm_random(request, tmp_path_factory):
    """A replica with every weight random (no ``context_strength``: its ``eh_proj`` would hide the
    hidden half of the input), loaded as float32 (the CPU's unquantized experts need it)."""
    tiny = checkpoints.glm4_moe(tmp_path_factory.mktemp("glm_ref") / "tiny", qk_norm=request.param)
    return tiny, read_tensors(tiny.path), load(tiny.path, mx.float32)[2]


@pytest.mark.parametrize("seed", SEEDS)
def test_mtp_layer_matches_a_float64_reference_at_every_position(glm_random, seed):
    tiny, t, head = glm_random
    drawn = resolve(seed)
    cfg, rng = tiny.config, np.random.default_rng(drawn)
    for _ in range(20):  # inputs whose expert choice is not within rounding of a tie
        tokens = [int(x) for x in rng.integers(0, cfg["vocab_size"], size=7)]
        hidden = rng.standard_normal((7, cfg["hidden_size"]))
        want, moe_in = glm_mtp_logits(t, cfg, hidden, tokens)
        if routing_margin(moe_in, t, f"model.layers.{cfg['num_hidden_layers']}.mlp.", 2) > 1e-4:
            break
    else:
        pytest.fail(f"seed {drawn}: 20 draws all route within 1e-4 of a tie")
    out = head(mx.array(hidden[None].astype(np.float32)), mx.array([tokens]), head.make_cache())
    got = np.asarray(head.logits(out)[0], dtype=np.float64)
    scale = np.abs(want).max()
    assert (np.abs(got - want).max(-1) < 1e-4 * scale).all(), (drawn, np.abs(got - want).max() / scale)
    for variant in ({"mask_first": False}, {"embedding_first": False}, {"head_norm": False}):
        other = glm_mtp_logits(t, cfg, hidden, tokens, **variant)[0]
        assert np.abs(got - other).max() > 1e-2 * scale, (drawn, variant)  # each convention shows
