"""Tiny checkpoints of the families mtplx hosts through mlx-vlm's language models
(`mtplx.trunk.backends.MLX_VLM_TEXT_FAMILIES`), written as the published checkpoints are.

``hy_v4`` (Hunyuan-V4): the config's keys are mlx-vlm 0.7.10's ``models/hy_v4/config.py``
``ModelConfig`` fields; the tensors are the reverse of its ``Model.sanitize``: per-expert
``mlp.experts.{e}.{gate,up,down}_proj.weight``, the attention's fused ``kv_b_proj`` as MXFP8
(``weight`` e4m3 bytes + ``weight_scale`` e8m0 bytes per 32, the only form that sanitize
reads), hyper-connection parameters ``hc_{attn,mlp}_layer.hc_pre.*`` and ``model.hc_head.*``
in float32 (its cast predicate keeps them so), the MTP layer under ``model.mtp_layers.0.``
with its own ``enorm`` / ``hnorm`` / ``eh_proj`` / ``final_layernorm`` (mlx-vlm's
``speculative/drafters/hy_v4_mtp/split.py`` reads these names). The other linear weights are
written float32 (published: MXFP8 too), so the NumPy float64 references compare tightly.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from support.checkpoints import Tiny, fp8_blocks, write_checkpoint
from support.models import _OUTPUT_PROJECTIONS, randomize, scale_outputs

HY_V4_VOCAB = 96
HY_V4_HIDDEN = 64  # a multiple of MXFP8's group of 32


def hy_v4_config(mtp_layers: int = 1, layers: int = 3, hc_mult: int = 2) -> dict:
    """Hunyuan-V4's config shrunk: MLA with the DSA indexer (keeping 4 keys, so it selects at
    test lengths), indexer layers "full" at 0 and 1 and "shared" at 2 (the published rule),
    a dense first layer and 4-expert MoE after, ``hc_mult`` hyper-connection streams."""
    return {
        "model_type": "hy_v4",
        "architectures": ["HYV4ForCausalLM"],
        "vocab_size": HY_V4_VOCAB,
        "hidden_size": HY_V4_HIDDEN,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "routed_scaling_factor": 2.0,
        "kv_lora_rank": 32,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "v_head_dim": 32,
        "qk_nope_head_dim": 32,
        "index_head_dim": 16,
        "index_n_heads": 2,
        "index_topk": 4,
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": 2,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 1,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hc_mult": hc_mult,
        "hc_eps": 1e-6,
        "hc_magnitude": 2.0,
        "num_nextn_predict_layers": mtp_layers,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,  # support.tokenizer.word_level's EOS
        "pad_token_id": 0,
        "quantization_config": {"quant_method": "modelopt", "quant_algo": "MXFP8"},
    }


def mxfp8(weight: mx.array) -> tuple[mx.array, mx.array]:
    """``weight`` [out, in] as MXFP8 as published: e4m3 bytes [out, in] and e8m0 scales [out, in / 32]."""
    packed, scales = mx.quantize(weight, group_size=32, bits=8, mode="mxfp8")
    return packed.view(mx.uint8).reshape(weight.shape), scales


def _published_layer(prefix: str, layer: nn.Module, args) -> dict[str, mx.array]:
    """One mlx-vlm HyV4 decoder layer's parameters under the published names."""
    out = {}
    for name, v in tree_flatten(layer.parameters()):
        if name.endswith(("embed_q.weight", "unembed_out.weight")):
            continue
        if ".switch_mlp." in name:
            if name.endswith("gate_up_proj.weight"):
                half = v.shape[1] // 2
                for e in range(v.shape[0]):
                    out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = v[e, :half]
                    out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = v[e, half:]
            else:
                for e in range(v.shape[0]):
                    out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = v[e]
            continue
        out[prefix + name] = v
    attn = layer.self_attn
    kv_b = mx.concatenate([attn.embed_q.weight.swapaxes(-1, -2), attn.unembed_out.weight], axis=1)
    weight, scale = mxfp8(kv_b.reshape(-1, args.kv_lora_rank))
    out[prefix + "self_attn.kv_b_proj.weight"] = weight
    out[prefix + "self_attn.kv_b_proj.weight_scale"] = scale
    return out


def hy_v4_mtp_modules(args) -> nn.Module:
    """The MTP layer's modules as the published checkpoint nests them under ``model.mtp_layers.0.``."""
    from mlx_vlm.speculative.drafters.hy_v4_mtp.hy_v4_mtp import HyV4MTPDecoderLayer

    layer_args = replace(
        args, num_hidden_layers=1, first_k_dense_replace=0, moe_layer_freq=1, indexer_types=["full"]
    )
    block = HyV4MTPDecoderLayer(layer_args, layer_idx=0)
    block.enorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
    block.hnorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
    block.eh_proj = nn.Linear(2 * args.hidden_size, args.hidden_size, bias=False)
    block.final_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
    return block


