"""Tiny random-weight checkpoints of the MTP-shipping families, written as the Hugging Face
checkpoints are: real HF tensor names and config fields (the reverse of each mlx-lm
``sanitize``), plus head tensors under the family's own key prefix.

Families: ``qwen3_5`` (hybrid gated-delta + gated attention, norms stored as offsets from 1,
``model.language_model.`` prefix, torch conv layout), ``deepseek_v3`` (MLA attention with the
fused ``kv_b_proj``, optional MoE with per-expert tensors, MTP layer at ``num_hidden_layers``),
``mimo`` (Qwen2-style, ``model.mtp_layers.0.*``). Everything is float32 so the NumPy float64
reference comparisons are tight.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

H, V = 32, 64  # hidden size and vocabulary of every tiny model


@dataclass
class Tiny:
    path: Path
    config: dict
    tensors: dict[str, np.ndarray]  # exactly what was written, by HF name
    head_module: nn.Module | None = None  # the head as built in mlx (quantized variants)


def randomize(module: nn.Module, seed: int) -> None:
    """Deterministic random weights; norm weights around 1 so wrong conventions show."""
    rng = np.random.default_rng(seed)
    new = []
    for name, p in tree_flatten(module.parameters()):
        if p.dtype not in (mx.float32, mx.float16, mx.bfloat16):
            new.append((name, p))
            continue
        shape = p.shape
        if "norm" in name.split(".")[-2] and len(shape) == 1:
            v = 1.0 + 0.3 * rng.standard_normal(shape)
        elif name.endswith("A_log"):
            v = np.log(rng.uniform(1, 8, shape))
        else:
            v = rng.standard_normal(shape) / np.sqrt(shape[-1])
        new.append((name, mx.array(v.astype(np.float32))))
    module.update(tree_unflatten(new))
    mx.eval(module.parameters())


def write_checkpoint(path: Path, tensors: dict[str, mx.array], config: dict, shards: int = 1) -> Tiny:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    names = sorted(tensors)
    if shards == 1:
        mx.save_safetensors(str(path / "model.safetensors"), {k: tensors[k] for k in names}, {"format": "pt"})
    else:
        weight_map = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = names[s::shards]
            mx.save_safetensors(str(path / fname), {k: tensors[k] for k in part}, {"format": "pt"})
            weight_map.update({k: fname for k in part})
        total = sum(t.nbytes for t in tensors.values())
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
        )
    return Tiny(path, config, {k: np.array(v) for k, v in tensors.items()})


def hub_cache_layout(src: Path, cache_dir: Path, repo_id: str, revision: str = "0" * 40) -> Path:
    """Copy a checkpoint into huggingface_hub's cache layout (blobs + snapshot symlinks + refs/main)."""
    repo = cache_dir / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    for f in sorted(src.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snap), snap / f.name)
    return snap


def _prefixed(module: nn.Module, prefix: str) -> dict[str, mx.array]:
    return {prefix + k: v for k, v in tree_flatten(module.parameters())}


# --------------------------------------------------------------------------- qwen3_5


