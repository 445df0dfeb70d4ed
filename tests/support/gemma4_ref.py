"""A NumPy float64 forward of the Gemma 4 assistant drafter, written from the transformers /
mlx-vlm reference (not from mtplx's module), over the tensors ``checkpoints.gemma4_assistant``
writes."""

from __future__ import annotations

import numpy as np

from support.models import GEMMA4_ROPE


def _rms(x: np.ndarray, w: np.ndarray | None, eps: float = 1e-6) -> np.ndarray:
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return y if w is None else y * w


def _rope(x: np.ndarray, position: int, kind: str) -> np.ndarray:
    """Half-split RoPE; full layers rotate only the first ``partial_rotary_factor`` of the pairs."""
    d = x.shape[-1]
    cfg = GEMMA4_ROPE[kind]
    rotated = int(d * cfg.get("partial_rotary_factor", 1.0)) if cfg["rope_type"] == "proportional" else d
    inv = np.zeros(d // 2)
    inv[: rotated // 2] = cfg["rope_theta"] ** (-np.arange(0, rotated, 2) / d)
    angle = position * inv
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([a * np.cos(angle) - b * np.sin(angle), a * np.sin(angle) + b * np.cos(angle)], -1)


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def reference_forward(
    t: dict[str, np.ndarray],
    config: dict,
    token_embedding: np.ndarray,
    hidden: np.ndarray,
    kv: dict[str, tuple[np.ndarray, np.ndarray]],
    position: int,
    fill: str = "floor",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One drafter step in float64. ``token_embedding``: the target's scaled embedding of the
    token [H]; ``hidden``: [H]; ``kv[kind]`` = (keys, values) [kv_heads, S, d] already cut to
    the positions this layer attends to. Returns (normed hidden, projected, logits)."""
    t = {k: np.asarray(v, dtype=np.float64) for k, v in t.items()}
    x = t["pre_projection.weight"] @ np.concatenate([token_embedding, hidden])
    for i, kind in enumerate(config["text_config"]["layer_types"]):
        p = f"model.layers.{i}."
        keys, values = (np.asarray(a, dtype=np.float64) for a in kv[kind])
        h = _rms(x, t[p + "input_layernorm.weight"])
        q = (t[p + "self_attn.q_proj.weight"] @ h).reshape(4, -1)
        q = _rope(_rms(q, t[p + "self_attn.q_norm.weight"]), position, kind)
        group = q.shape[0] // keys.shape[0]
        out = []
        for head in range(q.shape[0]):
            s = keys[head // group] @ q[head]  # attention scale 1.0 (q/k norms instead)
            a = np.exp(s - s.max())
            out.append((a / a.sum()) @ values[head // group])
        o = t[p + "self_attn.o_proj.weight"] @ np.concatenate(out)
        x = x + _rms(o, t[p + "post_attention_layernorm.weight"])
        h = _rms(x, t[p + "pre_feedforward_layernorm.weight"])
        m = t[p + "mlp.down_proj.weight"] @ (
            _gelu_tanh(t[p + "mlp.gate_proj.weight"] @ h) * (t[p + "mlp.up_proj.weight"] @ h)
        )
        x = (x + _rms(m, t[p + "post_feedforward_layernorm.weight"])) * t[p + "layer_scalar"][0]
    h = _rms(x, t["model.norm.weight"])
    projected = t["post_projection.weight"] @ h
    logits = t["model.embed_tokens.weight"] @ h
    if config["use_ordered_embeddings"]:
        n, k = config["num_centroids"], config["centroid_intermediate_top_k"]
        top = np.argsort(t["masked_embedding.centroids.weight"] @ h)[-k:]
        groups = t["masked_embedding.token_ordering"].astype(np.int64).reshape(n, -1)
        candidates = groups[top].reshape(-1)
        floor = logits[candidates].min() - 1.0 if fill == "floor" else -np.inf
        masked = np.full_like(logits, floor)
        masked[candidates] = logits[candidates]
        logits = masked
    return h, projected, logits
