"""Tiny checkpoint directories, written as the Hugging Face checkpoints are: real HF tensor names
and config fields (the reverse of each mlx-lm ``sanitize``), head tensors under the family's own
key prefix. The models and configs come from ``support.models``.

Families: ``qwen3_5`` (hybrid gated-delta + gated attention, norms stored as offsets from 1,
``model.language_model.`` prefix, torch conv layout), ``deepseek_v3`` (MLA attention with the
fused ``kv_b_proj``, optional MoE with per-expert tensors, MTP layer at ``num_hidden_layers``),
``glm4_moe`` (GLM-4.5: GQA + MoE, the MTP layer at ``num_hidden_layers`` in DeepSeek's
layout), ``mimo`` (Qwen2-style, ``model.mtp_layers.0.*``), ``gemma4_target`` and
``gemma4_assistant`` (``model.language_model.*``; ``model.*``, ``pre_projection``,
``post_projection``, ``masked_embedding.*``), and the others below; ``save_model`` writes any
in-memory mlx-lm model as mlx-lm saves it. Everything is float32 so the NumPy float64 reference
comparisons are tight, but ``glm4_moe`` (bfloat16 as published, by default).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from support.models import (
    GEMMA4_DRAFT_HIDDEN,
    GEMMA4_DRAFT_LAYERS,
    HIDDEN,
    VOCAB,
    deepseek_v3_config,
    ernie4_5_moe_config,
    gemma4_assistant_config,
    gemma4_config,
    glm4_moe_config,
    longcat_flash_config,
    mimo_config,
    mimo_v2_flash_config,
    qwen3_5_config,
    qwen3_5_mtp_layer,
    randomize,
    scale_outputs,
    step3p5_config,
    tiny_gemma4,
)


def _random_replica(family, config: dict, seed: int, context_strength: float | None):
    """(args, model): mlx-lm's ``family`` module built from ``config`` with `randomize`d weights.
    With ``context_strength``, the output projections are scaled (`scale_outputs`) and the
    embeddings brought to the residual stream's scale (RMS 1, as the MTP module's normed input
    is), so the head agrees with the trunk's bigram part and its drafts are kept."""
    args = family.ModelArgs.from_dict(config)
    model = family.Model(args)
    randomize(model, seed)
    if context_strength is not None:
        scale_outputs(model, context_strength)
        embed = getattr(model, "language_model", model).model.embed_tokens
        embed.weight = embed.weight * embed.weight.shape[-1] ** 0.5
    return args, model


@dataclass
class Tiny:
    path: Path
    config: dict
    tensors: dict[str, np.ndarray]  # exactly what was written, by HF name (bfloat16 as float32)
    head_module: nn.Module | None = None  # the head as built in mlx (quantized variants)


def write_checkpoint(path: Path, tensors: dict[str, mx.array], config: dict, shards: int = 1) -> Tiny:
    """``config.json`` and the tensors in ``shards`` safetensors files (with the index HF writes
    when there is more than one); the ``Tiny`` returned holds what was written."""
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
    return Tiny(path, config, {k: _numpy(v) for k, v in tensors.items()})


def _numpy(v: mx.array) -> np.ndarray:
    """NumPy has no bfloat16: such a tensor comes back as float32 (exact)."""
    return np.array(v.astype(mx.float32) if v.dtype == mx.bfloat16 else v)


def save_model(path: Path, model: nn.Module, **config) -> Tiny:
    """``model`` (an in-memory mlx-lm model) as mlx-lm saves one: its own parameter names (for a
    llama also the HF names) and its ``ModelArgs`` as config.json, ``config`` added on top."""
    fields = {k: v for k, v in asdict(model.args).items() if v is not None}
    return write_checkpoint(path, dict(tree_flatten(model.parameters())), {**fields, **config})


def _prefixed(module: nn.Module, prefix: str) -> dict[str, mx.array]:
    return {prefix + k: v for k, v in tree_flatten(module.parameters())}


