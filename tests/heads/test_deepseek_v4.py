"""DeepSeek-V4's MTP head (``mtplx.heads.deepseek_v4``) beside its mlx-vlm-hosted trunk.

The checkpoints are ``support.vlm_families.deepseek_v4``'s tiny replicas in the official layout
(``mtp.0.*``): one built so the head predicts (``CONTEXT_STRENGTH``: drafts kept), one all random
(the references'). The head's math against mlx-vlm's own drafter (``DeepseekV4MTPDraftModel``, its
``sanitize`` reading the same tensors) and against a float64 NumPy reference; decoding exactness
(greedy MTP == AR, alone and in a batch with rejections); the split drafter; conversion.
The trunk's own checks: ``tests/trunk/test_vlm_deepseek_v4.py``.
"""

from __future__ import annotations

import json

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.engine.engine import Engine
from mtplx.engine.request import GenerationRequest
from mtplx.heads.deepseek_v4 import DeepseekV4MTPHead
from mtplx.trunk.model import Trunk

import mlx.core as mx
import numpy as np
import pytest
from support.decoding import assert_mtp_equals_ar_with_drafts_kept
from support.models import randomize
from support.numpy_heads import causal_mask, e2m1_pairs, e4m3, e8m0, gqa_attention, read_tensors, rms, silu
from support.seeds import FRESH, SEEDS, resolve
from support.vlm_families import DEEPSEEK_V4_HIDDEN, DEEPSEEK_V4_VOCAB, tiny_deepseek_v4
from support.vlm_families import deepseek_v4 as deepseek_v4_checkpoint
from support.vlm_heads import (
    CHI_VOCAB,
    PROMPTS,
    assert_batched_rows_share_forwards_and_equal_ar,
    assert_chi_square_rejects_committed_rejected_drafts,
    assert_sampled_mtp_matches_ar,
    assert_split_head_equals_own,
    peaked_trunk,
    published_hidden,
    replica,
)

REFERENCE_LAYOUTS = ("deepseek_v4",)
CONTEXT_STRENGTH = 0.1
LENGTH = 11  # over the sliding window of 8: the head's window slides too
HC_MULT = 2
_req = GenerationRequest.from_kwargs


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v4") / "DeepSeek-V4-Tiny"
    return replica(path, deepseek_v4_checkpoint, DEEPSEEK_V4_VOCAB, context_strength=CONTEXT_STRENGTH)


@pytest.fixture(scope="module")
def engine(checkpoint) -> Engine:
    return Engine.load(str(checkpoint), depth=2)


@pytest.fixture(scope="module")
def random_checkpoint(tmp_path_factory):
    """Every weight random (``h_proj`` not zero, the head's own hc_head and norm): the references'."""
    path = tmp_path_factory.mktemp("deepseek_v4_random") / "r"
    return replica(path, deepseek_v4_checkpoint, DEEPSEEK_V4_VOCAB, seed=11)


@pytest.fixture(scope="module")
def random_engine(random_checkpoint) -> Engine:
    return Engine.load(str(random_checkpoint))


