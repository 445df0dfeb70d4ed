"""Qwen3.5 / Qwen3.6 GGUFs (``qwen35``, ``qwen35moe``) to an mlx-lm directory that keeps the
nextn block as the MTP head (``mtp.safetensors``, read by ``mtplx.heads``' Qwen3-Next layout).

The mapping is the inverse of llama.cpp's converter and loader, read for this module:

- ``conversion/qwen.py`` (``Qwen3NextModel``, ``_LinearAttentionVReorderBase``, ``_Qwen35MtpMixin``,
  ``Qwen3_5TextModel`` / ``Qwen3_5MoeTextModel``): every ``*norm.weight`` but the gated-delta one
  gets +1 (the GGUF holds plain scales, as mlx-lm's layers use them); ``A_log`` is written as
  ``-exp(A_log)`` (tensor ``ssm_a``, no suffix); ``dt_bias`` as ``ssm_dt.bias``; ``conv1d``
  squeezed to [channels, kernel]; with fewer key than value heads the value heads of
  ``in_proj_qkv`` (V rows), ``in_proj_z``, ``in_proj_a/b``, ``A_log``, ``dt_bias``, ``conv1d``
  (V channels) and ``out_proj`` (columns) are reordered from grouped-by-key-head to tiled; the
  ``mtp.*`` layer ``i`` becomes block ``num_hidden_layers + i`` (``blk.N.*``, named as a trunk
  layer) and ``mtp.fc`` / ``pre_fc_norm_embedding`` / ``pre_fc_norm_hidden`` / ``norm`` become
  ``blk.N.nextn.eh_proj`` / ``enorm`` / ``hnorm`` / ``shared_head_norm``; ``block_count``
  counts the nextn block and ``nextn_predict_layers`` says how many there are;
- ``gguf-py``'s ``tensor_mapping.py`` / ``constants.py`` (``MODEL_ARCH.QWEN35``): the per-layer
  names (``post_attention_layernorm`` -> ``post_attention_norm``, ``linear_attn.in_proj_qkv`` ->
  ``attn_qkv``, ``in_proj_z`` -> ``attn_gate``, ``in_proj_a/b`` -> ``ssm_alpha/beta`` ...);
- ``src/models/qwen35.cpp`` (loader and MTP graph): ``attn_q`` is the HF ``q_proj`` with its
  output gate (2 x heads x head_dim, no rope permutation: NeoX rope), the MTP block reads
  ``concat(enorm(embed), hnorm(h))`` with ``h`` the trunk's hidden after the final norm,
  ``nextn.shared_head_norm`` falls back to ``output_norm``, ``nextn.embed_tokens`` /
  ``shared_head_head`` (optional) fall back to the trunk's (mtplx's head always shares them).

Every tensor is dequantized exactly (``gguf_quants``) and written float; ``gguf_requantize``
then quantizes through ``convert_hf`` (mlx-lm's quantizer, the head at ``mtplx.heads.precision``'s
default) when the user asks for bits. The one inexact step is ``A_log = log(-ssm_a)``: mlx-lm's
layer computes ``-exp(A_log)`` itself, so the round trip can move ``A`` by an ulp.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mtplx.checkpoints.gguf import GGUFFile, TensorInfo, read_tensor
from mtplx.errors import MtplxError

import mlx.core as mx
import numpy as np

ARCHITECTURES = ("qwen35", "qwen35moe")
HEAD_FILE = "mtp.safetensors"  # as ``convert_hf`` names the head beside the trunk
SHARD_BYTES = 2 << 30
TRUNK = "language_model.model."  # mlx-lm qwen3_5's parameter prefix

# blk.N.<GGUF name> -> the decoder layer's mlx-lm parameter path (trunk and nextn block alike).
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # qwen35moe: experts stacked [E, out, in] (GGUF ne = in, out, E), mlx-lm's switch_mlp layout
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.switch_mlp.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.switch_mlp.up_proj.weight",
    "ffn_down_exps.weight": "mlp.switch_mlp.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
# blk.N.nextn.<name> -> the MTP head's checkpoint name (``mtplx.heads.qwen3_next``'s layout).
NEXTN_TENSORS = {
    "eh_proj.weight": "mtp.fc.weight",
    "enorm.weight": "mtp.pre_fc_norm_embedding.weight",
    "hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
    "shared_head_norm.weight": "mtp.norm.weight",
}
# Copies of the trunk's embedding / LM head the loader accepts in the nextn block: the head
# shares the trunk's, so these are left out.
NEXTN_SHARED = ("embed_tokens.weight", "shared_head_head.weight")
GLOBAL_TENSORS = {
    "token_embd.weight": TRUNK + "embed_tokens.weight",
    "output_norm.weight": TRUNK + "norm.weight",
    "output.weight": "language_model.lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


# ---------------------------------------------------------------- config


def _meta(gguf: GGUFFile, key: str, default: Any = None) -> Any:
    value = gguf.metadata.get(f"{gguf.architecture}.{key}", default)
    if value is None:
        raise MtplxError(f"{gguf.path}: GGUF metadata lacks {gguf.architecture}.{key}")
    return value


def _scalar(value: Any) -> Any:
    """A per-layer array llama.cpp may write (``head_count_kv``, ``feed_forward_length``) as one
    value: all layers' (attention layers' for a hybrid's per-layer counts, zero on the others)."""
    if isinstance(value, list):
        nonzero = sorted({v for v in value if v})
        return nonzero[0] if len(nonzero) == 1 else value
    return value