def _write_with_head(path: Path, trunk: dict, head: dict, config: dict, shards: int, sidecar: bool) -> Tiny:
    if not sidecar:
        return write_checkpoint(path, {**trunk, **head}, config, shards)
    tiny = write_checkpoint(path, trunk, config, shards)
    mx.save_safetensors(str(path / "mtp.safetensors"), head, {"format": "pt"})
    tiny.tensors.update({k: np.array(v) for k, v in head.items()})
    return tiny


def _unstack_experts(params: dict[str, mx.array]) -> dict[str, mx.array]:
    """mlx-lm's stacked ``mlp.switch_mlp.{proj}`` -> HF's per-expert ``mlp.experts.{e}.{proj}``."""
    out = {}
    for name, v in params.items():
        if ".mlp.switch_mlp." in name:
            layer, proj = name.split(".mlp.switch_mlp.")
            for e in range(v.shape[0]):
                out[f"{layer}.mlp.experts.{e}.{proj}"] = v[e]
        else:
            out[name] = v
    return out


def reads_next_embedding(eh_proj: nn.Linear, enorm: nn.RMSNorm) -> None:
    """Start an MTP module from reading the next token's embedding alone (``eh_proj`` = [I, 0],
    ``enorm`` = 1): with the trunk's final norm after it, the head predicts the trunk's bigram
    part and some drafts are kept (the ``context_strength`` factories)."""
    h = eh_proj.weight.shape[0]
    eh_proj.weight = mx.concatenate([mx.eye(h), mx.zeros((h, h))], axis=1)
    enorm.weight = mx.ones((h,))


def eh_proj_module(
    prefix: str,
    hidden: int,
    seed: int,
    *,
    context_strength: float | None,
    trunk_norm: mx.array,
    renames: tuple[tuple[str, str], ...] = (),
) -> dict[str, mx.array]:
    """A DeepSeek-style MTP module's own tensors (``enorm``, ``hnorm``, ``eh_proj``,
    ``final_layernorm``) under ``prefix``, random from ``seed``; ``renames`` (our name, the
    family's, first match) spell them as the family publishes them. With ``context_strength`` the
    module reads the next token's embedding alone and its final norm is the trunk's."""
    mod = nn.Module()
    mod.enorm, mod.hnorm = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
    mod.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
    mod.final_layernorm = nn.RMSNorm(hidden)
    randomize(mod, seed)
    if context_strength is not None:
        reads_next_embedding(mod.eh_proj, mod.enorm)
        mod.final_layernorm.weight = trunk_norm
    out = {}
    for name, v in tree_flatten(mod.parameters()):
        out[prefix + next((new + name[len(old) :] for old, new in renames if name.startswith(old)), name)] = v
    return out


# --------------------------------------------------------------------------- qwen3_5


def _qwen35_offset(name: str, v: mx.array) -> mx.array:
    # HF Qwen3.5 RMSNorm computes x * (1 + w): the file stores w = weight - 1.
    # Every RMSNorm but the gated-delta one (mtp.pre_fc_norm_* included, as in the HF files).
    is_norm = v.ndim == 1 and "norm" in name.split(".")[-2] and "linear_attn" not in name
    return v - 1.0 if is_norm else v


def _qwen_next_head_module(layers: list) -> nn.Module:
    m = nn.Module()
    m.fc = nn.Linear(2 * HIDDEN, HIDDEN, bias=False)
    m.pre_fc_norm_embedding = nn.RMSNorm(HIDDEN)
    m.pre_fc_norm_hidden = nn.RMSNorm(HIDDEN)
    m.layers = layers
    m.norm = nn.RMSNorm(HIDDEN)
    return m