def hy_v4(
    path: Path,
    *,
    seed: int = 0,
    mtp_layers: int = 1,
    context_strength: float | None = None,
    hc_mult: int = 2,
    ship_mtp: bool = True,
) -> Tiny:
    """A Hunyuan-V4 checkpoint (see the module docstring). ``context_strength``: the trunk's and
    the MTP layer's output projections scaled by it and the MTP layer started from reading the
    next token's embedding alone (``eh_proj`` = [I, 0]), so its drafts agree with the trunk's
    bigram part and some are kept. ``ship_mtp`` off: the config still declares the MTP layers but
    no tensor of theirs is written (as a conversion that dropped them leaves the trunk)."""
    from mlx_vlm.models.hy_v4.config import ModelConfig
    from mlx_vlm.models.hy_v4.language import LanguageModel

    config = hy_v4_config(mtp_layers, hc_mult=hc_mult)
    args = ModelConfig.from_dict(config)
    model = LanguageModel(args)
    randomize(model, seed)
    if context_strength is not None:
        scale_outputs(model, context_strength)
        embed = model.model.embed_tokens
        embed.weight = embed.weight * embed.weight.shape[-1] ** 0.5
    tensors = {
        "model.embed_tokens.weight": model.model.embed_tokens.weight,
        "model.norm.weight": model.model.norm.weight,
        "lm_head.weight": model.lm_head.weight,
    }
    tensors.update({f"model.hc_head.{k}": v for k, v in tree_flatten(model.model.hc_head.parameters())})
    for i, layer in enumerate(model.model.layers):
        tensors.update(_published_layer(f"model.layers.{i}.", layer, args))
    for m in range(mtp_layers):
        block = hy_v4_mtp_modules(args)
        randomize(block, seed + 1 + m)
        if context_strength is not None:
            scale_outputs(block, context_strength)
            h = args.hidden_size
            block.eh_proj.weight = mx.concatenate([mx.eye(h), mx.zeros((h, h))], axis=1)
            block.enorm.weight = mx.ones((h,))
            block.final_layernorm.weight = model.model.norm.weight
        if ship_mtp:
            tensors.update(_published_layer(f"model.mtp_layers.{m}.", block, args))
    return write_checkpoint(path, tensors, config)


def tiny_hy_v4(vocab_size: int = HY_V4_VOCAB, *, seed: int = 0, hc_mult: int = 2):
    """An in-memory Hunyuan-V4 trunk as mtplx hosts it (`mtplx.trunk.vlm_text.VlmTextModel` over
    mlx-vlm's language model, float32, random weights): for the rollback tests' cache kinds."""
    from mtplx.trunk.vlm_text import VlmTextModel

    from mlx_vlm.models.hy_v4.config import ModelConfig
    from mlx_vlm.models.hy_v4.language import LanguageModel

    config = {**hy_v4_config(hc_mult=hc_mult), "vocab_size": vocab_size}
    model = LanguageModel(ModelConfig.from_dict(config))
    randomize(model, seed)
    wrapped = VlmTextModel(model, "hy_v4")
    wrapped.eval()
    return wrapped


# --------------------------------------------------------------------------- Qwen3.8-Flash-Next

QWEN4_EXP_VOCAB = 96
QWEN4_EXP_HIDDEN = 64


def qwen4_exp_config(layers: int = 4, hc_count: int = 2) -> dict:
    """Qwen3.8-Flash-Next (``qwen4_exp``) shrunk, the published config.json's shape (a top-level
    ``text_config`` and ``vision_config``; keys from mlx-vlm 0.7.10's ``models/qwen4_exp/config.py``
    ``TextConfig``): gated-delta layers with a sparse-attention (QSA) layer every second one, the
    first layer with a PLE n-gram embedding, ``hc_count`` hyper-connection streams, a 4-expert
    MoE with a shared expert; the QSA indexer keeps 2 blocks of 2 keys (``indexer_budget`` 4), so
    it selects at test lengths. The vision tower is declared (one tiny block) and not shipped."""
    text = {
        "model_type": "qwen4_exp_text",
        "hidden_size": QWEN4_EXP_HIDDEN,
        "num_hidden_layers": layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "linear_num_value_heads": 2,
        "linear_num_key_heads": 1,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "shared_expert_intermediate_size": 32,
        "moe_intermediate_size": 32,
        "rms_norm_eps": 1e-6,
        "vocab_size": QWEN4_EXP_VOCAB,
        "max_position_embeddings": 512,
        "hc_count": hc_count,
        "hc_lowrank": 16,
        "full_attention_interval": 2,
        "ple_layer_ids": [1],
        "ple_embed_dim": 32,
        "ple_conv_kernel_size": 2,
        "ngram_size": 3,
        "heads_per_ngram": 2,
        "ngram_vocab_size_base": 50,
        "make_ngram_vocab_size_divisible_by": 8,
        "split_ngram_parts": 2,
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 4,
        "indexer_compress_ratio": 2,
        "mtp_num_hidden_layers": 1,
        "eos_token_id": 1,  # support.tokenizer.word_level's EOS
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "default",
            "mrope_section": [2, 1, 1],
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
    }
    vision = {
        "model_type": "qwen4_exp",
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 32,
        "out_hidden_size": QWEN4_EXP_HIDDEN,
        "num_heads": 2,
        "patch_size": 4,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": [],
    }
    return {
        "model_type": "qwen4_exp",
        "architectures": ["Qwen4ExpForConditionalGeneration"],
        "text_config": text,
        "vision_config": vision,
        "vocab_size": QWEN4_EXP_VOCAB,
        "image_token_id": 90,
        "video_token_id": 91,
        "vision_start_token_id": 92,
        "vision_end_token_id": 93,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
    }


