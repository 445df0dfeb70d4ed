"""MTP heads load from HF-format checkpoints and compute what the published architectures compute.

Each family's head output is compared with an independent NumPy float64 re-implementation
that reads the tensors straight from the written safetensors files (HF names, HF
conventions: Qwen3.5's 1+w norms, DeepSeek's fused kv_b_proj and interleaved rope,
MiMo's [hidden, embed] order). Covered by the NumPy reference: Qwen3.5 gated full
attention (partial rope, q/k norms, GQA) + dense MLP; DeepSeek-V3 MLA (q LoRA, latent
kv, decoupled rope) + dense MLP; MiMo Qwen2 attention (biases, GQA) + MLP. The MoE MLP
is checked structurally here (HF per-expert tensors land stacked in mlx-lm's SwitchGLU) and
numerically in ``test_glm4_moe.py``; the other families' references are in
``test_head_references.py`` (the building blocks: ``support/numpy_heads.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.errors import MtplxError
from mtplx.heads import (
    DEFAULT_HIDDEN_SOURCE,
    Qwen3NextMTPHead,
    declared_mtp_layers,
    detect_layout,
    find_head,
    load_head,
)
from mtplx.trunk.model import Trunk

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model as mlx_load_model
from support import checkpoints, models
from support.decoding import mtp_decode, take_tokens
from support.hub import cache_layout
from support.nemotron import nemotron_h_checkpoint
from support.numpy_heads import (
    causal_mask,
    gqa_attention,
    mla_attention,
    read_tensors,
    rms,
    rope,
    swiglu_mlp,
)
from support.seeds import SEEDS, resolve
from support.tokenizer import word_level
from support.vlm_families import deepseek_v4 as deepseek_v4_checkpoint
from support.vlm_families import glm5_next as glm5_next_checkpoint
from support.vlm_families import hy_v4 as hy_v4_checkpoint
from support.vlm_families import qwen4_exp as qwen4_exp_checkpoint
from support.vlm_inkling import inkling as inkling_checkpoint

# The registry rows whose float64 reference is in this module (read by ``test_reference_coverage.py``).
REFERENCE_LAYOUTS = ("qwen3_next", "deepseek", "mimo")
TOKENS = [[3, 17, 42, 5, 60, 9]]
NEXT = [[17, 42, 5, 60, 9, 11]]


# --------------------------------------------------------------------------- helpers


def load(path: Path):
    model, config = mlx_load_model(path)
    trunk = Trunk(model)
    return trunk, config, load_head(path, trunk, config)


def head_inputs(trunk: Trunk, head) -> tuple[mx.array, mx.array]:
    out = trunk(mx.array(TOKENS))
    hidden = out.hidden_pre_norm if head.hidden_source == "pre_norm" else out.hidden_post_norm
    return hidden, mx.array(NEXT)


def assert_close(a: mx.array, b: np.ndarray, tol: float = 2e-4) -> None:
    a = np.array(a.astype(mx.float32), dtype=np.float64)
    assert a.shape == b.shape
    assert np.max(np.abs(a - b)) < tol * max(1.0, np.max(np.abs(b))), np.max(np.abs(a - b))


def differs(a: mx.array, b: np.ndarray) -> bool:
    return np.max(np.abs(np.array(a, dtype=np.float64) - b)) > 1e-2


# --------------------------------------------------------------------------- qwen3_5


def qwen35_reference(t, hidden, next_tokens, cfg, offset=True, layer=0):
    tc_ = cfg["text_config"]
    nh, nkv, hd = tc_["num_attention_heads"], tc_["num_key_value_heads"], tc_["head_dim"]
    eps = tc_["rms_norm_eps"]
    g = (lambda w: 1.0 + w) if offset else (lambda w: w)
    rdims = int(hd * tc_["rope_parameters"]["partial_rotary_factor"])
    emb = t["model.language_model.embed_tokens.weight"][next_tokens]
    x = (
        np.concatenate(
            [
                rms(emb, g(t["mtp.pre_fc_norm_embedding.weight"]), eps),
                rms(hidden, g(t["mtp.pre_fc_norm_hidden.weight"]), eps),
            ],
            -1,
        )
        @ t["mtp.fc.weight"].T
    )
    p = f"mtp.layers.{layer}."
    T = x.shape[0]
    a = rms(x, g(t[p + "input_layernorm.weight"]), eps)
    qg = (a @ t[p + "self_attn.q_proj.weight"].T).reshape(T, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(T, nh * hd)
    k = (a @ t[p + "self_attn.k_proj.weight"].T).reshape(T, nkv, hd)
    v = (a @ t[p + "self_attn.v_proj.weight"].T).reshape(T, nkv, hd)
    q = rope(rms(q, g(t[p + "self_attn.q_norm.weight"]), eps), rdims, 10000.0, False)
    k = rope(rms(k, g(t[p + "self_attn.k_norm.weight"]), eps), rdims, 10000.0, False)
    o = gqa_attention(q, k, v, hd**-0.5, causal_mask(T))
    h = x + (o * (1 / (1 + np.exp(-gate)))) @ t[p + "self_attn.o_proj.weight"].T
    h = h + swiglu_mlp(rms(h, g(t[p + "post_attention_layernorm.weight"]), eps), t, p + "mlp.")
    return rms(h, g(t["mtp.norm.weight"]), eps)


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    path = tmp_path_factory.mktemp("q35") / "Qwen3.5-tiny"
    tiny = checkpoints.qwen3_5(path)
    return tiny, load(path)


def test_qwen35_head_matches_numpy_reference(qwen35):
    tiny, (trunk, config, head) = qwen35
    assert isinstance(head, Qwen3NextMTPHead) and head.num_layers == 1 and head.hidden_source == "post_norm"
    hidden, nxt = head_inputs(trunk, head)
    out = head(hidden, nxt, head.make_cache())
    t = read_tensors(tiny.path)
    ref = qwen35_reference(t, np.array(hidden[0], np.float64), np.array(nxt[0]), tiny.config)
    assert_close(out[0], ref)
    # Negative control: the same reference with plain (non-offset) norms is far away, so a
    # loader that forgot Qwen3.5's 1+w convention would fail the comparison above.
    assert differs(
        out[0],
        qwen35_reference(t, np.array(hidden[0], np.float64), np.array(nxt[0]), tiny.config, offset=False),
    )


def test_qwen35_trunk_round_trips_through_mlx_lm(qwen35):
    """The HF-format writer really is the reverse of mlx-lm's sanitize (else the fixture proves nothing)."""
    from mlx_lm.models import qwen3_5 as q

    tiny, (trunk, _, _) = qwen35
    fresh = q.Model(q.ModelArgs.from_dict(tiny.config))
    models.randomize(fresh, 0)  # the writer's seed: same weights as were written
    ours = dict(tree_flatten(trunk.model.parameters()))
    for name, v in tree_flatten(fresh.parameters()):
        assert mx.allclose(ours[name], v, atol=1e-6).item(), name