def qwen3_5(
    path: Path,
    *,
    mtp_layers: int = 1,
    ship_mtp: bool = True,
    shards: int = 1,
    seed: int = 0,
    context_strength: float | None = None,
) -> Tiny:
    """A Qwen3.5 checkpoint declaring ``mtp_layers`` MTP layers, their tensors under ``mtp.``
    unless ``ship_mtp`` is off (as a converter that dropped them leaves it).
    ``context_strength`` as ``deepseek_v3``'s: the head starts from reading the next token's
    embedding alone (``fc`` = [I, 0]), so it predicts the trunk's bigram part and drafts are kept."""
    from mlx_lm.models import qwen3_5 as q

    config = qwen3_5_config(mtp_layers=mtp_layers)
    _, model = _random_replica(q, config, seed, context_strength)
    inner = model.language_model.model
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
        head = _qwen_next_head_module([qwen3_5_mtp_layer(model) for _ in range(mtp_layers)])
        randomize(head, seed + 1)
        if context_strength is not None:
            scale_outputs(head, context_strength)
            head.fc.weight = mx.concatenate([mx.eye(HIDDEN), mx.zeros((HIDDEN, HIDDEN))], axis=1)
            head.pre_fc_norm_embedding.weight = mx.ones((HIDDEN,))
            head.norm.weight = inner.norm.weight
        for name, v in _prefixed(head, "mtp.").items():
            tensors[name] = _qwen35_offset(name, v)
    return write_checkpoint(path, tensors, config, shards)


# --------------------------------------------------------------------------- deepseek_v3


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


def _deepseek_layer_class(model_type: str) -> type:
    if model_type == "deepseek_v3":
        from mlx_lm.models.deepseek_v3 import DeepseekV3DecoderLayer

        return DeepseekV3DecoderLayer
    if model_type == "glm4_moe_lite":
        from mlx_lm.models.glm4_moe_lite import Glm4MoeLiteDecoderLayer

        return Glm4MoeLiteDecoderLayer
    from mlx_lm.models.deepseek_v32 import DeepseekV32DecoderLayer  # glm_moe_dsa builds these too

    return DeepseekV32DecoderLayer


DEEPSEEK_NAMES = (("final_layernorm.", "shared_head.norm."),)  # eh_proj_module's names as DeepSeek's
FP8_BLOCK = 128
FP8_MAX = 448.0  # largest finite e4m3


