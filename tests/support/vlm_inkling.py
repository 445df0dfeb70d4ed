"""A tiny Inkling (``inkling``) checkpoint written as the published one is (mlx-vlm 0.7.10's
``models/inkling``; its ``Model.sanitize`` read backwards), and the same trunk in memory.

Config: a top-level ``text_config`` / ``vision_config`` / ``audio_config`` (mlx-vlm's
``ModelConfig``), the text keys those of its ``TextConfig``: a sliding-window layer (window 4,
its relative-position band = the window), a global layer (band 8, log-scaled queries from
position 4), another sliding one; a dense first MLP and sigmoid-routed MoE after (4 routed
experts, one shared); logits divided by a width multiplier of 2; one MTP layer, a sliding one
(``mtp_local_layer_ids`` [0]). Tensor names: ``model.llm.{embed,unembed,embed_norm,norm}``,
``model.llm.layers.{i}.attn.{wq_du,wk_dv,wv_dv,wr_du,wo_ud}`` (the separate q/k/v/r
projections mlx-vlm fuses), ``attn.{k,v}_sconv`` / ``{attn,mlp}_sconv`` [C, 1, K],
``attn.rel_logits_proj``, ``attn_norm`` / ``mlp_norm``, the dense MLP's interleaved gate/up
``mlp.w13_dn`` and ``mlp.w2_md``, the MoE's ``mlp.gate.{weight,bias}``, ``mlp.global_scale``,
``mlp.experts.w13_weight`` [E, 2I, H] (gate and up interleaved by row) / ``w2_weight`` and
``mlp.shared_experts.shared_w{13,2}_weight``; the MTP layer under ``model.mtp.layers.0.``
(``embed_norm`` / ``hidden_norm`` / ``input_proj`` and the decoder layer under
``transformer_block.``, as mlx-vlm's ``inkling_mtp`` drafter reads them), its final norm the
trunk's ``model.llm.norm``. Float32 throughout (published: bfloat16 / NVFP4 experts), so the
NumPy float64 reference compares tightly. The vision and audio towers are declared, not shipped.
"""

from __future__ import annotations

from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from support.checkpoints import Tiny, write_checkpoint
from support.models import randomize, scale_outputs

INKLING_VOCAB = 96
INKLING_HIDDEN = 64
MUP_WIDTH = 2.0


def inkling_config(layers: int = 3) -> dict:
    """Inkling shrunk (see the module docstring)."""
    text = {
        "model_type": "inkling",
        "hidden_size": INKLING_HIDDEN,
        "num_hidden_layers": layers,
        "vocab_size": INKLING_VOCAB,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "use_embed_norm": True,
        "logits_mup_width_multiplier": MUP_WIDTH,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "swa_num_attention_heads": 2,
        "swa_num_key_value_heads": 2,
        "swa_head_dim": 16,
        "sliding_window_size": 4,
        "layer_types": ["hybrid_sliding" if i % 2 == 0 else "hybrid" for i in range(layers)],
        "d_rel": 4,
        "rel_extent": 8,
        "log_scaling_n_floor": 4,
        "log_scaling_alpha": 0.1,
        "sconv_kernel_size": 4,
        "mlp_layer_types": ["dense"] + ["sparse"] * (layers - 1),
        "intermediate_size": 32,
        "dense_intermediate_size": 64,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "route_scale": 2.0,
        "num_nextn_predict_layers": 1,
        "mtp_local_layer_ids": [0],
        "max_position_embeddings": 512,
        "eos_token_id": 1,  # support.tokenizer.word_level's EOS
    }
    return {
        "model_type": "inkling",
        "architectures": ["InklingForConditionalGeneration"],
        "text_config": text,
        "vision_config": {"model_type": "inkling_vision", "patch_size": 4, "n_layers": 2},
        "audio_config": {"model_type": "inkling_audio", "n_mel_bins": 8, "mel_vocab_size": 4},
        "vocab_size": INKLING_VOCAB,
        "image_token_id": 90,
        "audio_token_id": 91,
        "eos_token_id": [1],
    }


def _text_args(config: dict):
    from mlx_vlm.models.inkling.config import ModelConfig

    return ModelConfig.from_dict(config).text_config


def _conv(w: mx.array) -> mx.array:
    """MLX's depthwise conv weight [C, K, 1] -> the published [C, 1, K]."""
    return w.transpose(0, 2, 1)


def _interleaved(gate: mx.array, up: mx.array) -> mx.array:
    """gate / up [..., I, H] -> the published fused [..., 2I, H], gate and up alternating by row."""
    return mx.stack([gate, up], axis=-2).reshape(*gate.shape[:-2], -1, gate.shape[-1])