def test_head_cache_incremental_equals_full(qwen35):
    _, (trunk, _, head) = qwen35
    hidden, nxt = head_inputs(trunk, head)
    full = head(hidden, nxt, head.make_cache())
    cache = head.make_cache()
    a = head(hidden[:, :4], nxt[:, :4], cache)
    b = head(hidden[:, 4:], nxt[:, 4:], cache)
    assert cache[0].offset == 6
    assert mx.allclose(mx.concatenate([a, b], axis=1), full, atol=1e-5).item()


def test_checkpoint_keys_are_the_hf_names(qwen35):
    tiny, (_, _, head) = qwen35
    keys = head.checkpoint_keys()
    assert set(keys.values()) == {k for k in tiny.tensors if k.startswith("mtp.")}


def test_sharded_and_hub_cache_layouts_load_the_same_head(qwen35, tmp_path):
    from mtplx.checkpoints.load import resolve_model

    tiny, (trunk, _, head) = qwen35
    hidden, nxt = head_inputs(trunk, head)
    expected = head(hidden, nxt)
    sharded = checkpoints.qwen3_5(tmp_path / "sharded", shards=3)
    assert (sharded.path / "model.safetensors.index.json").exists()
    snap = cache_layout(sharded.path, tmp_path / "hub", "tiny-org/Qwen3.5-tiny")
    resolved = resolve_model("tiny-org/Qwen3.5-tiny", hub_cache=tmp_path / "hub")
    assert resolved == snap and (resolved / "model.safetensors.index.json").is_symlink()
    for path in (sharded.path, resolved):
        t2, _, h2 = load(path)
        assert mx.allclose(h2(*head_inputs(t2, h2)), expected, atol=1e-6).item()


def test_forged_style_head_on_a_llama_trunk():
    """The layout takes any trunk's own decoder layer (what `mtplx forge` builds)."""
    from mlx_lm.models import llama

    trunk = Trunk(models.tiny_llama(vocab_size=64))
    head = Qwen3NextMTPHead([llama.TransformerBlock(trunk.model.args)], 32, eps=1e-5, trunk=trunk)
    out = trunk(mx.array(TOKENS))
    y = head(out.hidden_post_norm, mx.array(NEXT), head.make_cache())
    assert y.shape == (1, 6, 32) and head.logits(y).shape == (1, 6, 64)
    assert all(k.startswith("mtp.") for k in head.checkpoint_keys().values())
    names = {k for k, _ in tree_flatten(head.parameters())}
    assert not any("embed_tokens" in k or "lm_head" in k for k in names)  # shared, not owned


# --------------------------------------------------------------------------- deepseek_v3


def mla_block(x, t, p, cfg):
    """DeepSeek-V3's decoder layer: MLA (latent norms at mlx-lm's / HF's 1e-6) + dense MLP."""
    eps = cfg["rms_norm_eps"]
    a = rms(x, t[p + "input_layernorm.weight"], eps)
    h = x + mla_attention(a, t, p + "self_attn.", cfg, latent_eps=1e-6)
    return h + swiglu_mlp(rms(h, t[p + "post_attention_layernorm.weight"], eps), t, p + "mlp.")


def zero_row0(emb, zero_first):
    """vLLM deepseek_mtp.py / mimo_mtp.py: ``inputs_embeds[positions == 0] = 0`` (rows are positions 0..)."""
    emb = emb.copy()
    if zero_first:
        emb[0] = 0.0
    return emb


def deepseek_reference(t, hidden, next_tokens, cfg, module=0, zero_first=True):
    """-> (pre-norm, post-norm, logits) of module ``module`` over positions 0..T-1 (causal)."""
    p = f"model.layers.{cfg['num_hidden_layers'] + module}."
    eps = cfg["rms_norm_eps"]
    emb = zero_row0(t["model.embed_tokens.weight"][next_tokens], zero_first)
    x = np.concatenate([rms(emb, t[p + "enorm.weight"], eps), rms(hidden, t[p + "hnorm.weight"], eps)], -1)
    x = mla_block(x @ t[p + "eh_proj.weight"].T, t, p, cfg)
    out = rms(x, t[p + "shared_head.norm.weight"], eps)
    return x, out, out @ t[p + "shared_head.head.weight"].T


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds") / "DeepSeek-V3-tiny"
    tiny = checkpoints.deepseek_v3(path)
    return tiny, load(path)