def fp8_blocks(w: mx.array, ue8m0: bool) -> tuple[mx.array, mx.array]:
    """``w`` [..., m, n] as DeepSeek's FP8 layout: e4m3 bytes and one inverse scale per 128 x 128
    block (edge blocks short): the block's max |w| / 448, rounded up to a power of two for V3.1's
    ``ue8m0`` scales. Returns (uint8 [..., m, n], float32 [..., ceil(m/128), ceil(n/128)])."""
    a = np.array(w.astype(mx.float32), dtype=np.float64)
    *lead, m, n = a.shape
    mb, nb = -(-m // FP8_BLOCK), -(-n // FP8_BLOCK)
    scale = np.empty((*lead, mb, nb))
    for i in range(mb):
        for j in range(nb):
            block = a[..., i * FP8_BLOCK : (i + 1) * FP8_BLOCK, j * FP8_BLOCK : (j + 1) * FP8_BLOCK]
            amax = np.maximum(np.abs(block).max(axis=(-2, -1)), 1e-12) / FP8_MAX
            scale[..., i, j] = 2.0 ** np.ceil(np.log2(amax)) if ue8m0 else amax
    full = scale.repeat(FP8_BLOCK, axis=-2)[..., :m, :].repeat(FP8_BLOCK, axis=-1)[..., :n]
    return mx.to_fp8(mx.array((a / full).astype(np.float32))), mx.array(scale.astype(np.float32))


def _fp8_head(head: dict[str, mx.array], ue8m0: bool) -> dict[str, mx.array]:
    """The MTP layer's linear weights (attention, MLPs, experts, ``eh_proj``) in FP8 blocks, as
    DeepSeek's FP8 checkpoints store them; norms, the router gate and the embedding / LM-head
    copies stay float."""
    out = {}
    for name, v in head.items():
        keep = v.ndim < 2 or "norm" in name or name.endswith(("mlp.gate.weight", "embed_tokens.weight"))
        if keep or "shared_head.head" in name:
            out[name] = v
            continue
        out[name], out[name + "_scale_inv"] = fp8_blocks(v, ue8m0)
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
    model_type: str = "deepseek_v3",
    context_strength: float | None = None,
    fp8: str | None = None,
) -> Tiny:
    """``context_strength``: scale the trunk's and the MTP blocks' output projections by it and
    start each MTP module from reading the next token's embedding alone (``eh_proj`` = [I, 0],
    ``enorm`` = 1, ``shared_head.norm`` = the trunk's final norm), so the head predicts the
    trunk's bigram part and some drafts are accepted. ``sidecar=True`` writes the MTP layers to ``mtp.safetensors`` beside the trunk's files,
    where mlx-lm never reads them (needed for ``mtp_layers > 1`` or ``trunk_layers != 61`` with
    ``deepseek_v3``: its sanitize drops only ``model.layers.61.*``). ``model_type``
    "deepseek_v32" (DeepSeek-V3.2) or "glm_moe_dsa" (GLM-5): MLA with the DSA indexer
    (``self_attn.indexer.*``, as those checkpoints name it; their sanitize drops every layer
    from ``num_hidden_layers`` on). ``fp8`` "ue8m0" (V3.1: power-of-two block scales) or "float"
    (V3 / R1): the MTP layer's linear weights in FP8 128 x 128 blocks, with the config's
    ``quantization_config`` as published."""
    import importlib

    d = importlib.import_module(f"mlx_lm.models.{model_type}")
    layer_class = _deepseek_layer_class(model_type)
    config = deepseek_v3_config(moe, mtp_layers, trunk_layers, model_type)
    args, model = _random_replica(d, config, seed, context_strength)
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
        block = layer_class(args, L)
        randomize(block, seed + 1 + 3 * m)
        if context_strength is not None:
            scale_outputs(block, context_strength)
        p = f"model.layers.{L}."
        head.update(_deepseek_hf_layer(p, block, args))
        head.update(
            eh_proj_module(
                p,
                HIDDEN,
                seed + 2 + 3 * m,
                context_strength=context_strength,
                trunk_norm=model.model.norm.weight,
                renames=DEEPSEEK_NAMES,
            )
        )
        # DeepSeek ships copies of the embedding and the LM head inside the MTP layer.
        head[p + "embed_tokens.weight"] = model.model.embed_tokens.weight
        head[p + "shared_head.head.weight"] = model.lm_head.weight
    if fp8 is not None:
        head = _fp8_head(head, ue8m0=fp8 == "ue8m0")
        config["quantization_config"] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
            **({"scale_fmt": "ue8m0"} if fp8 == "ue8m0" else {}),
        }
    return _write_with_head(path, tensors, head, config, shards, sidecar)


# --------------------------------------------------------------------------- glm4_moe


def glm4_moe(
    path: Path,
    *,
    ship_mtp: bool = True,
    shards: int = 1,
    seed: int = 0,
    context_strength: float | None = None,
    qk_norm: bool = True,
    dtype: mx.Dtype = mx.bfloat16,
) -> Tiny:
    """GLM-4.5 / 4.6 / 4.7 as published (``support.models.glm4_moe_config``): per-expert MoE
    tensors (``mlp.experts.{e}.*``, ``mlp.shared_experts.*``, ``mlp.gate.weight`` and
    ``mlp.gate.e_score_correction_bias``), GQA ``self_attn.{q,k,v}_proj`` with biases and
    ``q_norm`` / ``k_norm`` (none with ``qk_norm`` off, as GLM-4.5-Air), and the one MTP layer
    at ``model.layers.{num_hidden_layers}.``: ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, ``shared_head.head`` (an LM-head
    copy), ``embed_tokens`` (an embedding copy) and a MoE decoder layer of the trunk's class at
    the same prefix (vLLM ``glm4_moe_mtp.py``'s name map; mlx-lm's ``glm4_moe`` sanitize drops
    that layer). Everything ``dtype`` (bfloat16 as published) but the router's correction bias,
    kept float32 (mlx-lm's ``cast_predicate`` leaves it so). ``context_strength`` as
    ``deepseek_v3``'s (the head agrees with the trunk's bigram part, so drafts are kept)."""
    from mlx_lm.models import glm4_moe as g

    config = glm4_moe_config(qk_norm=qk_norm)
    args, model = _random_replica(g, config, seed, context_strength)
    tensors = _unstack_experts(dict(tree_flatten(model.parameters())))
    if ship_mtp:
        layer = args.num_hidden_layers
        block = g.DecoderLayer(args, layer)  # past first_k_dense_replace: MoE, as in GLM-4.5
        randomize(block, seed + 2)
        if context_strength is not None:
            scale_outputs(block, context_strength)
        p = f"model.layers.{layer}."
        tensors.update(
            eh_proj_module(
                p,
                HIDDEN,
                seed + 1,
                context_strength=context_strength,
                trunk_norm=model.model.norm.weight,
                renames=DEEPSEEK_NAMES,
            )
        )
        tensors.update(_unstack_experts(_prefixed(block, p)))
        tensors[p + "embed_tokens.weight"] = model.model.embed_tokens.weight
        tensors[p + "shared_head.head.weight"] = model.lm_head.weight
    tensors = {k: v if k.endswith("e_score_correction_bias") else v.astype(dtype) for k, v in tensors.items()}
    return write_checkpoint(path, tensors, config, shards)