def _qwen4_exp_published(prefix: str, name: str, v: mx.array, out: dict) -> None:
    """One mlx-vlm parameter under its published name (the reverse of ``Model.sanitize``): the
    experts fused as ``experts.gate_up_proj`` [E, 2I, H] / ``experts.down_proj`` (no ``.weight``),
    convolutions [C, 1, K], PLE shards ``ngram_embedding.shard_{i}``."""
    if ".switch_mlp." in name:
        stem = name.split(".switch_mlp.")[0]
        if name.endswith("up_proj.weight"):
            return  # written with gate_proj
        if name.endswith("gate_proj.weight"):
            out[f"{prefix}{stem}.experts.gate_up_proj"] = v  # completed by _fuse_experts
            return
        out[f"{prefix}{stem}.experts.down_proj"] = v
        return
    if name.endswith("conv1d.weight"):
        v = v.moveaxis(2, 1)
    out[prefix + name.replace(".ngram_embedding.shards.", ".ngram_embedding.shard_")] = v


def _qwen4_exp_tensors(module: nn.Module, prefix: str) -> dict[str, mx.array]:
    params = dict(tree_flatten(module.parameters()))
    out: dict[str, mx.array] = {}
    for name, v in params.items():
        _qwen4_exp_published(prefix, name, v, out)
    for name, v in params.items():
        if name.endswith("switch_mlp.up_proj.weight"):
            key = f"{prefix}{name.split('.switch_mlp.')[0]}.experts.gate_up_proj"
            out[key] = mx.concatenate([out[key], v], axis=-2)
    return out


def qwen4_exp_mtp_module(text_args) -> nn.Module:
    """mlx-vlm's Qwen3.8-Flash-Next MTP drafter's modules (what the checkpoint ships under ``mtp.``)."""
    from mlx_vlm.speculative.drafters.qwen4_exp_mtp import Model, ModelConfig

    return Model(ModelConfig(text_config=text_args))


def qwen4_exp(
    path: Path,
    *,
    seed: int = 0,
    context_strength: float | None = None,
    hc_count: int = 2,
    ship_mtp: bool = True,
) -> Tiny:
    """A Qwen3.8-Flash-Next checkpoint (see ``qwen4_exp_config``): the trunk under
    ``model.language_model.``, ``lm_head``, the MTP predictor under ``mtp.`` (mlx-vlm's splitter
    reads those). Float32 throughout (published: bfloat16 / FP8). ``context_strength``: the
    layers' output projections scaled by it, the embeddings at the streams' scale, and the MTP
    module started from reading the next token's embedding alone (``fc_embedding`` = I,
    ``fc_hidden`` = 0) through the trunk's own mixer, so its drafts agree with the trunk's bigram
    part and some are kept."""
    from mlx_vlm.models.qwen4_exp.config import ModelConfig
    from mlx_vlm.models.qwen4_exp.language import LanguageModel

    config = qwen4_exp_config(hc_count=hc_count)
    args = ModelConfig.from_dict(config)
    model = LanguageModel(args.text_config, args)
    randomize(model, seed)
    if context_strength is not None:
        scale_outputs(
            model, context_strength, (*_OUTPUT_PROJECTIONS, "value_proj.weight", "ple.conv1d.weight")
        )  # PLE: both parts
        embed = model.model.embed_tokens
        embed.weight = embed.weight * embed.weight.shape[-1] ** 0.5
    tensors = _qwen4_exp_tensors(model.model, "model.language_model.")
    tensors["lm_head.weight"] = model.lm_head.weight
    if ship_mtp:
        mtp = qwen4_exp_mtp_module(args.text_config)
        randomize(mtp, seed + 1)
        if context_strength is not None:
            scale_outputs(mtp, context_strength)
            h = QWEN4_EXP_HIDDEN
            mtp.fc_embedding.weight = mx.eye(h)
            mtp.fc_hidden.weight = mx.zeros((h, h))
            mtp.pre_fc_norm_embedding.weight = mx.zeros((h,))  # Qwen4's norms scale by 1 + w
            mtp.hyper_connection_mixer.update(model.model.hyper_connection_mixer.parameters())
        tensors.update(_qwen4_exp_tensors(mtp, "mtp."))
    return write_checkpoint(path, tensors, config)


