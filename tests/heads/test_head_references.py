"""Independent float64 references for the head families whose block mtplx builds from classes
the older tests ran in MLX: LongCat-Flash, MiMo-V2-Flash, Step-3.5-Flash and ERNIE-4.5.

Each reference is the family's whole MTP layer written in NumPy (``support.numpy_heads``) from
the published modeling code, reading the checkpoint's own tensors from its safetensors files
(never the loaded head's modules): the fused input, the decoder block (attention with its
mask, window, sinks or MLA; the MLP), the final norm and the LM head, giving logits at every
position of a short sequence. The loaded head (module 0, draft step 0) must match within
1e-4 of the logits' scale; each reference is also shown to move by more than 1e-2 under each
convention it encodes (the negative controls), so a head that broke one could not pass. A
three-step draft chain (the chained state fed back, module ``s % n`` at step ``s``, past the
sliding windows) is checked against the same references.

Sources (the facts followed):
- LongCat-Flash: vLLM ``model_executor/models/longcat_flash_mtp.py`` (no position-0 mask,
  ``eh_proj(concat[enorm(e), hnorm(h)])``, the block ``x + MLA(input_layernorm(x))`` then
  ``+ mlp(post_attention_layernorm(.))``, ``model.mtp.norm``) and HF ``modeling_longcat_flash.py``
  (MLA with ``mla_scale_q_lora = sqrt(hidden / q_lora_rank)`` on q and
  ``mla_scale_kv_lora = sqrt(hidden / kv_lora_rank)`` on the normed latent; rope on interleaved pairs).
- MiMo-V2-Flash: vLLM ``mimo_v2_flash_mtp.py`` / SGLang ``mimo_v2_flash_nextn.py`` (embedding
  first, no position-0 mask, ``final_layernorm``), vLLM ``mimo_v2_flash.py`` (sliding-window
  attention, ``swa_*`` head counts and rope base, partial rope on halves, attention sinks,
  values scaled by ``attention_value_scale``, asymmetric value heads).
- Step-3.5-Flash: vLLM ``step3p5_mtp.py`` / ``step3p5.py`` (norms ``x * (1 + w)`` from the raw
  checkpoint, q/k norms per head, head-wise sigmoid gate ``g_proj``, sliding window from
  ``layer_types``, the layer's own ``shared_head.output``).
- ERNIE-4.5: vLLM ``ernie_mtp.py`` (position-0 mask, embedding first, no final norm) and the
  trunk's decoder layer (rope on interleaved pairs, GQA, SwiGLU MLP).
- Forged heads (``heads/forged.py``, the Qwen3-Next layout, vLLM ``qwen3_next_mtp.py``'s fusion:
  embedding first, no position-0 mask) on a llama trunk: its layers run in sequence (one module),
  each a llama decoder layer (HF ``modeling_llama.py``: rope on halves, GQA, SwiGLU), then
  ``norm`` and the trunk's (tied) LM head restricted to the manifest's ``vocab_ids``.
"""

from __future__ import annotations

from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.heads import load_head
from mtplx.heads.forged import build_forged_head, lm_head_matrix, load_forged_head, save_forged_head
from mtplx.trunk.model import Trunk

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model as mlx_load_model
from support import checkpoints, models
from support.numpy_heads import (
    causal_mask,
    fuse_inputs,
    gqa_attention,
    mla_attention,
    read_tensors,
    rms,
    rope,
    swiglu_mlp,
    zero_position_zero,
)
from support.seeds import SEEDS, resolve

# The registry rows (``mtplx.heads.registry.FAMILIES``) whose reference is in this module
# (read by ``test_reference_coverage.py``).
REFERENCE_LAYOUTS = ("longcat", "mimo_v2_flash", "step3p5", "ernie", "forged")
LENGTH = 7  # longer than the sliding windows (4): the window shows