# --------------------------------------------------------------------------- mimo


def _mimo_head_module(block: nn.Module, hidden: int = HIDDEN) -> nn.Module:
    m = nn.Module()
    m.token_layernorm, m.hidden_layernorm = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
    m.input_proj = nn.Linear(2 * hidden, hidden, bias=False)
    m.block = block
    m.final_layernorm = nn.RMSNorm(hidden)
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
    vocab_size: int = VOCAB,
    ship_mtp: bool = True,
    shards: int = 1,
    seed: int = 0,
    quantize: dict | None = None,
    head_override_bits: int | None = None,
    mtp_layers: int = 1,
    num_heads: int = 4,
    hidden_size: int = HIDDEN,
    num_layers: int = 2,
) -> Tiny:
    """``quantize={"group_size": 32, "bits": 4}`` writes an mlx-format quantized checkpoint
    (``.scales``/``.biases``, a ``quantization`` block); ``head_override_bits`` adds a per-layer
    override for the head's ``input_proj``; ``num_heads``, ``hidden_size`` and ``num_layers`` as
    `mimo_config`."""
    from mlx_lm.models import mimo as m

    config = mimo_config(vocab_size, mtp_layers, num_heads, hidden_size, num_layers)
    args = m.ModelArgs.from_dict(config)
    model = m.Model(args)
    randomize(model, seed)
    heads = [_mimo_head_module(m.TransformerBlock(args), hidden_size) for _ in range(mtp_layers)]
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


# --------------------------------------------------------------------------- mimo_v2_flash


def mimo_v2_flash(
    path: Path,
    *,
    mtp_layers: int = 3,
    window: int = 4,
    ship_mtp: bool = True,
    seed: int = 0,
    context_strength: float | None = None,
) -> Tiny:
    """MiMo-V2-Flash as published: trunk experts per expert (``mlp.experts.{e}.*``), the MTP
    modules under ``model.mtp.layers.{i}.`` (enorm, hnorm, eh_proj, final_layernorm, and the
    block's self_attn / mlp / input_layernorm / pre_mlp_layernorm at the same prefix).
    ``context_strength`` as ``deepseek_v3``'s (the head agrees with the trunk's bigram part)."""
    from mlx_lm.models import mimo_v2_flash as m

    config = mimo_v2_flash_config(VOCAB, mtp_layers, window)
    args, model = _random_replica(m, config, seed, context_strength)
    tensors = _unstack_experts(dict(tree_flatten(model.parameters())))
    for i in range(mtp_layers if ship_mtp else 0):
        block = m.DecoderLayer(args, is_moe=False, is_sliding_window=True)
        randomize(block, seed + 2 + 2 * i)
        if context_strength is not None:
            scale_outputs(block, context_strength)
        p = f"model.mtp.layers.{i}."
        norm = model.model.norm.weight
        tensors.update(
            eh_proj_module(p, HIDDEN, seed + 1 + 2 * i, context_strength=context_strength, trunk_norm=norm)
        )
        for name, v in _prefixed(block, p).items():
            tensors[name.replace(".post_attention_layernorm.", ".pre_mlp_layernorm.")] = v
    return write_checkpoint(path, tensors, config)