def tiny_qwen4_exp(vocab_size: int = QWEN4_EXP_VOCAB, *, seed: int = 0, hc_count: int = 2):
    """An in-memory Qwen3.8-Flash-Next trunk as mtplx hosts it (float32, random weights)."""
    from mtplx.trunk.vlm_text import VlmTextModel

    from mlx_vlm.models.qwen4_exp.config import ModelConfig
    from mlx_vlm.models.qwen4_exp.language import LanguageModel

    config = qwen4_exp_config(hc_count=hc_count)
    config["text_config"]["vocab_size"] = config["vocab_size"] = vocab_size
    args = ModelConfig.from_dict(config)
    model = LanguageModel(args.text_config, args)
    randomize(model, seed)
    wrapped = VlmTextModel(model, "qwen4_exp")
    wrapped.eval()
    return wrapped


# --------------------------------------------------------------------------- DeepSeek-V4

DEEPSEEK_V4_VOCAB = 96
DEEPSEEK_V4_HIDDEN = 64


def deepseek_v4_config(layers: int = 3, hc_mult: int = 2) -> dict:
    """DeepSeek-V4 shrunk (keys from mlx-vlm 0.7.10's ``models/deepseek_v4/config.py``
    ``ModelConfig``, the published config.json's flat shape): a sliding window of 8 (it slides at
    test lengths), layer 1 with ratio-4 compressed KV and its sparse indexer keeping 4 pooled keys
    (it selects at test lengths), layers 0 and 2 window-only, layer 0 hash-routed (``tid2eid``),
    a 4-expert MoE with a shared expert, ``hc_mult`` hyper-connection streams."""
    return {
        "model_type": "deepseek_v4",
        "architectures": ["DeepseekV4ForCausalLM"],
        "vocab_size": DEEPSEEK_V4_VOCAB,
        "hidden_size": DEEPSEEK_V4_HIDDEN,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "routed_scaling_factor": 1.5,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "head_dim": 32,
        "scoring_func": "sqrtsoftplus",
        "compress_ratios": [0, 4] + [0] * (layers - 2),
        "compress_rope_theta": 160000.0,
        "hc_mult": hc_mult,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "num_hash_layers": 1,
        "swiglu_limit": 10.0,
        "sliding_window": 8,
        "o_groups": 2,
        "o_lora_rank": 16,
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_topk": 4,
        "num_nextn_predict_layers": 1,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,  # support.tokenizer.word_level's EOS
    }


def _deepseek_v4_language_model(config: dict, seed: int):
    from mlx_vlm.models.deepseek_v4.config import ModelConfig
    from mlx_vlm.models.deepseek_v4.language import LanguageModel

    model = LanguageModel(ModelConfig.from_dict(config))
    randomize(model, seed)
    n = config["n_routed_experts"]
    for layer in model.model.layers:  # hash routing: every token's experts, distinct, in range
        gate = layer.ffn.gate
        if "tid2eid" in gate:
            rows = [((t + np.arange(config["num_experts_per_tok"])) % n) for t in range(config["vocab_size"])]
            gate.tid2eid = mx.array(np.stack(rows).astype(np.int32))
    return model


def tiny_deepseek_v4(vocab_size: int = DEEPSEEK_V4_VOCAB, *, seed: int = 0, hc_mult: int = 2, **changes):
    """An in-memory DeepSeek-V4 trunk as mtplx hosts it (float32, random weights, mlx-vlm's caches;
    ``changes``: config keys replaced)."""
    from mtplx.trunk.vlm_text import VlmTextModel

    config = {**deepseek_v4_config(hc_mult=hc_mult), "vocab_size": vocab_size, **changes}
    wrapped = VlmTextModel(_deepseek_v4_language_model(config, seed), "deepseek_v4")
    wrapped.eval()
    return wrapped


_DEEPSEEK_V4_EXPERTS = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def _deepseek_v4_published(name: str, v: mx.array, out: dict) -> None:
    """One mlx-vlm DeepSeek-V4 parameter under the official inference checkpoint's name (the reverse
    of ``LanguageModel.sanitize``): ``embed`` / ``head`` / ``norm`` / ``hc_head_{fn,base,scale}`` at the
    top, ``layers.{i}.`` with ``hc_{attn,ffn}_{fn,base,scale}``, ``ffn.gate.bias``, per-expert
    ``ffn.experts.{e}.w{1,2,3}``, shared experts' ``w{1,2,3}`` and a 2-D ``attn.wo_a``."""
    top = {
        "model.embed_tokens.weight": "embed.weight",
        "model.norm.weight": "norm.weight",
        "lm_head.weight": "head.weight",
    }
    if name in top:
        out[top[name]] = v
        return
    if name.startswith("model.hc_head."):
        out["hc_head_" + name.rsplit(".", 1)[1]] = v
        return
    name = name.removeprefix("model.")
    for sub in ("attn", "ffn"):
        for param in ("fn", "base", "scale"):
            name = name.replace(f".{sub}_hc.{param}", f".hc_{sub}_{param}")
    name = name.replace(".ffn.gate.e_score_correction_bias", ".ffn.gate.bias")
    for mlx_name, published in _DEEPSEEK_V4_EXPERTS.items():
        name = name.replace(f".shared_experts.{mlx_name}.", f".shared_experts.{published}.")
        if f".switch_mlp.{mlx_name}." in name:
            stem = name.split(".switch_mlp.")[0]
            for e in range(v.shape[0]):
                out[f"{stem}.experts.{e}.{published}.weight"] = v[e]
            return
    if name.endswith("attn.wo_a.weight"):
        v = v.reshape(-1, v.shape[-1])
    out[name] = v