def text_config(gguf: GGUFFile) -> dict[str, Any]:
    """The mlx-lm ``qwen3_5`` text config the GGUF's metadata describes (see ``convert_hf_to_gguf``'s
    ``set_gguf_parameters``: ``ssm.state_size`` is the key head dim, ``ssm.group_count`` the key
    heads, ``ssm.time_step_rank`` the value heads, ``ssm.inner_size`` their total width)."""
    nextn = int(_meta(gguf, "nextn_predict_layers", 0))
    head_dim = int(_meta(gguf, "attention.key_length"))
    value_heads = int(_meta(gguf, "ssm.time_step_rank"))
    text: dict[str, Any] = {
        "model_type": "qwen3_5_moe_text" if gguf.architecture == "qwen35moe" else "qwen3_5_text",
        "hidden_size": int(_meta(gguf, "embedding_length")),
        "num_hidden_layers": int(_meta(gguf, "block_count")) - nextn,
        "num_attention_heads": int(_scalar(_meta(gguf, "attention.head_count"))),
        "num_key_value_heads": int(_scalar(_meta(gguf, "attention.head_count_kv"))),
        "head_dim": head_dim,
        "rms_norm_eps": float(_meta(gguf, "attention.layer_norm_rms_epsilon")),
        "vocab_size": int(gguf.tensors["token_embd.weight"].shape[0]),
        "max_position_embeddings": int(_meta(gguf, "context_length", 262144)),
        "linear_num_value_heads": value_heads,
        "linear_num_key_heads": int(_meta(gguf, "ssm.group_count")),
        "linear_key_head_dim": int(_meta(gguf, "ssm.state_size")),
        "linear_value_head_dim": int(_meta(gguf, "ssm.inner_size")) // value_heads,
        "linear_conv_kernel_dim": int(_meta(gguf, "ssm.conv_kernel")),
        "full_attention_interval": int(_meta(gguf, "full_attention_interval", 4)),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(_meta(gguf, "rope.freq_base", 10000000.0)),
            "partial_rotary_factor": int(_meta(gguf, "rope.dimension_count", head_dim)) / head_dim,
        },
    }
    if nextn:
        text["mtp_num_hidden_layers"] = nextn
    if gguf.architecture == "qwen35moe":
        text.update(
            num_experts=int(_meta(gguf, "expert_count")),
            num_experts_per_tok=int(_meta(gguf, "expert_used_count")),
            moe_intermediate_size=int(_meta(gguf, "expert_feed_forward_length")),
            shared_expert_intermediate_size=int(_meta(gguf, "expert_shared_feed_forward_length", 0)),
        )
    else:
        text["intermediate_size"] = int(_scalar(_meta(gguf, "feed_forward_length")))
    return text