def published_layer(prefix: str, layer: nn.Module) -> dict[str, mx.array]:
    """One mlx-vlm ``InklingDecoderLayer``'s parameters under the published names."""
    attn, mlp = layer.self_attn, layer.mlp
    q, k, v, r = mx.split(attn.qkvr_proj.weight, list(_cumulative(attn.qkvr_dims)), axis=0)
    out = {
        f"{prefix}attn.wq_du.weight": q,
        f"{prefix}attn.wk_dv.weight": k,
        f"{prefix}attn.wv_dv.weight": v,
        f"{prefix}attn.wr_du.weight": r,
        f"{prefix}attn.wo_ud.weight": attn.o_proj.weight,
        f"{prefix}attn.q_norm.weight": attn.q_norm.weight,
        f"{prefix}attn.k_norm.weight": attn.k_norm.weight,
        f"{prefix}attn.k_sconv.weight": _conv(attn.k_sconv.conv.weight),
        f"{prefix}attn.v_sconv.weight": _conv(attn.v_sconv.conv.weight),
        f"{prefix}attn.rel_logits_proj.weight": attn.rel_proj,
        f"{prefix}attn_norm.weight": layer.input_layernorm.weight,
        f"{prefix}mlp_norm.weight": layer.post_attention_layernorm.weight,
        f"{prefix}attn_sconv.weight": _conv(layer.attn_sconv.conv.weight),
        f"{prefix}mlp_sconv.weight": _conv(layer.mlp_sconv.conv.weight),
        f"{prefix}mlp.global_scale": mlp.global_scale,
    }
    if "switch_mlp" not in mlp:  # the dense MLP
        out[f"{prefix}mlp.w13_dn.weight"] = _interleaved(mlp.gate_proj.weight, mlp.up_proj.weight)
        out[f"{prefix}mlp.w2_md.weight"] = mlp.down_proj.weight
        return out
    experts, shared = mlp.switch_mlp, mlp.shared_experts
    out[f"{prefix}mlp.gate.weight"] = mlp.gate_weight
    out[f"{prefix}mlp.gate.bias"] = mlp.e_score_correction_bias
    out[f"{prefix}mlp.experts.w13_weight"] = _interleaved(experts.gate_proj.weight, experts.up_proj.weight)
    out[f"{prefix}mlp.experts.w2_weight"] = experts.down_proj.weight
    n, inter, hidden = mlp.n_shared, mlp.intermediate_size, shared.down_proj.weight.shape[0]
    shared_gate = shared.gate_proj.weight.reshape(n, inter, hidden)
    shared_up = shared.up_proj.weight.reshape(n, inter, hidden)
    out[f"{prefix}mlp.shared_experts.shared_w13_weight"] = _interleaved(shared_gate, shared_up)
    out[f"{prefix}mlp.shared_experts.shared_w2_weight"] = shared.down_proj.weight.reshape(
        hidden, n, inter
    ).transpose(1, 0, 2)
    return out


def _cumulative(dims) -> list[int]:
    """Split points of the fused q/k/v/r rows (all but the last boundary)."""
    points, total = [], 0
    for d in dims[:-1]:
        total += d
        points.append(total)
    return points


def _language_model(config: dict, seed: int):
    from mlx_vlm.models.inkling.language import LanguageModel

    model = LanguageModel(_text_args(config))
    randomize(model, seed)
    ones = []
    for name, p in tree_flatten(model.parameters()):
        if name.endswith(("switch_mlp.gate_scale", "switch_mlp.out_scale")):
            ones.append((name, mx.ones_like(p)))  # unquantized experts: mlx-vlm's sanitize writes ones
    model.load_weights(ones, strict=False)
    return model


def inkling_mtp_block(config: dict) -> nn.Module:
    """mlx-vlm's Inkling MTP drafter's block 0 (what the checkpoint ships under ``model.mtp.layers.0.``)."""
    from mlx_vlm.speculative.drafters.inkling_mtp.config import InklingMTPConfig
    from mlx_vlm.speculative.drafters.inkling_mtp.inkling_mtp import InklingMTPDraftModel

    drafter = InklingMTPDraftModel(InklingMTPConfig.from_dict({"text_config": config["text_config"]}))
    return drafter.blocks[0]


def tiny_inkling(vocab_size: int = INKLING_VOCAB, *, seed: int = 0):
    """An in-memory Inkling trunk as mtplx hosts it (float32, random weights, mlx-vlm's caches)."""
    from mtplx.trunk.vlm_text import VlmTextModel

    config = inkling_config()
    config["vocab_size"] = config["text_config"]["vocab_size"] = vocab_size
    wrapped = VlmTextModel(_language_model(config, seed), "inkling")
    wrapped.eval()
    return wrapped


def inkling(
    path: Path, *, seed: int = 0, context_strength: float | None = None, ship_mtp: bool = True
) -> Tiny:
    """An Inkling checkpoint (the module docstring). ``context_strength``: the layers' output
    projections scaled by it and the MTP layer started from reading the next token's embedding
    alone (``input_proj`` = [0, I]: the hidden state comes first) through the trunk's embedding
    norm, so its drafts agree with the trunk's bigram part and some are kept. ``ship_mtp`` off:
    the config still declares the MTP layer but none of its tensors is written."""
    config = inkling_config()
    model = _language_model(config, seed)
    if context_strength is not None:
        scale_outputs(model, context_strength)
    inner = model.model
    tensors = {
        "model.llm.embed.weight": inner.embed_tokens.weight,
        "model.llm.embed_norm.weight": inner.embed_norm.weight,
        "model.llm.norm.weight": inner.norm.weight,
        "model.llm.unembed.weight": model.lm_head.weight,
    }
    for i, layer in enumerate(inner.layers):
        tensors.update(published_layer(f"model.llm.layers.{i}.", layer))
    if ship_mtp:
        block = inkling_mtp_block(config)
        randomize(block, seed + 1)
        if context_strength is not None:
            scale_outputs(block, context_strength)
            h = INKLING_HIDDEN
            block.input_proj.weight = mx.concatenate([mx.zeros((h, h)), mx.eye(h)], axis=1)
            block.embed_norm.weight = inner.embed_norm.weight
        prefix = "model.mtp.layers.0."
        for name in ("embed_norm", "hidden_norm", "input_proj"):
            tensors[f"{prefix}{name}.weight"] = block[name].weight
        tensors.update(published_layer(f"{prefix}transformer_block.", block.transformer_block))
    return write_checkpoint(path, tensors, config)
