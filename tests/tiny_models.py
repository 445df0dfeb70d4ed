"""Tiny random models built from mlx-lm's own classes (real forwards, float32, seeded).

For tests that need a model's caches and logits but not trained weights. (Tiny
checkpoints with Hugging Face key layouts live in ``tiny_checkpoints.py``.)
"""

from __future__ import annotations

from collections.abc import Callable

import mtplx  # noqa: F401  (loads the BLAS before mlx)

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import QuantizedKVCache

VOCAB = 97


def _seeded(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    mx.random.seed(seed)
    model = build()
    model.eval()
    mx.eval(model.parameters())
    return model


def tiny_llama(seed: int = 0) -> nn.Module:
    """Pure attention; plain KVCache per layer. head_dim 32 so a 32-group quantized cache fits."""
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
    )
    return _seeded(lambda: llama.Model(args), seed)


def quantized_kv_cache(model: nn.Module) -> list:
    """A QuantizedKVCache per layer (8 bits, groups of 32 along the head dimension)."""
    return [QuantizedKVCache(group_size=32, bits=8) for _ in model.layers]


def tiny_qwen3_5(seed: int = 0) -> nn.Module:
    """Hybrid: layers 0 and 2 gated-delta (ArraysCache), 1 and 3 full attention (KVCache)."""
    from mlx_lm.models import qwen3_5

    text_config = dict(
        model_type="qwen3_5_text",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        full_attention_interval=2,
        rope_parameters={"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )
    args = qwen3_5.ModelArgs(model_type="qwen3_5", text_config=text_config)
    return _seeded(lambda: qwen3_5.Model(args), seed)


def tiny_gemma3(seed: int = 0, sliding_window: int = 4) -> nn.Module:
    """Layers 0 and 2 use a RotatingKVCache of ``sliding_window`` entries, 1 and 3 a KVCache."""
    from mlx_lm.models import gemma3_text

    args = gemma3_text.ModelArgs(
        model_type="gemma3_text",
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=128,
        num_attention_heads=2,
        head_dim=32,
        num_key_value_heads=1,
        vocab_size=VOCAB,
        query_pre_attn_scalar=32,
        sliding_window=sliding_window,
        sliding_window_pattern=2,
    )
    return _seeded(lambda: gemma3_text.Model(args), seed)


def tiny_qwen3_next(seed: int = 0) -> nn.Module:
    """Qwen3-Next hybrid (gated-delta + attention, tiny MoE MLP): the other supported recurrent module."""
    from mlx_lm.models import qwen3_next

    args = qwen3_next.ModelArgs(
        model_type="qwen3_next",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=2,
        num_experts_per_tok=1,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=64,
        mlp_only_layers=[],
        moe_intermediate_size=64,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB,
        num_key_value_heads=2,
        rope_theta=10000.0,
        partial_rotary_factor=0.5,
        max_position_embeddings=512,
        head_dim=16,
        full_attention_interval=2,
    )
    return _seeded(lambda: qwen3_next.Model(args), seed)
