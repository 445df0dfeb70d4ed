"""Hunyuan-V4 (``hy_v4``): the MTP head beside a hyper-connection trunk hosted through mlx-vlm.

The replica is ``support.vlm_families.hy_v4`` (the published layout; ``context_strength`` so that
drafts are kept). The reference is NumPy float64 from the checkpoint's tensors, MXFP8
``kv_b_proj`` decoded from its bytes, with the hidden state mlx-vlm's own forward hands a drafter
(``return_hidden``): so the head's choice of trunk state (the hyper-connection convention,
``mtplx/heads/hy_v4.py``) is checked, not only its math. Sources of the math: mlx-vlm 0.7.10
``models/hy_v4/language.py`` (``HyV4Attention``: output gate, sinks, the DSA top-k),
``models/deepseek_v32/language.py`` (the indexer, MLA, the sigmoid router),
``speculative/drafters/hy_v4_mtp/hy_v4_mtp.py`` (the MTP module).
"""

from __future__ import annotations

import json

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.engine.engine import Engine
from mtplx.engine.request import GenerationRequest
from mtplx.heads.hy_v4 import HyV4MTPHead, _block
from mtplx.trunk.model import Trunk

import mlx.core as mx
import numpy as np
import pytest
from support.decoding import assert_mtp_equals_ar_with_drafts_kept
from support.models import randomize
from support.numpy_heads import (
    causal_mask,
    e4m3,
    e8m0,
    read_tensors,
    rms,
    rope,
    sigmoid_moe,
    softmax_attention,
)
from support.seeds import SEEDS, resolve
from support.vlm_families import HY_V4_VOCAB, tiny_hy_v4
from support.vlm_families import hy_v4 as hy_v4_checkpoint
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

REFERENCE_LAYOUTS = ("hy_v4",)
CONTEXT_STRENGTH = 0.2
LENGTH = 10  # reference positions: over the indexer's 4 kept keys, so the selection matters
_req = GenerationRequest.from_kwargs


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("hy_v4") / "Hunyuan-V4-Tiny"
    return replica(path, hy_v4_checkpoint, HY_V4_VOCAB, context_strength=CONTEXT_STRENGTH)


@pytest.fixture(scope="module")
def engine(checkpoint) -> Engine:
    return Engine.load(str(checkpoint), depth=2)


@pytest.fixture(scope="module")
def random_checkpoint(tmp_path_factory):
    """Every weight random (no predictive construction): the reference's checkpoint."""
    path = tmp_path_factory.mktemp("hy_v4_random") / "r"
    return replica(path, hy_v4_checkpoint, HY_V4_VOCAB, seed=11)


@pytest.fixture(scope="module")
def random_engine(random_checkpoint) -> Engine:
    return Engine.load(str(random_checkpoint))


# --------------------------------------------------------------------------- float64 reference


def mxfp8_weight(t: dict[str, np.ndarray], key: str) -> np.ndarray:
    """``key`` (e4m3 bytes [out, in]) times its ``_scale`` (e8m0 bytes: 2^(s - 127) per 32 inputs)."""
    return e4m3(t[key]) * np.repeat(e8m0(t[key + "_scale"]), 32, axis=-1)


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * w + b


def dsa_keys(x: np.ndarray, qr: np.ndarray, t: dict, p: str, cfg: dict) -> tuple[np.ndarray, float]:
    """The DSA indexer's choice [T, T] (True: row i attends to key j) and the smallest gap between
    a kept and a dropped key's index score (a float32 run may choose otherwise only near a tie).
    Every key when there are at most ``index_topk``."""
    T, k_top = x.shape[0], cfg["index_topk"]
    if T <= k_top:
        return np.ones((T, T), bool), np.inf
    nh, hd, rd = cfg["index_n_heads"], cfg["index_head_dim"], cfg["qk_rope_head_dim"]
    q = rope((qr @ t[p + "wq_b.weight"].T).reshape(T, nh, hd), rd, cfg["rope_theta"], True)
    k = layer_norm(x @ t[p + "wk.weight"].T, t[p + "k_norm.weight"], t[p + "k_norm.bias"])
    k = rope(k.reshape(T, 1, hd), rd, cfg["rope_theta"], True)[:, 0]
    w = (x @ t[p + "weights_proj.weight"].T) * nh**-0.5 * hd**-0.5  # [T, nh]
    scores = (np.maximum(np.einsum("qhd,kd->qhk", q, k), 0) * w[:, :, None]).sum(1)
    scores = np.where(causal_mask(T), scores, -np.inf)
    chosen, gap = np.zeros((T, T), bool), np.inf
    for i in range(T):
        order = np.argsort(-scores[i], kind="stable")
        chosen[i, order[:k_top]] = True
        if i + 1 > k_top:
            gap = min(gap, scores[i, order[k_top - 1]] - scores[i, order[k_top]])
    return chosen & causal_mask(T), gap