def load(path: Path):
    model, config = mlx_load_model(path)
    trunk = Trunk(model)
    return trunk, config, load_head(path, trunk, config)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """Each family's tiny replica (random weights, norms around 1), loaded with its head."""
    root = tmp_path_factory.mktemp("refs")
    built = {
        "longcat": checkpoints.longcat_flash(root / "longcat"),
        "mimo_v2_flash": checkpoints.mimo_v2_flash(root / "mimo_v2_flash"),
        "step3p5": checkpoints.step3p5(root / "step3p5"),
        "ernie": checkpoints.ernie4_5_moe(root / "ernie"),
    }
    loaded = {name: (tiny, read_tensors(tiny.path), load(tiny.path)[2]) for name, tiny in built.items()}
    return {**loaded, "forged": forged_head(root)}


# --------------------------------------------------------------------------- longcat


def longcat_layer(
    t,
    cfg,
    hidden,
    tokens,
    module=0,
    *,
    embedding_first=True,
    mask_first=False,
    post_attn_norm=True,
    final_norm=True,
):
    """LongCat-Flash's one MTP layer (``model.mtp.layers.0``; ``module`` must be 0) in float64
    -> (before ``model.mtp.norm``, after it, logits [T, vocab])."""
    assert module == 0, "LongCat-Flash ships one MTP layer"
    p, eps, h = "model.mtp.layers.0.", cfg["rms_norm_eps"], cfg["hidden_size"]
    e = t["model.embed_tokens.weight"][tokens]
    e = zero_position_zero(e) if mask_first else e
    x = fuse_inputs(
        e, hidden, t[p + "enorm.m.weight"], t[p + "hnorm.m.weight"], t[p + "eh_proj.weight"], eps,
        hidden_first=not embedding_first,
    )  # fmt: skip
    scales = {"q_scale": (h / cfg["q_lora_rank"]) ** 0.5, "kv_scale": (h / cfg["kv_lora_rank"]) ** 0.5}
    a = rms(x, t[p + "input_layernorm.weight"], eps)
    x = x + mla_attention(a, t, p + "self_attn.", cfg, latent_eps=eps, **scales)
    m = rms(x, t[p + "post_attention_layernorm.weight"], eps) if post_attn_norm else x
    x = x + swiglu_mlp(m, t, p + "transformer_layer.mlp.")
    out = rms(x, t["model.mtp.norm.weight"], eps) if final_norm else x
    return x, out, out @ t["lm_head.weight"].T


# --------------------------------------------------------------------------- mimo_v2_flash


def mimo_v2_flash_layer(
    t, cfg, hidden, tokens, module=0, *, embedding_first=True, mask_first=False, window=True, sinks=True
):
    """MiMo-V2-Flash's MTP module ``module`` (``model.mtp.layers.{module}``) in float64
    -> (before ``final_layernorm``, after it, logits [T, vocab])."""
    p, eps, T = f"model.mtp.layers.{module}.", cfg["layernorm_epsilon"], len(tokens)
    nh, nkv, hd, vd = (
        cfg[k]
        for k in ("swa_num_attention_heads", "swa_num_key_value_heads", "swa_head_dim", "swa_v_head_dim")
    )
    e = t["model.embed_tokens.weight"][tokens]
    e = zero_position_zero(e) if mask_first else e
    x = fuse_inputs(
        e, hidden, t[p + "enorm.weight"], t[p + "hnorm.weight"], t[p + "eh_proj.weight"], eps,
        hidden_first=not embedding_first,
    )  # fmt: skip
    a = rms(x, t[p + "input_layernorm.weight"], eps)
    rope_dims = int(cfg["partial_rotary_factor"] * hd)
    q = rope(
        (a @ t[p + "self_attn.q_proj.weight"].T).reshape(T, nh, hd), rope_dims, cfg["swa_rope_theta"], False
    )
    k = rope(
        (a @ t[p + "self_attn.k_proj.weight"].T).reshape(T, nkv, hd), rope_dims, cfg["swa_rope_theta"], False
    )
    v = (a @ t[p + "self_attn.v_proj.weight"].T).reshape(T, nkv, vd) * cfg["attention_value_scale"]
    mask = causal_mask(T, cfg["sliding_window_size"] if window else None)
    sink = t[p + "self_attn.attention_sink_bias"] if sinks else None
    x = x + gqa_attention(q, k, v, hd**-0.5, mask, sink) @ t[p + "self_attn.o_proj.weight"].T
    x = x + swiglu_mlp(rms(x, t[p + "pre_mlp_layernorm.weight"], eps), t, p + "mlp.")
    out = rms(x, t[p + "final_layernorm.weight"], eps)
    return x, out, out @ t["lm_head.weight"].T