def deepseek_v4_mtp_module(config: dict) -> nn.Module:
    """mlx-vlm's DeepSeek-V4 MTP drafter's modules (what the checkpoint ships under ``mtp.0.``)."""
    from mlx_vlm.speculative.drafters.deepseek_v4_mtp.config import DeepseekV4MTPConfig
    from mlx_vlm.speculative.drafters.deepseek_v4_mtp.deepseek_v4_mtp import DeepseekV4MTPDraftModel

    return DeepseekV4MTPDraftModel(DeepseekV4MTPConfig.from_dict({"text_config": config}))


def _deepseek_v4_mtp_published(mtp: nn.Module, out: dict, index: int = 0) -> None:
    """The drafter's parameters under the official ``mtp.{index}.`` names (the block's as a layer's)."""
    prefix = f"mtp.{index}."
    for name, v in tree_flatten(mtp.parameters()):
        if name.startswith("decoder."):
            layer: dict[str, mx.array] = {}
            _deepseek_v4_published("model.layers.0." + name.removeprefix("decoder."), v, layer)
            out.update({prefix + k.removeprefix("layers.0."): w for k, w in layer.items()})
        elif name.startswith("hc_head."):
            out[prefix + "hc_head_" + name.rsplit(".", 1)[1]] = v
        else:
            out[prefix + name] = v


E8M0_BIAS = 127


def _fp8_e8m0(w: mx.array) -> tuple[mx.array, mx.array]:
    """``w`` [m, n] as DeepSeek-V4's FP8: e4m3 bytes and one E8M0 byte (2^(b - 127)) per 128 x 128 block."""
    w8, scale = fp8_blocks(w, ue8m0=True)
    exponent = np.rint(np.log2(np.array(scale, dtype=np.float64))).astype(np.int64) + E8M0_BIAS
    return w8, mx.array(exponent.astype(np.uint8))


def _fp4_e8m0(w: mx.array) -> tuple[mx.array, mx.array]:
    """``w`` [m, n] as DeepSeek-V4's FP4 experts: e2m1 pairs in int8 bytes [m, n/2] (first element
    in the low nibble) and one E8M0 byte per 32 inputs [m, n/32]."""
    packed, scales = mx.quantize(w, group_size=32, bits=4, mode="mxfp4")
    return packed.view(mx.uint8).reshape(w.shape[0], -1).view(mx.int8), scales


def deepseek_v4_fp8_head(tensors: dict[str, mx.array], prefix: str) -> dict[str, mx.array]:
    """The MTP block's tensors under ``prefix`` as published: routed experts FP4, ``e_proj``,
    ``h_proj``, the attention's and the shared experts' linears FP8 (mlx-vlm 0.7.10's drafter
    ``make_quantization_config``: what it reads packed); norms, the router and the
    hyper-connection parameters stay float."""
    out = {}
    for name, v in tensors.items():
        local = name.removeprefix(prefix)
        if not name.startswith(prefix) or not local.endswith(".weight") or v.ndim != 2:
            out[name] = v
        elif local.startswith("ffn.experts."):
            out[name], out[name.removesuffix(".weight") + ".scale"] = _fp4_e8m0(v)
        elif local.startswith(("e_proj.", "h_proj.", "attn.w", "ffn.shared_experts.")):
            out[name], out[name.removesuffix(".weight") + ".scale"] = _fp8_e8m0(v)
        else:
            out[name] = v
    return out