def qwen3_5_config(mtp_layers: int = 1) -> dict:
    text = {
        "model_type": "qwen3_5_text",
        "hidden_size": H,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-6,
        "vocab_size": V,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 2,
        "tie_word_embeddings": False,
        "max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    }
    if mtp_layers:
        text["mtp_num_hidden_layers"] = mtp_layers
    return {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": text,
    }


def _qwen35_offset(name: str, v: mx.array) -> mx.array:
    # HF Qwen3.5 RMSNorm computes x * (1 + w): the file stores w = weight - 1.
    # Every RMSNorm but the gated-delta one (mtp.pre_fc_norm_* included, as in the HF files).
    is_norm = v.ndim == 1 and "norm" in name.split(".")[-2] and "linear_attn" not in name
    return v - 1.0 if is_norm else v


def qwen3_5(
    path: Path, *, mtp_layers: int = 1, ship_mtp: bool = True, shards: int = 1, seed: int = 0
) -> Tiny:
    from mlx_lm.models import qwen3_5 as q

    config = qwen3_5_config(mtp_layers)
    model = q.Model(q.ModelArgs.from_dict(config))
    randomize(model, seed)
    tensors: dict[str, mx.array] = {}
    for name, v in tree_flatten(model.parameters()):
        if name.startswith("language_model.model."):
            hf = "model.language_model." + name[len("language_model.model.") :]
        else:
            hf = name[len("language_model.") :]  # lm_head.weight
        if "conv1d.weight" in name:
            v = v.moveaxis(2, 1)  # mlx [C, K, 1] -> torch [C, 1, K]
        tensors[hf] = _qwen35_offset(hf, v)
    if mtp_layers and ship_mtp:
        args = model.language_model.args
        layers = [q.DecoderLayer(args, layer_idx=args.full_attention_interval - 1) for _ in range(mtp_layers)]
        head = _qwen_next_head_module(layers)
        randomize(head, seed + 1)
        for name, v in _prefixed(head, "mtp.").items():
            tensors[name] = _qwen35_offset(name, v)
    return write_checkpoint(path, tensors, config, shards)


def _qwen_next_head_module(layers: list) -> nn.Module:
    m = nn.Module()
    m.fc = nn.Linear(2 * H, H, bias=False)
    m.pre_fc_norm_embedding = nn.RMSNorm(H)
    m.pre_fc_norm_hidden = nn.RMSNorm(H)
    m.layers = layers
    m.norm = nn.RMSNorm(H)
    return m


# --------------------------------------------------------------------------- deepseek_v3


def deepseek_v3_config(moe: bool = False, mtp_layers: int = 1, trunk_layers: int = 61) -> dict:
    cfg = {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "vocab_size": V,
        "hidden_size": H,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        # 61 as in DeepSeek-V3: mlx-lm's deepseek_v3 sanitize drops exactly model.layers.61.*
        "num_hidden_layers": trunk_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 16,
        "q_lora_rank": 16,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
        "qk_nope_head_dim": 8,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 256,
        "num_nextn_predict_layers": mtp_layers,
        "first_k_dense_replace": 60,  # MoE only in the last trunk layer and the MTP layer
        "moe_layer_freq": 1,
        "tie_word_embeddings": False,
    }
    if moe:
        cfg.update(
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.5,
            norm_topk_prob=True,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
        )
    return cfg


def _deepseek_hf_layer(prefix: str, layer: nn.Module, args) -> dict[str, mx.array]:
    """mlx-lm DeepseekV3DecoderLayer params -> HF names (fused kv_b_proj, per-expert MLPs)."""
    out = {}
    for name, v in tree_flatten(layer.parameters()):
        if name.endswith("embed_q.weight") or name.endswith("unembed_out.weight"):
            continue
        if ".switch_mlp." in name:
            proj = name.split(".")[-2]
            for e in range(v.shape[0]):
                out[f"{prefix}mlp.experts.{e}.{proj}.weight"] = v[e]
            continue
        out[prefix + name] = v
    attn = layer.self_attn
    wk = attn.embed_q.weight.swapaxes(-1, -2)  # [heads, nope, kv_lora]
    wv = attn.unembed_out.weight  # [heads, v, kv_lora]
    out[prefix + "self_attn.kv_b_proj.weight"] = mx.concatenate([wk, wv], axis=1).reshape(
        -1, args.kv_lora_rank
    )
    return out


def deepseek_v3(
    path: Path,
    *,
    moe: bool = False,
    ship_mtp: bool = True,
    shards: int = 1,
    seed: int = 0,
    mtp_layers: int = 1,
    sidecar: bool = False,
    trunk_layers: int = 61,
) -> Tiny:
    """``sidecar=True`` writes the MTP layers to ``mtp.safetensors`` beside the trunk's files,
    where mlx-lm never reads them (needed for ``mtp_layers > 1`` or ``trunk_layers != 61``:
    mlx-lm's sanitize drops only ``model.layers.61.*``)."""
    from mlx_lm.models import deepseek_v3 as d

    config = deepseek_v3_config(moe, mtp_layers, trunk_layers)
    args = d.ModelArgs.from_dict(config)
    model = d.Model(args)
    randomize(model, seed)
    tensors = {
        "model.embed_tokens.weight": model.model.embed_tokens.weight,
        "model.norm.weight": model.model.norm.weight,
        "lm_head.weight": model.lm_head.weight,
    }
    for i, layer in enumerate(model.model.layers):
        tensors.update(_deepseek_hf_layer(f"model.layers.{i}.", layer, args))
    head: dict[str, mx.array] = {}
    for m in range(mtp_layers if ship_mtp else 0):
        L = args.num_hidden_layers + m
        block = d.DeepseekV3DecoderLayer(args, L)
        randomize(block, seed + 1 + 3 * m)
        p = f"model.layers.{L}."
        head.update(_deepseek_hf_layer(p, block, args))
        extra = nn.Module()
        extra.enorm, extra.hnorm = nn.RMSNorm(H), nn.RMSNorm(H)
        extra.eh_proj = nn.Linear(2 * H, H, bias=False)
        extra.shared_head = nn.Module()
        extra.shared_head.norm = nn.RMSNorm(H)
        randomize(extra, seed + 2 + 3 * m)
        head.update(_prefixed(extra, p))
        # DeepSeek ships copies of the embedding and the LM head inside the MTP layer.
        head[p + "embed_tokens.weight"] = model.model.embed_tokens.weight
        head[p + "shared_head.head.weight"] = model.lm_head.weight
    return _write_with_head(path, tensors, head, config, shards, sidecar)


def _write_with_head(
    path: Path, trunk: dict, head: dict, config: dict, shards: int, sidecar: bool, sidecar_name: str = "mtp"
) -> Tiny:
    if not sidecar:
        return write_checkpoint(path, {**trunk, **head}, config, shards)
    tiny = write_checkpoint(path, trunk, config, shards)
    mx.save_safetensors(str(path / f"{sidecar_name}.safetensors"), head, {"format": "pt"})
    tiny.tensors.update({k: np.array(v) for k, v in head.items()})
    return tiny


# --------------------------------------------------------------------------- mimo


def mimo_config(mtp_layers: int = 1) -> dict:
    return {
        "model_type": "mimo",
        "architectures": ["MiMoForCausalLM"],
        "hidden_size": H,
        "num_hidden_layers": 2,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": V,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": mtp_layers,
    }


def mimo_head_module(block: nn.Module) -> nn.Module:
    m = nn.Module()
    m.token_layernorm, m.hidden_layernorm = nn.RMSNorm(H), nn.RMSNorm(H)
    m.input_proj = nn.Linear(2 * H, H, bias=False)
    m.block = block
    m.final_layernorm = nn.RMSNorm(H)
    return m


def _mimo_hf(module: nn.Module, prefix: str) -> dict[str, mx.array]:
    # The published MiMo checkpoints put the block's tensors directly under the MTP prefix.
    return {
        prefix + k.replace("block.", "", 1) if k.startswith("block.") else prefix + k: v
        for k, v in tree_flatten(module.parameters())
    }


def mimo(
    path: Path,
    *,
    ship_mtp: bool = True,
    shards: int = 1,
    seed: int = 0,
    quantize: dict | None = None,
    head_override_bits: int | None = None,
    mtp_layers: int = 1,
) -> Tiny:
    """``quantize={"group_size": 32, "bits": 4}`` writes an mlx-format quantized checkpoint
    (``.scales``/``.biases``, a ``quantization`` block); ``head_override_bits`` adds a per-layer
    override for the head's ``input_proj``."""
    from mlx_lm.models import mimo as m

    config = mimo_config(mtp_layers)
    args = m.ModelArgs.from_dict(config)
    model = m.Model(args)
    randomize(model, seed)
    heads = [mimo_head_module(m.TransformerBlock(args)) for _ in range(mtp_layers)]
    for i, head in enumerate(heads):
        randomize(head, seed + 1 + i)
    if quantize:
        nn.quantize(model, **quantize)
        q = dict(quantize)
        for i, head in enumerate(heads):
            if head_override_bits:
                q[f"model.mtp_layers.{i}.input_proj"] = {
                    "group_size": quantize["group_size"],
                    "bits": head_override_bits,
                }
                nn.quantize(
                    head,
                    group_size=quantize["group_size"],
                    bits=head_override_bits,
                    class_predicate=lambda p, mod: p == "input_proj",
                )
            nn.quantize(
                head, **quantize, class_predicate=lambda p, mod: isinstance(mod, (nn.Linear, nn.Embedding))
            )
        config["quantization"] = q
        config["quantization_config"] = q
    tensors = dict(tree_flatten(model.parameters()))
    if ship_mtp:
        for i, head in enumerate(heads):
            tensors.update(_mimo_hf(head, f"model.mtp_layers.{i}."))
    tiny = write_checkpoint(path, tensors, config, shards)
    tiny.head_module = heads[0]
    return tiny


# --------------------------------------------------------------------------- tokenizer


def add_tokenizer(path: Path) -> None:
    """A word-level tokenizer over the tiny vocabulary (``w0``..``w{V-1}``, ``w1`` = EOS), so
    ``Engine.load`` and ``mlx_lm.load`` open the checkpoint like a real one."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(V)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "w1", "unk_token": "w0"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
