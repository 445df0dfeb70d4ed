"""DFlash block drafters (z-lab's format; mlx-vlm 0.7.10's ``qwen3_dflash`` / ``gemma4_dflash``).

A DFlash drafter predicts a whole block in one forward: the block is ``[last token, mask, mask,
...]`` (``mask_token_id``), each position attending to the drafter's context (K/V of the
projected target features of every committed position, kept in its own cache) and to the whole
block (non-causal unless ``dflash_config.causal``); the logits at block positions 1.. are the
draft distributions. The math, as mlx-vlm 0.7.10 ``qwen3_dflash/dflash.py`` runs it:

- context: ``c = hidden_norm(fc(concat(taps of target_layer_ids)))`` [B, S, H];
- block: ``h = embed(block) * embed_scale``;
- per layer: ``x = input_layernorm(h)``; queries ``q_norm(q_proj(x))`` at positions
  ``offset + S ..``; keys ``k_norm(k_proj(.))`` and values ``v_proj(.)`` of the context (not
  normed by ``input_layernorm``) at ``offset ..`` and of ``x`` at ``offset + S ..``; the context
  K/V appended to the cache; ``h += o_proj(attention)``; ``h += mlp(post_attention_layernorm(h))``;
- ``logits = lm_head(norm(h))`` (the target's LM head unless the file has its own), softcapped
  when ``final_logit_softcapping`` is set.

Tensor names (``model.`` prefix optional): ``fc.weight``, ``hidden_norm.weight``,
``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.{q,k}_norm.weight``,
``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``layers.{i}.{input,post_attention}_layernorm.weight``,
``norm.weight``; optional ``embed_tokens.weight`` / ``lm_head.weight``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from mtplx.drafters.files import load_checked, published_weights, read_config
from mtplx.drafters.layouts import DFlashSpec, dflash_spec, drafter_layout
from mtplx.errors import MtplxError
from mtplx.trunk.compat import KVCache

import mlx.core as mx
import mlx.nn as nn


class DFlashAttention(nn.Module):
    def __init__(self, spec: DFlashSpec):
        super().__init__()
        dim, heads, kv_heads, head_dim = (
            spec.hidden_size,
            spec.num_attention_heads,
            spec.num_key_value_heads,
            spec.head_dim,
        )
        self.n_heads, self.n_kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.is_causal = spec.is_causal
        self.q_proj = nn.Linear(dim, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, dim, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=spec.rms_norm_eps)
        self.k_norm = nn.RMSNorm(head_dim, eps=spec.rms_norm_eps)

    def _heads(self, x: mx.array, n: int) -> mx.array:
        return x.reshape(x.shape[0], x.shape[1], n, -1).transpose(0, 2, 1, 3)

    def context_kv(self, context: mx.array, rope: nn.RoPE, offset) -> tuple[mx.array, mx.array]:
        """The context's keys (roped from ``offset``) and values, as the cache holds them."""
        keys = rope(self.k_norm(self._heads(self.k_proj(context), self.n_kv_heads)), offset=offset)
        return keys, self._heads(self.v_proj(context), self.n_kv_heads)

    def __call__(
        self, x: mx.array, context: mx.array, rope: nn.RoPE, cache: KVCache, counts: list[int] | None = None
    ) -> mx.array:
        """``counts`` (a batch on a `RaggedKVCache`): row r's new context is its first counts[r]
        positions (the rest padding); None: all of ``context`` (one row's KVCache)."""
        batch, length, _ = x.shape
        new = context.shape[1] if counts is None else mx.array(counts, dtype=mx.int32)
        start = cache.offset + new  # the block's first position
        queries = rope(self.q_norm(self._heads(self.q_proj(x), self.n_heads)), offset=start)
        block_keys = rope(self.k_norm(self._heads(self.k_proj(x), self.n_kv_heads)), offset=start)
        block_values = self._heads(self.v_proj(x), self.n_kv_heads)
        mask = "causal" if self.is_causal else None  # causal within the block, all of the context seen
        if counts is None:
            keys, values = cache.update_and_fetch(*self.context_kv(context, rope, cache.offset))
        else:
            ends = [n + c for n, c in zip(cache.lengths, counts)]
            new_kv = self.context_kv(context, rope, cache.offset) if context.shape[1] else None
            keys, values = _ragged_context(cache, new_kv, ends)
            mask = _ragged_mask(mask == "causal", keys.shape[2], ends, length)
        keys = mx.concatenate([keys, block_keys], axis=2)
        values = mx.concatenate([values, block_values], axis=2)
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))


def _ragged_context(cache, context_kv: tuple | None, ends: list[int]) -> tuple[mx.array, mx.array]:
    """A batch's new context K/V (None: none this time) written at each row's length (a
    `RaggedKVCache`), each row then holding its context up to ``ends[r]``; the rows' K/V buffers
    up to the longest."""
    if context_kv is not None:
        cache.update_and_fetch(*context_kv)
    cache.set_lengths(ends)
    width = max(ends)
    return cache.keys[: len(ends), :, :width], cache.values[: len(ends), :, :width]


