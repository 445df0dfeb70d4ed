"""Tiny drafter replicas written as the published files are, and float64 NumPy oracles of their math.

DFlash (z-lab's format, as ``z-lab/Qwen3-8B-DFlash-b16``'s ``config.json`` reads and mlx-vlm 0.7.10's
``qwen3_dflash`` loads it): ``architectures`` ``DFlashDraftModel``, ``model_type`` ``qwen3``,
``dflash_config`` {``mask_token_id``, ``target_layer_ids``}, top-level ``block_size`` and
``num_target_layers``, bfloat16 tensors named ``fc``, ``hidden_norm``, ``layers.{i}.*``, ``norm``.

The oracle is written from the published description of the math (mtplx's module docstring and
z-lab's reference), with no cache: the context's keys are recomputed from every tap so far, at
positions 0.., and the block sits right after them.
"""

from __future__ import annotations

import json
from pathlib import Path

from mtplx.trunk.model import Trunk

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import llama

DFLASH_HIDDEN, DFLASH_HEADS, DFLASH_KV_HEADS, DFLASH_HEAD_DIM = 32, 4, 2, 8


def tiny_target(seed: int, layers: int, vocab_size: int) -> Trunk:
    """A llama trunk of ``layers`` layers at the drafters' hidden size (mlx-lm's initialisation)."""
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=DFLASH_HIDDEN,
        num_hidden_layers=layers,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab_size,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    mx.random.seed(seed)
    model = llama.Model(args)
    model.eval()
    mx.eval(model.parameters())
    return Trunk(model)


def silenced_taps(trunk: Trunk, tokens: mx.array, layer_ids: list[int]) -> list[np.ndarray]:
    """Per id, layer ``i``'s output over ``tokens`` [B, T], independent of the layer tap: the
    final norm's input of the trunk with every later layer's output projections zeroed."""
    saved = tree_flatten(trunk.model.parameters())
    taps = []
    for index in layer_ids:
        for later in trunk.layers[index + 1 :]:
            zeroed = [
                (n, mx.zeros_like(v))
                for n, v in tree_flatten(later.parameters())
                if n.split(".")[-2] in ("o_proj", "down_proj")
            ]
            later.update(tree_unflatten(zeroed))
        taps.append(np.array(trunk(tokens, trunk.make_cache()).hidden_pre_norm).astype(np.float64))
        trunk.model.update(tree_unflatten(saved))
    return taps


def dflash_config(vocab_size: int, target_layer_ids: list[int], num_target_layers: int, **overrides) -> dict:
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": DFLASH_HIDDEN,
        "intermediate_size": 2 * DFLASH_HIDDEN,
        "num_hidden_layers": 2,
        "num_attention_heads": DFLASH_HEADS,
        "num_key_value_heads": DFLASH_KV_HEADS,
        "head_dim": DFLASH_HEAD_DIM,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "vocab_size": vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "layer_types": ["full_attention", "full_attention"],
        "use_sliding_window": False,
        "block_size": 4,
        "num_target_layers": num_target_layers,
        "dflash_config": {"mask_token_id": vocab_size - 1, "target_layer_ids": list(target_layer_ids)},
    }
    config.update(overrides)
    return config


