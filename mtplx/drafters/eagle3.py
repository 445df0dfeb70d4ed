"""EAGLE-3 drafters (mlx-vlm 0.7.10's ``eagle3`` and the speculators format).

An EAGLE-3 drafter drafts autoregressively with its own KV cache from three target layers'
features. The math, as mlx-vlm 0.7.10 ``drafters/eagle3/eagle3.py`` runs it:

- input hidden: the target taps concatenated [B, T, 3 Ht] go through ``input_norm`` (only with
  ``norm_before_fc``) and ``fc`` to [B, T, H]; a hidden already of width H (the drafter's own
  previous output, when chaining) is used as it is;
- first layer: ``e = input_layernorm(embed(tokens))``, ``g = hidden_norm(hidden)``; attention
  over ``concat(e, g)`` (2H wide q/k/v) with rope at ``position ..``; residual ``g`` with
  ``norm_before_residual``, else ``hidden``; then ``+ mlp(post_attention_layernorm(h))``;
- later layers: plain pre-norm decoder layers; causal attention over the drafter's cache;
- logits: ``lm_head(norm(h))`` over the draft vocabulary (tied to the embedding when the
  vocabularies are equal and ``tie_word_embeddings``); a draft id ``i`` is target id
  ``i + d2t[i]``.

The token embedding is the target's (mlx-vlm binds the target's whenever the shapes match: the
speculators file holds a frozen copy of it). ``t2d`` (which target ids the draft vocabulary
holds) is checked against ``d2t`` at load and not kept; ``verifier_*`` tensors and rotary
buffers are dropped, as mlx-vlm's ``sanitize`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from mtplx.drafters.files import load_checked, published_weights, read_config
from mtplx.drafters.layouts import Eagle3Spec, drafter_layout, eagle3_spec
from mtplx.errors import MtplxError
from mtplx.trunk.compat import KVCache

import mlx.core as mx
import mlx.nn as nn
import numpy as np


class Eagle3Attention(nn.Module):
    def __init__(self, spec: Eagle3Spec, input_size: int):
        super().__init__()
        heads, kv_heads, head_dim, bias = (
            spec.num_attention_heads,
            spec.num_key_value_heads,
            spec.head_dim,
            spec.attention_bias,
        )
        self.n_heads, self.n_kv_heads, self.scale = heads, kv_heads, head_dim**-0.5
        self.q_proj = nn.Linear(input_size, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(input_size, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(input_size, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, spec.hidden_size, bias=bias)
        self._rope = nn.RoPE(head_dim, traditional=spec.rope_traditional, base=spec.rope_theta)

    def __call__(self, x: mx.array, cache: KVCache, position, mask) -> mx.array:
        """``position``: the first position (an int, or [B] per row); ``mask``: "causal", None or
        bool [B, 1, T, keys] (rows of different lengths on a `RaggedKVCache`)."""
        batch, length, _ = x.shape

        def heads(y: mx.array, n: int) -> mx.array:
            return y.reshape(batch, length, n, -1).transpose(0, 2, 1, 3)

        queries = self._rope(heads(self.q_proj(x), self.n_heads), offset=position)
        keys = self._rope(heads(self.k_proj(x), self.n_kv_heads), offset=position)
        keys, values = cache.update_and_fetch(keys, heads(self.v_proj(x), self.n_kv_heads))
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))


class Eagle3MLP(nn.Module):
    def __init__(self, spec: Eagle3Spec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """A decoder layer; the first one (``first``) reads [embedding, hidden] with its ``hidden_norm``."""

    def __init__(self, spec: Eagle3Spec, first: bool):
        super().__init__()
        dim, eps = spec.hidden_size, spec.rms_norm_eps
        self.first, self.norm_before_residual = first, spec.norm_before_residual
        self.input_layernorm = nn.RMSNorm(dim, eps=eps)
        if first:
            self.hidden_norm = nn.RMSNorm(dim, eps=eps)
        self.self_attn = Eagle3Attention(spec, 2 * dim if first else dim)
        self.post_attention_layernorm = nn.RMSNorm(dim, eps=eps)
        self.mlp = Eagle3MLP(spec)

    def __call__(self, h: mx.array, embeds: mx.array | None, cache: KVCache, position, mask) -> mx.array:
        if self.first:
            normed = self.hidden_norm(h)
            residual = normed if self.norm_before_residual else h
            x = mx.concatenate([self.input_layernorm(embeds), normed], axis=-1)
        else:
            residual, x = h, self.input_layernorm(h)
        h = residual + self.self_attn(x, cache, position, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(nn.Module):
    def __init__(self, spec: Eagle3Spec, own_embedding: bool):
        super().__init__()
        self.spec = spec
        if own_embedding:
            self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.fc = nn.Linear(3 * spec.target_hidden_size, spec.hidden_size, bias=False)
        if spec.norm_before_fc:
            self.input_norm = nn.RMSNorm(3 * spec.target_hidden_size, eps=spec.rms_norm_eps)
        self.layers = [Eagle3Layer(spec, i == 0) for i in range(spec.num_hidden_layers)]
        self.norm = nn.RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        if not spec.tie_word_embeddings or spec.uses_draft_vocab:
            self.lm_head = nn.Linear(spec.hidden_size, spec.draft_vocab_size, bias=False)
        if spec.uses_draft_vocab:
            self.d2t = mx.zeros((spec.draft_vocab_size,), dtype=mx.int32)

    def tapped_layers(self, target_layers: int) -> tuple[int, ...]:
        return self.spec.tapped_layers(target_layers)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def draft_to_target(self, draft_ids: mx.array) -> mx.array:
        """Target token ids of draft-vocabulary ids (``id + d2t[id]``)."""
        ids = draft_ids.astype(mx.int32)
        return ids + self.d2t[ids] if "d2t" in self else ids

    def target_logits(self, draft_logits: mx.array) -> mx.array:
        """Draft logits [..., Vd] placed on the target vocabulary [..., V] (-inf where the draft
        vocabulary has no token): the proposal q an exact verifier needs, over the target's ids."""
        if "d2t" not in self:
            return draft_logits
        out = mx.full((*draft_logits.shape[:-1], self.spec.vocab_size), -mx.inf, dtype=draft_logits.dtype)
        out[..., self.draft_to_target(mx.arange(self.spec.draft_vocab_size))] = draft_logits
        return out


