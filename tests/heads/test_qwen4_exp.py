"""Qwen3.8-Flash-Next (``qwen4_exp``): the MTP head beside a hyper-connection trunk hosted through mlx-vlm.

The replica is ``support.vlm_families.qwen4_exp`` (the published layout; ``context_strength`` so
that drafts are kept). The reference is NumPy float64 from the checkpoint's tensors, fed the
hidden state mlx-vlm's own forward hands its drafter (``return_hidden``: the ``hc_count`` streams
before the final mixer), so the head's choice of trunk state (the hyper-connection convention,
``mtplx/heads/qwen4_exp.py``) is checked, not only its math. Sources of the math: mlx-vlm 0.7.10
``models/qwen4_exp/language.py`` (``Qwen4ExpRMSNorm`` x * (1 + w), ``Qwen4ExpGatedResidual``,
``Qwen4ExpDecoderLayer``, ``Qwen4ExpAttention``'s gated q_proj), ``models/qwen3_5_moe/language.py``
(the softmax router and the sigmoid-gated shared expert),
``speculative/drafters/qwen4_exp_mtp/qwen4_exp_mtp.py`` (the MTP module). The reference runs 5
positions: the QSA indexer keeps every key there (2 blocks of 2 are kept once 3 are complete), so
its selection is checked against mlx-vlm's forward in ``tests/trunk/test_vlm_qwen4_exp.py`` only.
"""

from __future__ import annotations

import json

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.engine.engine import Engine
from mtplx.engine.request import GenerationRequest
from mtplx.heads.qwen4_exp import Qwen4ExpMTPHead
from mtplx.trunk.model import Trunk

import mlx.core as mx
import numpy as np
import pytest
from support.decoding import assert_mtp_equals_ar_with_drafts_kept
from support.models import randomize
from support.numpy_heads import causal_mask, read_tensors, rope, silu
from support.seeds import SEEDS, resolve
from support.vlm_families import QWEN4_EXP_VOCAB, tiny_qwen4_exp
from support.vlm_families import qwen4_exp as qwen4_exp_checkpoint
from support.vlm_heads import (
    CHI_VOCAB,
    PROMPTS,
    assert_batched_rows_share_forwards_and_equal_ar,
    assert_chi_square_rejects_committed_rejected_drafts,
    assert_sampled_mtp_matches_ar,
    assert_split_head_equals_own,
    head_logits_on_trunk,
    peaked_trunk,
    published_hidden,
    replica,
)

REFERENCE_LAYOUTS = ("qwen4_exp",)
CONTEXT_STRENGTH = 0.2
LENGTH = 5
_req = GenerationRequest.from_kwargs


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen4_exp") / "Qwen3.8-Flash-Next-Tiny"
    return replica(path, qwen4_exp_checkpoint, QWEN4_EXP_VOCAB, context_strength=CONTEXT_STRENGTH)


@pytest.fixture(scope="module")
def engine(checkpoint) -> Engine:
    return Engine.load(str(checkpoint), depth=2)


@pytest.fixture(scope="module")
def random_checkpoint(tmp_path_factory):
    """Every weight random (no predictive construction: ``fc_hidden`` is not zero): the reference's."""
    path = tmp_path_factory.mktemp("qwen4_exp_random") / "r"
    return replica(path, qwen4_exp_checkpoint, QWEN4_EXP_VOCAB, seed=11)


@pytest.fixture(scope="module")
def random_engine(random_checkpoint) -> Engine:
    return Engine.load(str(random_checkpoint))


# --------------------------------------------------------------------------- float64 reference


def zrms(x: np.ndarray, w: np.ndarray, eps: float, group: int | None = None) -> np.ndarray:
    """Qwen4's RMSNorm: weights centred at zero (x * (1 + w)), per ``group`` features when given."""
    y = x.reshape(*x.shape[:-1], -1, group or x.shape[-1])
    y = y / np.sqrt((y**2).mean(-1, keepdims=True) + eps)
    return y.reshape(x.shape) * (1 + w)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