# --------------------------------------------------------------------------- step3p5


def step3p5_layer(
    t,
    cfg,
    hidden,
    tokens,
    module=0,
    *,
    embedding_first=True,
    mask_first=False,
    own_head=True,
    gate=True,
    offsets=True,
):
    """Step-3.5-Flash's MTP layer ``module`` (``model.layers.{num_hidden_layers + module}``) in
    float64; every norm of the raw checkpoint is an offset from 1 (``x * (1 + w)``;
    ``offsets=False``: read as stored) -> (before ``shared_head.norm``, after it, logits [T, vocab])."""
    p, eps, T = f"model.layers.{cfg['num_hidden_layers'] + module}.", cfg["rms_norm_eps"], len(tokens)
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_attention_groups"], cfg["head_dim"]
    w = lambda name: t[p + name] + (1.0 if offsets else 0.0)  # noqa: E731
    e = t["model.embed_tokens.weight"][tokens]
    e = zero_position_zero(e) if mask_first else e
    x = fuse_inputs(
        e, hidden, w("enorm.weight"), w("hnorm.weight"), t[p + "eh_proj.weight"], eps,
        hidden_first=not embedding_first,
    )  # fmt: skip
    a = rms(x, w("input_layernorm.weight"), eps)
    q = rms((a @ t[p + "self_attn.q_proj.weight"].T).reshape(T, nh, hd), w("self_attn.q_norm.weight"), eps)
    k = rms((a @ t[p + "self_attn.k_proj.weight"].T).reshape(T, nkv, hd), w("self_attn.k_norm.weight"), eps)
    q, k = rope(q, hd, cfg["rope_theta"], False), rope(k, hd, cfg["rope_theta"], False)
    v = (a @ t[p + "self_attn.v_proj.weight"].T).reshape(T, nkv, hd)
    o = gqa_attention(q, k, v, hd**-0.5, causal_mask(T, cfg["sliding_window"])).reshape(T, nh, hd)
    if gate:
        o = o / (1.0 + np.exp(-(a @ t[p + "self_attn.g_proj.weight"].T)))[..., None]
    x = x + o.reshape(T, -1) @ t[p + "self_attn.o_proj.weight"].T
    x = x + swiglu_mlp(rms(x, w("post_attention_layernorm.weight"), eps), t, p + "mlp.")
    out = rms(x, w("transformer.shared_head.norm.weight"), eps)
    lm_head = t[p + "transformer.shared_head.output.weight"] if own_head else t["lm_head.weight"]
    return x, out, out @ lm_head.T


# --------------------------------------------------------------------------- ernie