def hy_v4_attention(x: np.ndarray, t: dict, p: str, cfg: dict) -> tuple[np.ndarray, float]:
    """Hunyuan-V4's attention, positions 0..T-1: MLA (latent norms eps 1e-6, rope on adjacent pairs)
    over the DSA-chosen keys, one sink logit per head, the output gated by sigmoid(linear_gate(x))."""
    nh, nope, rd, vd, rank = (
        cfg[k]
        for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank")
    )
    T = x.shape[0]
    qr = rms(x @ t[p + "q_a_proj.weight"].T, t[p + "q_a_layernorm.weight"], 1e-6)
    q = (qr @ t[p + "q_b_proj.weight"].T).reshape(T, nh, nope + rd)
    kv = x @ t[p + "kv_a_proj_with_mqa.weight"].T
    latent = rms(kv[:, :rank], t[p + "kv_a_layernorm.weight"], 1e-6)
    kvb = (latent @ mxfp8_weight(t, p + "kv_b_proj.weight").T).reshape(T, nh, nope + vd)
    q_pe = rope(q[..., nope:], rd, cfg["rope_theta"], True)
    k_pe = rope(kv[:, rank:].reshape(T, 1, rd), rd, cfg["rope_theta"], True)[:, 0]
    scores = np.einsum("qhd,khd->hqk", q[..., :nope], kvb[..., :nope]) + np.einsum("qhd,kd->hqk", q_pe, k_pe)
    allowed, gap = dsa_keys(x, qr, t, p + "indexer.", cfg)
    out = softmax_attention(
        scores * (nope + rd) ** -0.5, kvb[..., nope:], allowed, t[p + "learnable_sink_param"]
    )
    gate = 1.0 / (1.0 + np.exp(-(x @ t[p + "linear_gate.weight"].T)))
    return (out * gate) @ t[p + "o_proj.weight"].T, gap


def mtp_logits(t: dict, cfg: dict, hidden: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, float]:
    """The MTP module at ``model.mtp_layers.0.`` on (trunk hidden, next token) rows: logits [T, V]."""
    p, eps = "model.mtp_layers.0.", cfg["rms_norm_eps"]
    e = t["model.embed_tokens.weight"][tokens]
    x = np.concatenate([rms(e, t[p + "enorm.weight"], eps), rms(hidden, t[p + "hnorm.weight"], eps)], -1)
    x = x @ t[p + "eh_proj.weight"].T
    attn, gap = hy_v4_attention(rms(x, t[p + "input_layernorm.weight"], eps), t, p + "self_attn.", cfg)
    h = x + attn
    h = h + sigmoid_moe(rms(h, t[p + "post_attention_layernorm.weight"], eps), t, p + "mlp.", cfg)
    return rms(h, t[p + "final_layernorm.weight"], eps) @ t["lm_head.weight"].T, gap


@pytest.mark.parametrize("seed", SEEDS)
def test_head_logits_match_the_float64_reference_at_every_position(random_engine, random_checkpoint, seed):
    seed = resolve(seed)
    rng = np.random.default_rng(seed)
    t = read_tensors(random_checkpoint)
    cfg = json.loads((random_checkpoint / "config.json").read_text())
    # The indexer's ReLU scores tie exactly (at 0) now and then; where a tie straddles the kept
    # set, which key a float32 run keeps is arbitrary: such a draw is replaced by the next one.
    for _ in range(20):
        tokens = rng.integers(0, HY_V4_VOCAB, size=LENGTH + 1).tolist()
        want, gap = mtp_logits(t, cfg, published_hidden(random_checkpoint, tokens[:-1]), np.array(tokens[1:]))
        if gap > 1e-4:
            break
    assert gap > 1e-4, f"seed {seed}: every draw's indexer choice is near a tie"
    got = head_logits_on_trunk(random_engine, tokens)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max(), f"seed {seed}"


