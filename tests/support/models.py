"""The tiny models every test builds: one config and one builder per family, real mlx-lm classes,
float32, seeded.

Two ways to fill the weights, each kept because fixed-seed tests were calibrated on it:
mlx-lm's own initialisation after ``mx.random.seed`` (the decode-loop and cache-rollback models),
and ``randomize`` (the checkpoint families of ``support.checkpoints``: NumPy-seeded, norm weights
around 1 so a wrong norm convention shows).

Families: llama; Qwen3.5 (hybrid: gated-delta layers with an ArraysCache, gated full attention);
Qwen3-Next (gated-delta + attention with a tiny MoE MLP); Gemma 3 (sliding-window layers with a
RotatingKVCache); Gemma 4 (sliding and full attention, per-layer inputs, KV-shared layers) and
its assistant drafter; the configs of the DeepSeek-V3 and MiMo checkpoints; and decode-loop pairs
(a trunk plus an MTP head whose agreement with it is controllable).
"""

from __future__ import annotations

from collections.abc import Callable

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.heads.qwen3_next import Qwen3NextMTPHead
from mtplx.trunk import compat_check
from mtplx.trunk.model import Trunk

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import gemma3_text, gemma4, llama, qwen3_5, qwen3_next
from mlx_lm.models.cache import QuantizedKVCache

HIDDEN = 32  # hidden size of every tiny model unless a builder says otherwise
VOCAB = 64  # vocabulary of the tiny checkpoints
ROLLBACK_VOCAB = 97  # vocabulary of ``rollback_model``'s models

_OUTPUT_PROJECTIONS = ("o_proj.weight", "down_proj.weight", "out_proj.weight")


def _seeded(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    """``build()`` under ``mx.random.seed(seed)``, evaluated: mlx-lm's own initialisation.

    The trunk's once-per-process layout probe runs first, before the seed: the callers draw more
    weights after wrapping the model in a ``Trunk`` (``make_loop_pair``), so a probe that took from
    the global stream there would give the process's first pair other weights than the later ones
    (a negative control's power then depended on test order)."""
    compat_check.check_once()
    mx.random.seed(seed)
    model = build()
    model.eval()
    mx.eval(model.parameters())
    return model


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


def scale_outputs(
    module: nn.Module, factor: float, projections: tuple[str, ...] = _OUTPUT_PROJECTIONS
) -> None:
    """Multiply the output projections (attention, MLP and gated-delta by default) by ``factor``:
    with the residual stream kept, this scales the context-dependent part of what a layer adds."""
    updates = [
        (name, value * factor)
        for name, value in tree_flatten(module.parameters())
        if name.endswith(projections)
    ]
    module.update(tree_unflatten(updates))


# --------------------------------------------------------------------------- llama


def tiny_llama(
    vocab_size: int = VOCAB,
    *,
    seed: int = 0,
    hidden_size: int = HIDDEN,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    tie_word_embeddings: bool = True,
) -> llama.Model:
    """A 2-layer llama (pure attention: a plain KVCache per layer), MLP twice as wide as
    ``hidden_size``. ``model.args`` builds more of its decoder layers (an MTP head's)."""
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden_size,
        num_hidden_layers=2,
        intermediate_size=2 * hidden_size,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        rms_norm_eps=1e-5,
        vocab_size=vocab_size,
        tie_word_embeddings=tie_word_embeddings,
        rope_theta=10000.0,
    )
    return _seeded(lambda: llama.Model(args), seed)


def quantized_kv_cache(model: nn.Module) -> list:
    """A QuantizedKVCache per layer (8 bits, groups of 32 along the head dimension)."""
    return [QuantizedKVCache(group_size=32, bits=8) for _ in model.layers]


def quantized_kv_cache_of_its_own(model: nn.Module) -> list:
    """``model``'s caches as ``--kv-bits 8 --kv-group-size 32`` makes them where a cache quantizes
    itself (mlx-vlm's QSAKVCache -> QSAQuantizedKVCache: `mtplx.trunk.kv_quant.make_cache`)."""
    from mtplx.trunk import kv_quant

    return kv_quant.make_cache(model.make_cache(), kv_quant.KVQuantization(8, 32, 0))


# --------------------------------------------------------------------------- Qwen3.5 hybrid