def hyper_connection(x: np.ndarray, t: dict, p: str, cfg: dict) -> tuple[np.ndarray, np.ndarray | None]:
    """The streams [T, hc*H] mixed to one [T, H] input, and each stream's injection weight [T, hc]."""
    hc, H = cfg["hc_count"], cfg["hidden_size"]
    normed = zrms(x, t[p + "hc_norm.weight"], cfg["rms_norm_eps"], H)
    mix = silu(normed @ t[p + "input_mix_weight_down.weight"].T / hc) @ t[p + "input_mix_weight_up.weight"].T
    mixed = (sigmoid(mix).reshape(-1, hc, H) * normed.reshape(-1, hc, H)).mean(1)
    if p + "block_inject_weight.weight" not in t:
        return mixed, None
    return mixed, 2 * sigmoid(normed @ t[p + "block_inject_weight.weight"].T / hc)


def attention(x: np.ndarray, t: dict, p: str, cfg: dict) -> np.ndarray:
    """Qwen3.5-style gated attention (q_proj = per head [query, gate]), zero-centred q/k norms,
    rope on the first quarter of each head (halves), causal over every key."""
    T, nh, nkv, hd, eps = (
        x.shape[0],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
        cfg["rms_norm_eps"],
    )
    rp = cfg["rope_parameters"]
    qg = (x @ t[p + "q_proj.weight"].T).reshape(T, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(T, nh * hd)
    k = (x @ t[p + "k_proj.weight"].T).reshape(T, nkv, hd)
    v = (x @ t[p + "v_proj.weight"].T).reshape(T, nkv, hd)
    dims = int(hd * rp["partial_rotary_factor"])
    q = rope(zrms(q, t[p + "q_norm.weight"], eps), dims, rp["rope_theta"], False)
    k = rope(zrms(k, t[p + "k_norm.weight"], eps), dims, rp["rope_theta"], False)
    k, v = np.repeat(k, nh // nkv, 1), np.repeat(v, nh // nkv, 1)
    scores = np.einsum("qhd,khd->hqk", q, k) * hd**-0.5
    scores = np.where(causal_mask(T)[None], scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    out = np.einsum("hqk,khd->qhd", w / w.sum(-1, keepdims=True), v).reshape(T, nh * hd)
    return (out * sigmoid(gate)) @ t[p + "o_proj.weight"].T


def swiglu(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    return (silu(x @ gate.T) * (x @ up.T)) @ down.T


def moe(x: np.ndarray, t: dict, p: str, cfg: dict) -> np.ndarray:
    """Softmax router, top-k renormalised; experts fused as published (gate rows first); the
    shared expert scaled by sigmoid(shared_expert_gate(x))."""
    logits = x @ t[p + "gate.weight"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    gate_up, down, inter = (
        t[p + "experts.gate_up_proj"],
        t[p + "experts.down_proj"],
        cfg["moe_intermediate_size"],
    )
    out = np.zeros_like(x)
    for i in range(x.shape[0]):
        top = np.argsort(-probs[i])[: cfg["num_experts_per_tok"]]
        for e, w in zip(top, probs[i, top] / probs[i, top].sum()):
            out[i] += w * swiglu(x[i], gate_up[e, :inter], gate_up[e, inter:], down[e])
    s = p + "shared_expert."
    shared = swiglu(x, t[s + "gate_proj.weight"], t[s + "up_proj.weight"], t[s + "down_proj.weight"])
    return out + sigmoid(x @ t[p + "shared_expert_gate.weight"].T) * shared


def decoder_layer(x: np.ndarray, t: dict, p: str, cfg: dict) -> np.ndarray:
    """Each branch reads the mixed streams and is added to every stream times its injection weight."""
    hc = cfg["hc_count"]
    for branch, name in ((attention, "self_attn."), (moe, "mlp.")):
        mixed, inject = hyper_connection(
            x, t, p + ("attn" if branch is attention else "mlp") + "_hyper_connection.", cfg
        )
        x = x + (branch(mixed, t, p + name, cfg)[:, None, :] * inject[:, :, None]).reshape(
            -1, hc * cfg["hidden_size"]
        )
    return x


def mtp_logits(t: dict, cfg: dict, streams: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """The MTP module at ``mtp.`` on (trunk streams, next token) rows: logits [T, V]."""
    hc, H, eps = cfg["hc_count"], cfg["hidden_size"], cfg["rms_norm_eps"]
    e = zrms(
        t["model.language_model.embed_tokens.weight"][tokens], t["mtp.pre_fc_norm_embedding.weight"], eps
    )
    e = e @ t["mtp.fc_embedding.weight"].T
    s = (
        zrms(streams, t["mtp.pre_fc_norm_hidden.weight"], eps).reshape(-1, hc, H)
        @ t["mtp.fc_hidden.weight"].T
    )
    x = decoder_layer((e[:, None, :] + s).reshape(-1, hc * H), t, "mtp.layers.0.", cfg)
    out, _ = hyper_connection(x, t, "mtp.hyper_connection_mixer.", cfg)
    return out @ t["lm_head.weight"].T


@pytest.mark.parametrize("seed", SEEDS)
def test_head_logits_match_the_float64_reference_at_every_position(random_engine, random_checkpoint, seed):
    seed = resolve(seed)
    tokens = np.random.default_rng(seed).integers(0, QWEN4_EXP_VOCAB, size=LENGTH + 1).tolist()
    t = read_tensors(random_checkpoint)
    cfg = json.loads((random_checkpoint / "config.json").read_text())["text_config"]
    want = mtp_logits(t, cfg, published_hidden(random_checkpoint, tokens[:-1]), np.array(tokens[1:]))
    got = head_logits_on_trunk(random_engine, tokens)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max(), f"seed {seed}"


def test_the_head_reads_the_streams_and_chains_on_its_layers_streams(random_engine):
    """The convention (``mtplx/heads/qwen4_exp.py``): the trunk's hc_count streams in, the head
    layer's streams (before its mixer) fed back at depth 2, the mixed state to the LM head."""
    head = random_engine.head
    assert (head.hidden_source, head.chain_source) == ("pre_norm", "pre_norm")
    streams = mx.array(np.random.default_rng(2).standard_normal((1, 1, 128)).astype(np.float32))
    out = head(streams, mx.array([[5]]), head.make_cache())
    assert out.shape == (1, 1, 64) and head.chain_input(out).shape == (1, 1, 128)
    assert mx.array_equal(head.chain_input(out), head.last_pre_norm[:, -1:]).item()


# --------------------------------------------------------------------------- decoding


def test_the_engine_finds_the_head_beside_the_mlx_vlm_trunk(engine):
    assert isinstance(engine.head, Qwen4ExpMTPHead) and type(engine.trunk.model).__name__ == "VlmTextModel"


def test_greedy_mtp_equals_ar_with_drafts_kept_at_depths_1_and_2(engine):
    assert_mtp_equals_ar_with_drafts_kept(engine.trunk, engine.head, PROMPTS[:1], 12)


def test_rows_in_a_batch_share_one_forward_and_equal_ar_with_rejections(engine, monkeypatch):
    """Its caches batch (`mtplx.trunk.batch_vlm`: ragged QSA rows, mlx-vlm's ArraysCaches rolled
    back per row), the head's QSA cache too: the three rows decode in shared trunk forwards (a
    forward of 3 rows is counted), each giving its AR tokens alone with drafts kept and rejected."""
    assert_batched_rows_share_forwards_and_equal_ar(engine, monkeypatch, max_tokens=12)


def test_under_kv_bits_greedy_mtp_equals_ar_and_the_trunk_equals_mlx_vlms_quantized_forward(
    checkpoint, tmp_path
):
    """``--kv-bits 8 --kv-group-size 32``: the QSA caches are mlx-vlm's QSAQuantizedKVCache from
    position 0; the trunk's logits equal mlx-vlm's forward on its own caches quantized the same
    way (a prompt, then decode steps); greedy MTP = AR with drafts kept; a prompt-cache entry
    written to disk serves a new engine the same tokens (the packed K / V read back)."""
    from mlx_vlm.utils import load_model

    def load():
        kv = dict(kv_bits=8, kv_group_size=32, quantized_kv_start=0, prompt_cache_bytes=1 << 26)
        engine = Engine.load(str(checkpoint), depth=2, **kv)
        engine.use_disk_cache(tmp_path, 1 << 26)
        return engine

    quantized = load()
    reference = load_model(checkpoint).language_model
    ref_cache = [
        c.to_quantized(group_size=32, bits=8) if hasattr(c, "index_keys") else c
        for c in reference.make_cache()
    ]
    cache, prompt = quantized.trunk.make_cache(), PROMPTS[0]
    assert [type(c).__name__ for c in cache] == [type(c).__name__ for c in ref_cache]
    assert "QSAQuantizedKVCache" in {type(c).__name__ for c in cache}
    got = quantized.trunk(mx.array([prompt]), cache).logits
    assert mx.allclose(got, reference(mx.array([prompt]), cache=ref_cache).logits, atol=1e-4).item()
    for t in (5, 60, 9):
        step = quantized.trunk(mx.array([[t]]), cache).logits
        assert mx.allclose(step, reference(mx.array([[t]]), cache=ref_cache).logits, atol=1e-4).item()
    assert_mtp_equals_ar_with_drafts_kept(quantized.trunk, quantized.head, PROMPTS[:1], 8, depths=(2,))
    request = _req(max_tokens=6, draft="head", depth=2)
    quantized.generate(prompt + [4, 4], request)  # its entry, in RAM and on disk
    in_ram = quantized.generate(prompt + [4, 4], request)  # the same grouping as a disk hit
    assert in_ram.stats.cached_tokens > 0 and quantized.prompt_cache.disk.flush()
    want = in_ram.token_ids
    fresh = load()
    from_disk = fresh.generate(prompt + [4, 4], request)
    assert from_disk.token_ids == want and fresh.prompt_cache.disk.stats.hits == 1


# --------------------------------------------------------------------------- the split drafter


def test_the_split_drafter_is_found_beside_the_trunk_and_equals_the_checkpoints_head(
    checkpoint, engine, tmp_path
):
    """mlx-vlm's splitter's ``qwen4_exp_mtp`` drafter of the replica, beside the same trunk
    without its MTP tensors (as a conversion that dropped them leaves it)."""
    from mlx_vlm.split_mtp import split_mtp

    trunk_dir = tmp_path / "Qwen3.8-Flash-Next-Tiny-4bit"
    replica(
        trunk_dir, qwen4_exp_checkpoint, QWEN4_EXP_VOCAB, context_strength=CONTEXT_STRENGTH, ship_mtp=False
    )
    drafter = split_mtp(str(checkpoint), str(tmp_path / "Qwen3.8-Flash-Next-Tiny-MTP"))
    assert json.loads((tmp_path / drafter / "config.json").read_text())["model_type"] == "qwen4_exp_mtp"
    split = Engine.load(str(trunk_dir), depth=2)
    head = split.head
    assert isinstance(head, Qwen4ExpMTPHead) and head.hidden_source == "pre_norm" and head.key_prefix == ""
    assert_split_head_equals_own(split, engine, PROMPTS[0])
    assert_mtp_equals_ar_with_drafts_kept(split.trunk, head, PROMPTS[:1], 10, depths=(2,))


# --------------------------------------------------------------------------- conversion


def test_mtplx_convert_keeps_the_head_at_safe_precision_and_mlx_vlm_opens_the_output(checkpoint, tmp_path):
    from mtplx.checkpoints.convert_hf import convert_hf

    from mlx_vlm.utils import load_model

    out = convert_hf(checkpoint, tmp_path / "Qwen3.8-Flash-Next-Tiny-4bit", q_bits=4, q_group_size=32)
    assert type(load_model(out)).__module__ == "mlx_vlm.models.qwen4_exp.qwen4_exp"  # opens in mlx-vlm
    converted = Engine.load(str(out), depth=2)
    bits = {path: m.bits for path, m in converted.head.named_modules() if hasattr(m, "scales")}
    assert bits["layers.0.self_attn.q_proj"] == 8 and bits["fc_hidden"] == 8 and bits["fc_embedding"] == 8
    assert bits["layers.0.mlp.switch_mlp.gate_proj"] == 4  # routed experts at the trunk's bits
    trunk_bits = {p: m.bits for p, m in converted.trunk.model.named_modules() if hasattr(m, "scales")}
    assert trunk_bits["language_model.model.layers.1.mlp.gate"] == 8  # mlx-vlm's rule: 8-bit router gates
    assert_mtp_equals_ar_with_drafts_kept(converted.trunk, converted.head, PROMPTS[:1], 10, depths=(2,))


def test_the_prompt_cache_and_its_disk_tier_reuse_mlx_vlms_own_caches(checkpoint, engine, tmp_path):
    """A second request sharing a prefix starts from the cached trunk + head caches (mlx-vlm's
    QSA and ArraysCache classes: in RAM, then from disk in a new engine, rebuilt as mlx-vlm's
    classes) and still gives the AR tokens."""
    prompt = PROMPTS[0]
    longer = prompt + [4, 4]
    ar = engine.generate(longer, _req(max_tokens=6, temperature=0.0, draft="none")).token_ids
    first = Engine.load(str(checkpoint), depth=2, prompt_cache_bytes=1 << 26)
    first.use_disk_cache(tmp_path, 1 << 26)
    first.generate(prompt, _req(max_tokens=6, temperature=0.0, draft="head"))
    again = first.generate(longer, _req(max_tokens=6, temperature=0.0, draft="head"))
    assert again.token_ids == ar and again.stats.cached_tokens > 0
    assert first.prompt_cache.disk.flush()
    second = Engine.load(str(checkpoint), depth=2, prompt_cache_bytes=1 << 26)
    second.use_disk_cache(tmp_path, 1 << 26)
    from_disk = second.generate(longer, _req(max_tokens=6, temperature=0.0, draft="head"))
    assert from_disk.token_ids == ar and from_disk.stats.cached_tokens > 0
    assert second.prompt_cache.disk.stats.hits == 1


# --------------------------------------------------------------------------- sampled distribution
# (Hunyuan-V4's runs in every make test: tests/heads/test_hy_v4.py; this family's behind slow.)


def chi_pair() -> tuple[Trunk, Qwen4ExpMTPHead]:
    """A 5-token Qwen3.8-Flash-Next trunk (2 hyper-connection streams, gated-delta + QSA + PLE)
    with peaked, context-dependent distributions (embeddings x8, logits x3) and a random MTP
    module beside it."""
    model = tiny_qwen4_exp(CHI_VOCAB, seed=3)
    trunk, inner = peaked_trunk(model), model.language_model
    head = Qwen4ExpMTPHead(inner.args, trunk=trunk, cache_like=[1])
    randomize(head, 5)
    return trunk, head


@pytest.mark.slow
def test_sampled_mtp_matches_the_exact_ar_distribution_at_t_0_7():
    """Depth 2: the first three tokens' joint and marginals against the float64 enumeration of AR
    sampling (every cache kind rolled back through mlx-vlm's transaction on the way)."""
    assert_sampled_mtp_matches_ar(chi_pair)


@pytest.mark.slow
def test_chi_square_rejects_a_loop_that_commits_the_rejected_draft(monkeypatch):
    assert_chi_square_rejects_committed_rejected_drafts(monkeypatch, chi_pair)