def test_deepseek_head_matches_numpy_reference(deepseek):
    tiny, (trunk, _, head) = deepseek
    assert (
        head.layout == "deepseek" and head.hidden_source == "post_norm" and head.chain_source == "post_norm"
    )
    assert head.max_depth is None
    hidden, nxt = head_inputs(trunk, head)
    out = head(hidden, nxt, head.make_cache())
    args = (read_tensors(tiny.path), np.array(hidden[0], np.float64), np.array(nxt[0]), tiny.config)
    _, ref, ref_logits = deepseek_reference(*args)
    assert_close(out[0], ref)
    assert_close(head.logits(out)[0], ref_logits)
    # Negative control: without the position-0 mask (the old convention) the output is elsewhere.
    assert differs(out[0], deepseek_reference(*args, zero_first=False)[1])
    # The shipped shared_head.head equals the trunk's lm_head: no second copy is kept.
    assert not any("shared_head.head" in k for k, _ in tree_flatten(head.parameters()))


def test_deepseek_moe_experts_are_stacked(tmp_path):
    tiny = checkpoints.deepseek_v3(tmp_path / "moe", moe=True)
    trunk, _, head = load(tiny.path)
    mlp_ = head.modules_[0].block.mlp
    assert hasattr(mlp_, "switch_mlp")
    p = "model.layers.61.mlp.experts."
    for e in range(4):
        np.testing.assert_array_equal(
            np.array(mlp_.switch_mlp.gate_proj.weight[e]), tiny.tensors[f"{p}{e}.gate_proj.weight"]
        )
        np.testing.assert_array_equal(
            np.array(mlp_.switch_mlp.down_proj.weight[e]), tiny.tensors[f"{p}{e}.down_proj.weight"]
        )
    hidden, nxt = head_inputs(trunk, head)
    assert np.isfinite(np.array(head(hidden, nxt, head.make_cache()))).all()


def test_deepseek_own_lm_head_copy_that_differs_is_kept_and_drafts(tmp_path):
    """A ``shared_head.head`` that is not the trunk's LM head becomes the module's own (loaded
    with the rest of the head) and gives the head's logits; the checkpoint name round-trips."""
    tiny = checkpoints.deepseek_v3(tmp_path / "own-head")
    arrays = dict(mx.load(str(tiny.path / "model.safetensors")))
    key = "model.layers.61.shared_head.head.weight"
    arrays[key] = arrays[key] * 0.5 + 0.01
    mx.save_safetensors(str(tiny.path / "model.safetensors"), arrays, {"format": "pt"})
    trunk, _, head = load(tiny.path)
    assert head.checkpoint_keys()["modules_.0.lm_head.weight"] == key
    hidden, nxt = head_inputs(trunk, head)
    out = head(hidden, nxt, head.make_cache())
    args = (read_tensors(tiny.path), np.array(hidden[0], np.float64), np.array(nxt[0]), tiny.config)
    _, ref, ref_logits = deepseek_reference(*args)  # logits through the checkpoint's (changed) copy
    assert_close(out[0], ref)
    assert_close(head.logits(out)[0], ref_logits)
    assert differs(head.logits(out)[0], ref @ args[0]["lm_head.weight"].T)  # not the trunk's LM head


# --------------------------------------------------------------------------- mimo


def mimo_reference(t, hidden, next_tokens, cfg, hidden_first=True, module=0, zero_first=True):
    """-> (pre-norm, post-norm, logits) of MTP module ``module`` over positions 0..T-1 (causal)."""
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, eps, T = cfg["hidden_size"] // nh, cfg["rms_norm_eps"], len(next_tokens)
    p = f"model.mtp_layers.{module}."
    emb = zero_row0(t["model.embed_tokens.weight"][next_tokens], zero_first)
    e = rms(emb, t[p + "token_layernorm.weight"], eps)
    h = rms(hidden, t[p + "hidden_layernorm.weight"], eps)
    x = np.concatenate([h, e] if hidden_first else [e, h], -1) @ t[p + "input_proj.weight"].T
    a = rms(x, t[p + "input_layernorm.weight"], eps)
    proj = {n: a @ t[f"{p}self_attn.{n}_proj.weight"].T + t[f"{p}self_attn.{n}_proj.bias"] for n in "qkv"}
    q = rope(proj["q"].reshape(T, nh, hd), hd, cfg["rope_theta"], False)
    k = rope(proj["k"].reshape(T, nkv, hd), hd, cfg["rope_theta"], False)
    o = gqa_attention(q, k, proj["v"].reshape(T, nkv, hd), hd**-0.5, causal_mask(T))
    x = x + o @ t[p + "self_attn.o_proj.weight"].T
    x = x + swiglu_mlp(rms(x, t[p + "post_attention_layernorm.weight"], eps), t, p + "mlp.")
    out = rms(x, t[p + "final_layernorm.weight"], eps)
    return x, out, out @ t["lm_head.weight"].T