def qwen3_5_config(
    vocab_size: int = VOCAB,
    *,
    hidden_size: int = HIDDEN,
    tie_word_embeddings: bool = False,
    mtp_layers: int = 0,
) -> dict:
    """The Hugging Face config of a 4-layer Qwen3.5: layers 0 and 2 gated-delta, 1 and 3 full
    attention (``full_attention_interval`` 2), heads of ``hidden_size / 4``, partial rope;
    ``mtp_layers`` declares that many MTP layers (``mtp_num_hidden_layers``)."""
    head_dim = hidden_size // 4
    text = {
        "model_type": "qwen3_5_text",
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": head_dim,
        "linear_value_head_dim": head_dim,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 2,
        "tie_word_embeddings": tie_word_embeddings,
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


def tiny_qwen3_5(
    vocab_size: int = VOCAB, *, seed: int = 0, hidden_size: int = HIDDEN, tie_word_embeddings: bool = False
) -> qwen3_5.Model:
    """``qwen3_5_config``'s model with mlx-lm's initialisation (no MTP layers: mlx-lm drops them)."""
    config = qwen3_5_config(vocab_size, hidden_size=hidden_size, tie_word_embeddings=tie_word_embeddings)
    return _seeded(lambda: qwen3_5.Model(qwen3_5.ModelArgs.from_dict(config)), seed)


def qwen3_5_mtp_layer(model: qwen3_5.Model) -> nn.Module:
    """A decoder layer for ``model``'s MTP head: full attention, as in the real Qwen3.5 checkpoints."""
    args = model.language_model.args
    return qwen3_5.DecoderLayer(args, layer_idx=args.full_attention_interval - 1)


# --------------------------------------------------------------------------- Qwen3-Next, Gemma 3


def tiny_qwen3_next(vocab_size: int = VOCAB, *, seed: int = 0) -> qwen3_next.Model:
    """``qwen3_5_config``'s hybrid at hidden 64 as a 2-layer Qwen3-Next (layer 0 gated-delta,
    layer 1 attention) with a 2-expert MoE MLP and a shared expert: the other recurrent module
    mtplx rolls back."""
    text = qwen3_5_config(vocab_size, hidden_size=64)["text_config"]
    rope = {k: text["rope_parameters"][k] for k in ("rope_theta", "partial_rotary_factor")}  # flat here
    moe = dict(num_experts=2, num_experts_per_tok=1, decoder_sparse_step=1, mlp_only_layers=[])
    moe.update(moe_intermediate_size=64, shared_expert_intermediate_size=64)
    config = {**text, **rope, **moe, "model_type": "qwen3_next", "num_hidden_layers": 2}
    return _seeded(lambda: qwen3_next.Model(qwen3_next.ModelArgs.from_dict(config)), seed)


def tiny_gemma3(vocab_size: int = VOCAB, *, seed: int = 0, sliding_window: int = 4) -> gemma3_text.Model:
    """A 4-layer Gemma 3, hidden 64 (head_dim 32): layers 0 and 2 keep a RotatingKVCache of
    ``sliding_window`` entries, 1 and 3 a KVCache."""
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text",
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=128,
        num_attention_heads=2,
        head_dim=32,
        num_key_value_heads=1,
        vocab_size=vocab_size,
        query_pre_attn_scalar=32,
        sliding_window=sliding_window,
        sliding_window_pattern=2,
    )
    return _seeded(lambda: gemma3_text.Model(args), seed)