def eagle3_forward(
    drafter: Eagle3Drafter,
    tokens: mx.array,
    hidden: mx.array,
    cache: list,
    position: int | None,
    embed: Callable[[mx.array], mx.array],
    counts: Sequence[int] | None = None,
) -> mx.array:
    """The drafter's hidden [B, T, H] for ``tokens`` [B, T] paired with ``hidden`` (the target taps
    joined, [B, T, 3 Ht], or the drafter's own previous hidden, [B, T, H]), positions from
    ``position`` (None: the cache's length + 1, where a pair (token p + 1, taps of p) sits);
    appends to ``cache``. A pure function of (taps, tokens, the drafter's cache). ``embed``: the
    target's embedding (`Trunk.embed`) where its shape is the drafter's, as mlx-vlm binds it; else
    the file's own copy (``drafter.embed_tokens``). ``counts`` (a batch on `RaggedKVCache`s, rows
    of different lengths): row r's first counts[r] positions are its own, the rest padding that
    the cache then drops; each row's positions from its own length + 1."""
    if hidden.shape[-1] != drafter.spec.hidden_size:
        hidden = drafter.fc(drafter.input_norm(hidden) if "input_norm" in drafter else hidden)
    embeds = embed(tokens)
    length = int(tokens.shape[1])
    h = hidden
    for layer, layer_cache in zip(drafter.layers, cache):
        if counts is None:
            start = layer_cache.offset + 1 if position is None else position
            h = layer(h, embeds, layer_cache, start, "causal" if length > 1 else None)
            continue
        held = list(layer_cache.lengths)
        h = layer(h, embeds, layer_cache, layer_cache.offset + 1, layer_cache.make_mask(length))
        layer_cache.set_lengths([n + c for n, c in zip(held, counts)])
    return h


