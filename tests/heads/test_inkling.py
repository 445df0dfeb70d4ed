"""Inkling (``inkling``): the MTP head beside a trunk hosted through mlx-vlm (`mtplx.trunk.vlm_inkling`).

The replica is ``support.vlm_inkling.inkling`` (the published layout; ``context_strength`` so
that drafts are kept). The reference is NumPy float64 from the checkpoint's tensors, fed the
hidden state mlx-vlm's own forward hands its drafter (``return_hidden``: the pre-norm state), so
the head's choice of trunk state is checked, not only its math. Sources of the math: mlx-vlm
0.7.10 ``models/inkling/language.py`` (``InklingShortConvolution``: a depthwise causal conv plus
its input; ``InklingAttention``: per-head q/k norms, the convolved k / v, the relative-position
band ``r @ rel_proj`` added inside it, scale 1 / head_dim, a sliding window; ``InklingDecoderLayer``:
each branch's output convolved and added to the residual; ``InklingDenseMLP``: SwiGLU times
``global_scale``; ``_logits_from_norm``: the division by the width multiplier),
``speculative/drafters/inkling_mtp/inkling_mtp.py`` (the MTP block: [hidden, embedding]).
"""

from __future__ import annotations

import json

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.engine.engine import Engine
from mtplx.engine.request import GenerationRequest
from mtplx.heads.inkling import InklingMTPHead
from mtplx.trunk import rollback

import mlx.core as mx
import numpy as np
import pytest
from support.decoding import assert_mtp_equals_ar_with_drafts_kept
from support.models import randomize
from support.numpy_heads import read_tensors, rms, silu
from support.seeds import SEEDS, resolve
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
from support.vlm_inkling import INKLING_VOCAB, inkling, tiny_inkling

REFERENCE_LAYOUTS = ("inkling",)
CONTEXT_STRENGTH = 0.05  # drafts kept and rejected (0.2: few kept; 0.01: all)
LENGTH = 7  # past the MTP layer's window of 4 keys


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("inkling") / "Inkling-Tiny"
    return replica(path, inkling, INKLING_VOCAB, context_strength=CONTEXT_STRENGTH)


@pytest.fixture(scope="module")
def engine(checkpoint) -> Engine:
    return Engine.load(str(checkpoint), depth=2)


@pytest.fixture(scope="module")
def random_checkpoint(tmp_path_factory):
    """Every weight random (no predictive construction): the reference's."""
    return replica(tmp_path_factory.mktemp("inkling_random") / "r", inkling, INKLING_VOCAB, seed=11)


@pytest.fixture(scope="module")
def random_engine(random_checkpoint) -> Engine:
    return Engine.load(str(random_checkpoint))


# --------------------------------------------------------------------------- float64 reference


