"""A tiny Qwen3.5 GGUF with its nextn block, written as llama.cpp's converter writes one, with the
``gguf`` package (llama.cpp's own ``gguf-py``): names from its ``TensorNameMap`` for
``MODEL_ARCH.QWEN35`` (and its ``TENSOR_NAMES`` for the nextn tensors), the converter's transforms
applied forward (``conversion/qwen.py``: ``Qwen3NextModel``, ``_LinearAttentionVReorderBase``,
``_Qwen35MtpMixin``), K-quant / BF16 / Q8_0 / F32 tensors as a Q4_K_M-style file mixes them.

The replica is ``support.checkpoints``' Qwen3.5 (HF layout: norms as offsets from 1, torch
conv layout) at hidden 256, so K-quant rows (256 elements) fit; its head predicts the trunk by
construction (``context_strength``) so drafts are kept; fewer key than value heads in the
gated-delta layers, so the value-head reorder is exercised."""

from __future__ import annotations

from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from support import ggml_blocks
from support.checkpoints import _qwen35_offset, _random_replica
from support.models import qwen3_5_config, qwen3_5_mtp_layer, randomize, scale_outputs

HIDDEN = 256
VOCAB = 64
NAME = "Qwen3.5-Tiny"

# GGUF tensor name (after blk.N.) -> ggml type; anything unlisted (norms, ssm_a, conv, dt) F32.
TYPES = {
    "token_embd.weight": "Q4_K",
    "output.weight": "Q6_K",
    "attn_q.weight": "Q4_K",
    "attn_k.weight": "Q5_K",
    "attn_v.weight": "Q6_K",
    "attn_output.weight": "Q4_K",
    "attn_qkv.weight": "Q8_0",
    "attn_gate.weight": "BF16",
    "ssm_alpha.weight": "BF16",
    "ssm_beta.weight": "F16",
    "ssm_out.weight": "Q5_K",
    "ffn_gate.weight": "Q4_K",
    "ffn_up.weight": "Q4_K",
    "ffn_down.weight": "Q6_K",
    "nextn.eh_proj.weight": "BF16",
    # qwen35moe: routed experts as a Q4_K_M file keeps them, router and shared-expert gate F32
    "ffn_gate_exps.weight": "Q4_K",
    "ffn_up_exps.weight": "Q4_K",
    "ffn_down_exps.weight": "Q6_K",
    "ffn_gate_shexp.weight": "Q8_0",
    "ffn_up_shexp.weight": "Q8_0",
    "ffn_down_shexp.weight": "Q8_0",
}
MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 256,
    "shared_expert_intermediate_size": 256,
}
# The nextn block: its decoder layer Q8_0 (as llama.cpp's quantizer keeps it) but its norms.
NEXTN_LAYER_TYPE = "Q8_0"


def replica(
    context_strength: float = 0.4, seed: int = 0, moe: bool = False
) -> tuple[dict, dict[str, np.ndarray]]:
    """(HF config, HF tensors as float32 numpy): a 4-layer Qwen3.5 at hidden 256 with one MTP
    layer; ``moe``: Qwen3.5-MoE (every MLP 4 routed experts + a shared expert, stacked as
    mlx-lm's ``switch_mlp``, which its loader reads as they are)."""
    from mlx_lm.models import qwen3_5 as q

    config = qwen3_5_config(VOCAB, hidden_size=HIDDEN, mtp_layers=1)
    if moe:
        config["model_type"], config["architectures"] = "qwen3_5_moe", ["Qwen3_5MoeForConditionalGeneration"]
        config["text_config"].update(MOE, model_type="qwen3_5_moe_text")
    _, model = _random_replica(q, config, seed, context_strength)
    tensors: dict[str, mx.array] = {}
    for name, v in tree_flatten(model.parameters()):
        if name.startswith("language_model.model."):
            hf = "model.language_model." + name[len("language_model.model.") :]
        else:
            hf = name[len("language_model.") :]
        if "conv1d.weight" in name:
            v = v.moveaxis(2, 1)
        tensors[hf] = _qwen35_offset(hf, v)
    head = nn.Module()
    head.fc = nn.Linear(2 * HIDDEN, HIDDEN, bias=False)
    head.pre_fc_norm_embedding, head.pre_fc_norm_hidden = nn.RMSNorm(HIDDEN), nn.RMSNorm(HIDDEN)
    head.layers = [qwen3_5_mtp_layer(model)]
    head.norm = nn.RMSNorm(HIDDEN)
    randomize(head, seed + 1)
    scale_outputs(head, context_strength)
    head.fc.weight = mx.concatenate([mx.eye(HIDDEN), mx.zeros((HIDDEN, HIDDEN))], axis=1)
    head.pre_fc_norm_embedding.weight = mx.ones((HIDDEN,))
    head.norm.weight = model.language_model.model.norm.weight
    for name, v in tree_flatten(head.parameters()):
        tensors["mtp." + name] = _qwen35_offset("mtp." + name, v)
    return config, {k: np.array(v.astype(mx.float32)) for k, v in tensors.items()}