def dflash_tensors(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights under the published names (norm weights around 1)."""
    rng = np.random.default_rng(seed)
    h, inter = config["hidden_size"], config["intermediate_size"]
    q, kv, d = (
        config["num_attention_heads"] * DFLASH_HEAD_DIM,
        config["num_key_value_heads"] * DFLASH_HEAD_DIM,
        DFLASH_HEAD_DIM,
    )
    n_taps = len(config["dflash_config"]["target_layer_ids"])

    def dense(out: int, inp: int) -> np.ndarray:
        return rng.standard_normal((out, inp)) / np.sqrt(inp)

    def norm(n: int) -> np.ndarray:
        return 1.0 + 0.3 * rng.standard_normal(n)

    shapes = {"fc.weight": dense(h, n_taps * h), "hidden_norm.weight": norm(h), "norm.weight": norm(h)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": dense(q, h),
            p + "self_attn.k_proj.weight": dense(kv, h),
            p + "self_attn.v_proj.weight": dense(kv, h),
            p + "self_attn.o_proj.weight": dense(h, q),
            p + "self_attn.q_norm.weight": norm(d),
            p + "self_attn.k_norm.weight": norm(d),
            p + "mlp.gate_proj.weight": dense(inter, h),
            p + "mlp.up_proj.weight": dense(inter, h),
            p + "mlp.down_proj.weight": dense(h, inter),
            p + "input_layernorm.weight": norm(h),
            p + "post_attention_layernorm.weight": norm(h),
        }
    return {k: v.astype(np.float32) for k, v in shapes.items()}


def write_dflash(path: Path, config: dict, tensors: dict[str, np.ndarray], prefix: str = "") -> Path:
    """The drafter directory: ``config.json`` and ``model.safetensors`` (bfloat16, as published)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(
        str(path / "model.safetensors"),
        {prefix + k: mx.array(v).astype(mx.bfloat16) for k, v in tensors.items()},
        metadata={"format": "pt"},
    )
    return path


def published_float64(path: Path) -> dict[str, np.ndarray]:
    """The tensors of a written replica as float64 (the bfloat16 values exactly; integer maps kept)."""
    out = {}
    for k, v in mx.load(str(path / "model.safetensors")).items():
        floating = mx.issubdtype(v.dtype, mx.floating)
        out[k.removeprefix("model.")] = (
            np.array(v.astype(mx.float32)).astype(np.float64) if floating else np.array(v)
        )
    return out


# --------------------------------------------------------------------------- float64 oracle


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, positions: np.ndarray, base: float) -> np.ndarray:
    """Split-half (NeoX) rotary embedding of x [..., T, D] at ``positions`` [T]."""
    half = x.shape[-1] // 2
    freqs = base ** (-np.arange(half) * 2.0 / x.shape[-1])
    angle = positions[:, None] * freqs[None, :]
    cos, sin = np.cos(angle), np.sin(angle)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def _heads(x: np.ndarray, n: int) -> np.ndarray:
    return x.reshape(x.shape[0], n, -1).transpose(1, 0, 2)  # [T, n*D] -> [n, T, D]


def _keys_values(w: dict, src: np.ndarray, pos: np.ndarray, nkv: int, eps: float, base: float) -> tuple:
    k = _rms(_heads(src @ w["self_attn.k_proj.weight"].T, nkv), w["self_attn.k_norm.weight"], eps)
    return _rope(k, pos, base), _heads(src @ w["self_attn.v_proj.weight"].T, nkv)


def dflash_logits(
    weights: dict[str, np.ndarray],
    config: dict,
    taps: np.ndarray,
    block: np.ndarray,
    embed: np.ndarray,
    lm_head: np.ndarray,
) -> np.ndarray:
    """One row: ``taps`` [S, n_taps * H] for every context position so far (in target_layer_ids
    order), ``block`` [L] tokens placed at positions S..; returns logits [L, V]."""
    return dflash_hidden(weights, config, taps, block, embed) @ lm_head.T


def _grouped_conv(h: np.ndarray, dynamic: np.ndarray, base: np.ndarray, group_size: int) -> np.ndarray:
    """out[t, c] = sum over o < K, t - o >= 0 of (base[o, c] + dynamic[t, o, c // group_size]) * h[t - o, c]."""
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        for o in range(min(base.shape[0], t + 1)):
            out[t] += (base[o] + np.repeat(dynamic[t, o], group_size)) * h[t - o]
    return out


