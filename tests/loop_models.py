"""A tiny trunk and MTP head whose agreement is controllable, for decode-loop tests.

The trunk is a real mlx-lm llama with random weights. Scaling its attention and
MLP output projections by ``context_strength`` makes it a bigram model plus a
context-dependent part (so cache bugs change its distribution). The head is a
real Qwen3-Next-style MTP head whose ``fc`` starts as [I, 0]: it reads mostly
the next token's embedding, so it predicts the trunk's bigram part, and
``head_noise`` makes it disagree by a controllable amount.
"""

from __future__ import annotations

import mtplx  # noqa: F401  (BLAS before mlx)
import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import llama

from mtplx.heads.qwen3_next import Qwen3NextMTPHead
from mtplx.trunk import Trunk


def tiny_llama_args(vocab_size: int, hidden_size: int = 32, num_layers: int = 2) -> llama.ModelArgs:
    return llama.ModelArgs(
        model_type="llama", hidden_size=hidden_size, num_hidden_layers=num_layers,
        intermediate_size=2 * hidden_size, num_attention_heads=4, num_key_value_heads=2,
        rms_norm_eps=1e-5, vocab_size=vocab_size, tie_word_embeddings=True, rope_theta=10000.0,
    )


def _scale_outputs(module, factor: float) -> None:
    updates = [(name, value * factor) for name, value in tree_flatten(module.parameters())
               if name.endswith(("o_proj.weight", "down_proj.weight"))]
    module.update(tree_unflatten(updates))


def make_loop_pair(vocab_size: int = 6, *, seed: int = 0, context_strength: float = 3.0,
                   head_noise: float = 1.0, logit_scale: float = 0.5) -> tuple[Trunk, Qwen3NextMTPHead]:
    mx.random.seed(seed)
    args = tiny_llama_args(vocab_size)
    model = llama.Model(args)
    model.model.embed_tokens.weight = mx.random.normal((vocab_size, args.hidden_size)) * logit_scale / args.hidden_size**0.5
    _scale_outputs(model, context_strength)
    trunk = Trunk(model)
    head = Qwen3NextMTPHead([llama.TransformerBlock(args)], args.hidden_size, eps=args.rms_norm_eps, trunk=trunk)
    h = args.hidden_size
    identity_then_zero = mx.concatenate([mx.eye(h), mx.zeros((h, h))], axis=1)
    head.fc.weight = identity_then_zero + head_noise * mx.random.normal((h, 2 * h)) / h**0.5
    _scale_outputs(head, head_noise)
    mx.eval(model.parameters(), head.parameters())
    return trunk, head