def _ragged_mask(causal: bool, width: int, ends: list[int], length: int) -> mx.array:
    """bool [B, 1, L, width + L]: row r sees its context (positions < ends[r]) and the block (all
    of it, or up to each query when the block is causal)."""
    rows = len(ends)
    context = mx.arange(width)[None, :] < mx.array(ends, dtype=mx.int32)[:, None]  # [B, width]
    context = mx.broadcast_to(context[:, None, None, :], (rows, 1, length, width))
    block = mx.ones((length, length), dtype=mx.bool_)
    block = mx.broadcast_to((mx.tril(block) if causal else block)[None, None], (rows, 1, length, length))
    return mx.concatenate([context, block], axis=-1)


class DFlashMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, spec: DFlashSpec):
        super().__init__()
        self.self_attn = DFlashAttention(spec)
        self.mlp = DFlashMLP(spec.hidden_size, spec.intermediate_size)
        self.input_layernorm = nn.RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)

    def __call__(
        self, h: mx.array, context: mx.array, rope: nn.RoPE, cache: KVCache, counts: list[int] | None = None
    ) -> mx.array:
        h = h + self.self_attn(self.input_layernorm(h), context, rope, cache, counts)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    """The drafter's own weights; the token embedding and LM head are the trunk's unless the
    checkpoint ships its own (``embed_tokens`` / ``lm_head`` then exist as attributes)."""

    def __init__(self, spec: DFlashSpec, own_embedding: bool = False, own_lm_head: bool = False):
        super().__init__()
        self.spec = spec
        self.fc = nn.Linear(spec.concat_dim, spec.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.layers = [DFlashLayer(spec) for _ in range(spec.num_hidden_layers)]
        self.norm = nn.RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self._rope = nn.RoPE(spec.head_dim, traditional=spec.rope_traditional, base=spec.rope_theta)
        if own_embedding:
            self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        if own_lm_head:
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.spec.target_layer_ids

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def block_tokens(self, last_tokens: mx.array, block_size: int) -> mx.array:
        """``[last token, mask, ..., mask]`` per row: [B, block_size]."""
        masks = mx.full((last_tokens.shape[0], block_size - 1), self.spec.mask_token_id, dtype=mx.int32)
        return mx.concatenate([last_tokens.astype(mx.int32)[:, None], masks], axis=1)

    def context(self, target_hidden: Sequence[mx.array]) -> mx.array:
        """The projected context [B, S, H] of the layer taps (one [B, S, Ht] per ``target_layer_ids``)."""
        context = self.hidden_norm(self.fc(mx.concatenate(list(target_hidden), axis=-1)))
        return context

    def extend_context(self, target_hidden: Sequence[mx.array], cache: list[KVCache]) -> None:
        """Append the context K/V of these taps to one row's ``cache`` without drafting (a prefill)."""
        context = self.context(target_hidden)
        for layer, layer_cache in zip(self.layers, cache):
            layer_cache.update_and_fetch(*layer.self_attn.context_kv(context, self._rope, layer_cache.offset))

    def hidden(
        self,
        block_embeds: mx.array,
        target_hidden: Sequence[mx.array],
        cache: list[KVCache],
        counts: list[int] | None = None,
    ) -> mx.array:
        """The drafter's final hidden [B, L, H] for the embedded block, given the new context's
        layer taps (one [B, S, H] per ``target_layer_ids``, in that order); appends the context's
        K/V to ``cache`` (a batch's `RaggedKVCache` with ``counts``: row r's first counts[r])."""
        context = self.context(target_hidden)
        h = block_embeds
        for layer, layer_cache in zip(self.layers, cache):
            h = layer(h, context, self._rope, layer_cache, counts)
        return self.norm(h)

    def logits(self, hidden: mx.array, lm_head: Callable[[mx.array], mx.array]) -> mx.array:
        logits = self.lm_head(hidden) if "lm_head" in self else lm_head(hidden)
        cap = self.spec.final_logit_softcapping
        return logits if cap is None else mx.tanh(logits / cap) * cap


def dflash_block_logits(
    drafter: DFlashDrafter,
    block: mx.array,
    target_hidden: Sequence[mx.array],
    cache: list[KVCache],
    embed: Callable[[mx.array], mx.array],
    lm_head: Callable[[mx.array], mx.array],
    embed_scale: float = 1.0,
    counts: list[int] | None = None,
) -> mx.array:
    """Logits [B, L, V] at every block position (position j >= 1 drafts the block's j-th token):
    a pure function of (the layer taps of the new context, the token block, the drafter's cache).
    ``embed`` / ``lm_head`` are the trunk's (`Trunk.embed`, `Trunk.lm_head`) unless the
    checkpoint ships its own; ``counts``: `DFlashDrafter.hidden`'s."""
    embedding = drafter.embed_tokens if "embed_tokens" in drafter else embed
    h = drafter.hidden(embedding(block) * embed_scale, target_hidden, cache, counts)
    return drafter.logits(h, lm_head)


def load_dflash(path: str | Path) -> DFlashDrafter:
    """Load a DFlash drafter directory (``config.json`` + safetensors, z-lab's or mlx-vlm's layout);
    a misfit (missing or extra tensor, wrong shape, unsupported field) is a one-line error."""
    path = Path(path)
    config = read_config(path, "DFlash drafter")
    if drafter_layout(config) != "dflash":
        raise MtplxError(f"{path}: not a DFlash drafter (no dflash_config, or a DSpark / DFlash2 layout)")
    spec = dflash_spec(config)
    weights = published_weights(path, "DFlash drafter")
    drafter = DFlashDrafter(spec, "embed_tokens.weight" in weights, "lm_head.weight" in weights)
    load_checked(drafter, weights, path, "DFlash drafter")
    return drafter