def deepseek_v4(
    path: Path,
    *,
    seed: int = 0,
    hc_mult: int = 2,
    context_strength: float | None = None,
    ship_mtp: bool = True,
    mtp_index: int = 0,
    fp8_head: bool = False,
) -> Tiny:
    """A DeepSeek-V4 checkpoint in the official inference layout (see ``_deepseek_v4_published``),
    float32 (published: FP8 / FP4), the MTP block under ``mtp.{mtp_index}.`` (mlx-vlm's splitter
    reads those; DeepSeek-V4-Flash ships ``mtp.1.``); ``fp8_head``: the block's linears as published
    (`deepseek_v4_fp8_head`), the trunk still float. ``context_strength``: the layers' output projections scaled by it, the embeddings at
    the streams' scale, and the MTP block started from reading the next token's embedding alone
    (``e_proj`` = I, ``h_proj`` = 0) through the trunk's own ``hc_head`` and ``norm``, so its
    drafts agree with the trunk's bigram part and some are kept."""
    config = deepseek_v4_config(hc_mult=hc_mult)
    model = _deepseek_v4_language_model(config, seed)
    if context_strength is not None:
        scale_outputs(model, context_strength, (*_OUTPUT_PROJECTIONS, "wo_b.weight"))
        embed = model.model.embed_tokens
        embed.weight = embed.weight * embed.weight.shape[-1] ** 0.5
    tensors: dict[str, mx.array] = {}
    for name, v in tree_flatten(model.parameters()):
        _deepseek_v4_published(name, v, tensors)
    if ship_mtp:
        mtp = deepseek_v4_mtp_module(config)
        randomize(mtp, seed + 1)
        if context_strength is not None:
            scale_outputs(mtp, context_strength, (*_OUTPUT_PROJECTIONS, "wo_b.weight"))
            h = DEEPSEEK_V4_HIDDEN
            mtp.e_proj.weight = mx.eye(h)
            mtp.h_proj.weight = mx.zeros((h, h))
            mtp.enorm.weight = mx.ones((h,))
            mtp.hc_head.update(model.model["hc_head"].parameters())
            mtp.norm.weight = model.model["norm"].weight
        _deepseek_v4_mtp_published(mtp, tensors, mtp_index)
        if fp8_head:
            tensors = deepseek_v4_fp8_head(tensors, f"mtp.{mtp_index}.")
    return write_checkpoint(path, tensors, config)


# --------------------------------------------------------------------------- GLM-5-Next

GLM5_NEXT_VOCAB = 96
GLM5_NEXT_HIDDEN = 64