# --------------------------------------------------------------------------- ernie4_5_moe


def ernie4_5_moe(
    path: Path,
    *,
    mtp_layers: int = 1,
    ship_mtp: bool = True,
    seed: int = 0,
    context_strength: float | None = None,
) -> Tiny:
    """ERNIE-4.5 MoE as published: experts per expert (``mlp.experts.{e}.*``), the router's
    ``moe_statics.e_score_correction_bias``, and the MTP layers as four lists indexed by layer:
    ``model.mtp_emb_norm.{i}``, ``model.mtp_hidden_norm.{i}``, ``model.mtp_linear_proj.{i}``,
    ``model.mtp_block.{i}.*`` (a dense decoder layer). ``context_strength`` as ``deepseek_v3``'s,
    with ``mtp_emb_norm`` = the trunk's final norm (the layer has no final norm of its own)."""
    from mlx_lm.models import ernie4_5_moe as e

    config = ernie4_5_moe_config(mtp_layers=mtp_layers)
    args, model = _random_replica(e, config, seed, context_strength)
    tensors = _unstack_experts(dict(tree_flatten(model.parameters())))
    tensors["model.layers.1.mlp.moe_statics.e_score_correction_bias"] = mx.zeros((1, args.moe_num_experts))
    for i in range(mtp_layers if ship_mtp else 0):
        mod = nn.Module()
        mod.mtp_emb_norm, mod.mtp_hidden_norm = nn.RMSNorm(HIDDEN), nn.RMSNorm(HIDDEN)
        mod.mtp_linear_proj = nn.Linear(2 * HIDDEN, HIDDEN, bias=False)
        block = e.Ernie4_5_DecoderLayer(args, args.num_hidden_layers + i)  # dense, as the references build it
        randomize(mod, seed + 1 + 2 * i)
        randomize(block, seed + 2 + 2 * i)
        if context_strength is not None:
            scale_outputs(block, context_strength)
            reads_next_embedding(mod.mtp_linear_proj, mod.mtp_emb_norm)
            mod.mtp_emb_norm.weight = model.model.norm.weight
        for name, v in tree_flatten(mod.parameters()):
            own, rest = name.split(".", 1)
            tensors[f"model.{own}.{i}.{rest}"] = v
        tensors.update(_prefixed(block, f"model.mtp_block.{i}."))
    return write_checkpoint(path, tensors, config)


# --------------------------------------------------------------------------- longcat_flash


def _mla_hf(prefix: str, attn: nn.Module, args) -> dict[str, mx.array]:
    """An mlx-lm MLA attention's parameters under HF names: ``embed_q`` / ``unembed_out`` fused back
    into ``kv_b_proj`` [heads*(nope+v), kv_lora]."""
    out = {
        prefix + k: v
        for k, v in tree_flatten(attn.parameters())
        if not k.startswith(("embed_q", "unembed_out"))
    }
    wk = attn.embed_q.weight.swapaxes(-1, -2)  # [heads, nope, kv_lora]
    out[prefix + "kv_b_proj.weight"] = mx.concatenate([wk, attn.unembed_out.weight], axis=1).reshape(
        -1, args.kv_lora_rank
    )
    return out


