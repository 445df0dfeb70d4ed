"""NumPy float64 building blocks for independent MTP-head references (tests only).

Each function is the published modeling code's math on plain arrays: rows are sequence
positions ``offset, offset+1, ...``, weights are checkpoint tensors in Hugging Face layout
(``[out, in]``), read with ``read_tensors`` straight from the written safetensors files, never
through mtplx's head modules. Sources, for the facts only: HF transformers
``modeling_deepseek_v3.py`` / ``modeling_longcat_flash.py`` (MLA, the latent LoRA scales),
``modeling_glm4_moe.py`` (the sigmoid-routed MoE), ``modeling_mimo_v2_flash.py`` and vLLM ``model_executor/models/mimo_v2_flash.py`` (partial rope,
sliding window, attention sinks, value scale), mlx-lm ``models/base.py`` (sinks join the softmax
denominator as one extra logit per head) and ``mlx.nn.RoPE`` (``traditional`` = adjacent pairs).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np


def read_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint directory ``path`` (every shard) as float64, by its checkpoint
    name; read with ``mx.load``, which also reads bfloat16 (exactly widened to float32 first)."""
    out: dict[str, np.ndarray] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(
            {k: np.asarray(v.astype(mx.float32), dtype=np.float64) for k, v in mx.load(str(f)).items()}
        )
    return out


def rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: ``x / sqrt(mean(x^2) + eps) * w``."""
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def swiglu_mlp(x: np.ndarray, t: dict[str, np.ndarray], prefix: str) -> np.ndarray:
    """``down(silu(gate(x)) * up(x))`` with ``{prefix}{gate,up,down}_proj.weight``."""
    gate, up = x @ t[prefix + "gate_proj.weight"].T, x @ t[prefix + "up_proj.weight"].T
    return (silu(gate) * up) @ t[prefix + "down_proj.weight"].T


def sigmoid_moe(x: np.ndarray, t: dict[str, np.ndarray], p: str, cfg: dict) -> np.ndarray:
    """DeepSeek-V3 / GLM-4.5 MoE (HF ``modeling_glm4_moe.py``, ``n_group`` 1): sigmoid router
    scores; the top ``num_experts_per_tok`` by score + ``gate.e_score_correction_bias`` are
    chosen, weighted by their uncorrected scores (normalised to sum 1 with ``norm_topk_prob``)
    times ``routed_scaling_factor``; plus the shared experts. Per-expert HF tensors
    ``{p}experts.{e}.*``, ``{p}shared_experts.*``, ``{p}gate.weight``."""
    if cfg.get("n_group", 1) != 1:
        raise ValueError("sigmoid_moe covers n_group == 1 only")
    scores = 1.0 / (1.0 + np.exp(-(x @ t[p + "gate.weight"].T)))  # [T, experts]
    chosen = np.argsort(-(scores + t[p + "gate.e_score_correction_bias"]), axis=-1, kind="stable")
    chosen = chosen[:, : cfg["num_experts_per_tok"]]
    weights = np.take_along_axis(scores, chosen, -1)
    if cfg["num_experts_per_tok"] > 1 and cfg.get("norm_topk_prob"):
        weights = weights / weights.sum(-1, keepdims=True)
    weights = weights * cfg.get("routed_scaling_factor", 1.0)
    out = np.zeros_like(x)
    for row in range(x.shape[0]):
        for e, w in zip(chosen[row], weights[row]):
            out[row] += w * swiglu_mlp(x[row : row + 1], t, f"{p}experts.{e}.")[0]
    return out + swiglu_mlp(x, t, p + "shared_experts.") if cfg.get("n_shared_experts") else out


def routing_margin(x: np.ndarray, t: dict[str, np.ndarray], p: str, k: int) -> float:
    """The smallest gap, over rows, between the k-th and (k+1)-th corrected router score: a
    float32 router can pick other experts than the float64 reference only near a tie."""
    scores = 1.0 / (1.0 + np.exp(-(x @ t[p + "gate.weight"].T))) + t[p + "gate.e_score_correction_bias"]
    ranked = -np.sort(-scores, axis=-1)
    return float((ranked[:, k - 1] - ranked[:, k]).min())


def rope(x: np.ndarray, dims: int, base: float, traditional: bool, offset: int = 0) -> np.ndarray:
    """x [T, heads, d]: the first ``dims`` features rotated by position ``offset + row``;
    ``traditional``: pairs (2i, 2i+1), else halves (i, i + dims/2). The rest passes through."""
    positions = offset + np.arange(x.shape[0])
    inv_freq = base ** (-np.arange(0, dims, 2) / dims)
    angle = positions[:, None] * inv_freq[None]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    r, rest = x[..., :dims], x[..., dims:]
    if traditional:
        a, b = r[..., 0::2], r[..., 1::2]
        out = np.empty_like(r)
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
    else:
        a, b = r[..., : dims // 2], r[..., dims // 2 :]
        out = np.concatenate([a * cos - b * sin, a * sin + b * cos], -1)
    return np.concatenate([out, rest], -1)


def causal_mask(length: int, window: int | None = None) -> np.ndarray:
    """[T, T] bool, True where query row i may read key column j: ``j <= i`` and, with a
    sliding ``window``, ``i - j < window`` (the query itself and the window-1 keys before it)."""
    i, j = np.arange(length)[:, None], np.arange(length)[None]
    allowed = j <= i
    return allowed & (i - j < window) if window else allowed


def softmax_attention(
    scores: np.ndarray, v: np.ndarray, mask: np.ndarray, sinks: np.ndarray | None = None
) -> np.ndarray:
    """scores [heads, T, T] (already scaled), v [T, heads, dv] -> [T, heads * dv].

    ``sinks`` [heads]: one extra logit per head in every row's softmax denominator, attending
    to nothing (its probability mass is dropped)."""
    scores = np.where(mask[None], scores, -np.inf)
    top = scores.max(-1, keepdims=True)
    if sinks is not None:
        top = np.maximum(top, sinks[:, None, None])
    p = np.exp(scores - top)
    denominator = p.sum(-1, keepdims=True)
    if sinks is not None:
        denominator = denominator + np.exp(sinks[:, None, None] - top)
    p /= denominator
    return np.einsum("hqk,khd->qhd", p, v).reshape(v.shape[0], -1)


def gqa_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    scale: float,
    mask: np.ndarray,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """q [T, heads, d], k [T, kv_heads, d], v [T, kv_heads, dv]; each kv head serves
    ``heads / kv_heads`` consecutive query heads. -> [T, heads * dv]."""
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    return softmax_attention(np.einsum("qhd,khd->hqk", q, k) * scale, v, mask, sinks)


def mla_attention(
    x: np.ndarray,
    t: dict[str, np.ndarray],
    p: str,
    cfg: dict,
    *,
    latent_eps: float,
    q_scale: float = 1.0,
    kv_scale: float = 1.0,
) -> np.ndarray:
    """Multi-head latent attention (DeepSeek-V2/V3, LongCat-Flash), causal, positions 0..T-1,
    with the checkpoint's fused ``kv_b_proj`` [heads * (nope + v), kv_lora] under prefix ``p``.

    q = q_b(norm(q_a(x))) * q_scale; latent = norm(kv_a(x)[:kv_lora]) * kv_scale; rope
    (interleaved pairs) on q's last ``qk_rope_head_dim`` features and on the one shared k_pe.
    LongCat-Flash's ``mla_scale_{q,kv}_lora`` are ``q_scale`` / ``kv_scale``. -> after o_proj."""
    nh, nope, rd, vd = (
        cfg[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    )
    rank, T = cfg["kv_lora_rank"], x.shape[0]
    q = rms(x @ t[p + "q_a_proj.weight"].T, t[p + "q_a_layernorm.weight"], latent_eps)
    q = (q @ t[p + "q_b_proj.weight"].T).reshape(T, nh, nope + rd) * q_scale
    kv = x @ t[p + "kv_a_proj_with_mqa.weight"].T
    latent = rms(kv[:, :rank], t[p + "kv_a_layernorm.weight"], latent_eps) * kv_scale
    kvb = (latent @ t[p + "kv_b_proj.weight"].T).reshape(T, nh, nope + vd)
    k_nope, v = kvb[..., :nope], kvb[..., nope:]
    q_pe = rope(q[..., nope:], rd, cfg["rope_theta"], True)
    k_pe = rope(kv[:, rank:].reshape(T, 1, rd), rd, cfg["rope_theta"], True)[:, 0]
    scores = np.einsum("qhd,khd->hqk", q[..., :nope], k_nope) + np.einsum("qhd,kd->hqk", q_pe, k_pe)
    out = softmax_attention(scores * (nope + rd) ** -0.5, v, causal_mask(T))
    return out @ t[p + "o_proj.weight"].T


def fuse_inputs(
    embedded: np.ndarray,
    hidden: np.ndarray,
    w_embed_norm: np.ndarray,
    w_hidden_norm: np.ndarray,
    w_proj: np.ndarray,
    eps: float,
    *,
    hidden_first: bool = False,
) -> np.ndarray:
    """The MTP input: ``proj(concat([norm(e), norm(h)]))`` (embedding first, as DeepSeek,
    Qwen3-Next, LongCat, ERNIE, Step-3.5, MiMo-V2-Flash; ``hidden_first`` for MiMo)."""
    parts = [rms(embedded, w_embed_norm, eps), rms(hidden, w_hidden_norm, eps)]
    return np.concatenate(parts[::-1] if hidden_first else parts, -1) @ w_proj.T


def zero_position_zero(embedded: np.ndarray, offset: int = 0) -> np.ndarray:
    """The embedding with sequence position 0's row zeroed (vLLM ``deepseek_mtp.py`` / ``mimo_mtp.py`` /
    ``ernie_mtp.py``: ``inputs_embeds[positions == 0] = 0``); rows are positions ``offset, ...``."""
    out = embedded.copy()
    if offset == 0:
        out[0] = 0.0
    return out


# --------------------------------------------------------------------------- OCP microscaling bytes


def e4m3(byte: np.ndarray) -> np.ndarray:
    """OCP FP8 E4M3FN bytes -> float64: sign, 4 exponent bits (bias 7), 3 mantissa bits;
    exponent 0 is subnormal (m / 8 * 2^-6)."""
    b = byte.astype(np.int64) & 0xFF
    sign = np.where(b >> 7, -1.0, 1.0)
    exponent, mantissa = (b >> 3) & 0xF, b & 7
    normal = (1 + mantissa / 8) * 2.0 ** (exponent - 7)
    return sign * np.where(exponent == 0, mantissa / 8 * 2.0**-6, normal)


def e2m1_pairs(byte: np.ndarray, low_first: bool = True) -> np.ndarray:
    """OCP FP4 E2M1 bytes [..., n/2] -> float64 [..., n], two elements a byte (the first in the low
    nibble unless ``low_first`` is off): sign, 2 exponent bits (bias 1), 1 mantissa bit; exponent
    0 is subnormal (m / 2): the values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives."""
    b = byte.astype(np.int64) & 0xFF
    nibbles = [b & 0xF, b >> 4] if low_first else [b >> 4, b & 0xF]
    out = np.stack(nibbles, -1).reshape(*b.shape[:-1], -1)
    sign = np.where(out >> 3, -1.0, 1.0)
    exponent, mantissa = (out >> 1) & 3, out & 1
    return sign * np.where(exponent == 0, mantissa / 2, (1 + mantissa / 2) * 2.0 ** (exponent - 1))


def e8m0(byte: np.ndarray) -> np.ndarray:
    """OCP E8M0 scale bytes -> 2^(b - 127)."""
    return 2.0 ** ((byte.astype(np.int64) & 0xFF) - 127)