def ernie_layer(t, cfg, hidden, tokens, module=0, *, embedding_first=True, mask_first=True, final_norm=False):
    """ERNIE-4.5's MTP layer ``module`` (``model.mtp_*.{module}``) in float64; tied embeddings
    -> (the block's output, the same (no final norm), logits [T, vocab])."""
    p, eps, T = f"model.mtp_block.{module}.", cfg["rms_norm_eps"], len(tokens)
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    e = t["model.embed_tokens.weight"][tokens]
    e = zero_position_zero(e) if mask_first else e
    x = fuse_inputs(
        e, hidden, t[f"model.mtp_emb_norm.{module}.weight"], t[f"model.mtp_hidden_norm.{module}.weight"],
        t[f"model.mtp_linear_proj.{module}.weight"], eps, hidden_first=not embedding_first,
    )  # fmt: skip
    a = rms(x, t[p + "input_layernorm.weight"], eps)
    q = rope((a @ t[p + "self_attn.q_proj.weight"].T).reshape(T, nh, hd), hd, cfg["rope_theta"], True)
    k = rope((a @ t[p + "self_attn.k_proj.weight"].T).reshape(T, nkv, hd), hd, cfg["rope_theta"], True)
    v = (a @ t[p + "self_attn.v_proj.weight"].T).reshape(T, nkv, hd)
    x = x + gqa_attention(q, k, v, hd**-0.5, causal_mask(T)) @ t[p + "self_attn.o_proj.weight"].T
    x = x + swiglu_mlp(rms(x, t[p + "post_attention_layernorm.weight"], eps), t, p + "mlp.")
    out = rms(x, t["model.norm.weight"], eps) if final_norm else x
    return x, out, out @ t["model.embed_tokens.weight"].T


# --------------------------------------------------------------------------- forged

FORGED_VOCAB = 64
FORGED_IDS = list(range(0, FORGED_VOCAB, 3))  # a reduced draft vocabulary


def forged_head(tmp_path: Path):
    """(tiny, tensors, head): a 2-layer forged head with a reduced vocabulary on a tiny llama,
    written by ``save_forged_head`` and loaded back by ``load_forged_head``; ``tensors`` are the
    written ``head.safetensors`` plus the trunk's (tied) embedding, ``tiny`` a stand-in with the
    config the reference reads."""
    trunk = Trunk(models.tiny_llama(vocab_size=FORGED_VOCAB))
    head = build_forged_head(trunk, "post_norm", num_layers=2)
    models.randomize(head, 3)
    head.set_draft_vocab(FORGED_IDS, lm_head_matrix(trunk))
    out = tmp_path / "forged"
    save_forged_head(out, head, {"trunk_fingerprint": "tiny"})
    t = read_tensors(out)
    t["embed_tokens.weight"] = np.asarray(trunk.model.model.embed_tokens.weight, dtype=np.float64)
    args = trunk.model.args
    config = {
        k: getattr(args, k)
        for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "rope_theta")
    }
    config.update(vocab_size=FORGED_VOCAB, num_layers=2, vocab_ids=FORGED_IDS)
    tiny = type("ForgedTiny", (), {"config": config})()
    return tiny, t, load_forged_head(out, trunk, "tiny")


def forged_layer(
    t, cfg, hidden, tokens, module=0, *, embedding_first=True, mask_first=False, layers=None, final_norm=True
):
    """A forged head in float64 (one module: ``module`` must be 0): the fusion, every layer in
    sequence (``layers``: how many), ``norm``, the tied LM head on ``vocab_ids`` only (-inf
    elsewhere) -> (before ``norm``, after it, logits [T, vocab])."""
    assert module == 0, "a forged head is one module"
    eps, T, nh, nkv = cfg["rms_norm_eps"], len(tokens), cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg["hidden_size"] // nh
    e = t["embed_tokens.weight"][tokens]
    e = zero_position_zero(e) if mask_first else e
    x = fuse_inputs(
        e, hidden, t["pre_fc_norm_embedding.weight"], t["pre_fc_norm_hidden.weight"], t["fc.weight"], eps,
        hidden_first=not embedding_first,
    )  # fmt: skip
    for i in range(cfg["num_layers"] if layers is None else layers):
        p = f"layers.{i}."
        a = rms(x, t[p + "input_layernorm.weight"], eps)
        q = rope((a @ t[p + "self_attn.q_proj.weight"].T).reshape(T, nh, hd), hd, cfg["rope_theta"], False)
        k = rope((a @ t[p + "self_attn.k_proj.weight"].T).reshape(T, nkv, hd), hd, cfg["rope_theta"], False)
        v = (a @ t[p + "self_attn.v_proj.weight"].T).reshape(T, nkv, hd)
        x = x + gqa_attention(q, k, v, hd**-0.5, causal_mask(T)) @ t[p + "self_attn.o_proj.weight"].T
        x = x + swiglu_mlp(rms(x, t[p + "post_attention_layernorm.weight"], eps), t, p + "mlp.")
    out = rms(x, t["norm.weight"], eps) if final_norm else x
    logits = np.full((T, cfg["vocab_size"]), -np.inf)
    ids = cfg["vocab_ids"]
    logits[:, ids] = out @ t["embed_tokens.weight"][ids].T
    return x, out, logits