def test_mimo_head_matches_numpy_reference(tmp_path):
    tiny = checkpoints.mimo(tmp_path / "MiMo-tiny")
    trunk, _, head = load(tiny.path)
    assert head.layout == "mimo" and head.hidden_source == "pre_norm" and head.max_depth is None
    hidden, nxt = head_inputs(trunk, head)
    out = head(hidden, nxt, head.make_cache())
    t = read_tensors(tiny.path)
    args = (t, np.array(hidden[0], np.float64), np.array(nxt[0]), tiny.config)
    assert_close(out[0], mimo_reference(*args)[1])
    assert differs(out[0], mimo_reference(*args, hidden_first=False)[1])  # negative control: concat order
    assert differs(out[0], mimo_reference(*args, zero_first=False)[1])  # negative control: position 0


def test_quantized_checkpoint_head_is_quantized_like_the_checkpoint(tmp_path):
    tiny = checkpoints.mimo(
        tmp_path / "MiMo-tiny-4bit", quantize={"group_size": 32, "bits": 4}, head_override_bits=8
    )
    trunk, _, head = load(tiny.path)
    m = head.modules_[0]
    assert isinstance(m.input_proj, nn.QuantizedLinear) and m.input_proj.bits == 8  # per-layer override
    assert isinstance(m.block.self_attn.q_proj, nn.QuantizedLinear) and m.block.self_attn.q_proj.bits == 4
    # Same tensors, same quantization -> the module the checkpoint was written from (up to kernel rounding).
    ref = tiny.head_module
    hidden, nxt = head_inputs(trunk, head)
    emb = trunk.embed(nxt)
    e = ref.token_layernorm(mx.concatenate([mx.zeros_like(emb[:, :1]), emb[:, 1:]], axis=1))  # position 0
    x = ref.input_proj(mx.concatenate([ref.hidden_layernorm(hidden), e], -1))
    from mlx_lm.models.base import create_attention_mask

    x = ref.final_layernorm(ref.block(x, create_attention_mask(x, None, return_array=True), None))
    assert mx.allclose(head(hidden, nxt), x, atol=1e-3).item()


# --------------------------------------------------------------------------- bad input


def _drop_head_tensors(path: Path, keep) -> None:
    for f in path.glob("*.safetensors"):
        arrays = mx.load(str(f))
        mx.save_safetensors(str(f), {k: v for k, v in arrays.items() if keep(k)}, {"format": "pt"})


@pytest.mark.parametrize(
    "family,build,keep",
    [
        ("qwen3_5", checkpoints.qwen3_5, lambda k: not k.startswith("mtp.")),
        ("deepseek_v3", checkpoints.deepseek_v3, lambda k: not k.startswith("model.layers.61.")),
        ("mimo", checkpoints.mimo, lambda k: not k.startswith("model.mtp_layers.")),
    ],
)
def test_declared_but_missing_head_is_a_one_line_error(tmp_path, family, build, keep):
    tiny = build(tmp_path / family)
    model, config = mlx_load_model(tiny.path)
    _drop_head_tensors(tiny.path, keep)
    with pytest.raises(MtplxError) as err:
        load_head(tiny.path, Trunk(model), config)
    msg = str(err.value)
    assert "\n" not in msg and str(tiny.path) in msg and "ships no" in msg


def test_head_shape_mismatch_is_a_one_line_error(tmp_path):
    tiny = checkpoints.qwen3_5(tmp_path / "bad")
    model, config = mlx_load_model(tiny.path)
    arrays = dict(mx.load(str(tiny.path / "model.safetensors")))
    arrays["mtp.fc.weight"] = arrays["mtp.fc.weight"][:, : models.HIDDEN]  # [H, H] instead of [H, 2H]
    mx.save_safetensors(str(tiny.path / "model.safetensors"), arrays, {"format": "pt"})
    with pytest.raises(MtplxError, match=r"mtp.fc.weight|fc\.weight") as err:
        load_head(tiny.path, Trunk(model), config)
    assert "\n" not in str(err.value) and str(tiny.path) in str(err.value) and "shape" in str(err.value)


def test_no_declared_head_is_none(tmp_path):
    tiny = checkpoints.qwen3_5(tmp_path / "nomtp", mtp_layers=0)
    model, config = mlx_load_model(tiny.path)
    assert load_head(tiny.path, Trunk(model), config) is None


def test_default_hidden_sources_are_explicit():
    assert DEFAULT_HIDDEN_SOURCE == {
        "qwen3_next": "post_norm",
        "deepseek": "post_norm",
        "mimo": "pre_norm",
        "mimo_v2_flash": "post_norm",
        "ernie": "post_norm",
        "step3p5": "post_norm",
        "longcat": "post_norm",
        "nemotron_h": "post_norm",
        "hy_v4": "post_norm",
        "qwen4_exp": "pre_norm",
        "deepseek_v4": "pre_norm",
        "glm5_next": "post_norm",
        "inkling": "pre_norm",
    }


