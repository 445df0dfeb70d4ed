"""A tiny random-weight Gemma 4 target and its assistant drafter, written as the Hugging Face
checkpoints are (``model_type`` ``gemma4`` with ``model.language_model.*`` tensors;
``gemma4_assistant`` with ``model.*``, ``pre_projection``, ``post_projection``,
``masked_embedding.*``), plus a NumPy float64 forward of the assistant written from the
transformers / mlx-vlm reference (not from mtplx's module).

The target has sliding-window and full-attention layers, per-layer inputs (as E2B/E4B) and
KV sharing: its last two layers own no cache and reuse the KV of the last earlier layer of
their type, which is also what the assistant reads.
"""

from __future__ import annotations

from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from tiny_checkpoints import randomize, write_checkpoint

H = 32  # target hidden size
DRAFT_H = 16
WINDOW = 8
ROPE = {
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
}
TARGET_LAYER_TYPES = [
    "sliding_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention",
]
DRAFT_LAYER_TYPES = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]


def target_config(vocab_size: int) -> dict:
    text = {
        "model_type": "gemma4_text",
        "hidden_size": H,
        "num_hidden_layers": len(TARGET_LAYER_TYPES),
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "head_dim": 8,
        "global_head_dim": 16,
        "num_key_value_heads": 2,
        "num_kv_shared_layers": 2,
        "hidden_size_per_layer_input": 4,
        "vocab_size_per_layer_input": vocab_size,
        "sliding_window": WINDOW,
        "layer_types": TARGET_LAYER_TYPES,
        "rope_parameters": ROPE,
        "rms_norm_eps": 1e-6,
        "final_logit_softcapping": 30.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "vocab_size": vocab_size,
    }
    return {
        "model_type": "gemma4",
        "architectures": ["Gemma4ForConditionalGeneration"],
        "text_config": text,
        "vocab_size": vocab_size,
        "tie_word_embeddings": True,
    }


def gemma4_target(path: Path, vocab_size: int = 64, seed: int = 0, context_strength: float = 1.0):
    """Writes the target; ``context_strength`` scales the attention output projections (a strong
    context part makes cache bugs change the output)."""
    from mlx_lm.models import gemma4

    config = target_config(vocab_size)
    model = gemma4.Model(gemma4.ModelArgs.from_dict(config))
    randomize(model, seed)
    tensors = {}
    for name, v in tree_flatten(model.parameters()):
        if name.endswith("o_proj.weight"):
            v = v * context_strength
        tensors["model.language_model." + name[len("language_model.model.") :]] = v
    return write_checkpoint(path, tensors, config)


def assistant_config(vocab_size: int, ordered: bool, num_centroids: int, top_k: int) -> dict:
    return {
        "model_type": "gemma4_assistant",
        "architectures": ["Gemma4AssistantForCausalLM"],
        "backbone_hidden_size": H,
        "use_ordered_embeddings": ordered,
        "num_centroids": num_centroids,
        "centroid_intermediate_top_k": top_k,
        "tie_word_embeddings": True,
        "block_size": 4,
        "text_config": {
            "model_type": "gemma4_text",
            "hidden_size": DRAFT_H,
            "num_hidden_layers": len(DRAFT_LAYER_TYPES),
            "intermediate_size": 32,
            "num_attention_heads": 4,
            "head_dim": 8,
            "global_head_dim": 16,
            "num_key_value_heads": 2,
            "num_kv_shared_layers": len(DRAFT_LAYER_TYPES),
            "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0,
            "use_double_wide_mlp": False,
            "enable_moe_block": False,
            "sliding_window": WINDOW,
            "layer_types": DRAFT_LAYER_TYPES,
            "rope_parameters": ROPE,
            "rms_norm_eps": 1e-6,
            "vocab_size": vocab_size,
            "max_position_embeddings": 512,
        },
    }


def _head_dim(kind: str) -> int:
    return 16 if kind == "full_attention" else 8


def gemma4_assistant(
    path: Path,
    vocab_size: int = 64,
    *,
    ordered: bool = False,
    num_centroids: int = 8,
    top_k: int = 2,
    seed: int = 1,
    scale: float = 1.0,
    backbone_hidden_size: int | None = None,
):
    """The assistant checkpoint with HF tensor names (including the unused k_proj/k_norm of its
    KV-shared layers and an int64 ``token_ordering``)."""
    rng = np.random.default_rng(seed)
    config = assistant_config(vocab_size, ordered, num_centroids, top_k)
    if backbone_hidden_size is not None:
        config["backbone_hidden_size"] = backbone_hidden_size
    backbone = config["backbone_hidden_size"]

    def w(rows, cols):
        return scale * rng.standard_normal((rows, cols)) / np.sqrt(cols)

    def norm(n):
        return 1.0 + 0.3 * rng.standard_normal(n)

    t: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.standard_normal((vocab_size, DRAFT_H)) / np.sqrt(DRAFT_H),
        "model.norm.weight": norm(DRAFT_H),
        "pre_projection.weight": w(DRAFT_H, 2 * backbone),
        "post_projection.weight": w(backbone, DRAFT_H),
    }
    for i, kind in enumerate(DRAFT_LAYER_TYPES):
        p, hd = f"model.layers.{i}.", _head_dim(kind)
        t[p + "self_attn.q_proj.weight"] = w(4 * hd, DRAFT_H)
        t[p + "self_attn.q_norm.weight"] = norm(hd)
        t[p + "self_attn.o_proj.weight"] = w(DRAFT_H, 4 * hd)
        t[p + "self_attn.k_proj.weight"] = w(2 * hd, DRAFT_H)  # unused by a KV-shared layer
        t[p + "self_attn.k_norm.weight"] = norm(hd)
        for n in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            t[p + n + ".weight"] = norm(DRAFT_H)
        t[p + "mlp.gate_proj.weight"] = w(32, DRAFT_H)
        t[p + "mlp.up_proj.weight"] = w(32, DRAFT_H)
        t[p + "mlp.down_proj.weight"] = w(DRAFT_H, 32)
        t[p + "layer_scalar"] = rng.uniform(0.5, 1.5, (1,))
    if ordered:
        t["masked_embedding.centroids.weight"] = w(num_centroids, DRAFT_H)
    tensors = {k: mx.array(v.astype(np.float32)) for k, v in t.items()}
    if ordered:
        tensors["masked_embedding.token_ordering"] = mx.array(rng.permutation(vocab_size).astype(np.int64))
    return write_checkpoint(path, tensors, config)


# ------------------------------------------------------------------ NumPy float64 reference


def _rms(x: np.ndarray, w: np.ndarray | None, eps: float = 1e-6) -> np.ndarray:
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return y if w is None else y * w


def _rope(x: np.ndarray, position: int, kind: str) -> np.ndarray:
    """Half-split RoPE; full layers rotate only the first ``partial_rotary_factor`` of the pairs."""
    d = x.shape[-1]
    cfg = ROPE[kind]
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


def write_word_tokenizer(path: Path, vocab_size: int) -> None:
    """A whitespace word-level tokenizer over ``w0 .. w{V-1}`` (eos = w1), so the engine can load
    the tiny target like a real model."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "w1", "unk_token": "w0"}'
    )