def test_the_head_chains_on_its_normed_output(random_engine):
    """Depth 2 reads the first draft step's post-``final_layernorm`` output (the hyper-connection
    convention's chain, ``mtplx/heads/hy_v4.py``); the pre-norm state would give other logits."""
    head = random_engine.head
    assert (head.hidden_source, head.chain_source) == ("post_norm", "post_norm")
    hidden = mx.array(np.random.default_rng(2).standard_normal((1, 1, 64)).astype(np.float32))
    cache = head.make_cache()
    first = head(hidden, mx.array([[5]]), cache)
    chained = head.chain_input(first)
    assert mx.array_equal(chained, first[:, -1:]).item()
    assert not mx.allclose(head.last_pre_norm[:, -1:], chained, atol=1e-3).item()


# --------------------------------------------------------------------------- decoding


def test_the_engine_finds_the_head_beside_the_mlx_vlm_trunk(engine):
    assert isinstance(engine.head, HyV4MTPHead) and type(engine.trunk.model).__name__ == "VlmTextModel"
    assert engine.head.hidden_source == "post_norm"


def test_greedy_mtp_equals_ar_with_drafts_kept_at_depths_1_and_2(engine):
    assert_mtp_equals_ar_with_drafts_kept(engine.trunk, engine.head, PROMPTS[:2], 14)


def test_rows_in_a_batch_share_one_forward_and_equal_ar_with_rejections(engine, monkeypatch):
    """Its caches (a CacheList of the MLA latent and the indexer's keys per layer) batch: the three
    rows decode in shared trunk forwards (a forward of 3 rows is counted), each giving its AR
    tokens alone with drafts kept and rejected."""
    assert_batched_rows_share_forwards_and_equal_ar(engine, monkeypatch, max_tokens=16)


def test_a_seeded_n_2_request_among_batched_rows_gives_what_it_gives_alone(engine):
    """A seeded request with n = 2 (its choices forked from one prefill into rows of the batch,
    the CacheList caches copied) decoded beside two greedy head rows gives each choice's tokens
    alone, and the greedy rows theirs."""
    from mtplx.engine.scheduler import run_to_completion

    def per_choice(chunks) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for c in chunks:
            out.setdefault(c.index, []).extend(c.token_ids)
        return out

    seeded = _req(max_tokens=10, temperature=1.0, seed=17, n=2, draft="head", depth=2)
    greedy = _req(max_tokens=10, draft="head", depth=2)
    prompts, requests = [PROMPTS[0], PROMPTS[1], PROMPTS[2]], [seeded, greedy, greedy]
    alone = [
        run_to_completion(engine.batch(draft_policy="fixed"), [p], [r])[0] for p, r in zip(prompts, requests)
    ]
    together = run_to_completion(engine.batch(draft_policy="fixed"), prompts, requests)
    assert [per_choice(c) for c in together] == [per_choice(c) for c in alone]
    assert len(per_choice(together[0])) == 2


# --------------------------------------------------------------------------- sampled distribution


def chi_pair() -> tuple[Trunk, HyV4MTPHead]:
    """A 5-token Hunyuan-V4 trunk (2 hyper-connection streams) with peaked, context-dependent
    distributions (embeddings x8, logits x3) and a random MTP module beside it."""
    model = tiny_hy_v4(CHI_VOCAB, seed=3)
    trunk, inner = peaked_trunk(model), model.language_model
    args = inner.args
    head = HyV4MTPHead(
        [_block(args)], args.hidden_size, eps=args.rms_norm_eps, first_layer=0, trunk=trunk, cache_like=[0]
    )
    randomize(head, 5)
    return trunk, head


def test_sampled_mtp_matches_the_exact_ar_distribution_at_t_0_7():
    """Depth 2: the first three tokens' joint and marginals against the float64 enumeration of AR
    sampling; 100 samples, the count with which the control below catches a wrong loop."""
    assert_sampled_mtp_matches_ar(chi_pair)


def test_chi_square_rejects_a_loop_that_commits_the_rejected_draft(monkeypatch):
    assert_chi_square_rejects_committed_rejected_drafts(monkeypatch, chi_pair)