def test_each_registry_row_recognises_its_own_checkpoint_and_no_other(tmp_path):
    """One row per family: a checkpoint's tensors match exactly one row's marker, and the row's
    model types and count keys give the same layout and layer count from the config alone."""
    from mtplx.heads.registry import FAMILIES
    from mtplx.heads.weights import weight_index

    built = {
        "qwen3_next": checkpoints.qwen3_5(tmp_path / "q", mtp_layers=2),
        "deepseek": checkpoints.deepseek_v3(tmp_path / "d", mtp_layers=2, sidecar=True, trunk_layers=2),
        "mimo": checkpoints.mimo(tmp_path / "m", mtp_layers=2),
        "mimo_v2_flash": checkpoints.mimo_v2_flash(tmp_path / "mv2", mtp_layers=2),
        "ernie": checkpoints.ernie4_5_moe(tmp_path / "e", mtp_layers=2),
        "step3p5": checkpoints.step3p5(tmp_path / "s", mtp_layers=2),
        "hy_v4": hy_v4_checkpoint(tmp_path / "h", mtp_layers=2),
    }
    # LongCat-Flash ships one MTP layer and its config declares none: counted from tensor names.
    longcat = checkpoints.longcat_flash(tmp_path / "l")
    assert set(built) | {"longcat", "nemotron_h", "qwen4_exp", "deepseek_v4", "glm5_next", "inkling"} == set(
        FAMILIES
    )
    # The mlx-vlm-hosted families with one MTP layer as published (more is refused at load).
    for name, one in (
        ("qwen4_exp", qwen4_exp_checkpoint(tmp_path / "q4")),
        ("deepseek_v4", deepseek_v4_checkpoint(tmp_path / "d4")),
        ("glm5_next", glm5_next_checkpoint(tmp_path / "g5")),
        ("inkling", inkling_checkpoint(tmp_path / "i")),
    ):
        index = weight_index(one.path)
        assert [f.name for f in FAMILIES.values() if f.has_layout(index)] == [name]
        assert detect_layout({}, one.config) == name
        assert FAMILIES[name].declared_layers(one.config) == declared_mtp_layers(one.config) == 1
    # Nemotron-H: one MTP module (the published configs declare 1; more is refused at load).
    nemotron = nemotron_h_checkpoint(tmp_path / "n")
    index = weight_index(nemotron.path)
    assert [f.name for f in FAMILIES.values() if f.has_layout(index)] == ["nemotron_h"]
    assert detect_layout({}, nemotron.config) == "nemotron_h"
    assert FAMILIES["nemotron_h"].declared_layers(nemotron.config) == 1
    index = weight_index(longcat.path)
    assert [f.name for f in FAMILIES.values() if f.has_layout(index)] == ["longcat"]
    assert detect_layout({}, longcat.config) == "longcat"
    assert FAMILIES["longcat"].layer_count(index, longcat.config) == (1, "tensor names")
    for name, tiny in built.items():
        index = weight_index(tiny.path)
        assert [f.name for f in FAMILIES.values() if f.has_layout(index)] == [name]
        assert detect_layout({}, tiny.config) == name  # stripped head: the model_type decides
        assert FAMILIES[name].declared_layers(tiny.config) == declared_mtp_layers(tiny.config) == 2
    assert detect_layout({"model.norm.weight": "x"}, {"model_type": "llama"}) is None


# --------------------------------------------------------------------------- draft-chain conventions


DRAFTS = [7, 33, 50]  # teacher-forced draft tokens d_1..d_3 fed to steps 1..3


def chain_reference(module_out, n, hidden, next_tokens, depth, *, pick=None, chain="post_norm"):
    """The head's draft chain, re-implemented from the references, in NumPy float64.

    Step 0 reads the true (trunk hidden, next token) pairs; step s >= 1 appends one pair
    (the chained state of step s-1's last position, d_s). Step s is answered by module
    ``s % n`` (vLLM ``deepseek_mtp.py`` / ``mimo_mtp.py`` / ``qwen3_next_mtp.py``:
    ``spec_step_idx % num_mtp_layers``); every module has seen every earlier pair, so each
    step is that module run causally over the whole pair sequence. The chained state is the
    output after the module's final norm (SGLang ``deepseek_nextn.py``; vLLM's current
    ``deepseek_mtp.py``), ``chain="pre_norm"`` the old convention.
    ``module_out(j, hidden, tokens) -> (pre, post, logits)``. Returns [(post, logits)] per step.
    """
    pick = pick or (lambda s: s % n)
    hs, toks = list(hidden), list(next_tokens)
    steps, prev = [], None
    for s in range(depth):
        if s > 0:
            hs.append(prev[0][-1] if chain == "pre_norm" else prev[1][-1])
            toks.append(DRAFTS[s - 1])
        prev = module_out(pick(s), np.array(hs), np.array(toks))
        steps.append((prev[1][-1], prev[2][-1]))
    return steps


def run_chain(head, hidden, nxt, depth):
    """The same chain through the mlx head and its caches, as the decode loop drives it."""
    cache = head.make_cache()
    out = head(hidden, nxt, cache, step=0)
    steps = [(out[0, -1], head.logits(out, step=0)[0, -1])]
    for s in range(1, depth):
        out = head(head.chain_input(out), mx.array([[DRAFTS[s - 1]]]), cache, step=s)
        steps.append((out[0, -1], head.logits(out, step=s)[0, -1]))
    return steps


def qwen35_module(t, cfg, layer):
    def run(j, hidden, tokens):
        post = qwen35_reference(t, hidden, tokens, cfg, layer=layer(j))
        return None, post, post @ t["lm_head.weight"].T

    return run


@pytest.fixture(scope="module")
def two_module_heads(tmp_path_factory):
    """family -> (tiny, trunk, head, module_out(j, hidden, tokens, zero_first)) with 2 MTP modules."""
    root = tmp_path_factory.mktemp("two")
    out = {}
    ds = checkpoints.deepseek_v3(root / "ds2", mtp_layers=2, sidecar=True, trunk_layers=2)
    mi = checkpoints.mimo(root / "mimo2", mtp_layers=2)
    q = checkpoints.qwen3_5(root / "q2", mtp_layers=2)
    for name, tiny, ref in (
        ("deepseek", ds, lambda t, c: lambda j, h, x, z=True: deepseek_reference(t, h, x, c, j, z)),
        ("mimo", mi, lambda t, c: lambda j, h, x, z=True: mimo_reference(t, h, x, c, module=j, zero_first=z)),
    ):
        trunk, _, head = load(tiny.path)
        out[name] = (tiny, trunk, head, ref(read_tensors(tiny.path), tiny.config))
    trunk, _, head = load(q.path)
    t = read_tensors(q.path)
    out["qwen3_next"] = (
        q,
        trunk,
        head,
        lambda j, h, x, z=True: qwen35_module(t, q.config, lambda i: i)(j, h, x),
    )
    return out


