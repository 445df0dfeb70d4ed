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

import mlx.core as mx
import numpy as np

DFLASH_HIDDEN, DFLASH_HEADS, DFLASH_KV_HEADS, DFLASH_HEAD_DIM = 32, 4, 2, 8


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
    """The tensors of a written replica as float64 (the bfloat16 values exactly)."""
    return {
        k.removeprefix("model."): np.array(v.astype(mx.float32)).astype(np.float64)
        for k, v in mx.load(str(path / "model.safetensors")).items()
    }


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
        h = h + att.transpose(1, 0, 2).reshape(L, -1) @ w["self_attn.o_proj.weight"].T
        y = _rms(h, w["post_attention_layernorm.weight"], eps)
        gate, up = y @ w["mlp.gate_proj.weight"].T, y @ w["mlp.up_proj.weight"].T
        h = h + (gate / (1.0 + np.exp(-gate)) * up) @ w["mlp.down_proj.weight"].T
    return _rms(h, weights["norm.weight"], eps) @ lm_head.T