# ---------------------------------------------------------------- llama.cpp's converter, forward


def _reorder_v_heads(x: np.ndarray, axis: int, key_heads: int, per_key: int, head_dim: int) -> np.ndarray:
    """``_LinearAttentionVReorderBase._reorder_v_heads``: grouped-by-key-head -> tiled."""
    shape = list(x.shape)
    new = shape[:axis] + [key_heads, per_key, head_dim] + shape[axis + 1 :]
    return np.swapaxes(x.reshape(new), axis, axis + 1).reshape(shape)


def _reorder(name: str, w: np.ndarray, text: dict) -> np.ndarray:
    k, v = text["linear_num_key_heads"], text["linear_num_value_heads"]
    if k == v or "linear_attn." not in name:
        return w
    per, hk, hv = v // k, text["linear_key_head_dim"], text["linear_value_head_dim"]
    if ".in_proj_qkv." in name:
        qk = 2 * hk * k
        return np.concatenate([w[:qk], _reorder_v_heads(w[qk:], 0, k, per, hv)])
    if ".in_proj_z." in name:
        return _reorder_v_heads(w, 0, k, per, hv)
    if ".in_proj_b." in name or ".in_proj_a." in name:
        return _reorder_v_heads(w, 0, k, per, 1)
    if ".A_log" in name or ".dt_bias" in name:
        return _reorder_v_heads(w[:, None], 0, k, per, 1)[:, 0]
    if ".conv1d" in name:
        data = w.squeeze()
        qk = 2 * hk * k
        return np.concatenate([data[:qk], _reorder_v_heads(data[qk:], 0, k, per, hv)])
    if ".out_proj." in name:
        return _reorder_v_heads(w, 1, k, per, hv)
    return w


def _qwen3_next(name: str, w: np.ndarray) -> tuple[str, np.ndarray]:
    """``Qwen3NextModel.modify_tensors``' elementwise part."""
    if name.endswith(".A_log"):
        return name, -np.exp(w)
    if name.endswith(".dt_bias"):
        return name[: -len(".dt_bias")] + ".dt_proj.bias", w
    if "conv1d" in name:
        return name, w.squeeze()
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return name, w + 1
    return name, w