@pytest.mark.parametrize("family", ["deepseek", "mimo", "qwen3_next"])
@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_two_module_chain_uses_module_s_mod_n(two_module_heads, family, depth):
    tiny, trunk, head, module_out = two_module_heads[family]
    assert len(head.make_cache()) == 2 and head.max_depth is None
    hidden, nxt = head_inputs(trunk, head)
    got = run_chain(head, hidden, nxt, depth)
    h64, x = np.array(hidden[0], np.float64), np.array(nxt[0])
    ref = chain_reference(module_out, 2, h64, x, depth)
    for (out, logits), (ref_out, ref_logits) in zip(got, ref):
        assert_close(out, ref_out)
        assert_close(logits, ref_logits)
    if depth >= 2:
        # Negative control: module 0 at every step (the old loop) drafts differently from step 1 on.
        old = chain_reference(module_out, 2, h64, x, depth, pick=lambda s: 0)
        assert differs(got[1][0], old[1][0])


@pytest.mark.parametrize("family", ["deepseek", "mimo"])
def test_one_module_chain_feeds_back_post_norm_and_masks_position_zero(deepseek, tmp_path, family):
    if family == "deepseek":
        tiny, (trunk, _, head) = deepseek
        t = read_tensors(tiny.path)
        module_out = lambda j, h, x, z=True: deepseek_reference(t, h, x, tiny.config, j, z)  # noqa: E731
    else:
        tiny = checkpoints.mimo(tmp_path / "mimo1")
        trunk, _, head = load(tiny.path)
        t = read_tensors(tiny.path)
        module_out = lambda j, h, x, z=True: mimo_reference(t, h, x, tiny.config, module=j, zero_first=z)  # noqa: E731
    hidden, nxt = head_inputs(trunk, head)
    got = run_chain(head, hidden, nxt, 3)
    h64, x = np.array(hidden[0], np.float64), np.array(nxt[0])
    ref = chain_reference(module_out, 1, h64, x, 3)
    for (out, logits), (ref_out, ref_logits) in zip(got, ref):
        assert_close(out, ref_out)
        assert_close(logits, ref_logits)
    # Negative controls: pre-norm feedback (the old DeepSeek convention) and no position-0 mask.
    pre = chain_reference(module_out, 1, h64, x, 3, chain="pre_norm")
    assert differs(got[1][0], pre[1][0]) and differs(got[2][0], pre[2][0])
    unmasked = chain_reference(lambda j, h, x_: module_out(j, h, x_, False), 1, h64, x, 3)
    assert differs(got[2][0], unmasked[2][0])


@pytest.mark.parametrize("family", ["deepseek", "mimo"])
def test_two_module_heads_decode_at_depths_1_to_4(two_module_heads, family):
    """The decode loop runs a 2-module head at every depth (it crashed in trim_kv at depth >= 2),
    greedy MTP equals greedy AR, and after the run every module's cache equals the cache a
    from-scratch pass over the committed tokens builds (the rollback drops exactly the drafts)."""
    from mtplx.sampling import SamplerConfig

    from support import decoding as decode

    _, trunk, head, _ = two_module_heads[family]
    prompt = [3, 17, 42, 5, 60, 9, 11, 2]
    greedy = SamplerConfig(temperature=0.0)

    ar = take_tokens(
        decode.ar_decode(trunk, prompt, decode.DecodeSettings(sampler=greedy), mx.random.key(0)), 8
    )
    for depth in (1, 2, 3, 4):
        head_cache = head.make_cache()
        settings = decode.DecodeSettings(sampler=greedy, depth=depth)
        steps = mtp_decode(trunk, head, prompt, settings, mx.random.key(0), head_cache=head_cache)
        assert take_tokens(steps, 8) == ar, depth
        # From scratch: the true (trunk hidden, next token) pairs of the committed sequence.
        held = head_cache[0].offset
        assert all(c.offset == held for c in head_cache)
        seq = prompt + ar
        out = trunk(mx.array([seq[: held + 1]]))
        hidden = out.hidden_pre_norm if head.hidden_source == "pre_norm" else out.hidden_post_norm
        fresh = head.make_cache()
        head(hidden[:, :held], mx.array([seq[1 : held + 1]]), fresh)
        for c, f in zip(head_cache, fresh):
            k, fk = c.state[0][..., :held, :], f.state[0][..., :held, :]
            assert mx.allclose(k, fk, atol=1e-4).item(), depth