# --------------------------------------------------------------------------- the split drafter


@pytest.fixture(scope="module")
def split_replica(checkpoint, tmp_path_factory) -> dict:
    """mlx-vlm's splitter's ``hy_v4_mtp`` drafter of the replica, beside the same trunk without
    its MTP tensors (as a conversion that dropped them leaves it)."""
    from pathlib import Path

    from mlx_vlm.split_mtp import split_mtp

    root = tmp_path_factory.mktemp("hy_v4_split")
    trunk = root / "Hunyuan-V4-Tiny-mxfp8"
    replica(trunk, hy_v4_checkpoint, HY_V4_VOCAB, context_strength=CONTEXT_STRENGTH, ship_mtp=False)
    drafter = Path(split_mtp(str(checkpoint), str(root / "Hunyuan-V4-Tiny-MTP-bf16")))
    return {"trunk": trunk, "drafter": drafter}


def test_the_split_drafter_is_found_beside_the_trunk_and_equals_the_checkpoints_head(split_replica, engine):
    from mtplx.heads.hy_v4 import SplitHyV4Head

    config = json.loads((split_replica["drafter"] / "config.json").read_text())
    assert config["model_type"] == "hy_v4_mtp"
    split = Engine.load(str(split_replica["trunk"]), depth=2)
    head = split.head
    assert isinstance(head, SplitHyV4Head) and head.hidden_source == "post_norm"
    kinds = {type(m).__name__ for _, m in head.named_modules()}
    assert "QuantizedMultiLinear" in kinds or any("Quantized" in k for k in kinds), kinds  # embed_q packed
    assert_split_head_equals_own(split, engine, PROMPTS[0])
    assert_mtp_equals_ar_with_drafts_kept(split.trunk, head, PROMPTS[:2], 14)


# --------------------------------------------------------------------------- conversion


def test_mtplx_convert_keeps_the_head_at_safe_precision_and_mlx_vlm_opens_the_output(checkpoint, tmp_path):
    from mtplx.checkpoints.convert_hf import convert_hf

    from mlx_vlm.utils import load_model

    out = convert_hf(checkpoint, tmp_path / "Hunyuan-V4-Tiny-4bit", q_bits=4, q_group_size=32)
    assert type(load_model(out)).__module__ == "mlx_vlm.models.hy_v4.hy_v4"  # opens in mlx-vlm
    converted = Engine.load(str(out), depth=2)
    bits = {path: m.bits for path, m in converted.head.named_modules() if hasattr(m, "scales")}
    assert bits["modules_.0.block.self_attn.q_a_proj"] == 8 and bits["modules_.0.eh_proj"] == 8
    assert bits["modules_.0.block.mlp.switch_mlp.gate_up_proj"] == 4  # routed experts at the trunk's bits
    assert_mtp_equals_ar_with_drafts_kept(converted.trunk, converted.head, PROMPTS[:2], 14)


def test_the_prompt_cache_and_its_disk_tier_reuse_the_mlx_vlm_trunks_caches(checkpoint, engine, tmp_path):
    """A second request sharing a prefix starts from the cached trunk + head caches (in RAM, then
    from disk in a new engine) and still gives the AR tokens."""
    prompt = PROMPTS[0]
    longer = prompt + [4, 4]
    ar = engine.generate(longer, _req(max_tokens=12, temperature=0.0, draft="none")).token_ids
    first = Engine.load(str(checkpoint), depth=2, prompt_cache_bytes=1 << 26)
    first.use_disk_cache(tmp_path, 1 << 26)
    first.generate(prompt, _req(max_tokens=12, temperature=0.0, draft="head"))
    again = first.generate(longer, _req(max_tokens=12, temperature=0.0, draft="head"))
    assert again.token_ids == ar and again.stats.cached_tokens > 0
    assert first.prompt_cache.disk.flush()  # the writer thread has written the entries
    second = Engine.load(str(checkpoint), depth=2, prompt_cache_bytes=1 << 26)
    second.use_disk_cache(tmp_path, 1 << 26)
    from_disk = second.generate(longer, _req(max_tokens=12, temperature=0.0, draft="head"))
    assert from_disk.token_ids == ar and from_disk.stats.cached_tokens > 0