# --------------------------------------------------------------------------- the tests

# layout -> (its layer's reference, the conventions the negative controls flip)
REFERENCES = {
    "longcat": (longcat_layer, ({"mask_first": True}, {"post_attn_norm": False}, {"final_norm": False})),
    "mimo_v2_flash": (mimo_v2_flash_layer, ({"mask_first": True}, {"window": False}, {"sinks": False})),
    "step3p5": (
        step3p5_layer,
        ({"mask_first": True}, {"own_head": False}, {"gate": False}, {"offsets": False}),
    ),
    "ernie": (ernie_layer, ({"mask_first": False}, {"final_norm": True})),
    "forged": (forged_layer, ({"mask_first": True}, {"layers": 1}, {"final_norm": False})),
}
# layout -> which state the next draft step reads: after the final norm ("post_norm") or before
# it ("pre_norm"). vLLM ``mimo_v2_flash_mtp.py`` / ``longcat_flash_mtp.py`` and SGLang's nextn
# models feed back the normed output; vLLM ``step3p5_mtp.py`` applies ``shared_head`` only in
# ``compute_logits``, so the next step reads the state before it; ERNIE has no final norm (the
# two are one); a forged head feeds back what it was trained on (its manifest's hidden source).
CHAIN_SOURCE = {
    "longcat": "post_norm",
    "mimo_v2_flash": "post_norm",
    "step3p5": "pre_norm",
    "ernie": "post_norm",
    "forged": "post_norm",
}
DRAFTS = [5, 11]  # teacher-forced draft tokens d_1, d_2 fed to steps 1, 2


def reference_logits(layout: str, t, cfg, hidden, tokens, **variant) -> np.ndarray:
    return REFERENCES[layout][0](t, cfg, hidden, tokens, **variant)[2]


def head_logits(head, hidden: np.ndarray, tokens: list[int]) -> np.ndarray:
    """The loaded head's logits (draft step 0, fresh caches) at every position, as float64."""
    out = head(mx.array(hidden[None].astype(np.float32)), mx.array([tokens]), head.make_cache())
    return np.asarray(head.logits(out)[0], dtype=np.float64)


@pytest.mark.parametrize("layout", REFERENCE_LAYOUTS)
@pytest.mark.parametrize("seed", SEEDS)
def test_head_logits_match_the_float64_reference_at_every_position(replicas, layout, seed):
    tiny, t, head = replicas[layout]
    variants = REFERENCES[layout][1]
    drawn = resolve(seed)
    rng = np.random.default_rng(drawn)
    tokens = [int(x) for x in rng.integers(0, tiny.config["vocab_size"], size=LENGTH)]
    hidden = rng.standard_normal((LENGTH, tiny.config["hidden_size"]))
    got, want = head_logits(head, hidden, tokens), reference_logits(layout, t, tiny.config, hidden, tokens)
    drafted = np.isfinite(want)  # a reduced draft vocabulary is -inf elsewhere
    assert (np.isfinite(got) == drafted).all(), (layout, drawn)
    got, want = np.where(drafted, got, 0.0), np.where(drafted, want, 0.0)
    scale = np.abs(want).max()
    worst = np.abs(got - want).max(-1)  # per position
    assert (worst < 1e-4 * scale).all(), (layout, drawn, worst / scale)
    for variant in ({"embedding_first": False}, *variants):  # negative controls: each convention shows
        other = np.where(drafted, reference_logits(layout, t, tiny.config, hidden, tokens, **variant), 0.0)
        assert np.abs(got - other).max() > 1e-2 * scale, (layout, drawn, variant)