def longcat_flash(
    path: Path, *, ship_mtp: bool = True, seed: int = 0, context_strength: float | None = None
) -> Tiny:
    """LongCat-Flash as published (vLLM ``longcat_flash_mtp.py``'s name map): per-expert trunk
    MoE, fused ``kv_b_proj``, and the MTP layer under ``model.mtp.``: ``layers.0.{enorm,hnorm}.m``,
    ``layers.0.eh_proj``, the MLA attention and both norms at ``layers.0.``, the dense MLP at
    ``layers.0.transformer_layer.mlp``, the final norm ``model.mtp.norm``, an embedding copy
    ``model.mtp.embed_tokens``. ``context_strength`` as ``deepseek_v3``'s."""
    from mlx_lm.models import longcat_flash as lc

    config = longcat_flash_config()
    args, model = _random_replica(lc, config, seed, context_strength)
    h = args.hidden_size
    params = _unstack_experts(dict(tree_flatten(model.parameters())))
    tensors = {k: v for k, v in params.items() if ".self_attn." not in k}
    for i, layer in enumerate(model.model.layers):
        for a, attn in enumerate(layer.self_attn):
            tensors.update(_mla_hf(f"model.layers.{i}.self_attn.{a}.", attn, args))
    if ship_mtp:
        block = nn.Module()
        block.input_layernorm, block.post_attention_layernorm = nn.RMSNorm(h), nn.RMSNorm(h)
        block.mlp = lc.LongcatFlashMLP(args, False)
        attn = lc.LongcatFlashMLA(args)
        randomize(block, seed + 3)
        randomize(attn, seed + 2)
        if context_strength is not None:
            scale_outputs(block, context_strength)
            scale_outputs(attn, context_strength)
        p = "model.mtp.layers.0."
        own = eh_proj_module(
            p,
            h,
            seed + 1,
            context_strength=context_strength,
            trunk_norm=model.model.norm.weight,
            renames=(("enorm.", "enorm.m."), ("hnorm.", "hnorm.m.")),
        )
        tensors["model.mtp.norm.weight"] = own.pop(p + "final_layernorm.weight")  # one, outside the layer
        tensors.update(own)
        tensors.update(
            {
                (p + k).replace(".mlp.", ".transformer_layer.mlp.", 1): v
                for k, v in tree_flatten(block.parameters())
            }
        )
        tensors.update(_mla_hf(p + "self_attn.", attn, args))
        tensors["model.mtp.embed_tokens.weight"] = model.model.embed_tokens.weight
    return write_checkpoint(path, tensors, config)


# --------------------------------------------------------------------------- step3p5

_STEP3P5_HF = (  # mlx-lm's spelling -> the published one (step3p5.sanitize's remappings, reversed)
    (".mlp.switch_mlp.", ".moe."),
    (".mlp.gate.gate.", ".moe.gate."),
    (".mlp.gate.router_bias", ".moe.router_bias"),
    (".mlp.share_expert.", ".share_expert."),
)


def _step3p5_hf(name: str, v: mx.array) -> tuple[str, mx.array]:
    for ours, theirs in _STEP3P5_HF:
        name = name.replace(ours, theirs)
    # Every RMSNorm weight is stored as an offset from 1 (zero-centred; vLLM's GemmaRMSNorm).
    return name, (v - 1.0 if name.endswith(".weight") and "norm" in name else v)


def step3p5(
    path: Path,
    *,
    mtp_layers: int = 3,
    ship_mtp: bool = True,
    seed: int = 0,
    context_strength: float | None = None,
) -> Tiny:
    """Step-3.5-Flash as published: stacked experts under ``.moe.``, norms as offsets from 1, and
    the MTP layers at ``model.layers.{2 + i}``: ``enorm``, ``hnorm``, ``eh_proj``, the block's
    tensors at the prefix itself, ``transformer.shared_head.norm`` and its own LM head
    ``transformer.shared_head.output`` (1.5x the trunk's, so it is kept and its argmax agrees).
    ``context_strength`` as ``deepseek_v3``'s."""
    from mlx_lm.models import step3p5 as st

    config = step3p5_config(mtp_layers=mtp_layers)
    args, model = _random_replica(st, config, seed, context_strength)
    h = args.hidden_size
    tensors = dict(_step3p5_hf(k, v) for k, v in tree_flatten(model.parameters()))
    for i in range(mtp_layers if ship_mtp else 0):
        layer = args.num_hidden_layers + i
        block = st.Step3p5DecoderLayer(args, layer)
        randomize(block, seed + 2 + 2 * i)
        head_norm = model.model.norm.weight
        if context_strength is not None:
            scale_outputs(block, context_strength)
        p = f"model.layers.{layer}."
        own = eh_proj_module(p, h, seed + 1 + 2 * i, context_strength=context_strength, trunk_norm=head_norm)
        own[p + "final_layernorm.weight"] = head_norm  # the trunk's final norm, with or without context
        own = {k.replace(".final_layernorm.", ".transformer.shared_head.norm."): v for k, v in own.items()}
        tensors.update(_step3p5_hf(k, v) for k, v in own.items())
        tensors.update(_step3p5_hf(k, v) for k, v in _prefixed(block, p).items())
        tensors[p + "transformer.shared_head.output.weight"] = model.lm_head.weight * 1.5
    return write_checkpoint(path, tensors, config)