def rollback_model(family: str, *, seed: int = 0) -> nn.Module:
    """One model per cache kind the rollback code handles, hidden 64, ``ROLLBACK_VOCAB`` tokens:
    ``llama`` (KVCache; head_dim 32, so a ``quantized_kv_cache`` fits), ``qwen3_5`` and
    ``qwen3_next`` (gated-delta ArraysCache + KVCache), ``gemma3`` (RotatingKVCache + KVCache),
    ``nemotron_h`` (Mamba2 ArraysCache + KVCache, hidden 32: ``support.nemotron``), ``hy_v4``
    (Hunyuan-V4 through mlx-vlm: a CacheList of MLA KV + DSA indexer KV per layer, hyper-connections;
    ``support.vlm_families``), ``qwen4_exp`` (Qwen3.8-Flash-Next through mlx-vlm, its own caches:
    QSA KV + indexer keys, gated-delta and PLE ArraysCaches), ``deepseek_v4`` (DeepSeek-V4 through
    mlx-vlm, its own caches: sliding-window RotatingKVCache, compressed PoolingCaches), ``glm5_next`` (GLM-5-Next through mlx-vlm, its own caches:
    linear-attention ArraysCaches, CacheList(KV, indexer KV, PoolingCache, pooled KV)),
    ``minimax_m3`` (MiniMax-M3 through mlx-vlm, its own caches: MiniMaxM3KVCache = KV +
    block-sparse index keys, KVCache), ``inkling`` (Inkling through mlx-vlm, its own caches:
    CacheList(KVCache, ArraysCache of its four short convolutions' windows); ``support.vlm_inkling``)."""
    if family == "llama":
        return tiny_llama(ROLLBACK_VOCAB, seed=seed, hidden_size=64, num_heads=2, num_kv_heads=1)
    if family == "qwen3_5":
        return tiny_qwen3_5(ROLLBACK_VOCAB, seed=seed, hidden_size=64)
    if family == "qwen3_next":
        return tiny_qwen3_next(ROLLBACK_VOCAB, seed=seed)
    if family == "gemma3":
        return tiny_gemma3(ROLLBACK_VOCAB, seed=seed)
    if family == "nemotron_h":
        from support.nemotron import tiny_nemotron_h

        return tiny_nemotron_h(ROLLBACK_VOCAB, seed=seed)
    if family == "hy_v4":
        from support.vlm_families import tiny_hy_v4

        return tiny_hy_v4(ROLLBACK_VOCAB, seed=seed)
    if family == "qwen4_exp":
        from support.vlm_families import tiny_qwen4_exp

        return tiny_qwen4_exp(ROLLBACK_VOCAB, seed=seed)
    if family == "deepseek_v4":
        from support.vlm_families import tiny_deepseek_v4

        return tiny_deepseek_v4(ROLLBACK_VOCAB, seed=seed)
    if family == "glm5_next":
        from support.vlm_families import tiny_glm5_next

        return tiny_glm5_next(ROLLBACK_VOCAB, seed=seed)
    if family == "minimax_m3":
        from support.vlm_families import tiny_minimax_m3

        return tiny_minimax_m3(ROLLBACK_VOCAB, seed=seed)
    if family == "inkling":
        from support.vlm_inkling import tiny_inkling

        return tiny_inkling(ROLLBACK_VOCAB, seed=seed)
    raise ValueError(family)


# --------------------------------------------------------------------------- Gemma 4

GEMMA4_DRAFT_HIDDEN = 16
GEMMA4_WINDOW = 8
GEMMA4_ROPE = {
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
}
GEMMA4_TARGET_LAYERS = [
    "sliding_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "full_attention",
]
GEMMA4_DRAFT_LAYERS = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]