def glm5_next_config(layers: int = 4, hc_mult: int = 2) -> dict:
    """GLM-5-Next shrunk, the published config.json's shape (a top-level ``text_config`` and
    ``vision_config``; keys from mlx-vlm 0.7.10's ``models/glm5_next/config.py``): linear-attention
    layers with a NoPE MLA sparse-attention layer every fourth (the published rule), its indexer
    keeping 4 keys in pools of 2 (it selects at test lengths), a dense first layer and a 4-expert
    MoE after, ``hc_mult`` hyper-connection streams. The vision tower is declared and not shipped."""
    text = {
        "model_type": "glm5_next_text",
        "vocab_size": GLM5_NEXT_VOCAB,
        "hidden_size": GLM5_NEXT_HIDDEN,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": layers,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 32,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 0,
        "v_head_dim": 32,
        "qk_nope_head_dim": 32,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "index_topk": 4,
        "index_head_dim": 16,
        "index_n_heads": 2,
        "index_kpool": 2,
        "linear_attn_config": {"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4},
        "hc_mult": hc_mult,
        "first_k_dense_replace": 1,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "eos_token_id": 1,  # support.tokenizer.word_level's EOS
        "pad_token_id": 0,
        "tie_word_embeddings": False,
    }
    vision = {
        "model_type": "glm5_next_vision",
        "depth": 1,
        "hidden_size": 16,
        "num_heads": 2,
        "intermediate_size": 32,
        "out_hidden_size": GLM5_NEXT_HIDDEN,
        "patch_size": 4,
    }
    return {
        "model_type": "glm5_next",
        "architectures": ["Glm5NextForConditionalGeneration"],
        "text_config": text,
        "vision_config": vision,
        "vocab_size": GLM5_NEXT_VOCAB,
        "image_token_id": 90,
        "video_token_id": 91,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
    }


def _glm5_next_language_model(config: dict, seed: int):
    from mlx_vlm.models.glm5_next.config import ModelConfig
    from mlx_vlm.models.glm5_next.language import LanguageModel

    model = LanguageModel(ModelConfig.from_dict(config).text_config)
    randomize(model, seed)
    return model


def tiny_glm5_next(vocab_size: int = GLM5_NEXT_VOCAB, *, seed: int = 0, hc_mult: int = 2):
    """An in-memory GLM-5-Next trunk as mtplx hosts it (float32, random weights, mlx-vlm's caches)."""
    from mtplx.trunk.vlm_text import VlmTextModel

    config = glm5_next_config(hc_mult=hc_mult)
    config["vocab_size"] = config["text_config"]["vocab_size"] = vocab_size
    wrapped = VlmTextModel(_glm5_next_language_model(config, seed), "glm5_next")
    wrapped.eval()
    return wrapped


def _glm5_next_published_layer(prefix: str, name: str, v: mx.array, args, out: dict) -> None:
    """One mlx-vlm GLM-5-Next layer parameter (``name`` relative to the layer) under the published
    names (the reverse of ``LanguageModel.sanitize``): separate ``q/k/v_proj``, ``f_a/b/g_a_proj``,
    ``q/k/v_conv1d`` [C, 1, K], ``gate_proj`` / ``up_proj``, per-expert ``experts.{e}.*``,
    ``q_a_proj`` / ``kv_a_proj_with_mqa``, a fused ``kv_b_proj``, ``hc_{attn,ffn}_{fn,base,scale}``."""
    for site in ("attn", "ffn"):
        for param in ("fn", "base", "scale"):
            name = name.replace(f"{site}_hc.{param}", f"hc_{site}_{param}")
    stem = name.rsplit(".", 2)[0] if name.count(".") >= 2 else ""
    if name.endswith("qkv_proj.weight"):
        for part, w in zip(("q_proj", "k_proj", "v_proj"), mx.split(v, 3, axis=0)):
            out[f"{prefix}{stem}.{part}.weight"] = w
    elif name.endswith("qkv_conv.conv.weight"):
        stem = name.removesuffix(".qkv_conv.conv.weight")
        for part, w in zip(("q_conv1d", "k_conv1d", "v_conv1d"), mx.split(v, 3, axis=0)):
            out[f"{prefix}{stem}.{part}.weight"] = w.moveaxis(2, 1)
    elif name.endswith("fbg_a_proj.weight"):
        hd, nh = args.linear_head_dim, args.linear_num_heads
        for part, w in zip(("f_a_proj", "b_proj", "g_a_proj"), mx.split(v, [hd, hd + nh], axis=0)):
            out[f"{prefix}{stem}.{part}.weight"] = w
    elif name.endswith("gate_up_proj.weight"):
        for part, w in zip(("gate_proj", "up_proj"), mx.split(v, 2, axis=0)):
            out[f"{prefix}{stem}.{part}.weight"] = w
    elif ".switch_mlp." in name:
        mlp, proj = name.split(".switch_mlp.")
        for e in range(v.shape[0]):
            out[f"{prefix}{mlp}.experts.{e}.{proj}"] = v[e]
    elif name.endswith("qkv_a_proj.weight"):
        for part, w in zip(("q_a_proj", "kv_a_proj_with_mqa"), mx.split(v, [args.q_lora_rank], axis=0)):
            out[f"{prefix}{stem}.{part}.weight"] = w
    elif name.endswith("embed_q.weight"):
        return  # written with unembed_out
    elif name.endswith("unembed_out.weight"):
        return
    else:
        out[prefix + name] = v


def _glm5_next_tensors(model, args) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for name, v in tree_flatten(model.model.parameters()):
        if name.startswith("layers."):
            i, rest = name.split(".", 2)[1:]
            _glm5_next_published_layer(f"model.language_model.layers.{i}.", rest, v, args, out)
        else:
            out["model.language_model." + name] = v
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        if "embed_q" in attn:
            kv_b = mx.concatenate([attn.embed_q.weight.swapaxes(-1, -2), attn.unembed_out.weight], axis=1)
            out[f"model.language_model.layers.{i}.self_attn.kv_b_proj.weight"] = kv_b.reshape(
                -1, args.kv_lora_rank
            )
    out["lm_head.weight"] = model.lm_head.weight
    return out


def glm5_next_mtp_module(text_args) -> nn.Module:
    """mlx-vlm's GLM-5-Next MTP drafter's modules (what the checkpoint ships at layer ``num_hidden_layers``)."""
    from mlx_vlm.speculative.drafters.glm5_next_mtp.config import Glm5NextMTPConfig
    from mlx_vlm.speculative.drafters.glm5_next_mtp.glm5_next_mtp import Glm5NextMTPDraftModel

    return Glm5NextMTPDraftModel(Glm5NextMTPConfig(text_config=text_args))


def _glm5_next_mtp_tensors(mtp: nn.Module, args) -> dict[str, mx.array]:
    """The drafter's parameters under the published layer ``num_hidden_layers``'s names."""
    prefix = f"model.language_model.layers.{args.num_hidden_layers}."
    out: dict[str, mx.array] = {}
    for name, v in tree_flatten(mtp.parameters()):
        if name.startswith("mtp_block."):
            _glm5_next_published_layer(prefix, name.removeprefix("mtp_block."), v, args, out)
        else:
            out[prefix + name.replace("shared_head_norm.", "shared_head.norm.")] = v
    attn = mtp.mtp_block.self_attn
    kv_b = mx.concatenate([attn.embed_q.weight.swapaxes(-1, -2), attn.unembed_out.weight], axis=1)
    out[prefix + "self_attn.kv_b_proj.weight"] = kv_b.reshape(-1, args.kv_lora_rank)
    return out


def glm5_next(
    path: Path,
    *,
    seed: int = 0,
    hc_mult: int = 2,
    context_strength: float | None = None,
    ship_mtp: bool = True,
) -> Tiny:
    """A GLM-5-Next checkpoint in the published layout (``model.language_model.*``, ``lm_head``;
    see ``_glm5_next_published_layer``), float32, the MTP layer at index ``num_hidden_layers``
    (mlx-vlm's splitter reads it there). ``context_strength``: the layers' output projections
    scaled by it, the embeddings at the streams' scale, and the MTP layer started from reading the
    next token's embedding alone (``eh_proj`` = [I, 0]) through the trunk's final norm weight, so
    its drafts agree with the trunk's bigram part and some are kept."""
    config = glm5_next_config(hc_mult=hc_mult)
    model = _glm5_next_language_model(config, seed)
    args = model.args
    if context_strength is not None:
        scale_outputs(model, context_strength)
        embed = model.model.embed_tokens
        embed.weight = embed.weight * embed.weight.shape[-1] ** 0.5
    tensors = _glm5_next_tensors(model, args)
    if ship_mtp:
        mtp = glm5_next_mtp_module(args)
        randomize(mtp, seed + 1)
        if context_strength is not None:
            scale_outputs(mtp, context_strength)
            h = GLM5_NEXT_HIDDEN
            mtp.eh_proj.weight = mx.concatenate([mx.eye(h), mx.zeros((h, h))], axis=1)
            mtp.enorm.weight = mx.ones((h,))
            mtp.shared_head_norm.weight = model.model.norm.weight
        tensors.update(_glm5_next_mtp_tensors(mtp, args))
    return write_checkpoint(path, tensors, config)


# --------------------------------------------------------------------------- MiniMax-M3

MINIMAX_M3_VOCAB = 96
MINIMAX_M3_HIDDEN = 64


def minimax_m3_config(layers: int = 3) -> dict:
    """MiniMax-M3 shrunk (keys from mlx-vlm 0.7.10's ``models/minimax_m3_vl/config.py``
    ``TextConfig``, the published flat config.json): a dense first layer, then MoE layers with
    block-sparse attention (blocks of 2 keys, the 2 best blocks plus the local one: it selects at
    test lengths), 4 routed experts and a shared one packed with them (equal widths)."""
    return {
        "model_type": "minimax_m3",
        "architectures": ["MiniMaxM3ForCausalLM"],
        "vocab_size": MINIMAX_M3_VOCAB,
        "hidden_size": MINIMAX_M3_HIDDEN,
        "intermediate_size": 32,
        "dense_intermediate_size": 64,
        "shared_intermediate_size": 32,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "num_hidden_layers": layers,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sparse_attention_config": {  # as published: which layers index, and how
            "use_sparse_attention": True,
            "sparse_attention_freq": [0] + [1] * (layers - 1),
            "sparse_disable_index_value": [0] + [1] * (layers - 1),
            "sparse_score_type": "max",
            "sparse_init_block": 0,
        },
        "mlp_layer_types": ["dense"] + ["sparse"] * (layers - 1),
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_block_size": 2,
        "index_topk_blocks": 2,
        "index_local_blocks": 1,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "eos_token_id": 1,  # support.tokenizer.word_level's EOS
    }