# --------------------------------------------------------------------------- gemma4


def gemma4_target(path: Path, vocab_size: int = VOCAB, seed: int = 0, context_strength: float = 1.0) -> Tiny:
    """``models.tiny_gemma4`` with its HF tensor names (``model.language_model.*``)."""
    model = tiny_gemma4(vocab_size, seed=seed, context_strength=context_strength)
    tensors = {
        "model.language_model." + name[len("language_model.model.") :]: v
        for name, v in tree_flatten(model.parameters())
    }
    return write_checkpoint(path, tensors, gemma4_config(vocab_size))


def _head_dim(kind: str) -> int:
    return 16 if kind == "full_attention" else 8


def gemma4_assistant(
    path: Path,
    vocab_size: int = VOCAB,
    *,
    ordered: bool = False,
    num_centroids: int = 8,
    top_k: int = 2,
    seed: int = 1,
    scale: float = 1.0,
    backbone_hidden_size: int | None = None,
) -> Tiny:
    """The assistant checkpoint with HF tensor names (including the unused k_proj/k_norm of its
    KV-shared layers and an int64 ``token_ordering``), NumPy-seeded; ``scale`` scales its
    projections."""
    rng = np.random.default_rng(seed)
    config = gemma4_assistant_config(vocab_size, ordered=ordered, num_centroids=num_centroids, top_k=top_k)
    if backbone_hidden_size is not None:
        config["backbone_hidden_size"] = backbone_hidden_size
    backbone = config["backbone_hidden_size"]
    hidden = GEMMA4_DRAFT_HIDDEN

    def w(rows, cols):
        return scale * rng.standard_normal((rows, cols)) / np.sqrt(cols)

    def norm(n):
        return 1.0 + 0.3 * rng.standard_normal(n)

    t: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.standard_normal((vocab_size, hidden)) / np.sqrt(hidden),
        "model.norm.weight": norm(hidden),
        "pre_projection.weight": w(hidden, 2 * backbone),
        "post_projection.weight": w(backbone, hidden),
    }
    for i, kind in enumerate(GEMMA4_DRAFT_LAYERS):
        p, hd = f"model.layers.{i}.", _head_dim(kind)
        t[p + "self_attn.q_proj.weight"] = w(4 * hd, hidden)
        t[p + "self_attn.q_norm.weight"] = norm(hd)
        t[p + "self_attn.o_proj.weight"] = w(hidden, 4 * hd)
        t[p + "self_attn.k_proj.weight"] = w(2 * hd, hidden)  # unused by a KV-shared layer
        t[p + "self_attn.k_norm.weight"] = norm(hd)
        for n in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            t[p + n + ".weight"] = norm(hidden)
        t[p + "mlp.gate_proj.weight"] = w(32, hidden)
        t[p + "mlp.up_proj.weight"] = w(32, hidden)
        t[p + "mlp.down_proj.weight"] = w(hidden, 32)
        t[p + "layer_scalar"] = rng.uniform(0.5, 1.5, (1,))
    if ordered:
        t["masked_embedding.centroids.weight"] = w(num_centroids, hidden)
    tensors = {k: mx.array(v.astype(np.float32)) for k, v in t.items()}
    if ordered:
        tensors["masked_embedding.token_ordering"] = mx.array(rng.permutation(vocab_size).astype(np.int64))
    return write_checkpoint(path, tensors, config)


def copy_tokenizer(source: Path, path: Path) -> None:
    """Give the checkpoint at ``path`` the tokenizer of ``source`` (the default model's), so an
    engine can load it; prompts stay token ids below the tiny vocabulary."""
    import shutil

    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(source / name, path / name)