def chain_reference(layout, t, cfg, hidden, tokens, depth, *, modules, chain, pick=None) -> list[np.ndarray]:
    """The draft chain in float64: step 0 reads the true (hidden, token) pairs; step s >= 1 appends
    (step s-1's chained state at its last position, d_s) and runs module ``s % modules`` (vLLM's
    ``spec_step_idx % num_mtp_layers``) causally over the whole pair sequence, as every module's
    cache holds every position. -> the last position's logits per step."""
    layer, pick = REFERENCES[layout][0], pick or (lambda s: s % modules)
    hs, toks, steps, prev = list(hidden), list(tokens), [], None
    for s in range(depth):
        if s > 0:
            hs.append(prev[0 if chain == "pre_norm" else 1][-1])
            toks.append(DRAFTS[s - 1])
        prev = layer(t, cfg, np.array(hs), np.array(toks), pick(s))
        steps.append(prev[2][-1])
    return steps


def head_chain(head, hidden: np.ndarray, tokens: list[int], depth: int) -> list[np.ndarray]:
    """The same chain through the loaded head and its caches, as the decode loop drives it."""
    cache = head.make_cache()
    out = head(mx.array(hidden[None].astype(np.float32)), mx.array([tokens]), cache, step=0)
    steps = [np.asarray(head.logits(out, step=0)[0, -1], dtype=np.float64)]
    for s in range(1, depth):
        out = head(head.chain_input(out), mx.array([[DRAFTS[s - 1]]]), cache, step=s)
        steps.append(np.asarray(head.logits(out, step=s)[0, -1], dtype=np.float64))
    return steps


def finite(x: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(x), x, 0.0)


@pytest.mark.parametrize("layout", REFERENCE_LAYOUTS)
def test_three_step_draft_chain_matches_the_float64_reference(replicas, layout):
    """Steps 1 and 2 read the chained state and module ``s % n``; past the window (4) on the
    sliding families. Negative controls: the other chained state, and module 0 at every step."""
    tiny, t, head = replicas[layout]
    cfg, rng = tiny.config, np.random.default_rng(7)
    tokens = [int(x) for x in rng.integers(0, cfg["vocab_size"], size=LENGTH)]
    hidden = rng.standard_normal((LENGTH, cfg["hidden_size"]))
    modules, chain = cfg.get("num_nextn_predict_layers") or 1, CHAIN_SOURCE[layout]
    got = [finite(x) for x in head_chain(head, hidden, tokens, 3)]
    want = [
        finite(x) for x in chain_reference(layout, t, cfg, hidden, tokens, 3, modules=modules, chain=chain)
    ]
    for step, (g, w) in enumerate(zip(got, want)):
        assert np.abs(g - w).max() < 1e-4 * np.abs(w).max(), (layout, step)
    other = "pre_norm" if chain == "post_norm" else "post_norm"
    controls = [{"chain": other}] if layout != "ernie" else []  # ERNIE: pre-norm is post-norm
    controls += [{"chain": chain, "pick": lambda s: 0}] if modules > 1 else []
    for control in controls:
        wrong = chain_reference(layout, t, cfg, hidden, tokens, 3, modules=modules, **control)
        assert np.abs(got[1] - finite(wrong[1])).max() > 1e-2 * np.abs(want[1]).max(), (layout, control)