def _conv_prepare(w: dict, name: str, x: np.ndarray, kernel: int, group_size: int) -> tuple:
    dynamic = (x @ w[f"{name}.kernel_projection.weight"].T).reshape(x.shape[0], 2, kernel, -1)
    return _grouped_conv(x, dynamic[:, 0], w[f"{name}.base_kernel"][0], group_size), dynamic[:, 1]


def dflash_hidden(
    weights: dict[str, np.ndarray], config: dict, taps: np.ndarray, block: np.ndarray, embed: np.ndarray
) -> np.ndarray:
    """``dflash_logits``' final hidden [L, H] (after the drafter's ``norm``); a DFlash2 config
    (``dflash_config.conv_kernel_size``) wraps attention and MLP in its grouped dynamic convolutions."""
    conv = config["dflash_config"].get("conv_kernel_size")
    group = config["dflash_config"].get("conv_group_size")
    eps, base = config["rms_norm_eps"], config["rope_theta"]
    nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    causal = bool(config["dflash_config"].get("causal", False))
    S, L = taps.shape[0], block.shape[0]
    ctx = _rms(taps @ weights["fc.weight"].T, weights["hidden_norm.weight"], eps)
    h = embed[block]
    ctx_pos, blk_pos = np.arange(S, dtype=np.float64), np.arange(S, S + L, dtype=np.float64)
    for i in range(config["num_hidden_layers"]):
        w = {k.removeprefix(f"layers.{i}."): v for k, v in weights.items() if k.startswith(f"layers.{i}.")}
        x = _rms(h, w["input_layernorm.weight"], eps)
        if conv:
            x, after = _conv_prepare(w, "attention_conv", x, conv, group)
        q = _rope(
            _rms(_heads(x @ w["self_attn.q_proj.weight"].T, nh), w["self_attn.q_norm.weight"], eps),
            blk_pos,
            base,
        )

        (kc, vc), (kb, vb) = (
            _keys_values(w, ctx, ctx_pos, nkv, eps, base),
            _keys_values(w, x, blk_pos, nkv, eps, base),
        )
        k, v = np.concatenate([kc, kb], axis=1), np.concatenate([vc, vb], axis=1)
        k, v = np.repeat(k, nh // nkv, axis=0), np.repeat(v, nh // nkv, axis=0)
        scores = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
        if causal:
            scores = np.where(np.arange(S + L)[None, :] <= S + np.arange(L)[:, None], scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        att = (p / p.sum(-1, keepdims=True)) @ v
        att = att.transpose(1, 0, 2).reshape(L, -1) @ w["self_attn.o_proj.weight"].T
        h = h + (_grouped_conv(att, after, w["attention_conv.base_kernel"][1], group) if conv else att)
        y = _rms(h, w["post_attention_layernorm.weight"], eps)
        if conv:
            y, after = _conv_prepare(w, "mlp_conv", y, conv, group)
        gate, up = y @ w["mlp.gate_proj.weight"].T, y @ w["mlp.up_proj.weight"].T
        mlp = (gate / (1.0 + np.exp(-gate)) * up) @ w["mlp.down_proj.weight"].T
        h = h + (_grouped_conv(mlp, after, w["mlp_conv.base_kernel"][1], group) if conv else mlp)
    return _rms(h, weights["norm.weight"], eps)


# --------------------------------------------------------------------------- EAGLE-3

EAGLE3_HIDDEN = 32


def eagle3_config(
    vocab_size: int, draft_vocab: int, aux_ids: list[int] | None, *, speculators: bool = True, layers: int = 1
) -> dict:
    """The speculators format (``Eagle3Speculator``, ``speculators_model_type``, its
    ``speculators_config``) or, with ``speculators=False``, mlx-vlm's own ``eagle3`` config."""
    layer = {
        "model_type": "llama",
        "hidden_size": EAGLE3_HIDDEN,
        "intermediate_size": 2 * EAGLE3_HIDDEN,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "attention_bias": False,
        "tie_word_embeddings": False,
    }
    config = {
        "transformer_layer_config": layer,
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": EAGLE3_HIDDEN,
        "norm_before_residual": speculators,
        "norm_before_fc": not speculators,
        "torch_dtype": "bfloat16",
    }
    if aux_ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = aux_ids
    if speculators:
        method = {"proposal_type": "greedy", "speculative_tokens": 3}
        verifier = {"name_or_path": "tiny-llama", "architectures": ["LlamaForCausalLM"]}
        config |= {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.1.0",
            "speculators_config": {"algorithm": "eagle3", "proposal_methods": [method], "verifier": verifier},
        }
    else:
        config |= {"model_type": "eagle3", "block_size": 4}
    return config


def eagle3_tensors(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under the published names; ``d2t`` (int64) and ``t2d`` (bool) for a draft
    vocabulary of every other target id from a random offset (so ``d2t`` is not constant)."""
    rng = np.random.default_rng(seed)
    layer = config["transformer_layer_config"]
    h, inter, vocab, draft = (
        layer["hidden_size"],
        layer["intermediate_size"],
        layer["vocab_size"],
        config["draft_vocab_size"],
    )
    q, kv = layer["num_attention_heads"] * layer["head_dim"], layer["num_key_value_heads"] * layer["head_dim"]

    def dense(out: int, inp: int) -> np.ndarray:
        return rng.standard_normal((out, inp)) / np.sqrt(inp)

    def norm(n: int) -> np.ndarray:
        return 1.0 + 0.3 * rng.standard_normal(n)

    t = {
        "embed_tokens.weight": rng.standard_normal((vocab, h)),
        "fc.weight": dense(h, 3 * h),
        "norm.weight": norm(h),
        "lm_head.weight": dense(draft, h),
    }
    if config.get("norm_before_fc"):
        t["input_norm.weight"] = norm(3 * h)
    for i in range(layer["num_hidden_layers"]):
        p, width = f"layers.{i}.", 2 * h if i == 0 else h
        t |= {p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h)}
        if i == 0:
            t[p + "hidden_norm.weight"] = norm(h)
        t |= {
            p + "self_attn.q_proj.weight": dense(q, width),
            p + "self_attn.k_proj.weight": dense(kv, width),
            p + "self_attn.v_proj.weight": dense(kv, width),
            p + "self_attn.o_proj.weight": dense(h, q),
            p + "mlp.gate_proj.weight": dense(inter, h),
            p + "mlp.up_proj.weight": dense(inter, h),
            p + "mlp.down_proj.weight": dense(h, inter),
        }
    out = {k: v.astype(np.float32) for k, v in t.items()}
    if draft != vocab:
        targets = np.sort(rng.choice(vocab, draft, replace=False))
        out["d2t"] = (targets - np.arange(draft)).astype(np.int64)
        held = np.zeros(vocab, dtype=bool)
        held[targets] = True
        out["t2d"] = held
    return out


def write_eagle3(path: Path, config: dict, tensors: dict[str, np.ndarray]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    arrays = {
        k: mx.array(v) if v.dtype != np.float32 else mx.array(v).astype(mx.bfloat16)
        for k, v in tensors.items()
    }
    mx.save_safetensors(str(path / "model.safetensors"), arrays, metadata={"format": "pt"})
    return path


def _causal_attention(x: np.ndarray, w: dict, layer: dict, positions: np.ndarray) -> np.ndarray:
    nh, nkv = layer["num_attention_heads"], layer["num_key_value_heads"]
    q = _rope(_heads(x @ w["self_attn.q_proj.weight"].T, nh), positions, layer["rope_theta"])
    k = _rope(_heads(x @ w["self_attn.k_proj.weight"].T, nkv), positions, layer["rope_theta"])
    v = _heads(x @ w["self_attn.v_proj.weight"].T, nkv)
    k, v = np.repeat(k, nh // nkv, axis=0), np.repeat(v, nh // nkv, axis=0)
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    n = x.shape[0]
    scores = np.where(np.tril(np.ones((n, n), dtype=bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return ((p / p.sum(-1, keepdims=True)) @ v).transpose(1, 0, 2).reshape(n, -1) @ w[
        "self_attn.o_proj.weight"
    ].T


def eagle3_hidden(
    weights: dict,
    config: dict,
    tokens: np.ndarray,
    hidden_in: np.ndarray,
    first_position: int,
    embed: np.ndarray,
) -> np.ndarray:
    """One row, no cache: the drafter's hidden [T, H] for ``tokens`` [T] paired with ``hidden_in``
    [T, H] (already through ``fc``), causal over the whole sequence, positions from ``first_position``."""
    layer = config["transformer_layer_config"]
    eps = layer["rms_norm_eps"]
    positions = np.arange(first_position, first_position + len(tokens), dtype=np.float64)
    h = hidden_in
    for i in range(layer["num_hidden_layers"]):
        w = {k.removeprefix(f"layers.{i}."): v for k, v in weights.items() if k.startswith(f"layers.{i}.")}
        if i == 0:
            g = _rms(h, w["hidden_norm.weight"], eps)
            residual = g if config["norm_before_residual"] else h
            x = np.concatenate([_rms(embed[tokens], w["input_layernorm.weight"], eps), g], axis=-1)
        else:
            residual, x = h, _rms(h, w["input_layernorm.weight"], eps)
        h = residual + _causal_attention(x, w, layer, positions)
        y = _rms(h, w["post_attention_layernorm.weight"], eps)
        gate, up = y @ w["mlp.gate_proj.weight"].T, y @ w["mlp.up_proj.weight"].T
        h = h + (gate / (1.0 + np.exp(-gate)) * up) @ w["mlp.down_proj.weight"].T
    return h


def eagle3_project(weights: dict, config: dict, taps: np.ndarray) -> np.ndarray:
    """The joined target taps [T, 3 Ht] through ``input_norm`` (with ``norm_before_fc``) and ``fc``."""
    if config.get("norm_before_fc"):
        taps = _rms(taps, weights["input_norm.weight"], config["transformer_layer_config"]["rms_norm_eps"])
    return taps @ weights["fc.weight"].T


def eagle3_target_logits(weights: dict, config: dict, hidden: np.ndarray) -> np.ndarray:
    """Logits [T, V] on the target vocabulary (-inf off the draft vocabulary), through ``d2t``."""
    eps = config["transformer_layer_config"]["rms_norm_eps"]
    draft = _rms(hidden, weights["norm.weight"], eps) @ weights["lm_head.weight"].T
    if "d2t" not in weights:
        return draft
    out = np.full((hidden.shape[0], config["transformer_layer_config"]["vocab_size"]), -np.inf)
    out[:, np.arange(draft.shape[1]) + weights["d2t"].astype(np.int64)] = draft
    return out


# --------------------------------------------------------------------------- DSpark

DSPARK_RANK = 8


def dspark_config(
    vocab_size: int, target_layer_ids: list[int], num_target_layers: int, *, sample_from_anchor: bool = True
) -> dict:
    """A canonical DSpark config: the DFlash keys plus ``projector_type`` dspark, the Markov rank,
    the confidence head; ``block_size`` 3 proposals (mlx-vlm's verification width 4)."""
    config = dflash_config(
        vocab_size, target_layer_ids, num_target_layers, architectures=["DSparkDraftModel"]
    )
    config.pop("block_size")
    config["dflash_config"] |= {
        "projector_type": "dspark",
        "block_size": 3,
        "num_target_layers": num_target_layers,
        "markov_rank": DSPARK_RANK,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "sample_from_anchor": sample_from_anchor,
    }
    return config


def dspark_tensors(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed + 1000)
    h, vocab = config["hidden_size"], config["vocab_size"]
    out = dflash_tensors(config, seed)
    out["markov_head.markov_w1.weight"] = rng.standard_normal((vocab, DSPARK_RANK)).astype(np.float32)
    out["markov_head.markov_w2.weight"] = (
        rng.standard_normal((vocab, DSPARK_RANK)) / np.sqrt(DSPARK_RANK)
    ).astype(np.float32)
    out["confidence_head.proj.weight"] = (rng.standard_normal((1, h + DSPARK_RANK)) / np.sqrt(h)).astype(
        np.float32
    )
    out["confidence_head.proj.bias"] = rng.standard_normal(1).astype(np.float32)
    return out


def dspark_step(
    weights: dict[str, np.ndarray], hidden: np.ndarray, lm_head: np.ndarray, previous: np.ndarray
) -> tuple:
    """One row's draft logits [P, V] and confidence [P] from the block's final hidden [P, H] and
    each draft's previous token [P]."""
    prev = weights["markov_head.markov_w1.weight"][previous]
    logits = hidden @ lm_head.T + prev @ weights["markov_head.markov_w2.weight"].T
    z = (
        np.concatenate([hidden, prev], axis=-1) @ weights["confidence_head.proj.weight"].T
        + weights["confidence_head.proj.bias"]
    )
    return logits, 1.0 / (1.0 + np.exp(-z[:, 0]))


# --------------------------------------------------------------------------- DFlash2

DFLASH2 = {"conv_kernel_size": 3, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 6}


def dflash2_config(vocab_size: int, target_layer_ids: list[int], num_target_layers: int) -> dict:
    """A DFlash2 config as published (``architectures`` DFlash2DraftModel, the sizes in ``dflash_config``)."""
    config = dflash_config(
        vocab_size, target_layer_ids, num_target_layers, architectures=["DFlash2DraftModel"]
    )
    config.pop("block_size")
    config["dflash_config"] |= {
        "block_size": 4,
        "input_embedding_scale": 1.5,
        "output_multiplier": 0.75,
        **DFLASH2,
    }
    return config


def dflash2_tensors(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """DFlash's tensors plus the convolutions and the selector (its codebooks without ``.weight``)."""
    rng = np.random.default_rng(seed + 2000)
    h, vocab = config["hidden_size"], config["vocab_size"]
    k, g, r = DFLASH2["conv_kernel_size"], h // DFLASH2["conv_group_size"], DFLASH2["selector_rank"]
    out = dflash_tensors(config, seed)
    for i in range(config["num_hidden_layers"]):
        for name in ("attention_conv", "mlp_conv"):
            out[f"layers.{i}.{name}.base_kernel"] = (rng.standard_normal((2, k, h)) * 0.5).astype(np.float32)
            out[f"layers.{i}.{name}.kernel_projection.weight"] = (
                rng.standard_normal((2 * k * g, h)) * 0.1
            ).astype(np.float32)
    out["candidate_selector.predecessor_codebook"] = rng.standard_normal((vocab, r)).astype(np.float32)
    out["candidate_selector.successor_codebook"] = rng.standard_normal((vocab, r)).astype(np.float32)
    out["candidate_selector.hidden_projection.weight"] = (rng.standard_normal((r, h)) / np.sqrt(h)).astype(
        np.float32
    )
    return out


def dflash2_scores(
    weights: dict, logits: np.ndarray, hidden: np.ndarray, previous: np.ndarray, top_k: int
) -> np.ndarray:
    """One row's selector scores [P, V]: logit + edge on each position's top-k tokens, -inf elsewhere."""
    out = np.full(logits.shape, -np.inf)
    projected = hidden @ weights["candidate_selector.hidden_projection.weight"].T
    for p in range(logits.shape[0]):
        top = np.argsort(logits[p])[-top_k:]
        pred = weights["candidate_selector.predecessor_codebook"][previous[p]]
        succ = weights["candidate_selector.successor_codebook"][top]
        out[p, top] = logits[p, top] + succ @ (pred * projected[p])
    return out