def gguf_tensors(config: dict, hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The replica's tensors under their GGUF names, in llama.cpp's layout (float32)."""
    import gguf

    text = config["text_config"]
    n, nextn = text["num_hidden_layers"], text["mtp_num_hidden_layers"]
    arch = gguf.MODEL_ARCH.QWEN35MOE if text.get("num_experts") else gguf.MODEL_ARCH.QWEN35
    names = gguf.get_tensor_name_map(arch, n + nextn)
    # _Qwen35MtpMixin's remap (the HF-side name its modify_tensors passes on) and the tensor it becomes
    nextn_names = {
        "mtp.fc": ("eh_proj", gguf.MODEL_TENSOR.NEXTN_EH_PROJ),
        "mtp.pre_fc_norm_embedding": ("enorm", gguf.MODEL_TENSOR.NEXTN_ENORM),
        "mtp.pre_fc_norm_hidden": ("hnorm", gguf.MODEL_TENSOR.NEXTN_HNORM),
        "mtp.norm": ("shared_head.norm", gguf.MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM),
    }
    out: dict[str, np.ndarray] = {}
    for hf_name, w in hf.items():
        # Qwen2MoeModel merges the experts into model.layers.{bid}.mlp.experts.{proj} (stacked)
        name = hf_name.replace("language_model.", "").replace(".mlp.switch_mlp.", ".mlp.experts.")
        stem = name[: -len(".weight")]
        if stem in nextn_names:
            remapped, tensor = nextn_names[stem]
            _, w = _qwen3_next(f"model.layers.{n}.{remapped}.weight", w)  # enorm.weight: a norm, +1
            out[gguf.TENSOR_NAMES[tensor].format(bid=n) + ".weight"] = w
            continue
        for i in range(nextn):
            name = name.replace(f"mtp.layers.{i}.", f"model.layers.{n + i}.")
        name, w = _qwen3_next(name, _reorder(name, w, text))
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        out[gguf_name] = np.ascontiguousarray(w, dtype=np.float32)
    return out


def ggml_type(gguf_name: str, trunk_layers: int) -> int:
    """The file's type for a tensor: ``TYPES`` by its name after ``blk.N.``, the nextn block's
    decoder layer ``NEXTN_LAYER_TYPE``, 1-D tensors and the conv kernel F32."""
    parts = gguf_name.split(".")
    rest = ".".join(parts[2:]) if parts[0] == "blk" else gguf_name
    if parts[0] == "blk" and int(parts[1]) >= trunk_layers and rest in TYPES and "nextn" not in rest:
        return ggml_blocks.TYPES[NEXTN_LAYER_TYPE]
    return ggml_blocks.TYPES[TYPES.get(rest, "F32")]


TOKENS = (
    [chr(c) for c in range(ord("a"), ord("z") + 1)]
    + [str(d) for d in range(10)]
    + ["Ġ", ".", "'", ",", "Ġt", "he", "Ġthe", "in", "Ġa"]
    + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    + [chr(c) for c in range(ord("A"), ord("A") + 16)]
)
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _metadata(writer, text: dict) -> None:
    n, nextn, head_dim = text["num_hidden_layers"], text["mtp_num_hidden_layers"], text["head_dim"]
    writer.add_block_count(n + nextn)
    if text.get("num_experts"):
        writer.add_expert_count(text["num_experts"])
        writer.add_expert_used_count(text["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(text["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(text["shared_expert_intermediate_size"])
    if nextn:  # _Qwen35MtpMixin writes the key only for a checkpoint with MTP layers
        writer.add_nextn_predict_layers(nextn)
    writer.add_context_length(text["max_position_embeddings"])
    writer.add_embedding_length(text["hidden_size"])
    writer.add_feed_forward_length(text["intermediate_size"])
    writer.add_head_count(text["num_attention_heads"])
    writer.add_head_count_kv(text["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(text["rms_norm_eps"])
    rope = text["rope_parameters"]
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
    writer.add_rope_dimension_sections([11, 11, 10, 0])
    writer.add_ssm_conv_kernel(text["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(text["linear_key_head_dim"])
    writer.add_ssm_group_count(text["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(text["linear_num_value_heads"])
    writer.add_ssm_inner_size(text["linear_value_head_dim"] * text["linear_num_value_heads"])
    writer.add_full_attention_interval(text["full_attention_interval"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen35")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3 if t in SPECIAL else 1 for t in TOKENS])
    writer.add_token_merges(MERGES)
    writer.add_eos_token_id(TOKENS.index("<|im_end|>"))
    writer.add_bos_token_id(TOKENS.index("<|endoftext|>"))
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")


def write_gguf(path: Path, config: dict, tensors: dict[str, np.ndarray], types: dict[str, int]) -> Path:
    """``tensors`` (GGUF names, float32) written as ``types`` says, with the Qwen3.5 metadata."""
    import gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "qwen35moe" if config["text_config"].get("num_experts") else "qwen35")
    _metadata(writer, config["text_config"])
    for name, w in tensors.items():
        t = types[name]
        if t == 0:
            writer.add_tensor(name, w.astype(np.float32))
        else:
            writer.add_tensor(name, ggml_blocks.encode(w, t), raw_dtype=gguf.GGMLQuantizationType(t))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def qwen35_gguf(
    path: Path, context_strength: float = 0.4, seed: int = 0, moe: bool = False
) -> tuple[dict, dict, dict]:
    """Write the tiny GGUF; returns (HF config, HF tensors, {GGUF name: (type, float32 value written)})."""
    config, hf = replica(context_strength, seed, moe)
    tensors = gguf_tensors(config, hf)
    n = config["text_config"]["num_hidden_layers"]
    types = {name: ggml_type(name, n) for name in tensors}
    write_gguf(path, config, tensors, types)
    return config, hf, {name: (types[name], tensors[name]) for name in tensors}