def _head_logits(engine: Engine, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """mtplx's head on (trunk streams at positions 0..T-2, tokens 1..T-1): logits, its streams."""
    head, trunk = engine.head, engine.trunk
    out = trunk(mx.array([tokens[:-1]]), trunk.make_cache())
    hidden = getattr(out, f"hidden_{head.hidden_source}")
    logits = head.logits(head(hidden, mx.array([tokens[1:]]), head.make_cache()))
    return np.asarray(logits[0], dtype=np.float64), np.asarray(head.last_pre_norm[0], dtype=np.float64)


# --------------------------------------------------------------------------- float64 reference
# From the published math as mlx-vlm 0.7.10 writes it (models/deepseek_v4/language.py and
# hyper_connection.py, speculative/drafters/deepseek_v4_mtp), on the official tensor names.


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


def unit_rms(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def hyper_weights(x: np.ndarray, t: dict, p: str, cfg: dict) -> tuple[np.ndarray, ...]:
    """A hyper-connection's per-row weights from the streams x [T, hc, H]: ``pre`` [T, hc] (the
    collapse), ``post`` [T, hc] (the branch's injection), ``comb`` [T, hc, hc] (Sinkhorn-balanced
    stream mixing: rows then columns normalised ``hc_sinkhorn_iters`` times)."""
    hc, eps = cfg["hc_mult"], cfg["hc_eps"]
    mix = unit_rms(x.reshape(x.shape[0], -1), cfg["rms_norm_eps"]) @ t[p + "fn"].T
    scale, base = t[p + "scale"], t[p + "base"]
    pre = sigmoid(mix[:, :hc] * scale[0] + base[:hc]) + eps
    post = 2 * sigmoid(mix[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = mix[:, 2 * hc :].reshape(-1, hc, hc) * scale[2] + base[2 * hc :].reshape(hc, hc)
    comb = np.exp(comb - comb.max(-1, keepdims=True))
    comb = comb / comb.sum(-1, keepdims=True) + eps
    comb = comb / (comb.sum(-2, keepdims=True) + eps)
    for _ in range(cfg["hc_sinkhorn_iters"] - 1):
        comb = comb / (comb.sum(-1, keepdims=True) + eps)
        comb = comb / (comb.sum(-2, keepdims=True) + eps)
    return pre, post, comb


def rope_tail(x: np.ndarray, cfg: dict, sign: float = 1.0) -> np.ndarray:
    """x [T, heads, d]: the LAST ``qk_rope_head_dim`` features rotated in pairs (2i, 2i+1) by
    position * theta^(-2i/dims) (``sign`` -1: the inverse rotation the output gets)."""
    dims = cfg["qk_rope_head_dim"]
    angle = sign * np.arange(x.shape[0])[:, None] * cfg["rope_theta"] ** (-np.arange(0, dims, 2) / dims)
    cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]
    tail = x[..., -dims:]
    a, b = tail[..., 0::2], tail[..., 1::2]
    out = np.empty_like(tail)
    out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
    return np.concatenate([x[..., :-dims], out], -1)


def attention(x: np.ndarray, t: dict, p: str, cfg: dict) -> np.ndarray:
    """Sliding-window attention with one shared K=V head, unit-RMS queries, attention sinks, the
    output rotated back, and a grouped low-rank output (``wo_a`` per group, then ``wo_b``)."""
    T, nh, hd, eps, groups = (
        x.shape[0],
        cfg["num_attention_heads"],
        cfg["head_dim"],
        cfg["rms_norm_eps"],
        cfg["o_groups"],
    )
    q_residual = rms(x @ t[p + "wq_a.weight"].T, t[p + "q_norm.weight"], eps)
    q = rope_tail(unit_rms((q_residual @ t[p + "wq_b.weight"].T).reshape(T, nh, hd), eps), cfg)
    kv = rope_tail(rms(x @ t[p + "wkv.weight"].T, t[p + "kv_norm.weight"], eps).reshape(T, 1, hd), cfg)
    mask = causal_mask(T, cfg["sliding_window"])
    out = gqa_attention(q, kv, kv, hd**-0.5, mask, sinks=t[p + "attn_sink"]).reshape(T, nh, hd)
    out = rope_tail(out, cfg, -1.0).reshape(T, groups, -1)
    wo_a = t[p + "wo_a.weight"].reshape(groups, cfg["o_lora_rank"], -1)
    return np.einsum("tgi,goi->tgo", out, wo_a).reshape(T, -1) @ t[p + "wo_b.weight"].T


def limited_swiglu(x: np.ndarray, t: dict, p: str, limit: float) -> np.ndarray:
    gate, up = x @ t[p + "w1.weight"].T, x @ t[p + "w3.weight"].T
    return (silu(np.minimum(gate, limit)) * np.clip(up, -limit, limit)) @ t[p + "w2.weight"].T


def moe(x: np.ndarray, t: dict, p: str, cfg: dict) -> np.ndarray:
    """sqrt(softplus) router scores; the top-k by score + bias, weighted by their scores
    renormalised, times routed_scaling_factor; clamped SwiGLU experts plus the shared expert."""
    scores = np.sqrt(np.log1p(np.exp(x @ t[p + "gate.weight"].T)))
    chosen = np.argsort(-(scores + t[p + "gate.bias"]), axis=-1, kind="stable")[
        :, : cfg["num_experts_per_tok"]
    ]
    weights = np.take_along_axis(scores, chosen, -1)
    weights = weights / weights.sum(-1, keepdims=True) * cfg["routed_scaling_factor"]
    limit = cfg["swiglu_limit"]
    out = limited_swiglu(x, t, p + "shared_experts.", limit)
    for row in range(x.shape[0]):
        for e, w in zip(chosen[row], weights[row]):
            out[row] += w * limited_swiglu(x[row], t, f"{p}experts.{e}.", limit)
    return out


def block(x: np.ndarray, t: dict, p: str, cfg: dict) -> np.ndarray:
    """Each branch reads the streams collapsed by ``pre`` and normed; new streams =
    post * branch output + comb-mixed old streams (stream h gets sum_k comb[k, h] * x[k])."""
    for name, branch in (("attn", attention), ("ffn", moe)):
        pre, post, comb = hyper_weights(x, t, f"{p}hc_{name}_", cfg)
        normed = rms((pre[..., None] * x).sum(1), t[f"{p}{name}_norm.weight"], cfg["rms_norm_eps"])
        x = post[..., None] * branch(normed, t, f"{p}{name}.", cfg)[:, None] + np.einsum(
            "tkh,tkd->thd", comb, x
        )
    return x


def mtp_logits(t: dict, cfg: dict, streams: np.ndarray, tokens: np.ndarray, p: str = "mtp.0.") -> np.ndarray:
    """The MTP block at ``p`` on (trunk streams [T, hc * H], next token) rows: logits [T, V]."""
    hc, eps = cfg["hc_mult"], cfg["rms_norm_eps"]
    e = rms(t["embed.weight"][tokens], t[p + "enorm.weight"], eps) @ t[p + "e_proj.weight"].T
    s = rms(streams.reshape(len(tokens), hc, -1), t[p + "hnorm.weight"], eps) @ t[p + "h_proj.weight"].T
    x = block(s + e[:, None], t, p, cfg)
    mix = unit_rms(x.reshape(len(tokens), -1), eps) @ t[p + "hc_head_fn"].T
    pre = sigmoid(mix * t[p + "hc_head_scale"] + t[p + "hc_head_base"]) + cfg["hc_eps"]
    return rms((pre[..., None] * x).sum(1), t[p + "norm.weight"], eps) @ t["head.weight"].T


@pytest.mark.parametrize("seed", SEEDS)
def test_head_logits_match_the_float64_reference_at_every_position(random_engine, random_checkpoint, seed):
    seed = resolve(seed)
    tokens = np.random.default_rng(seed).integers(0, DEEPSEEK_V4_VOCAB, size=LENGTH + 1).tolist()
    t = read_tensors(random_checkpoint)
    cfg = json.loads((random_checkpoint / "config.json").read_text())
    want = mtp_logits(t, cfg, published_hidden(random_checkpoint, tokens[:-1]), np.array(tokens[1:]))
    got, _ = _head_logits(random_engine, tokens)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max(), f"seed {seed}"


def decoded_fp8_fp4(t: dict[str, np.ndarray], low_first: bool = True) -> dict[str, np.ndarray]:
    """The published FP8 / FP4 tensors decoded in float64 from their bytes: ``x.weight`` beside an
    ``x.scale`` is e4m3 with one E8M0 byte per 128 x 128 block, or (half as wide as its scales
    say) e2m1 pairs with one E8M0 byte per 32 inputs."""
    out = dict(t)
    for key in [k for k in t if k.endswith(".scale") and k.removesuffix(".scale") + ".weight" in t]:
        wkey, scale = key.removesuffix(".scale") + ".weight", e8m0(out.pop(key))
        if scale.shape[-1] * 16 == t[wkey].shape[-1]:
            out[wkey] = e2m1_pairs(t[wkey], low_first) * np.repeat(scale, 32, -1)
        else:
            m, n = t[wkey].shape
            out[wkey] = e4m3(t[wkey]) * np.repeat(np.repeat(scale, 128, 0), 128, 1)[:m, :n]
    return out


def test_an_fp8_fp4_head_shipped_as_mtp_1_matches_the_float64_reference_of_its_bytes(tmp_path):
    """DeepSeek-V4-Flash's naming (the one block under ``mtp.1.``) and its published precisions
    (FP8 linears with E8M0 block scales, FP4 routed experts): loaded as mxfp8 / mxfp4 layers of
    the same bytes, the head's logits equal the float64 reference on those bytes decoded in NumPy
    (control: the FP4 nibbles read high-first give other logits)."""
    path = tmp_path / "DeepSeek-V4-Flash-Tiny"
    replica(path, deepseek_v4_checkpoint, DEEPSEEK_V4_VOCAB, seed=11, mtp_index=1, fp8_head=True)
    engine = Engine.load(str(path))
    assert engine.head.key_prefix == "mtp.1."
    modes = {p: m.mode for p, m in engine.head.named_modules() if hasattr(m, "scales")}
    assert modes["e_proj"] == modes["decoder.attn.wo_a"] == "mxfp8"
    assert modes["decoder.ffn.switch_mlp.gate_proj"] == "mxfp4"
    tokens = np.random.default_rng(resolve(FRESH)).integers(0, DEEPSEEK_V4_VOCAB, size=LENGTH + 1).tolist()
    t, cfg = read_tensors(path), json.loads((path / "config.json").read_text())
    streams, nxt = published_hidden(path, tokens[:-1]), np.array(tokens[1:])
    want = mtp_logits(decoded_fp8_fp4(t), cfg, streams, nxt, "mtp.1.")
    got, _ = _head_logits(engine, tokens)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max(), tokens
    swapped = mtp_logits(decoded_fp8_fp4(t, low_first=False), cfg, streams, nxt, "mtp.1.")
    assert np.abs(got - swapped).max() > 1e-2 * np.abs(want).max()


# --------------------------------------------------------------------------- mlx-vlm's drafter


def _mlx_vlm_drafter(checkpoint):
    """mlx-vlm's DeepSeek-V4 drafter filled from the checkpoint's ``mtp.*`` tensors by its own
    ``sanitize``, bound to mlx-vlm's own language model (its embedding)."""
    from mlx_vlm.speculative.drafters.deepseek_v4_mtp import Model, ModelConfig
    from mlx_vlm.utils import load_model

    config = json.loads((checkpoint / "config.json").read_text())
    drafter = Model(ModelConfig.from_dict({"text_config": config}))
    tensors = mx.load(str(checkpoint / "model.safetensors"))
    drafter.load_weights(
        list(drafter.sanitize({k: v for k, v in tensors.items() if k.startswith("mtp.")}).items())
    )
    lm = load_model(checkpoint).language_model
    drafter.bind(lm)
    return drafter, lm


@pytest.mark.parametrize("seed", SEEDS)
def test_head_equals_mlx_vlms_drafter_at_every_position(random_checkpoint, random_engine, seed):
    """Same tensors, same trunk streams (mlx-vlm's ``return_hidden``), same next tokens: the
    logits and the streams it chains on equal mlx-vlm's ``_forward_hidden``."""
    seed = resolve(seed)
    tokens = np.random.default_rng(seed).integers(0, DEEPSEEK_V4_VOCAB, size=LENGTH + 1).tolist()
    drafter, lm = _mlx_vlm_drafter(random_checkpoint)
    streams = lm(mx.array([tokens[:-1]]), cache=lm.make_cache(), return_hidden=True).hidden_states[0]
    nxt = mx.array([tokens[1:]])
    hidden, chained = drafter._forward_hidden(lm.model.embed_tokens(nxt), streams, nxt, drafter.make_cache())
    want = np.asarray(lm.lm_head(hidden)[0], dtype=np.float64)
    got, got_streams = _head_logits(random_engine, tokens)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max(), f"seed {seed}"
    want_streams = np.asarray(chained[0], dtype=np.float64).reshape(LENGTH, -1)
    assert np.abs(got_streams - want_streams).max() < 1e-4 * np.abs(want_streams).max(), f"seed {seed}"


def test_the_head_reads_the_streams_and_chains_on_its_blocks_streams(random_engine):
    """The convention (``mtplx/heads/deepseek_v4.py``): the trunk's hc_mult streams in, the block's
    streams (before its own hc_head and norm) fed back at depth 2, the collapsed state to the LM head."""
    head = random_engine.head
    assert (head.hidden_source, head.chain_source) == ("pre_norm", "pre_norm")
    width = HC_MULT * DEEPSEEK_V4_HIDDEN
    streams = mx.array(np.random.default_rng(2).standard_normal((1, 1, width)).astype(np.float32))
    out = head(streams, mx.array([[5]]), head.make_cache())
    assert out.shape == (1, 1, DEEPSEEK_V4_HIDDEN) and head.chain_input(out).shape == (1, 1, width)
    assert mx.array_equal(head.chain_input(out), head.last_pre_norm[:, -1:]).item()


# --------------------------------------------------------------------------- decoding


def test_the_engine_finds_the_head_beside_the_mlx_vlm_trunk(engine):
    assert isinstance(engine.head, DeepseekV4MTPHead) and type(engine.trunk.model).__name__ == "VlmTextModel"


def test_greedy_mtp_equals_ar_with_drafts_kept_at_depths_1_and_2(engine):
    assert_mtp_equals_ar_with_drafts_kept(engine.trunk, engine.head, PROMPTS[:1], 8)


def test_rows_share_forwards_and_equal_ar_with_rejections(engine, monkeypatch):
    """Its caches batch (`mtplx.trunk.batch_deepseek_v4`: the windows as rings, the compressors'
    pools and open windows per row), the head's window too: the three rows decode in shared trunk
    forwards (a forward of 3 rows is counted), each giving its AR tokens alone with drafts kept
    and rejected (EOS ignored: the replica ends one prompt at once)."""
    assert_batched_rows_share_forwards_and_equal_ar(engine, monkeypatch, max_tokens=8, ignore_eos=True)


def test_the_batch_cost_profile_times_the_head_on_the_trunks_streams(engine):
    """`measure_cost_profile` (what `mtplx serve` measures before batching) feeds the head the
    trunk state it reads: the hc_mult streams, wider than the embedding (the width it used to
    take, which the head refuses in one line)."""
    from mtplx.spec_decode.draft_policy import measure_cost_profile

    profile = measure_cost_profile(engine.trunk, engine.head, max_tokens=2, max_rows=2, context=4, repeats=1)
    assert profile.head_rows == (1, 2) and len(profile.head_seconds) == 2


# --------------------------------------------------------------------------- the split drafter


def test_the_split_drafter_is_found_beside_the_trunk_and_equals_the_checkpoints_head(
    checkpoint, engine, tmp_path
):
    """mlx-vlm's splitter's ``deepseek_v4_mtp`` drafter of the replica, beside the same trunk
    without its MTP tensors (as a conversion that dropped them leaves it)."""
    from mlx_vlm.split_mtp import split_mtp

    trunk_dir = tmp_path / "DeepSeek-V4-Tiny-4bit"
    replica(
        trunk_dir,
        deepseek_v4_checkpoint,
        DEEPSEEK_V4_VOCAB,
        context_strength=CONTEXT_STRENGTH,
        ship_mtp=False,
    )
    drafter = split_mtp(str(checkpoint), str(tmp_path / "DeepSeek-V4-Tiny-MTP"))
    assert json.loads((tmp_path / drafter / "config.json").read_text())["model_type"] == "deepseek_v4_mtp"
    split = Engine.load(str(trunk_dir), depth=2)
    head = split.head
    assert isinstance(head, DeepseekV4MTPHead) and head.hidden_source == "pre_norm" and head.key_prefix == ""
    assert_split_head_equals_own(split, engine, PROMPTS[0])
    assert_mtp_equals_ar_with_drafts_kept(split.trunk, head, PROMPTS[:1], 10, depths=(2,))


# --------------------------------------------------------------------------- conversion


def test_mtplx_convert_keeps_the_head_at_safe_precision_and_mlx_vlm_opens_the_output(checkpoint, tmp_path):
    from mtplx.checkpoints.convert_hf import convert_hf

    from mlx_vlm.utils import load_model

    out = convert_hf(checkpoint, tmp_path / "DeepSeek-V4-Tiny-4bit", q_bits=4, q_group_size=32)
    assert type(load_model(out)).__module__ == "mlx_vlm.models.deepseek_v4.deepseek_v4"  # opens in mlx-vlm
    converted = Engine.load(str(out), depth=2)
    assert isinstance(converted.head, DeepseekV4MTPHead)
    bits = {path: m.bits for path, m in converted.head.named_modules() if hasattr(m, "scales")}
    assert bits["e_proj"] == bits["h_proj"] == bits["decoder.attn.wq_a"] == bits["decoder.attn.wo_a"] == 8
    assert bits["decoder.ffn.switch_mlp.gate_proj"] == 4  # routed experts at the trunk's bits
    trunk_bits = {p: m.bits for p, m in converted.trunk.model.named_modules() if hasattr(m, "scales")}
    assert trunk_bits["language_model.model.layers.0.ffn.switch_mlp.gate_proj"] == 4
    assert_mtp_equals_ar_with_drafts_kept(converted.trunk, converted.head, PROMPTS[:1], 10, depths=(2,))


# --------------------------------------------------------------------------- sampled distribution
# (Hunyuan-V4's runs in every make test: tests/heads/test_hy_v4.py; this family's behind slow.)


def chi_pair() -> tuple[Trunk, DeepseekV4MTPHead]:
    """A 5-token DeepSeek-V4 trunk (2 hyper-connection streams, window + compressed KV) with
    peaked, context-dependent distributions (embeddings x8, logits x3) and a random MTP block."""
    model = tiny_deepseek_v4(CHI_VOCAB, seed=3)
    trunk, inner = peaked_trunk(model), model.language_model
    head = DeepseekV4MTPHead(inner.args, trunk=trunk)
    randomize(head, 5)
    return trunk, head


@pytest.mark.slow
def test_sampled_mtp_matches_the_exact_ar_distribution_at_t_0_7():
    """Depth 2: the first three tokens' joint and marginals against the float64 enumeration of AR
    sampling (the window and pool caches rolled back through mlx-vlm's transaction on the way)."""
    assert_sampled_mtp_matches_ar(chi_pair)


@pytest.mark.slow
def test_chi_square_rejects_a_loop_that_commits_the_rejected_draft(monkeypatch):
    assert_chi_square_rejects_committed_rejected_drafts(monkeypatch, chi_pair)


def test_a_block_scale_beside_a_float_weight_is_a_one_line_error():
    from mtplx.errors import MtplxError
    from mtplx.heads.deepseek_v4 import packed_fp8_fp4

    with pytest.raises(MtplxError) as e:
        packed_fp8_fp4({"e_proj.weight": mx.zeros((4, 32)), "e_proj.scale": mx.ones((1, 1))}, "head")
    assert "\n" not in str(e.value) and "e_proj" in str(e.value) and "float32" in str(e.value)