def gemma4_config(vocab_size: int = VOCAB) -> dict:
    """The Hugging Face config of a 5-layer Gemma 4 target: sliding-window (``GEMMA4_WINDOW``) and
    full-attention layers, per-layer inputs (as E2B/E4B) and KV sharing: the last two layers own
    no cache and reuse the KV of the last earlier layer of their type (what the assistant reads)."""
    text = {
        "model_type": "gemma4_text",
        "hidden_size": HIDDEN,
        "num_hidden_layers": len(GEMMA4_TARGET_LAYERS),
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "head_dim": 8,
        "global_head_dim": 16,
        "num_key_value_heads": 2,
        "num_kv_shared_layers": 2,
        "hidden_size_per_layer_input": 4,
        "vocab_size_per_layer_input": vocab_size,
        "sliding_window": GEMMA4_WINDOW,
        "layer_types": GEMMA4_TARGET_LAYERS,
        "rope_parameters": GEMMA4_ROPE,
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


def tiny_gemma4(vocab_size: int = VOCAB, *, seed: int = 0, context_strength: float = 1.0) -> gemma4.Model:
    """``gemma4_config``'s target, ``randomize``d; ``context_strength`` scales the attention output
    projections (a strong context part makes cache bugs change the output)."""
    model = gemma4.Model(gemma4.ModelArgs.from_dict(gemma4_config(vocab_size)))
    randomize(model, seed)
    scale_outputs(model, context_strength, ("o_proj.weight",))
    mx.eval(model.parameters())
    return model


def gemma4_assistant_config(
    vocab_size: int = VOCAB, *, ordered: bool = False, num_centroids: int = 8, top_k: int = 2
) -> dict:
    """The Hugging Face config of the target's assistant drafter: 4 KV-shared layers (every one
    reads the target's KV) of hidden ``GEMMA4_DRAFT_HIDDEN``; ``ordered`` narrows its vocabulary
    to the tokens of the ``top_k`` best of ``num_centroids`` centroids."""
    return {
        "model_type": "gemma4_assistant",
        "architectures": ["Gemma4AssistantForCausalLM"],
        "backbone_hidden_size": HIDDEN,
        "use_ordered_embeddings": ordered,
        "num_centroids": num_centroids,
        "centroid_intermediate_top_k": top_k,
        "tie_word_embeddings": True,
        "block_size": 4,
        "text_config": {
            "model_type": "gemma4_text",
            "hidden_size": GEMMA4_DRAFT_HIDDEN,
            "num_hidden_layers": len(GEMMA4_DRAFT_LAYERS),
            "intermediate_size": 32,
            "num_attention_heads": 4,
            "head_dim": 8,
            "global_head_dim": 16,
            "num_key_value_heads": 2,
            "num_kv_shared_layers": len(GEMMA4_DRAFT_LAYERS),
            "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0,
            "use_double_wide_mlp": False,
            "enable_moe_block": False,
            "sliding_window": GEMMA4_WINDOW,
            "layer_types": GEMMA4_DRAFT_LAYERS,
            "rope_parameters": GEMMA4_ROPE,
            "rms_norm_eps": 1e-6,
            "vocab_size": vocab_size,
            "max_position_embeddings": 512,
        },
    }


# --------------------------------------------------------------------------- DeepSeek-V3, MiMo


# DeepSeek-V3's config, and what DeepSeek-V3.2 (``deepseek_v32``) and GLM-5 (``glm_moe_dsa``) add to
# it: the DSA indexer's fields (``index_*``); GLM-5 also gives its rope as ``rope_parameters``.
DEEPSEEK_ARCHITECTURES = {
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
    "glm4_moe_lite": "Glm4MoeLiteForCausalLM",  # GLM-4.7-Flash: DeepSeek-V3's MLA + MoE, no indexer
}
INDEX_TOPK = 4  # the DSA replicas' indexer keeps 4 keys: below any test context, so it really selects


def deepseek_v3_config(
    moe: bool = False, mtp_layers: int = 1, trunk_layers: int = 61, model_type: str = "deepseek_v3"
) -> dict:
    """The Hugging Face config of a DeepSeek-V3 (MLA attention, ``num_nextn_predict_layers`` MTP
    layers after the trunk's); ``moe`` makes the last trunk layer and the MTP layers 4-expert MoE.
    ``model_type`` "deepseek_v32" / "glm_moe_dsa": the same with the DSA indexer (``INDEX_TOPK``)."""
    cfg = {
        "model_type": model_type,
        "architectures": [DEEPSEEK_ARCHITECTURES[model_type]],
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
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
        "first_k_dense_replace": trunk_layers - 1,  # MoE only in the last trunk layer and the MTP layer
        "moe_layer_freq": 1,
        "tie_word_embeddings": False,
    }
    if model_type in ("deepseek_v32", "glm_moe_dsa"):
        cfg.update(index_head_dim=8, index_n_heads=2, index_topk=INDEX_TOPK)
    if model_type == "glm_moe_dsa":
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
        del cfg["rope_scaling"]
        cfg.update(indexer_rope_interleave=True, attention_bias=False)
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


def glm4_moe_config(mtp_layers: int = 1, trunk_layers: int = 2, qk_norm: bool = True) -> dict:
    """The Hugging Face config of a GLM-4.5 (``glm4_moe``), its keys as zai-org/GLM-4.5 publishes
    them, shrunk: GQA (4 query heads, 2 KV heads of 16) with q/k/v biases, QK norm unless
    ``qk_norm`` is off (GLM-4.5 has it, GLM-4.5-Air not), RoPE on half of each head (``partial_rotary_factor`` 0.5), the first
    layer dense and the rest 4-expert sigmoid-routed MoE with one shared expert and the router's
    ``e_score_correction_bias``, routed scale 2.5, and ``num_nextn_predict_layers`` MTP layers
    at ``model.layers.{num_hidden_layers}``; bfloat16 as published."""
    return {
        "model_type": "glm4_moe",
        "architectures": ["Glm4MoeForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 64,
        "moe_intermediate_size": 32,  # a multiple of the quantization group: experts quantize
        "num_hidden_layers": trunk_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "partial_rotary_factor": 0.5,
        "attention_bias": True,
        "attention_dropout": 0.0,
        "use_qk_norm": qk_norm,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000,
        "rope_scaling": None,
        "max_position_embeddings": 256,
        "first_k_dense_replace": 1,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "num_nextn_predict_layers": mtp_layers,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def mimo_config(
    vocab_size: int = VOCAB,
    mtp_layers: int = 1,
    num_heads: int = 4,
    hidden_size: int = HIDDEN,
    num_layers: int = 2,
) -> dict:
    """The Hugging Face config of a ``num_layers``-layer MiMo (Qwen2-style attention with biases)
    declaring ``mtp_layers`` MTP layers, context 256; ``num_heads`` attention heads (KV heads half
    as many, one when one) over ``hidden_size``: quantized KV's groups need a head dimension of 32
    or more (``num_heads=1``, or ``hidden_size=128`` with 4 heads)."""
    return {
        "model_type": "mimo",
        "architectures": ["MiMoForCausalLM"],
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "intermediate_size": 64,
        "num_attention_heads": num_heads,
        "num_key_value_heads": max(1, num_heads // 2),
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": mtp_layers,
    }


def step3p5_config(vocab_size: int = 32, mtp_layers: int = 3, window: int = 4) -> dict:
    """The Hugging Face config of a 2-layer Step-3.5-Flash (``stepfun-ai/Step-3.5-Flash``'s keys):
    layer 0 full attention + dense MLP, layer 1 sliding-window (``window``) attention + a 4-expert
    MoE with a shared expert; head-wise attention gates; ``num_nextn_predict_layers`` MTP layers
    (3 as released), sliding, listed in ``layer_types`` after the trunk's. Hidden size 64: mlx-lm
    quantizes the router (``mlp.gate.gate``) at group size 64 whatever the trunk's."""
    return {
        "model_type": "step3p5",
        "architectures": ["Step3p5ForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": 2 * HIDDEN,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_attention_groups": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "sliding_window": window,
        "layer_types": ["full_attention", "sliding_attention"] + ["sliding_attention"] * mtp_layers,
        "use_head_wise_attn_gate": True,
        "moe_num_experts": 4,
        "moe_top_k": 2,
        "moe_intermediate_size": 16,
        "share_expert_dim": 16,
        "moe_layers_enum": "1",
        "moe_router_scaling_factor": 1.0,
        "norm_expert_weight": True,
        "num_nextn_predict_layers": mtp_layers,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def longcat_flash_config(vocab_size: int = 32) -> dict:
    """The Hugging Face config of a 1-layer LongCat-Flash (``meituan-longcat/LongCat-Flash-Chat``'s
    keys): each layer two MLA attentions + two dense MLPs + a shortcut MoE with zero (identity)
    experts; the MTP layer (one, as released) is counted from its tensor names. Hidden size 64:
    mlx-lm quantizes the router at group size 64 whatever the trunk's."""
    return {
        "model_type": "longcat_flash",
        "architectures": ["LongcatFlashForCausalLM"],
        "attention_method": "MLA",
        "vocab_size": vocab_size,
        "hidden_size": 2 * HIDDEN,
        "ffn_hidden_size": 64,
        "expert_ffn_hidden_size": 16,
        "moe_topk": 2,
        "n_routed_experts": 4,
        "zero_expert_num": 2,
        "zero_expert_type": "identity",
        "num_layers": 1,
        "num_attention_heads": 2,
        "kv_lora_rank": 16,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
        "routed_scaling_factor": 1.0,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "mla_scale_q_lora": True,
        "mla_scale_kv_lora": True,
        "attention_bias": False,
        "max_position_embeddings": 256,
        "torch_dtype": "float32",
    }


def ernie4_5_moe_config(vocab_size: int = 32, mtp_layers: int = 1) -> dict:
    """The Hugging Face config of a 2-layer ERNIE-4.5 MoE (``baidu/ERNIE-4.5-21B-A3B-PT``'s keys):
    layer 0 dense, layer 1 a 4-expert MoE with a shared expert (``moe_layer_start_index`` 1),
    tied embeddings, ``num_nextn_predict_layers`` MTP layers (1 as released)."""
    return {
        "model_type": "ernie4_5_moe",
        "architectures": ["Ernie4_5_MoeForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "use_bias": False,
        "tie_word_embeddings": True,
        "moe_num_experts": 4,
        "moe_k": 2,
        "moe_intermediate_size": 16,
        "moe_num_shared_experts": 1,
        "moe_layer_start_index": 1,
        "moe_layer_interval": 1,
        "moe_use_aux_free": True,
        "num_nextn_predict_layers": mtp_layers,
        "torch_dtype": "float32",
    }


def mimo_v2_flash_config(vocab_size: int = VOCAB, mtp_layers: int = 3, window: int = 4) -> dict:
    """The Hugging Face config of a 2-layer MiMo-V2-Flash: one full-attention dense layer, one
    sliding-window (``window``) MoE layer with attention sinks, asymmetric value heads, partial
    rope, ``num_nextn_predict_layers`` = 3 as released."""
    return {
        "model_type": "mimo_v2_flash",
        "architectures": ["MiMoV2FlashForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 2,
        "hybrid_layer_pattern": [0, 1],
        "moe_layer_freq": [0, 1],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "v_head_dim": 4,
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 2,
        "swa_head_dim": 8,
        "swa_v_head_dim": 4,
        "sliding_window_size": window,
        "add_swa_attention_sink_bias": True,
        "add_full_attention_sink_bias": False,
        "attention_value_scale": 0.7,
        "partial_rotary_factor": 0.5,
        "rope_theta": 10000.0,
        "swa_rope_theta": 1000.0,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": None,
        "routed_scaling_factor": None,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "layernorm_epsilon": 1e-5,
        "max_position_embeddings": 256,
        "attention_bias": False,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": mtp_layers,
    }


# --------------------------------------------------------------------------- decode-loop pairs


def make_loop_pair(
    vocab_size: int = 6,
    *,
    seed: int = 0,
    context_strength: float = 3.0,
    head_noise: float = 1.0,
    logit_scale: float = 0.5,
    family: str = "llama",
    num_heads: int = 4,
) -> tuple[Trunk, Qwen3NextMTPHead]:
    """A tied-embedding trunk (``tiny_llama`` or ``tiny_qwen3_5``) and a Qwen3-Next-style MTP head
    whose agreement with it is controllable.

    The embedding is rescaled by ``logit_scale`` and the trunk's output projections by
    ``context_strength``: the trunk is a bigram model plus a context-dependent part (so cache
    bugs change its distribution). The head's ``fc`` starts as [I, 0], reading mostly the next
    token's embedding, so it predicts the trunk's bigram part; ``head_noise`` makes it disagree.
    ``num_heads`` (llama): attention heads, KV heads half as many (one when one: head dimension
    32, which quantized KV's groups of 32 need).
    """
    if family == "llama":
        model = tiny_llama(vocab_size, seed=seed, num_heads=num_heads, num_kv_heads=max(1, num_heads // 2))
        make_head_layer, eps = (lambda: llama.TransformerBlock(model.args)), model.args.rms_norm_eps
    elif family == "qwen3_5":
        model = tiny_qwen3_5(vocab_size, seed=seed, tie_word_embeddings=True)
        make_head_layer, eps = (lambda: qwen3_5_mtp_layer(model)), 1e-6
    else:
        raise ValueError(family)
    trunk = Trunk(model)
    trunk.inner.embed_tokens.weight = mx.random.normal((vocab_size, HIDDEN)) * logit_scale / HIDDEN**0.5
    scale_outputs(model, context_strength)
    # The head's layer draws its initial weights after the trunk's (the seeded order).
    head = Qwen3NextMTPHead([make_head_layer()], HIDDEN, eps=eps, trunk=trunk)
    identity_then_zero = mx.concatenate([mx.eye(HIDDEN), mx.zeros((HIDDEN, HIDDEN))], axis=1)
    head.fc.weight = identity_then_zero + head_noise * mx.random.normal((HIDDEN, 2 * HIDDEN)) / HIDDEN**0.5
    scale_outputs(head, head_noise)
    mx.eval(model.parameters(), head.parameters())
    return trunk, head