def _minimax_m3_language_model(config: dict, seed: int):
    from mlx_vlm.models.minimax_m3 import Model, ModelConfig

    model = Model(ModelConfig.from_dict(config)).language_model
    randomize(model, seed)
    return model


def tiny_minimax_m3(vocab_size: int = MINIMAX_M3_VOCAB, *, seed: int = 0):
    """An in-memory MiniMax-M3 trunk as mtplx hosts it (float32, random weights, mlx-vlm's caches)."""
    from mtplx.trunk.vlm_text import VlmTextModel

    config = {**minimax_m3_config(), "vocab_size": vocab_size}
    wrapped = VlmTextModel(_minimax_m3_language_model(config, seed), "minimax_m3")
    wrapped.eval()
    return wrapped


def minimax_m3(path: Path, *, seed: int = 0) -> Tiny:
    """A MiniMax-M3 checkpoint in the published layout (the reverse of mlx-vlm's ``sanitize``):
    ``model.*`` and ``lm_head``, each MoE layer's ``block_sparse_moe.experts.{e}.w{1,2,3}`` and
    ``shared_experts.{gate,up,down}_proj`` (mlx-vlm packs the shared expert as the last one)."""
    config = minimax_m3_config()
    model = _minimax_m3_language_model(config, seed)
    n, inter = config["num_local_experts"], config["intermediate_size"]
    out: dict[str, mx.array] = {}
    for name, v in tree_flatten(model.parameters()):
        if ".switch_mlp." not in name:
            out[name] = v
            continue
        stem = name.split(".switch_mlp.")[0]
        if name.endswith("gate_up_proj.weight"):
            for e in range(n):
                out[f"{stem}.experts.{e}.w1.weight"] = v[e, :inter]
                out[f"{stem}.experts.{e}.w3.weight"] = v[e, inter:]
            out[f"{stem}.shared_experts.gate_proj.weight"] = v[n, :inter]
            out[f"{stem}.shared_experts.up_proj.weight"] = v[n, inter:]
        else:
            for e in range(n):
                out[f"{stem}.experts.{e}.w2.weight"] = v[e]
            out[f"{stem}.shared_experts.down_proj.weight"] = v[n]
    return write_checkpoint(path, out, config)