def eagle3_logits(
    drafter: Eagle3Drafter, hidden: mx.array, embed_as_linear: Callable[[mx.array], mx.array]
) -> mx.array:
    """Draft-vocabulary logits [..., Vd] of the drafter's hidden."""
    normed = drafter.norm(hidden)
    return drafter.lm_head(normed) if "lm_head" in drafter else embed_as_linear(normed)


def _sanitized(weights: dict[str, mx.array], spec: Eagle3Spec, path: Path) -> dict[str, mx.array]:
    """mlx-vlm's ``sanitize``: drop ``t2d`` (checked against ``d2t`` first), ``verifier_*``, rotary
    buffers, an unused ``input_norm`` or tied ``lm_head``; ``d2t`` as int32."""
    out = {}
    for key, value in weights.items():
        if key == "t2d" or key.startswith("verifier_") or "rotary_emb.inv_freq" in key:
            continue
        if (key == "input_norm.weight" and not spec.norm_before_fc) or (
            key == "lm_head.weight" and spec.tie_word_embeddings and not spec.uses_draft_vocab
        ):
            continue
        out[key] = value.astype(mx.int32) if key == "d2t" else value
    if "d2t" in out:
        _check_vocab_maps(np.array(out["d2t"]), weights.get("t2d"), spec, path)
    return out


def _check_vocab_maps(d2t: np.ndarray, t2d: mx.array | None, spec: Eagle3Spec, path: Path) -> None:
    if d2t.shape != (spec.draft_vocab_size,):
        raise MtplxError(
            f"EAGLE-3 drafter {path}: d2t has shape {d2t.shape}, expected ({spec.draft_vocab_size},)"
        )
    targets = np.arange(d2t.shape[0]) + d2t
    if targets.min() < 0 or targets.max() >= spec.vocab_size or len(set(targets.tolist())) != len(targets):
        raise MtplxError(
            f"EAGLE-3 drafter {path}: d2t maps draft ids outside or twice onto the {spec.vocab_size}-token vocabulary"
        )
    if t2d is not None:
        held = np.array(t2d).astype(bool)
        if held.shape != (spec.vocab_size,) or not held[targets].all() or held.sum() != len(targets):
            raise MtplxError(f"EAGLE-3 drafter {path}: t2d does not mark exactly the target ids d2t maps to")


def load_eagle3(path: str | Path) -> Eagle3Drafter:
    """Load an EAGLE-3 drafter directory (mlx-vlm's ``eagle3`` or the speculators format); a
    misfit (missing or extra tensor, wrong shape, inconsistent ``d2t`` / ``t2d``) is one line."""
    path = Path(path)
    config = read_config(path, "EAGLE-3 drafter")
    if drafter_layout(config) != "eagle3":
        raise MtplxError(f"{path}: not an EAGLE-3 drafter (model_type / speculators_model_type eagle3)")
    spec = eagle3_spec(config)
    weights = _sanitized(published_weights(path, "EAGLE-3 drafter"), spec, path)
    if spec.uses_draft_vocab and "d2t" not in weights:
        raise MtplxError(
            f"EAGLE-3 drafter {path}: tensor d2t missing (draft_vocab_size {spec.draft_vocab_size})"
        )
    drafter = Eagle3Drafter(spec, "embed_tokens.weight" in weights)
    load_checked(drafter, weights, path, "EAGLE-3 drafter")
    return drafter


def joined_taps(taps: Sequence[mx.array]) -> mx.array:
    return mx.concatenate(list(taps), axis=-1)