def test_qwen_norms_of_unknown_provenance_are_judged_per_tensor_with_a_warning(tmp_path, capsys):
    """A re-export of unknown provenance (MLX-written, no mtplx mark) that shifted some norms to
    plain scales and left others as offsets from 1 (mlx-lm shifts only some suffixes) still loads
    the right head: each MTP norm is judged on its own, with one warning line. Negative control:
    any one rule for all of them is far from the reference."""
    tiny = checkpoints.qwen3_5(tmp_path / "mixed")
    t = read_tensors(tiny.path)  # as written: every norm an offset from 1
    arrays = dict(mx.load(str(tiny.path / "model.safetensors")))
    shifted = ["mtp.pre_fc_norm_hidden.weight", "mtp.layers.0.input_layernorm.weight", "mtp.norm.weight"]
    for k in shifted:
        arrays[k] = arrays[k] + 1.0
    mx.save_safetensors(str(tiny.path / "model.safetensors"), arrays, {"format": "mlx"})
    capsys.readouterr()
    trunk, _, head = load(tiny.path)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "provenance unknown" in err[0] and "judged by its mean" in err[0]
    hidden, nxt = head_inputs(trunk, head)
    out = head(hidden, nxt, head.make_cache())
    h64, x = np.array(hidden[0], np.float64), np.array(nxt[0])
    assert_close(out[0], qwen35_reference(t, h64, x, tiny.config))
    as_stored = {k: (v + 1.0 if k in shifted else v) for k, v in t.items()}
    assert differs(out[0], qwen35_reference(as_stored, h64, x, tiny.config, offset=True))
    assert differs(out[0], qwen35_reference(as_stored, h64, x, tiny.config, offset=False))


# --------------------------------------------------------------------------- Engine.load and head discovery


def _mimo_with_tokenizer(path: Path, **kw) -> checkpoints.Tiny:
    tiny = checkpoints.mimo(path, **kw)
    word_level(path)
    return tiny


def test_engine_load_on_a_stripped_head(tmp_path, capsys):
    """Config declares MTP layers, a converter dropped their tensors (as mlx-lm's does)."""
    from mtplx.engine.engine import Engine

    tiny = _mimo_with_tokenizer(tmp_path / "stripped")
    _drop_head_tensors(tiny.path, lambda k: not k.startswith("model.mtp_layers."))
    engine = Engine.load(str(tiny.path), mtp=False)
    assert engine.head is None and capsys.readouterr().err == ""
    engine = Engine.load(str(tiny.path))
    err = capsys.readouterr().err
    assert engine.head is None and err.count("\n") == 1 and "ships no model.mtp_layers" in err
    result = engine.generate("w3 w5 w7", max_tokens=4, seed=0)
    assert "head" not in result.stats.drafters and len(result.token_ids) >= 1  # no head drafts
    with pytest.raises(MtplxError) as excinfo:
        Engine.load(str(tiny.path), mtp=True)
    assert "\n" not in str(excinfo.value) and "ships no" in str(excinfo.value)


def test_engine_load_mtp_false_never_reads_the_head(tmp_path):
    from mtplx.engine.engine import Engine

    tiny = _mimo_with_tokenizer(tmp_path / "broken")
    arrays = dict(mx.load(str(tiny.path / "model.safetensors")))
    key = "model.mtp_layers.0.input_proj.weight"
    arrays[key] = arrays[key][:, : models.HIDDEN]  # mis-shaped: loading the head would fail
    mx.save_safetensors(str(tiny.path / "model.safetensors"), arrays, {"format": "pt"})
    with pytest.raises(MtplxError, match="shape"):
        Engine.load(str(tiny.path))
    assert Engine.load(str(tiny.path), mtp=False).head is None