def hf_config(gguf: GGUFFile) -> dict[str, Any]:
    """``config.json``: the multimodal wrapper mlx-lm's ``qwen3_5`` / ``qwen3_5_moe`` load, text only."""
    text = text_config(gguf)
    moe = gguf.architecture == "qwen35moe"
    config: dict[str, Any] = {
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "tie_word_embeddings": text["tie_word_embeddings"],
        "text_config": text,
    }
    for name in ("bos", "eos", "padding"):
        if f"tokenizer.ggml.{name}_token_id" in gguf.metadata:
            key = "pad_token_id" if name == "padding" else f"{name}_token_id"
            config[key] = int(gguf.metadata[f"tokenizer.ggml.{name}_token_id"])
    return config


# ---------------------------------------------------------------- names


def target_name(gguf_name: str, trunk_layers: int) -> str | None:
    """The mlx-lm (trunk) or head checkpoint (``mtp.*``) name of a GGUF tensor; "" for a nextn
    copy of a shared tensor (skipped); None for a tensor this layout does not have."""
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    if m is None:
        return None
    block, rest = int(m.group(1)), m.group(2)
    if block < trunk_layers:
        return f"{TRUNK}layers.{block}.{LAYER_TENSORS[rest]}" if rest in LAYER_TENSORS else None
    if rest.startswith("nextn."):
        rest = rest[len("nextn.") :]
        if rest in NEXTN_SHARED:
            return ""
        return NEXTN_TENSORS.get(rest)
    return f"mtp.layers.{block - trunk_layers}.{LAYER_TENSORS[rest]}" if rest in LAYER_TENSORS else None


# ---------------------------------------------------------------- transforms