def short_conv(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Depthwise causal conv (published weight [C, 1, K], zeros before position 0) plus its input."""
    k = w.shape[-1]
    padded = np.concatenate([np.zeros((k - 1, x.shape[1])), x])
    out = sum(w[:, 0, i] * padded[i : i + x.shape[0]] for i in range(k))
    return out + x


def attention(x: np.ndarray, t: dict, p: str, cfg: dict, sliding: bool) -> np.ndarray:
    """One Inkling attention over positions 0..T-1 (a fresh cache)."""
    T, eps = x.shape[0], cfg["rms_norm_eps"]
    pre = "swa_" if sliding else ""
    nh, nkv, hd = (cfg[f"{pre}num_attention_heads"], cfg[f"{pre}num_key_value_heads"], cfg[f"{pre}head_dim"])
    window = cfg["sliding_window_size"] if sliding else 0
    extent = cfg["sliding_window_size"] if sliding else cfg["rel_extent"]
    q = rms((x @ t[p + "attn.wq_du.weight"].T).reshape(T, nh, hd), t[p + "attn.q_norm.weight"], eps)
    k = short_conv(x @ t[p + "attn.wk_dv.weight"].T, t[p + "attn.k_sconv.weight"])
    v = short_conv(x @ t[p + "attn.wv_dv.weight"].T, t[p + "attn.v_sconv.weight"]).reshape(T, nkv, hd)
    k = rms(k.reshape(T, nkv, hd), t[p + "attn.k_norm.weight"], eps)
    r = (x @ t[p + "attn.wr_du.weight"].T).reshape(T, nh, cfg["d_rel"])
    dist = np.arange(T)[:, None] - np.arange(T)[None]
    band = np.einsum("ihd,dij->hij", r, t[p + "attn.rel_logits_proj.weight"][:, np.clip(dist, 0, extent - 1)])
    band = np.where((dist < extent)[None], band, 0.0)
    allowed = (dist >= 0) & ((dist < window) if window else True)
    rep = nh // nkv
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) / hd + band
    if not sliding and cfg.get("log_scaling_n_floor"):
        qpos = np.arange(T) + 1.0
        tau = 1.0 + cfg["log_scaling_alpha"] * np.log(np.maximum(qpos / cfg["log_scaling_n_floor"], 1.0))
        scores = scores * tau[None, :, None]
    scores = np.where(allowed[None], scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    out = np.einsum("hqk,khd->qhd", w / w.sum(-1, keepdims=True), v).reshape(T, nh * hd)
    return out @ t[p + "attn.wo_ud.weight"].T


def dense_mlp(x: np.ndarray, t: dict, p: str) -> np.ndarray:
    """SwiGLU with the published interleaved gate/up rows, times ``global_scale``."""
    w13 = t[p + "mlp.w13_dn.weight"]
    gate, up = w13[0::2], w13[1::2]
    return ((silu(x @ gate.T) * (x @ up.T)) @ t[p + "mlp.w2_md.weight"].T) * t[p + "mlp.global_scale"]


def decoder_layer(x: np.ndarray, t: dict, p: str, cfg: dict, sliding: bool) -> np.ndarray:
    eps = cfg["rms_norm_eps"]
    r = attention(rms(x, t[p + "attn_norm.weight"], eps), t, p, cfg, sliding)
    h = x + short_conv(r, t[p + "attn_sconv.weight"])
    r = dense_mlp(rms(h, t[p + "mlp_norm.weight"], eps), t, p)
    return h + short_conv(r, t[p + "mlp_sconv.weight"])


def mtp_logits(t: dict, cfg: dict, hidden: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """The MTP module at ``model.mtp.layers.0.`` on (trunk hidden, next token) rows: logits [T, V]."""
    p, eps = "model.mtp.layers.0.", cfg["rms_norm_eps"]
    e = rms(t["model.llm.embed.weight"][tokens], t[p + "embed_norm.weight"], eps)
    h = rms(hidden, t[p + "hidden_norm.weight"], eps)
    x = np.concatenate([h, e], axis=-1) @ t[p + "input_proj.weight"].T
    x = decoder_layer(x, t, p + "transformer_block.", cfg, sliding=0 in cfg["mtp_local_layer_ids"])
    out = rms(x, t["model.llm.norm.weight"], eps) / cfg["logits_mup_width_multiplier"]
    return out @ t["model.llm.unembed.weight"].T


@pytest.mark.parametrize("seed", SEEDS)
def test_head_logits_match_the_float64_reference_at_every_position(random_engine, random_checkpoint, seed):
    seed = resolve(seed)
    tokens = np.random.default_rng(seed).integers(0, INKLING_VOCAB, size=LENGTH + 1).tolist()
    t = read_tensors(random_checkpoint)
    cfg = json.loads((random_checkpoint / "config.json").read_text())["text_config"]
    want = mtp_logits(t, cfg, published_hidden(random_checkpoint, tokens[:-1]), np.array(tokens[1:]))
    got = head_logits_on_trunk(random_engine, tokens)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max(), f"seed {seed}"


def test_the_head_reads_the_pre_norm_state_and_chains_on_its_block_output(random_engine):
    """The convention (``mtplx/heads/inkling.py``): the trunk's pre-norm state in, the block's
    output before the final norm fed back at depth 2, norm / width multiplier to the LM head."""
    head = random_engine.head
    assert (head.hidden_source, head.chain_source) == ("pre_norm", "pre_norm")
    hidden = mx.array(np.random.default_rng(2).standard_normal((1, 1, 64)).astype(np.float32))
    out = head(hidden, mx.array([[5]]), head.make_cache())
    assert mx.array_equal(head.chain_input(out), head.last_pre_norm[:, -1:]).item()
    want = head.norm(head.last_pre_norm) / head.width_multiplier
    assert mx.allclose(out, want, atol=1e-6).item()


def _windows(cache) -> list[mx.array]:
    """The head layer's K/V entries and its four short-convolution windows."""
    kv, conv = cache[0].caches
    return [kv.keys[..., : kv.offset, :], kv.values[..., : kv.offset, :], *conv.cache]


def test_dropping_the_chains_entries_restores_the_head_caches_conv_windows(random_engine):
    """After true pairs, a 2-step chain and ``trim_kv`` of its 2 entries, the head's cache equals
    one fed the true pairs alone (K/V and the four conv windows); the control (the KV member alone
    trimmed, as before this family) leaves the chain's windows and is caught."""
    head = random_engine.head
    rng = np.random.default_rng(4)
    hidden = mx.array(rng.standard_normal((1, 5, 64)).astype(np.float32))
    tokens = mx.array([rng.integers(2, INKLING_VOCAB, size=5).tolist()])

    def fed() -> list:
        cache = head.make_cache()
        head(hidden, tokens, cache)
        return cache

    def chained() -> list:
        cache = fed()
        chain = head.chain_input(head(hidden[:, -1:], tokens[:, -1:], cache, step=1))
        head(chain, mx.array([[7]]), cache, step=2)
        return cache

    want = _windows(fed())
    cache = chained()
    rollback.trim_kv(cache, 2)
    assert all(mx.array_equal(g, w).item() for g, w in zip(_windows(cache), want))
    control = chained()
    control[0].caches[0].trim(2)
    assert not all(mx.array_equal(g, w).item() for g, w in zip(_windows(control), want))


# --------------------------------------------------------------------------- decoding


def test_the_engine_finds_the_head_beside_the_mlx_vlm_trunk(engine):
    assert isinstance(engine.head, InklingMTPHead) and type(engine.trunk.model).__name__ == "VlmTextModel"


def test_greedy_mtp_equals_ar_with_drafts_kept_at_depths_1_and_2(engine):
    assert_mtp_equals_ar_with_drafts_kept(engine.trunk, engine.head, PROMPTS[:1], 12)


def test_rows_in_a_batch_share_one_forward_and_equal_ar_with_rejections(engine, monkeypatch):
    """Its caches batch (`mtplx.trunk.batch_inkling`: the K/V as ragged rows, the short
    convolutions' windows rolled back per row by mlx-vlm, the band at each row's positions), the
    head's too: the three rows decode in shared trunk forwards, each giving its AR tokens alone
    with drafts kept and rejected."""
    assert_batched_rows_share_forwards_and_equal_ar(engine, monkeypatch, max_tokens=8)


def _head_rows(engine, prompts, blocks, counts, chained: int, *, record: bool = True):
    """The head's batch caches (as `HeadChain` uses them) for rows joining after their prompts'
    pairs: a block of the padded true pairs ``blocks`` keeping ``counts[r]`` per row, then
    ``chained`` one-position chain steps, all dropped. ``record`` False: the blocks' windows
    are not recorded (the control). Returns the batch cache."""
    from mtplx.trunk.batch_cache import BatchCache

    head = engine.head
    batch = BatchCache(head.make_cache(), own_layer=engine.trunk.model.batch_layer)
    singles = []
    for hidden, tokens in prompts:
        cache = head.make_cache()
        head(hidden, tokens, cache)
        singles.append(cache)
    batch.add_rows(singles)

    def begin(n):
        block = batch.begin_block(n)
        if not record:
            for r in block.recurrent:
                r.cache.abort_speculation(r.generation)
            block.recurrent.clear()
        return block

    hidden, tokens = blocks
    block = begin(tokens.shape[1])
    out = head(hidden, tokens, batch.layers)
    batch.commit_block(block, list(counts))
    block = begin(chained)
    for _ in range(chained):
        out = head(out[:, -1:], tokens[:, :1], batch.layers, step=1)
    batch.commit_block(block, [0] * len(counts))
    return batch


def test_the_heads_batch_caches_keep_each_rows_true_pairs_and_drop_the_chain(engine):
    """The head's caches in a batch, used as `HeadChain` uses them (a block over the padded true
    pairs, each row keeping its own count; a block over the chain's entries, dropped): each row's
    next head logits are its own caches' alone, fed only its true pairs (1e-4). Control: the
    windows not recorded (kept over the padding and the chain) give other logits."""
    rng = np.random.default_rng(0)
    head = engine.head
    width = engine.trunk.model.args.hidden_size

    def pairs(n):
        return mx.array(rng.normal(size=(1, n, width)).astype(np.float32)), mx.array(
            rng.integers(2, 90, (1, n))
        )

    prompts = [pairs(2), pairs(6)]
    counts = (1, 3)
    padded = [pairs(3), pairs(3)]
    blocks = (mx.concatenate([h for h, _ in padded]), mx.concatenate([t for _, t in padded]))
    after = [pairs(2), pairs(2)]
    nxt = (mx.concatenate([h for h, _ in after]), mx.concatenate([t for _, t in after]))
    batch = _head_rows(engine, prompts, blocks, counts, chained=1)
    together = head.logits(head(*nxt, batch.layers))
    for r, ((hidden, tokens), n) in enumerate(zip(prompts, counts)):
        cache = head.make_cache()
        head(hidden, tokens, cache)
        head(padded[r][0][:, :n], padded[r][1][:, :n], cache)
        alone = head.logits(head(*after[r], cache))
        assert np.abs(np.array(together[r : r + 1]) - np.array(alone)).max() < 1e-4, r
    control = _head_rows(engine, prompts, blocks, counts, chained=1, record=False)
    wrong = head.logits(head(*nxt, control.layers))
    assert np.abs(np.array(wrong[:1]) - np.array(together[:1])).max() > 1e-3


# --------------------------------------------------------------------------- the split drafter


def test_the_split_drafter_is_found_beside_the_trunk_and_equals_the_checkpoints_head(
    checkpoint, engine, tmp_path
):
    """mlx-vlm's splitter's ``inkling_mtp`` drafter of the replica, beside the same trunk without
    its MTP tensors (as a conversion that dropped them leaves it)."""
    from mlx_vlm.split_mtp import split_mtp

    trunk_dir = tmp_path / "Inkling-Tiny-4bit"
    replica(trunk_dir, inkling, INKLING_VOCAB, context_strength=CONTEXT_STRENGTH, ship_mtp=False)
    drafter = split_mtp(str(checkpoint), str(tmp_path / "Inkling-Tiny-MTP"))
    assert json.loads((tmp_path / drafter / "config.json").read_text())["model_type"] == "inkling_mtp"
    split = Engine.load(str(trunk_dir), depth=2)
    head = split.head
    assert isinstance(head, InklingMTPHead) and head.hidden_source == "pre_norm" and head.key_prefix == ""
    assert_split_head_equals_own(split, engine, PROMPTS[0])
    assert_mtp_equals_ar_with_drafts_kept(split.trunk, head, PROMPTS[:1], 10, depths=(2,))


# --------------------------------------------------------------------------- the prompt cache


@pytest.mark.slow
def test_the_prompt_cache_and_its_disk_tier_reuse_its_caches(checkpoint, engine, tmp_path):
    """A second request sharing a prefix starts from the cached trunk + head caches (mlx-vlm's
    CacheList of KV and the conv windows' ArraysCache: in RAM, then from disk in a new engine)
    and still gives the AR tokens (the disk tier itself: tests/heads/test_qwen4_exp.py)."""
    req = GenerationRequest.from_kwargs
    prompt = PROMPTS[0]
    longer = prompt + [4, 4]
    ar = engine.generate(longer, req(max_tokens=6, draft="none")).token_ids
    first = Engine.load(str(checkpoint), depth=2, prompt_cache_bytes=1 << 26)
    first.use_disk_cache(tmp_path, 1 << 26)
    first.generate(prompt, req(max_tokens=6, draft="head"))
    again = first.generate(longer, req(max_tokens=6, draft="head"))
    assert again.token_ids == ar and again.stats.cached_tokens > 0
    assert first.prompt_cache.disk.flush()
    second = Engine.load(str(checkpoint), depth=2, prompt_cache_bytes=1 << 26)
    second.use_disk_cache(tmp_path, 1 << 26)
    from_disk = second.generate(longer, req(max_tokens=6, draft="head"))
    assert from_disk.token_ids == ar and from_disk.stats.cached_tokens > 0
    assert second.prompt_cache.disk.stats.hits == 1


# --------------------------------------------------------------------------- sampled distribution
# (Hunyuan-V4's runs in every make test: tests/heads/test_hy_v4.py; this family's behind slow.)


def chi_pair():
    """A 5-token Inkling trunk with peaked, context-dependent distributions (logits x3; its
    embedding norm undoes the embeddings' x8) and a random MTP module beside it (a sliding layer
    with its own short convolutions)."""
    model = tiny_inkling(CHI_VOCAB, seed=3)
    trunk = peaked_trunk(model)
    head = InklingMTPHead(model.args, local=[0], trunk=trunk, cache_like=[0])
    randomize(head, 5)
    return trunk, head


@pytest.mark.slow
def test_sampled_mtp_matches_the_exact_ar_distribution_at_t_0_7():
    """Depth 2: the first three tokens' joint and marginals against the float64 enumeration of AR
    sampling (the trunk's conv windows rolled back through mlx-vlm's transaction on the way)."""
    assert_sampled_mtp_matches_ar(chi_pair)


@pytest.mark.slow
def test_chi_square_rejects_a_loop_that_commits_the_rejected_draft(monkeypatch):
    assert_chi_square_rejects_committed_rejected_drafts(monkeypatch, chi_pair)