def test_sidecar_head_file_outside_the_shard_index_is_found(tmp_path):
    """Head tensors in ``mtp.safetensors`` beside index-listed shards (not in the index)."""
    tiny = checkpoints.mimo(tmp_path / "sharded", shards=2)
    trunk, _, expected = load(tiny.path)
    hidden, nxt = head_inputs(trunk, expected)
    index_file = tiny.path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    head: dict[str, mx.array] = {}
    for f in sorted(tiny.path.glob("model-*.safetensors")):
        arrays = dict(mx.load(str(f)))
        mx.eval(arrays)  # read before the file is rewritten
        head.update({k: v for k, v in arrays.items() if k.startswith("model.mtp_layers.")})
        mx.save_safetensors(str(f), {k: v for k, v in arrays.items() if k not in head}, {"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k not in head}
    index_file.write_text(json.dumps(index))
    mx.save_safetensors(str(tiny.path / "mtp.safetensors"), head, {"format": "pt"})
    trunk2, _, found = load(tiny.path)
    assert found is not None
    assert mx.allclose(found(hidden, nxt), expected(hidden, nxt), atol=1e-6).item()


def test_find_head_gives_the_shipped_head_for_the_default_model(default_model_dir):
    from mtplx.checkpoints import load as loading
    from mtplx.heads.forged import ForgedMTPHead

    loaded = loading.load_model(None)
    head = find_head(loaded, Trunk(loaded.model))
    assert isinstance(head, ForgedMTPHead) and head.default_depth is not None
    # Given by its converted directory, the default model is still the default model.
    again = find_head(loaded, Trunk(loaded.model), model=str(default_model_dir))
    assert isinstance(again, ForgedMTPHead)


def test_find_head_gives_the_checkpoints_own_head_or_none(tmp_path, capsys):
    from mtplx.checkpoints.load import LoadedModel

    def loaded_model(tiny: checkpoints.Tiny) -> LoadedModel:
        model, config = mlx_load_model(tiny.path)
        return LoadedModel(model, None, config, tiny.path, "fingerprint")

    own = loaded_model(checkpoints.mimo(tmp_path / "mimo"))
    head = find_head(own, Trunk(own.model), model=str(own.path))
    assert head is not None and head.layout == "mimo"
    bare = loaded_model(checkpoints.qwen3_5(tmp_path / "nomtp", mtp_layers=0))
    assert find_head(bare, Trunk(bare.model), model=str(bare.path)) is None
    stripped = loaded_model(checkpoints.mimo(tmp_path / "stripped"))
    _drop_head_tensors(stripped.path, lambda k: not k.startswith("model.mtp_layers."))
    assert find_head(stripped, Trunk(stripped.model), model=str(stripped.path)) is None
    assert "ships no model.mtp_layers" in capsys.readouterr().err
    with pytest.raises(MtplxError, match="ships no"):
        find_head(stripped, Trunk(stripped.model), model=str(stripped.path), required=True)


# ------------------------------------------------------------- a count only the tensor names give


def _without_mtp_count(path: Path) -> Path:
    """The config as Qwen3-Next publishes it: MTP tensors shipped, no MTP layer count declared."""
    config = json.loads((path / "config.json").read_text())
    del config["text_config"]["mtp_num_hidden_layers"]
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_a_head_whose_config_declares_no_count_loads_inspects_and_converts_from_its_tensor_names(tmp_path):
    from mtplx.checkpoints.convert_hf import convert_hf
    from mtplx.checkpoints.inspect import inspect_model

    _, _, declared = load(checkpoints.qwen3_5(tmp_path / "declared", mtp_layers=2).path)
    published = _without_mtp_count(checkpoints.qwen3_5(tmp_path / "published", mtp_layers=2).path)
    _, config, head = load(published)
    assert declared_mtp_layers(config) == 0  # the config really says nothing
    assert head is not None and head.num_layers == 2
    assert [k for k, _ in tree_flatten(head.parameters())] == [
        k for k, _ in tree_flatten(declared.parameters())
    ]
    for (name, ours), (_, theirs) in zip(
        tree_flatten(head.parameters()), tree_flatten(declared.parameters())
    ):
        assert mx.array_equal(ours, theirs), name  # the same head as the declared checkpoint's
    info = inspect_model(published)
    assert info["verdict"] == "MTP-ready" and "counted from tensor names" in info["reason"]
    assert info["mtp"]["declared_layers"] == 2 and info["mtp"]["layer_count_source"] == "tensor names"
    out = convert_hf(published, tmp_path / "converted", q_bits=4, q_group_size=32)
    kept = json.loads((out / "config.json").read_text())
    assert kept["text_config"]["mtp_num_hidden_layers"] == 2  # conversion records the count
    _, _, converted_head = load(out)
    assert converted_head is not None and converted_head.num_layers == 2


def test_no_count_and_no_tensors_is_still_no_head(tmp_path):
    """Negative control: the tensor-name count does not invent a head the checkpoint lacks."""
    stripped = _without_mtp_count(
        checkpoints.qwen3_5(tmp_path / "stripped", mtp_layers=2, ship_mtp=False).path
    )
    _, _, head = load(stripped)
    assert head is None
    from mtplx.checkpoints.inspect import inspect_model

    assert inspect_model(stripped)["verdict"] == "AR-only"


def test_an_unknown_layout_loads_ar_only_with_a_note_and_inspect_names_what_it_found(tmp_path, capsys):
    """A config declaring MTP layers whose tensors no family reads: a one-line note and AR, an error
    only when MTP is required; inspect counts the head-like tensors it saw."""
    from mtplx.checkpoints.inspect import inspect_model
    from mtplx.checkpoints.load import LoadedModel

    model = models.tiny_llama(seed=3)
    tiny = checkpoints.save_model(tmp_path / "odd", model, num_nextn_predict_layers=1)
    extra = {"model.mtp_block.0.proj.weight": np.zeros((4, 4), dtype=np.float32)}
    from safetensors.numpy import save_file

    save_file(extra, str(tiny.path / "mtp-extra.safetensors"))
    loaded_model, config = mlx_load_model(tiny.path)
    loaded = LoadedModel(loaded_model, None, config, tiny.path, "fingerprint")
    assert find_head(loaded, Trunk(loaded_model), model=str(tiny.path)) is None
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "a layout mtplx does not know" in err[0] and "decoding without MTP" in err[0]
    with pytest.raises(MtplxError, match="does not know"):
        find_head(loaded, Trunk(loaded_model), model=str(tiny.path), required=True)
    info = inspect_model(tiny.path)
    assert info["verdict"] == "AR-only" and "does not know" in info["reason"]
    assert "1 tensor(s) named like a head" in info["reason"]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", [(130, 260), (3, 130, 260)], ids=["2-D", "stacked experts"])
def test_fp8_block_dequantization_matches_a_float64_reference_for_any_leading_dims(shape, seed):
    """Each 128x128 block (edge blocks short) times its own inverse scale, as DeepSeek's FP8 layout
    defines it; stacked expert tensors keep their leading dimension."""
    from mtplx.heads.weights import dequantize_fp8_blocks

    rng = np.random.default_rng(resolve(seed))
    w8 = mx.to_fp8(mx.array(rng.normal(size=shape).astype(np.float32)))
    blocks = (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128))
    scale = rng.uniform(0.5, 2.0, size=blocks).astype(np.float32)
    out = dequantize_fp8_blocks({"x.weight": w8, "x.weight_scale_inv": mx.array(scale)})
    assert set(out) == {"x.weight"} and out["x.weight"].shape == shape
    values = np.array(mx.from_fp8(w8, dtype=mx.float32), dtype=np.float64)
    rows = np.arange(shape[-2]) // 128
    cols = np.arange(shape[-1]) // 128
    expected = values * scale.astype(np.float64)[..., rows[:, None], cols[None, :]]
    got = np.array(out["x.weight"].astype(mx.float32), dtype=np.float64)
    np.testing.assert_allclose(got, expected, rtol=2**-7, atol=0)  # bfloat16 rounding of both factors