def _untile(x: np.ndarray, axis: int, key_heads: int, per_key: int, head_dim: int) -> np.ndarray:
    """Undo ``_reorder_v_heads``: value heads along ``axis`` from llama.cpp's tiled order
    (head j*key_heads + k) back to HF's grouped order (head k*per_key + j)."""
    x = np.moveaxis(x, axis, 0)
    rest = x.shape[1:]
    x = x.reshape(per_key, key_heads, head_dim, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.ascontiguousarray(np.moveaxis(x, 0, axis))


def _value_heads(kind: str, w: np.ndarray, text: dict) -> np.ndarray:
    """The value-head order of one gated-delta tensor back to HF's (a no-op with as many key as
    value heads, where llama.cpp reorders nothing)."""
    k, v = text["linear_num_key_heads"], text["linear_num_value_heads"]
    if k == v:
        return w
    per, hv = v // k, text["linear_value_head_dim"]
    key_dim = 2 * k * text["linear_key_head_dim"]  # q and k rows / channels come first
    if kind in ("in_proj_qkv.weight", "conv1d.weight"):
        return np.concatenate([w[:key_dim], _untile(w[key_dim:], 0, k, per, hv)], axis=0)
    if kind == "in_proj_z.weight":
        return _untile(w, 0, k, per, hv)
    if kind in ("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias"):
        return _untile(w, 0, k, per, 1)
    if kind == "out_proj.weight":
        return _untile(w, 1, k, per, hv)
    return w


def to_mlx(name: str, w: np.ndarray, text: dict) -> np.ndarray:
    """One dequantized tensor (float32, numpy order) in the layout mlx-lm's layer holds under
    ``name`` (the converter's transforms undone; norms already plain scales)."""
    if ".linear_attn." in name:
        kind = name.split(".linear_attn.")[1]
        if kind == "A_log":
            with np.errstate(divide="ignore", invalid="ignore"):
                w = np.log(-w.astype(np.float64)).astype(np.float32)  # ssm_a = -exp(A_log)
        w = _value_heads(kind, w, text)
        if kind == "conv1d.weight":
            w = w[:, :, None]  # [channels, kernel] -> mlx Conv1d [out, kernel, in/groups]
    elif name.endswith("shared_expert_gate.weight") and w.ndim == 1:
        w = w[None, :]  # llama.cpp stores the one-output gate as a vector
    return w


def mlx_tensors(gguf: GGUFFile, text: dict) -> Iterator[tuple[str, TensorInfo, np.ndarray]]:
    """(mlx-lm or head name, GGUF tensor, float32 value) for every tensor, one at a time;
    a one-line MtplxError naming a tensor this layout does not have."""
    trunk_layers = text["num_hidden_layers"]
    for info in gguf.tensors.values():
        name = target_name(info.name, trunk_layers)
        if name is None:
            raise MtplxError(f"{gguf.path}: unsupported tensor {info.name} for a {gguf.architecture} model")
        if name:
            yield name, info, to_mlx(name, read_tensor(gguf, info), text)


# ---------------------------------------------------------------- writing


def _check_head(gguf: GGUFFile, head: dict[str, Any], text: dict) -> None:
    """The nextn block is complete: ``eh_proj``, the two input norms and a decoder layer; a missing
    ``shared_head_norm`` is the trunk's final norm (llama.cpp's loader falls back to it)."""
    nextn = text.get("mtp_num_hidden_layers", 0)
    if not nextn:
        return
    for needed in ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight"):
        if needed not in head:
            gguf_name = next(k for k, v in NEXTN_TENSORS.items() if v == needed)
            raise MtplxError(
                f"{gguf.path}: declares {nextn} nextn layer(s) but lacks blk.{text['num_hidden_layers']}.nextn.{gguf_name}"
            )


class _ShardWriter:
    """Trunk tensors into ``model-XXXXX-of-YYYYY.safetensors`` shards of about ``SHARD_BYTES``
    (the HF index beside them), so a large GGUF never sits in memory whole."""

    def __init__(self, out: Path, dtype: Any):
        self.out, self.dtype = out, dtype
        self.pending: dict[str, mx.array] = {}
        self.pending_bytes, self.files, self.weight_map = 0, [], {}

    def add(self, name: str, value: np.ndarray) -> None:
        keep_float32 = name.endswith("A_log")  # mlx-lm's cast_predicate keeps A_log float32
        array = mx.array(value)
        self.pending[name] = array if keep_float32 else array.astype(self.dtype)
        self.pending_bytes += self.pending[name].nbytes
        if self.pending_bytes >= SHARD_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        name = f"model-{len(self.files) + 1:05d}.safetensors"
        mx.save_safetensors(str(self.out / name), self.pending, metadata={"format": "mlx"})
        self.files.append(name)
        self.weight_map.update(dict.fromkeys(self.pending, name))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        self.flush()
        total = len(self.files)
        renamed = {f: f"model-{i + 1:05d}-of-{total:05d}.safetensors" for i, f in enumerate(self.files)}
        for old, new in renamed.items():
            (self.out / old).rename(self.out / new)
        index = {"metadata": {}, "weight_map": {k: renamed[v] for k, v in sorted(self.weight_map.items())}}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")


def write_float_dir(gguf: GGUFFile, out: Path, dtype: str) -> dict[str, Any]:
    """The float model directory (trunk shards, head sidecar, config) in ``out``; returns the config."""
    from mtplx.heads.weights import PLAIN_NORMS_MARK

    config = hf_config(gguf)
    text = config["text_config"]
    shards, head = _ShardWriter(out, getattr(mx, dtype)), {}
    for name, _, value in mlx_tensors(gguf, text):
        if name.startswith("mtp."):
            head[name] = mx.array(value).astype(getattr(mx, dtype))
        else:
            shards.add(name, value)
    shards.finish()
    _check_head(gguf, head, text)
    if head and "mtp.norm.weight" not in head:
        norm = mx.load(str(out / shards.weight_map[TRUNK + "norm.weight"]))[TRUNK + "norm.weight"]
        head["mtp.norm.weight"] = norm
    if head:
        key, mark = PLAIN_NORMS_MARK  # the nextn norms are plain scales, as llama.cpp stores them
        mx.save_safetensors(str(out / HEAD_FILE), head, metadata={"format": "mlx", key: mark})
    config["torch_dtype"] = dtype
    config["text_config"]["dtype"] = dtype
    return config
