"""DFlash2 block drafters (mlx-vlm 0.7.10 ``drafters/dflash2``).

A DFlash backbone (`mtplx.drafters.dflash`) with, per layer, a grouped dynamic causal convolution
around attention and around the MLP, and a candidate selector. The math, as mlx-vlm runs it:

- ``conv(h, dynamic, base)``: ``h`` [B, L, H] in G groups of ``conv_group_size``; output at block
  position ``t`` is ``sum_o (base[o] + dynamic[t, o]) * h[t - o]`` over ``o < conv_kernel_size``
  (zero before the block's start: causal within the block); ``dynamic`` [B, L, K, G] comes from
  ``kernel_projection(h)`` (two halves: before and after the wrapped part);
- layer: ``x, k = prepare(input_layernorm(h))``; ``h += finish(attention(x), k)``; the same around
  the MLP with ``post_attention_layernorm``;
- embeddings times ``input_embedding_scale``; logits times ``output_multiplier`` (then softcap);
- the block is ``[anchor, mask x P]``, position 0 dropped; each draft is chosen among the top-k
  tokens of its logits by ``logit + <predecessor_codebook[prev], hidden_projection(h), successor_codebook[c]>``,
  the previous token being the anchor, then the draft before.

Tensors: the DFlash names plus ``layers.{i}.{attention,mlp}_conv.{base_kernel, kernel_projection.weight}``
and ``candidate_selector.{predecessor_codebook, successor_codebook}`` (published without
``.weight``, as mlx-vlm's ``sanitize`` adds it), ``candidate_selector.hidden_projection.weight``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from mtplx.drafters.dflash import DFlashDrafter, DFlashLayer
from mtplx.drafters.files import load_checked, published_weights, read_config
from mtplx.drafters.layouts import DFlash2Spec, dflash2_spec, drafter_layout
from mtplx.errors import MtplxError
from mtplx.trunk.compat import KVCache

import mlx.core as mx
import mlx.nn as nn


def grouped_causal_conv(hidden: mx.array, dynamic: mx.array, base: mx.array, group_size: int) -> mx.array:
    batch, length, size = hidden.shape
    groups = size // group_size
    blocks = hidden.reshape(batch, length, groups, group_size)
    dynamic = dynamic.reshape(batch, length, base.shape[0], groups, 1)
    out = mx.zeros_like(blocks)
    for offset in range(base.shape[0]):
        shifted = (
            blocks
            if offset == 0
            else mx.concatenate([mx.zeros_like(blocks[:, :offset]), blocks[:, :-offset]], axis=1)
        )
        out = (
            out
            + (base[offset].reshape(1, 1, groups, group_size).astype(hidden.dtype) + dynamic[:, :, offset])
            * shifted
        )
    return out.reshape(hidden.shape)


class DynamicConv(nn.Module):
    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.base_kernel = mx.zeros((2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(
            hidden_size, 2 * kernel_size * (hidden_size // group_size), bias=False
        )

    def prepare(self, h: mx.array) -> tuple[mx.array, mx.array]:
        dynamic = self.kernel_projection(h).reshape(*h.shape[:-1], 2, self.kernel_size, -1)
        return grouped_causal_conv(h, dynamic[..., 0, :, :], self.base_kernel[0], self.group_size), dynamic[
            ..., 1, :, :
        ]

    def finish(self, h: mx.array, dynamic: mx.array) -> mx.array:
        return grouped_causal_conv(h, dynamic, self.base_kernel[1], self.group_size)


class DFlash2Layer(DFlashLayer):
    def __init__(self, spec: DFlash2Spec):
        super().__init__(spec.backbone)
        size = spec.backbone.hidden_size
        self.attention_conv = DynamicConv(size, spec.conv_kernel_size, spec.conv_group_size)
        self.mlp_conv = DynamicConv(size, spec.conv_kernel_size, spec.conv_group_size)

    def __call__(
        self, h: mx.array, context: mx.array, rope: nn.RoPE, cache: KVCache, counts: list[int] | None = None
    ) -> mx.array:
        x, kernel = self.attention_conv.prepare(self.input_layernorm(h))
        h = h + self.attention_conv.finish(self.self_attn(x, context, rope, cache, counts), kernel)
        x, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(x), kernel)


class CandidateSelector(nn.Module):
    def __init__(self, spec: DFlash2Spec):
        super().__init__()
        vocab, rank = spec.backbone.vocab_size, spec.selector_rank
        self.predecessor_codebook = nn.Embedding(vocab, rank)
        self.successor_codebook = nn.Embedding(vocab, rank)
        self.hidden_projection = nn.Linear(spec.backbone.hidden_size, rank, bias=False)


class DFlash2Drafter(DFlashDrafter):
    def __init__(self, spec: DFlash2Spec, own_embedding: bool = False, own_lm_head: bool = False):
        super().__init__(spec.backbone, own_embedding, own_lm_head)
        self.dflash2 = spec
        self.layers = [DFlash2Layer(spec) for _ in range(spec.backbone.num_hidden_layers)]
        self.candidate_selector = CandidateSelector(spec)


def dflash2_block(
    drafter: DFlash2Drafter,
    block: mx.array,
    target_hidden: Sequence[mx.array],
    cache: list[KVCache],
    embed: Callable[[mx.array], mx.array],
    lm_head: Callable[[mx.array], mx.array],
    embed_scale: float = 1.0,
    counts: list[int] | None = None,
) -> tuple[mx.array, mx.array]:
    """The drafts' hidden [B, P, H] and logits [B, P, V] of one block ``[anchor, mask x P]``
    (``counts``: `DFlashDrafter.hidden`'s)."""
    embedding = drafter.embed_tokens if "embed_tokens" in drafter else embed
    hidden = drafter.hidden(
        embedding(block) * embed_scale * drafter.dflash2.input_embedding_scale, target_hidden, cache, counts
    )
    hidden = hidden[:, 1:]
    logits = (
        drafter.lm_head(hidden) if "lm_head" in drafter else lm_head(hidden)
    ) * drafter.dflash2.output_multiplier
    cap = drafter.spec.final_logit_softcapping
    return hidden, logits if cap is None else mx.tanh(logits / cap) * cap


def dflash2_scores(
    drafter: DFlash2Drafter, hidden: mx.array, logits: mx.array, previous: mx.array
) -> mx.array:
    """Each draft's selector scores on the vocabulary [B, P, V] given the token before it
    (``previous`` [B, P]): ``logit + edge`` on its top-k candidates, -inf elsewhere (the
    distribution the selector samples from, as logits)."""
    selector, k = drafter.candidate_selector, drafter.dflash2.selector_top_k
    candidates = mx.argpartition(logits, -k, axis=-1)[..., -k:]
    unary = mx.take_along_axis(logits, candidates, axis=-1)
    projected = selector.hidden_projection(hidden)  # [B, P, r]
    edges = mx.sum(
        selector.predecessor_codebook(previous)[:, :, None]
        * projected[:, :, None]
        * selector.successor_codebook(candidates),
        axis=-1,
    )
    out = mx.full(logits.shape, -mx.inf, dtype=logits.dtype)
    return mx.put_along_axis(out, candidates, (unary + edges).astype(logits.dtype), axis=-1)


def load_dflash2(path: str | Path) -> DFlash2Drafter:
    """Load a DFlash2 drafter directory; a misfit is a one-line error naming the field or tensor."""
    path = Path(path)
    config = read_config(path, "DFlash2 drafter")
    if drafter_layout(config) != "dflash2":
        raise MtplxError(f"{path}: not a DFlash2 drafter (architectures DFlash2DraftModel)")
    spec = dflash2_spec(config)
    weights = published_weights(path, "DFlash2 drafter")
    for name in ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"):
        if name in weights:
            weights[f"{name}.weight"] = weights.pop(name)
    drafter = DFlash2Drafter(spec, "embed_tokens.weight" in weights, "lm_head.weight" in weights)
    load_checked(drafter, weights, path, "DFlash2 drafter")
    return drafter
