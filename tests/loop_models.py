"""Tiny trunks and MTP heads whose agreement is controllable, for decode-loop tests.

The trunk is a real mlx-lm model with random weights: a llama, or a Qwen3.5
hybrid (gated-delta + full attention layers). Scaling its layers' output
projections by ``context_strength`` makes it a bigram model plus a
context-dependent part (so cache bugs change its distribution). The head is a
real Qwen3-Next-style MTP head whose ``fc`` starts as [I, 0]: it reads mostly
the next token's embedding, so it predicts the trunk's bigram part, and
``head_noise`` makes it disagree by a controllable amount.
"""

from __future__ import annotations

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.heads.qwen3_next import Qwen3NextMTPHead
from mtplx.trunk.model import Trunk

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import llama, qwen3_5

HIDDEN = 32
_OUTPUT_PROJECTIONS = ("o_proj.weight", "down_proj.weight", "out_proj.weight")


def _llama(vocab_size: int):
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        intermediate_size=2 * HIDDEN,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab_size,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    )
    model = llama.Model(args)
    return model, lambda: llama.TransformerBlock(args), args.rms_norm_eps


def _qwen3_5(vocab_size: int):
    text_config = dict(
        model_type="qwen3_5_text",
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        vocab_size=vocab_size,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        full_attention_interval=2,
        tie_word_embeddings=True,
        rope_parameters={"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )
    model = qwen3_5.Model(qwen3_5.ModelArgs(model_type="qwen3_5", text_config=text_config))
    text_args = model.language_model.args
    # The MTP layer is a full-attention decoder layer, as in real Qwen3.5 checkpoints.
    return (
        model,
        lambda: qwen3_5.DecoderLayer(text_args, layer_idx=text_args.full_attention_interval - 1),
        1e-6,
    )


FAMILIES = {"llama": _llama, "qwen3_5": _qwen3_5}


def _scale_outputs(module, factor: float) -> None:
    updates = [
        (name, value * factor)
        for name, value in tree_flatten(module.parameters())
        if name.endswith(_OUTPUT_PROJECTIONS)
    ]
    module.update(tree_unflatten(updates))


def make_loop_pair(
    vocab_size: int = 6,
    *,
    seed: int = 0,
    context_strength: float = 3.0,
    head_noise: float = 1.0,
    logit_scale: float = 0.5,
    family: str = "llama",
) -> tuple[Trunk, Qwen3NextMTPHead]:
    mx.random.seed(seed)
    model, make_head_layer, eps = FAMILIES[family](vocab_size)
    trunk = Trunk(model)
    trunk.inner.embed_tokens.weight = mx.random.normal((vocab_size, HIDDEN)) * logit_scale / HIDDEN**0.5
    _scale_outputs(model, context_strength)
    head = Qwen3NextMTPHead([make_head_layer()], HIDDEN, eps=eps, trunk=trunk)
    identity_then_zero = mx.concatenate([mx.eye(HIDDEN), mx.zeros((HIDDEN, HIDDEN))], axis=1)
    head.fc.weight = identity_then_zero + head_noise * mx.random.normal((HIDDEN, 2 * HIDDEN)) / HIDDEN**0.5
    _scale_outputs(head, head_noise)
    mx.eval(model.parameters(), head.parameters())
    return trunk, head
